"""FLAP as a peer (`--method flap`): the pure math of `compressor.math.fluctuation` on planted data, then the method
in the pipeline on tiny random models of every family (budget, bias compensation, save→load identical logits)."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import random_windows, reloaded_identically, tiny_model
from test_attention_heads import plan_untargeted

from compressor.api.pipeline import compress_model
from compressor.checkpoint import save_compressed
from compressor.math.accounting import HEADS_READER, NEURON_READER
from compressor.math.fluctuation import (
    compensation_bias,
    fluctuation,
    head_removal_steps,
    removal_counts,
    standardized,
)
from compressor.modeling.adapters import get_adapter
from compressor.recipes.schema import CompressionSettings
from compressor.runtime.errors import UserError
from compressor.statistics.capture import collect_statistics


def _inputs(tokens=400, width=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, width, generator=g, dtype=torch.float64) * torch.linspace(0.1, 2.0, width)
    x = x + torch.randn(width, generator=g, dtype=torch.float64)  # non-zero means
    w = torch.randn(5, width, generator=g, dtype=torch.float64)
    return x, x.T @ x / tokens, x.mean(0), w


def test_fluctuation_is_the_output_error_of_replacing_a_channel_by_its_mean():
    x, c, mean, w = _inputs()
    scores = fluctuation(c, mean, w)
    for j in range(x.shape[1]):
        replaced = x.clone()
        replaced[:, j] = mean[j]
        error = float((x @ w.T - replaced @ w.T).square().sum(-1).mean())
        assert float(scores[j]) == pytest.approx(error, rel=1e-9)


def test_bias_compensation_is_exact_for_constant_channels_and_keeps_the_output_mean():
    x, c, mean, w = _inputs()
    x[:, [2, 7]] = torch.tensor([0.5, -1.5], dtype=torch.float64)  # two channels that never move
    c, mean = x.T @ x / len(x), x.mean(0)
    assert float(fluctuation(c, mean, w)[[2, 7]].abs().max()) < 1e-12
    removed = torch.tensor([2, 7])
    kept = torch.tensor([j for j in range(x.shape[1]) if j not in (2, 7)])
    pruned = x[:, kept] @ w[:, kept].T + compensation_bias(w, mean, removed)
    torch.testing.assert_close(pruned, x @ w.T, rtol=0, atol=1e-12)
    # with moving channels removed too, the output's mean over the tokens is still the original's
    removed = torch.tensor([0, 1, 2])
    kept = torch.arange(3, x.shape[1])
    pruned = x[:, kept] @ w[:, kept].T + compensation_bias(w, mean, removed)
    torch.testing.assert_close(pruned.mean(0), (x @ w.T).mean(0), rtol=0, atol=1e-12)


def test_scores_are_standardized_within_a_layer():
    out = standardized(torch.tensor([3.0, 40.0, 5.0, 1.0], dtype=torch.float64))
    assert float(out.mean()) == pytest.approx(0.0, abs=1e-12)
    assert float(out.std()) == pytest.approx(1.0)
    assert torch.equal(out.argsort(), torch.tensor([3, 0, 2, 1]))  # the order within the layer is kept
    assert torch.equal(standardized(torch.ones(3)), torch.zeros(3))


def test_head_steps_take_one_head_per_kv_group_and_leave_one():
    scores = torch.tensor([5.0, 1.0, 3.0, 0.5, 9.0, 2.0])  # two KV groups of three query heads
    steps, step_scores = head_removal_steps(scores, kv_heads=2)
    assert steps == [[1, 3], [2, 5]]  # the lowest of each group first; the best of each group stays
    assert step_scores.tolist() == [0.75, 2.5]
    steps, step_scores = head_removal_steps(torch.tensor([0.0, 10.0, 1.0, 1.0]), kv_heads=1)
    assert steps == [[0], [2], [3]] and step_scores.tolist() == [0.0, 1.0, 1.0]  # ties: lower index first


def test_removal_counts_free_enough_lowest_first_and_refuse_the_infeasible():
    steps = {"a": (torch.tensor([0.1, 0.5, 0.9]), 10), "b": (torch.tensor([0.2, 0.3]), 25)}
    assert removal_counts(steps, 0) == {"a": 0, "b": 0}
    assert removal_counts(steps, 30) == {"a": 1, "b": 1}  # 0.1 (10), 0.2 (25): 35 ≥ 30
    assert removal_counts(steps, 36) == {"a": 1, "b": 2}  # then 0.3 (25)
    with pytest.raises(UserError, match="infeasible for FLAP"):
        removal_counts(steps, 81)


def _compress(model, ratio, targets="attn,mlp"):
    adapter = get_adapter(model)
    windows = random_windows()
    stats = collect_statistics(model, adapter, windows, progress=False, mlp="mlp" in targets)
    settings = CompressionSettings(method="flap", targets=targets)
    return compress_model(model, adapter, stats, settings, ratio, progress=False, windows=windows), stats


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_flap_meets_the_budget_counts_its_biases_and_reloads_exactly(family, tmp_path):
    model = tiny_model(family, num_attention_heads=8, num_key_value_heads=2)
    outcome, _ = _compress(model, 0.5)
    plan, adapter = outcome.plan, get_adapter(model)
    assert plan.params_after() <= plan.budget
    assert plan.achieved_ratio() >= 0.5
    # every number the plan counts is in the model, the new biases of o_proj and down_proj included
    assert plan.params_after() == sum(p.numel() for p in model.parameters()) - plan_untargeted(model, plan)
    for layer in range(adapter.num_layers):
        assert adapter.projection(layer, HEADS_READER).bias is not None
        assert adapter.projection(layer, NEURON_READER).bias is not None
    widths = [plan.get(layer, NEURON_READER).rank for layer in range(adapter.num_layers)]
    heads = [plan.get(layer, HEADS_READER).rank for layer in range(adapter.num_layers)]
    assert min(widths) < model.config.intermediate_size and min(heads) < 4  # both kinds of structure went
    path = save_compressed(model, plan, tmp_path / "ckpt")
    reloaded_identically(model, path)


def test_flap_keeps_the_kept_columns_and_compensates_the_removed_mean():
    """Nothing is refit: a kept neuron's down_proj column is the original's; the bias is the removed neurons'
    mean contribution measured on the calibration windows."""
    model = tiny_model("llama")
    original = copy.deepcopy(model)
    outcome, stats = _compress(model, 0.25, targets="mlp")
    before, after = get_adapter(original), get_adapter(model)
    for layer in range(before.num_layers):
        gate_before, gate_after = (
            before.projection(layer, "gate_proj").weight,
            after.projection(layer, "gate_proj").weight,
        )
        kept = [int((gate_before - row).abs().sum(1).argmin()) for row in gate_after]
        removed = torch.tensor(sorted(set(range(gate_before.shape[0])) - set(kept)))
        down = before.projection(layer, NEURON_READER).weight.detach().double()
        torch.testing.assert_close(
            after.projection(layer, NEURON_READER).weight.double(), down[:, kept].float().double()
        )
        expected = compensation_bias(down, stats.input_mean("down", layer), removed)
        torch.testing.assert_close(
            after.projection(layer, NEURON_READER).bias.double(), expected, rtol=1e-5, atol=1e-6
        )


def test_flap_refuses_a_ratio_beyond_what_it_can_remove():
    with pytest.raises(UserError, match="infeasible"):
        _compress(tiny_model("llama"), 0.97, targets="attn")
