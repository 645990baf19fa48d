"""MoDeGPT as a peer (`--method modegpt`): the pure math of `compressor.math.modular` on planted data, the
`rows`/`columns` modules, then the method in the pipeline on tiny random models of every family (budget,
rotary pairs, save→load identical logits)."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import random_windows, reloaded_identically, tiny_model
from test_attention_heads import plan_untargeted

from compressor.api.pipeline import compress_model
from compressor.api.preview import plan_from_config
from compressor.checkpoint import save_compressed
from compressor.math.modular import (
    kept_rotary_dims,
    layer_sparsities,
    rotary_pair_scores,
    row_energies,
    value_output_factors,
)
from compressor.math.whitening import whitening_factor
from compressor.methods import MethodContext, ModelShape, modegpt
from compressor.methods.modegpt import ModeGpt
from compressor.modeling.adapters import get_adapter, target_projections
from compressor.modeling.remote_code.masa_modules import ColumnSubsetLinear, subset_linear
from compressor.recipes.schema import CompressionSettings
from compressor.report.records import kept_fractions
from compressor.runtime.errors import UserError
from compressor.statistics.block_influence import block_influence
from compressor.statistics.capture import collect_statistics


def _random(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_row_energies_are_the_mean_square_outputs():
    x, w = _random(300, 6), _random(4, 6, seed=1)
    torch.testing.assert_close(row_energies(w, x.T @ x / 300), (x @ w.T).square().mean(0))


def test_rotary_pairs_are_kept_together_and_scored_over_the_group():
    query = torch.tensor([[1.0, 0.0, 5.0, 0.0], [1.0, 0.0, 0.0, 0.0]])  # two query heads, head_dim 4
    key = torch.tensor([1.0, 10.0, 1.0, 1.0])
    scores = rotary_pair_scores(query, key)  # pair 0 = dims (0, 2), pair 1 = dims (1, 3)
    assert scores.tolist() == [1 + 5 + 1, 0.0]
    assert kept_rotary_dims(scores, 1).tolist() == [0, 2]
    assert kept_rotary_dims(torch.tensor([0.0, 3.0, 1.0]), 2).tolist() == [1, 2, 4, 5]


def test_value_output_factors_are_exact_at_full_rank_and_optimal_below():
    hidden, d, heads = 10, 4, 3
    x = _random(500, hidden) * torch.linspace(0.2, 2.0, hidden)
    factor = whitening_factor(x.T @ x / 500)
    value, outputs = _random(d, hidden, seed=2), [_random(hidden, d, seed=3 + i) for i in range(heads)]
    r, p, damping = value_output_factors(value, outputs, factor.S, d)
    assert damping == 0.0
    torch.testing.assert_close(p @ r, value)

    def error(approx):
        return sum(float((x @ (value - approx).T @ o.T).square().sum()) for o in outputs)

    r, p, _ = value_output_factors(value, outputs, factor.S, 2)
    best = error(p @ r)
    for seed in range(5):  # no other rank-2 value head does better in the group's output metric
        other = _random(d, 2, seed=10 + seed) @ _random(2, hidden, seed=20 + seed)
        assert error(other) > best
    u, s, vh = torch.linalg.svd(value @ factor.S)  # nor the plain whitened SVD of V (no output metric)
    plain = (u[:, :2] * s[:2]) @ torch.linalg.solve_triangular(factor.S, vh[:2], upper=False, left=False)
    assert error(plain) >= best - 1e-9


def test_layer_sparsities_keep_the_mean_favour_low_influence_and_respect_the_cap():
    influence = torch.tensor([0.02, 0.3, 0.05, 0.4], dtype=torch.float64)
    sparsity = layer_sparsities(influence, 0.3, smoothing=0.15, cap=0.8)
    assert float(sparsity.mean()) == pytest.approx(0.3)
    assert sparsity.argsort().tolist() == [3, 1, 2, 0]  # the most influential layer loses least
    capped = layer_sparsities(influence, 0.5, smoothing=0.01, cap=0.6)
    assert float(capped.max()) <= 0.6 + 1e-12 and float(capped.mean()) == pytest.approx(0.5)
    flat = layer_sparsities(influence, 0.2, smoothing=1e6, cap=0.8)
    torch.testing.assert_close(flat, torch.full((4,), 0.2, dtype=torch.float64))


def test_row_and_column_subsets_equal_their_dense_weights():
    x, w, b = _random(5, 6).float(), _random(8, 6, seed=1).float(), _random(3, seed=2).float()
    rows = torch.tensor([1, 4, 6])
    module = subset_linear("rows", w[rows], rows, b, 8, 6, torch.float32, "cpu")
    dense = torch.zeros(8, 6).index_copy(0, rows, w[rows])
    torch.testing.assert_close(module.dense_weight(), dense)
    torch.testing.assert_close(module.dense_bias(), torch.zeros(8).index_copy(0, rows, b))
    torch.testing.assert_close(module(x), x @ dense.T + module.dense_bias())
    columns = torch.tensor([0, 2, 5])
    module = subset_linear("columns", w[:, columns], columns, None, 8, 6, torch.float32, "cpu")
    torch.testing.assert_close(module(x), x[:, columns] @ w[:, columns].T)
    assert module.dense_weight()[:, [1, 3, 4]].abs().max() == 0


def test_block_influence_is_zero_for_a_layer_that_changes_nothing():
    model = tiny_model("llama")
    adapter = get_adapter(model)
    for name in ("o_proj", "down_proj"):  # layer 1 adds nothing to the residual stream
        adapter.projection(1, name).weight.data.zero_()
    influence, _ = block_influence(adapter, random_windows(n=2), progress=False)
    assert float(influence[1]) == pytest.approx(0.0, abs=1e-6)
    assert float(influence[0]) > 1e-3


def _compress(model, ratio, targets="attn,mlp"):
    adapter = get_adapter(model)
    windows = random_windows()
    stats = collect_statistics(model, adapter, windows, progress=False, mlp="mlp" in targets)
    settings = CompressionSettings(method="modegpt", targets=targets)
    return compress_model(model, adapter, stats, settings, ratio, progress=False, windows=windows)


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "gemma"])
def test_modegpt_meets_the_budget_keeps_rotary_pairs_and_reloads_exactly(family, tmp_path):
    model = tiny_model(family, num_attention_heads=4, num_key_value_heads=2)
    outcome = _compress(model, 0.3)
    plan, adapter = outcome.plan, get_adapter(model)
    assert plan.params_after() <= plan.budget and plan.achieved_ratio() >= 0.3
    assert plan.achieved_ratio() < 0.3 + 0.05  # the least sparsity that fits: not far beyond the request
    assert plan.params_after() == sum(p.numel() for p in model.parameters()) - plan_untargeted(model, plan)
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    for layer in range(adapter.num_layers):
        q, k = adapter.projection(layer, "q_proj"), adapter.projection(layer, "k_proj")
        dims = (k.rows[: k.rank // 2] % head_dim).tolist()
        assert all((d + head_dim // 2) in dims for d in dims if d < head_dim // 2)  # pairs kept together
        assert len(dims) % 2 == 0
        # the group's first query head keeps the key head's dimensions
        assert torch.equal(q.rows[: len(dims)] % head_dim, k.rows[: len(dims)] % head_dim)
    assert len(set(outcome.report["modegpt"]["sparsity"])) > 1  # layers differ by their influence
    kept = kept_fractions(plan.to_dict()["projections"])  # the report's share: kept rows, or columns read
    for projection in ("q_proj", "o_proj"):
        pp = plan.get(0, projection)
        width = pp.out_features if pp.mode == "rows" else pp.in_features
        assert kept[(0, projection)] == pytest.approx(pp.rank / width)
    path = save_compressed(model, plan, tmp_path / "ckpt")
    reloaded_identically(model, path)


def test_modegpt_at_full_keep_is_the_original_model():
    """Every dimension, the full value rank and every neuron kept: the same logits (the value bias of Qwen2
    folded into o_proj's exactly, the MLP refit onto all of its neurons)."""
    model = tiny_model("qwen2", num_attention_heads=4, num_key_value_heads=2)
    original, adapter, windows = copy.deepcopy(model), get_adapter(model), random_windows()
    stats = collect_statistics(model, adapter, windows, progress=False, mlp=True)
    settings = CompressionSettings(method="modegpt", targets="attn,mlp")
    shape = ModelShape.from_adapter(adapter, target_projections("attn,mlp"))
    plan = ModeGpt().plan(shape, settings, 0.2, check_feasible=False)
    modegpt._set_ranks(plan, shape, [1.0] * shape.num_layers)
    ctx = MethodContext(model, adapter, stats, settings, 0.2, torch.device("cpu"), False, shape, windows)
    for layer in range(shape.num_layers):
        modegpt._install_query_key(ctx, plan, layer)
        modegpt._install_value_output(ctx, plan, layer)
        modegpt._install_mlp(ctx, plan, layer)
    assert isinstance(adapter.projection(0, "o_proj"), ColumnSubsetLinear)
    tokens = random_windows(n=2)
    torch.testing.assert_close(model(tokens).logits, original(tokens).logits, rtol=1e-4, atol=1e-4)


def test_modegpt_refuses_an_impossible_ratio():
    with pytest.raises(UserError, match="infeasible"):
        _compress(tiny_model("llama"), 0.95, targets="attn")


def test_the_plan_states_modegpts_own_largest_ratio_and_a_run_just_past_it_is_refused():
    """Every module keeps at least 1 − CAP of its dimensions: `plan`'s largest feasible ratio is that bound,
    not the 1.0 a method with no cap would reach."""
    model = tiny_model("llama")
    settings = CompressionSettings(method="modegpt", targets="attn,mlp")
    largest = plan_from_config(model.config, 0.5, settings)["max_ratio"]
    assert modegpt.CAP - 0.05 < largest < modegpt.CAP + 0.05
    with pytest.raises(UserError, match="infeasible"):
        _compress(model, min(0.99, largest + 0.02))


def test_modegpt_exports_dense_with_its_zeros_and_the_same_logits(tmp_path):
    """export-dense writes the pruned q/k rows and unused value dimensions back as zeros (the base shapes: not
    smaller), the MLP padded to its widest layer; the dense model gives the checkpoint's logits."""
    from transformers import AutoModelForCausalLM

    from compressor.checkpoint import export_dense, load_compressed

    model = tiny_model("qwen2", num_attention_heads=4, num_key_value_heads=2)
    outcome = _compress(model, 0.3)
    path = save_compressed(model, outcome.plan, tmp_path / "ckpt")
    dense = AutoModelForCausalLM.from_pretrained(export_dense(path, tmp_path / "dense").path)
    q = dense.model.layers[0].self_attn.q_proj.weight
    assert q.shape == (model.config.hidden_size, model.config.hidden_size)
    assert 0 < int((q.abs().sum(1) == 0).sum()) < q.shape[0]  # pruned rows are zero, the rest are not
    x = random_windows(2, 12)
    with torch.no_grad():
        torch.testing.assert_close(dense(x).logits, load_compressed(path)(x).logits, rtol=0, atol=1e-5)
