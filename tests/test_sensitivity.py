"""Loss sensitivity (`--allocation global-loss`): one backward pass, no weight updated, on tiny random models."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import random_windows, tiny_model

from compressor.api.pipeline import compress_model
from compressor.modeling.adapters import PROJECTIONS, get_adapter
from compressor.recipes.schema import CompressionSettings
from compressor.statistics.capture import collect_statistics
from compressor.statistics.sensitivity import collect_sensitivity

ALL = PROJECTIONS + ("gate_proj", "up_proj", "down_proj")


def test_sensitivity_is_the_mean_squared_loss_gradient_at_each_output():
    model = tiny_model("llama", num_hidden_layers=3)
    adapter = get_adapter(model)
    windows = random_windows(3, 16)
    sensitivity = collect_sensitivity(model, adapter, windows, ALL, progress=False)

    # Independently: keep every output, differentiate the summed next-token loss with respect to them.
    expected = dict.fromkeys(sensitivity.weights, 0.0)
    for window in windows:
        outputs = {}
        handles = [
            adapter.projection(layer, p).register_forward_hook(
                lambda m, a, out, key=(layer, p), seen=outputs: seen.setdefault(key, out)
            )
            for layer, p in expected
        ]
        with torch.enable_grad():
            embeds = model.get_input_embeddings()(window[None]).detach().requires_grad_(True)
            logits = model(inputs_embeds=embeds).logits
            loss = F.cross_entropy(logits[0, :-1], window[1:], reduction="sum")
            grads = torch.autograd.grad(loss, [outputs[k] for k in expected])
        for handle in handles:
            handle.remove()
        for key, grad in zip(expected, grads, strict=True):
            expected[key] += float(grad.double().pow(2).sum())
    for (layer, p), total in expected.items():
        d_out = adapter.projection(layer, p).weight.shape[0]
        assert sensitivity[(layer, p)] == pytest.approx(total / (windows.numel() * d_out), rel=1e-6)
    assert sensitivity.tokens == windows.numel() and sensitivity.windows == 3


def test_sensitivity_leaves_the_model_as_it_was():
    model = tiny_model("llama", num_hidden_layers=2)
    model.model.layers[0].mlp.up_proj.weight.requires_grad_(False)
    flags = {name: p.requires_grad for name, p in model.named_parameters()}
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    collect_sensitivity(model, get_adapter(model), random_windows(2, 16), ALL, progress=False)
    assert {name: p.requires_grad for name, p in model.named_parameters()} == flags
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())
    assert not model.training


@pytest.mark.parametrize("autocast", [None, torch.bfloat16])
@pytest.mark.parametrize("batch_size", [1, 2])
def test_the_capture_measures_the_sensitivity_on_its_first_windows_as_a_separate_pass_does(
    batch_size, autocast
):
    """Sharing the forward passes changes neither measurement: the sensitivity equals `collect_sensitivity`'s on
    the same first windows, the statistics equal a capture without it, and the model is left as it was; with the
    forward passes in bfloat16 too (the separate pass computing as the capture did)."""
    model = tiny_model("llama", num_hidden_layers=3)
    adapter = get_adapter(model)
    windows = random_windows(5, 16)
    flags = {name: p.requires_grad for name, p in model.named_parameters()}
    shared = collect_statistics(
        model, adapter, windows, batch_size, progress=False, mlp=True,
        sensitivity_projections=ALL, sensitivity_windows=3, autocast=autocast,
    )  # fmt: skip
    alone = collect_sensitivity(model, adapter, windows[:3], ALL, progress=False, autocast=autocast)
    plain = collect_statistics(
        model, adapter, windows, batch_size, progress=False, mlp=True, autocast=autocast
    )
    assert shared.sensitivity.windows == 3 and shared.sensitivity.tokens == alone.tokens
    for key, value in alone.weights.items():
        assert shared.sensitivity[key] == pytest.approx(value, rel=1e-5)
    for a, b in zip(
        shared.attn_autocorr + shared.down_autocorr, plain.attn_autocorr + plain.down_autocorr, strict=True
    ):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(shared.block_output_means, plain.block_output_means, rtol=1e-5, atol=1e-6)
    assert not shared.block_output_means.requires_grad and not shared.attn_autocorr[0].requires_grad
    assert {name: p.requires_grad for name, p in model.named_parameters()} == flags
    assert all(p.grad is None for p in model.parameters())


def test_a_capture_without_sensitivity_projections_measures_none():
    model = tiny_model("llama", num_hidden_layers=2)
    stats = collect_statistics(
        model, get_adapter(model), random_windows(2, 16), progress=False, sensitivity_windows=2
    )
    assert stats.sensitivity is None


def test_outputs_that_cannot_reach_the_loss_weigh_nothing_and_get_no_rank():
    """With o_proj of layer 1 all zero, nothing q, k or v of that layer output reaches the loss: their outputs
    have no gradient, so global-loss spends nothing on them (and o_proj, all zero, has nothing to approximate)."""
    model = tiny_model("llama", num_hidden_layers=3)
    adapter = get_adapter(model)
    adapter.projection(1, "o_proj").weight.data.zero_()
    windows = random_windows(4, 16)
    stats = collect_statistics(model, adapter, windows, progress=False)
    stats.sensitivity = collect_sensitivity(model, adapter, windows, PROJECTIONS, progress=False)
    assert all(stats.sensitivity[(1, p)] == 0.0 for p in ("q_proj", "k_proj", "v_proj"))
    assert stats.sensitivity[(0, "q_proj")] > 0.0
    settings = CompressionSettings(sharing="none", allocation="global-loss")
    outcome = compress_model(model, adapter, stats, settings, 0.3, progress=False, windows=windows)
    assert outcome.seconds["sensitivity"] == stats.sensitivity.seconds  # measured once, by the test above
    for p in PROJECTIONS:
        assert outcome.plan.get(1, p).rank == 0
    kept = outcome.plan.get(0, "q_proj")
    assert kept.mode == "dense" or kept.rank > 0  # the budget went to what the loss sees


def test_global_loss_needs_the_sensitivity():
    model = tiny_model("llama", num_hidden_layers=2)
    adapter = get_adapter(model)
    stats = collect_statistics(model, adapter, random_windows(2, 16), progress=False)
    with pytest.raises(ValueError, match="global-loss needs the calibration windows"):
        compress_model(
            model, adapter, stats, CompressionSettings(sharing="none", allocation="global-loss"), 0.3,
            progress=False,
        )  # fmt: skip


def test_a_sensitivity_measured_after_the_capture_computes_as_the_capture_did():
    """Statistics without a sensitivity (read from the cache, say) get it from `compress_model`, in the dtype
    their forward passes computed in: the same numbers a capture that measured it on the way would give."""
    model = tiny_model("llama", num_hidden_layers=3)
    adapter, windows = get_adapter(model), random_windows(4, 16)
    stats = collect_statistics(model, adapter, windows, progress=False, autocast=torch.bfloat16)
    assert stats.sensitivity is None
    settings = CompressionSettings(sharing="none", allocation="global-loss", sensitivity_samples=2)
    compress_model(model, adapter, stats, settings, 0.3, progress=False, windows=windows)
    original = tiny_model("llama", num_hidden_layers=3)  # the model above was compressed in place
    in_bf16 = collect_sensitivity(original, get_adapter(original), windows[:2], PROJECTIONS, progress=False,
                                  autocast=torch.bfloat16)  # fmt: skip
    in_fp32 = collect_sensitivity(original, get_adapter(original), windows[:2], PROJECTIONS, progress=False)
    for key, value in in_bf16.weights.items():
        assert stats.sensitivity[key] == pytest.approx(value, rel=1e-6)
    assert any(
        stats.sensitivity[key] != pytest.approx(value, rel=1e-6) for key, value in in_fp32.weights.items()
    )
