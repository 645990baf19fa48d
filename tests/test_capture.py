"""Calibration capture: the fp32-per-window autocorrelation products stay within their stated bound of the fp64
sums, do not depend on how windows are batched, and the capture runs no LM head."""

from __future__ import annotations

import pytest
import torch
from conftest import random_windows, tiny_model

from compressor.modeling.adapters import get_adapter
from compressor.runtime.errors import NumericalError
from compressor.statistics.capture import (
    GRAM_BLOCK_COLUMNS,
    GRAM_CHUNK_TOKENS,
    add_cross,
    add_gram,
    check_gram,
    collect_statistics,
    gram_blocks,
    token_mean,
)

UNIT_ROUNDOFF_FP32 = 2.0**-24


def gram_error_bound(x: torch.Tensor) -> torch.Tensor:
    """Entrywise bound of `add_gram`'s error against the exact Σ xᵀx: each fp32 product sums at most
    `GRAM_CHUNK_TOKENS` terms (error ≤ n·u·Σ|x_i x_j|, plus one rounding of each product), the fp64 sum adds
    nothing at this scale."""
    rows = x.reshape(-1, x.shape[-1]).double().abs()
    return (GRAM_CHUNK_TOKENS + 2) * UNIT_ROUNDOFF_FP32 * (rows.T @ rows)


def assert_within_gram_bound(got: torch.Tensor, x: torch.Tensor, tokens: int = 1) -> None:
    rows = x.reshape(-1, x.shape[-1]).double()
    error = (got - rows.T @ rows / tokens).abs()
    bound = gram_error_bound(x) / tokens
    assert bool((error <= bound).all()), f"worst error / bound: {(error / bound).max().item():.3g}"


def projection_input(model, adapter, layer: int, name: str, windows: torch.Tensor) -> torch.Tensor:
    """What `name` of `layer` receives when `model` reads `windows` in one plain forward pass."""
    inputs = []
    handle = adapter.projection(layer, name).register_forward_pre_hook(lambda m, a: inputs.append(a[0]))
    with torch.no_grad():
        model(input_ids=windows)
    handle.remove()
    return inputs[0]


def _activations(tokens: int, width: int, seed: int = 0) -> torch.Tensor:
    """Heavy-tailed activations with a few outlier channels, like the inputs of a real LLM's projections."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, width, generator=generator) * torch.rand(width, generator=generator).pow(3) * 4
    x[:, :3] *= 200.0  # massive-activation channels
    return x + 0.5  # a non-zero mean


@pytest.mark.parametrize(
    "tokens,width",
    [
        (7, 96),
        (GRAM_CHUNK_TOKENS, 96),
        (3 * GRAM_CHUNK_TOKENS + 5, 96),
        (GRAM_CHUNK_TOKENS + 3, 2 * GRAM_BLOCK_COLUMNS + 40),
    ],
)
def test_fp32_products_stay_within_the_stated_bound(tokens, width):
    x = _activations(tokens, width)
    total = torch.zeros(width, width, dtype=torch.float64)
    add_gram(total, x.view(1, tokens, width))
    token_mean(total, 1)  # completes the blocks below the diagonal (divides by 1)
    assert_within_gram_bound(total, x)
    # and the bound is not vacuous: the relative error in the Frobenius norm is that of fp32, not of nothing
    exact = x.double().T @ x.double()
    assert ((total - exact).norm() / exact.norm()).item() < 1e-6


@pytest.mark.parametrize("tokens", [7, GRAM_CHUNK_TOKENS, 3 * GRAM_CHUNK_TOKENS + 5])
def test_the_cross_moments_stay_within_the_same_bound(tokens):
    """`add_cross` (the stream refit's Σ tᵀx) sums fp32 products over the same chunks: its entries' error is
    bounded by (chunk + 2)·u·Σ|t_i x_j|, windows batched or not."""
    x, t = _activations(tokens, 96), _activations(tokens, 40, seed=1)
    total = torch.zeros(40, 96, dtype=torch.float64)
    add_cross(total, t.view(1, tokens, 40), x.view(1, tokens, 96))
    exact = t.double().T @ x.double()
    bound = (GRAM_CHUNK_TOKENS + 2) * UNIT_ROUNDOFF_FP32 * (t.double().abs().T @ x.double().abs())
    assert bool(((total - exact).abs() <= bound).all())
    assert ((total - exact).norm() / exact.norm()).item() < 1e-6
    two_windows = torch.zeros_like(total)
    add_cross(two_windows, torch.stack([t, 2 * t]), torch.stack([x, x]))
    assert bool(((two_windows - 3 * exact).abs() <= 3 * bound).all())  # each window its own product, summed


def test_only_the_blocks_on_and_above_the_diagonal_are_summed_then_mirrored():
    width = 2 * GRAM_BLOCK_COLUMNS + 40
    blocks = gram_blocks(width)
    assert [b.stop - b.start for b in blocks] == [GRAM_BLOCK_COLUMNS, GRAM_BLOCK_COLUMNS, 40]
    total = torch.zeros(width, width, dtype=torch.float64)
    add_gram(total, _activations(50, width).view(1, 50, width))
    for i, rows in enumerate(blocks):
        for columns in blocks[:i]:
            assert not total[rows, columns].any()  # below the diagonal: left to token_mean
        assert total[rows, rows.start :].abs().min() > 0
    token_mean(total, 50)
    assert torch.equal(
        total[GRAM_BLOCK_COLUMNS:, :GRAM_BLOCK_COLUMNS], total[:GRAM_BLOCK_COLUMNS, GRAM_BLOCK_COLUMNS:].T
    )
    for rows in blocks:  # a diagonal block is one fp32 product: symmetric up to its rounding
        torch.testing.assert_close(total[rows, rows], total[rows, rows].T, rtol=1e-6, atol=0)


def test_a_half_precision_product_would_break_the_bound():
    """The test above can fail: the same products taken in bf16 exceed the bound."""
    x = _activations(GRAM_CHUNK_TOKENS, 96)
    coarse = (x.bfloat16().T @ x.bfloat16()).double()
    error = (coarse - x.double().T @ x.double()).abs()
    assert bool((error > gram_error_bound(x)).any())


def test_the_sum_does_not_depend_on_how_windows_are_batched():
    x = _activations(4 * 40, 64).view(4, 40, 64)
    batched = torch.zeros(64, 64, dtype=torch.float64)
    add_gram(batched, x)
    one_by_one = torch.zeros(64, 64, dtype=torch.float64)
    for window in x:
        add_gram(one_by_one, window.unsqueeze(0))
    assert torch.equal(batched, one_by_one)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf"), 1e30])
def test_a_non_finite_or_overflowing_activation_is_refused_naming_where(bad: float):
    """The check reads the sum's diagonal only: one bad activation anywhere in a later window still shows (its
    column's Σ x² is non-finite; 1e30 overflows fp32 there); good windows pass."""
    x = _activations(3 * 40, 16).view(3, 40, 16)
    x[2, 17, 5] = bad
    total = torch.zeros(16, 16, dtype=torch.float64)
    add_gram(total, x)
    with pytest.raises(NumericalError, match="at the input of layer 7 down_proj"):
        check_gram(total, "layer 7 down_proj")
    good = torch.zeros(16, 16, dtype=torch.float64)
    add_gram(good, x[:2])
    check_gram(good, "test")


@pytest.mark.parametrize("projection", ["q_proj", "o_proj", "down_proj"])
def test_the_capture_names_the_input_that_went_non_finite(projection):
    model = tiny_model("llama", num_hidden_layers=3)
    adapter = get_adapter(model)
    adapter.projection(1, projection).register_forward_pre_hook(lambda m, a: (a[0] * float("inf"),))
    with pytest.raises(NumericalError, match=f"at the input of layer 1 {projection}"):
        collect_statistics(model, adapter, random_windows(2, 16), progress=False, mlp=True)


def test_statistics_are_the_same_at_any_batch_size_and_within_the_bound():
    model = tiny_model("llama")
    adapter = get_adapter(model)
    windows = random_windows(6, 24)
    single = collect_statistics(model, adapter, windows, batch_size=1, progress=False)
    batched = collect_statistics(model, adapter, windows, batch_size=4, progress=False)
    for a, b in zip(
        single.attn_autocorr + single.o_autocorr, batched.attn_autocorr + batched.o_autocorr, strict=True
    ):
        assert torch.equal(a, b)
    o_input = projection_input(model, adapter, 2, "o_proj", windows)
    assert_within_gram_bound(single.autocorr("o", 2), o_input, tokens=windows.numel())


def test_the_capture_runs_no_lm_head():
    model = tiny_model("llama")
    adapter = get_adapter(model)
    calls = []
    handle = model.get_output_embeddings().register_forward_hook(lambda *a: calls.append(1))
    try:
        collect_statistics(model, adapter, random_windows(2, 16), progress=False)
    finally:
        handle.remove()
    assert calls == []


#: bfloat16's unit roundoff (8 significant bits).
BF16_UNIT = 2.0**-8


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma"])
def test_bfloat16_forward_passes_give_the_statistics_within_a_few_of_its_rounding_units(family):
    """`autocast=torch.bfloat16` (`--calib-precision bfloat16`): the forward passes round their matrix
    products' inputs to 8 bits, the statistics are still summed in fp64; each autocorrelation stays within 8
    bfloat16 units of the float32 capture's (about 3 measured on these models) and differs from it (the option
    takes effect), and the statistics say how they were computed."""
    model = tiny_model(family)
    adapter, windows = get_adapter(model), random_windows(4, 32)
    exact = collect_statistics(model, adapter, windows, progress=False, mlp=True)
    rounded = collect_statistics(model, adapter, windows, progress=False, mlp=True, autocast=torch.bfloat16)
    assert exact.autocast is None and rounded.autocast == torch.bfloat16
    for kind in ("attn", "o", "mlp", "down"):
        for layer in range(adapter.num_layers):
            a, b = exact.autocorr(kind, layer), rounded.autocorr(kind, layer)
            assert b.dtype == torch.float64 and torch.equal(b, b.T)
            relative = float((a - b).norm() / a.norm())
            assert 0 < relative <= 8 * BF16_UNIT, (kind, layer, relative)


@pytest.mark.parametrize(
    ("precision", "expected"), [("model", "float32"), ("bfloat16", "bfloat16 (autocast)")]
)
def test_a_run_says_what_its_calibration_computed_in(tmp_path, precision, expected):
    from conftest import tiny_model_dir

    from compressor.api import CompressOptions, compress

    text = tmp_path / "calib.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 200)
    options = CompressOptions(
        calib=str(text), calib_samples=2, seq_len=32, calib_precision=precision, evaluate=False, save=False,
        stats_cache=False,
    )  # fmt: skip
    summary = compress(str(tiny_model_dir(tmp_path / "tiny")), options, device="cpu", progress=False).summary
    calibration = summary["settings"]["calibration"]
    assert calibration["precision"] == precision and calibration["computed_in"] == expected


def test_leaving_out_the_gate_input_changes_no_other_statistic():
    model = tiny_model("llama")
    adapter, windows = get_adapter(model), random_windows(4, 16)
    full = collect_statistics(model, adapter, windows, progress=False, mlp=True)
    lean = collect_statistics(model, adapter, windows, progress=False, mlp=True, gate_input=False)
    assert full.inputs == ("attn", "o", "mlp", "down") and lean.inputs == ("attn", "o", "down")
    assert lean.mlp_autocorr is None and "mlp" not in lean.input_means
    for kind in lean.inputs:
        for layer in range(adapter.num_layers):
            assert torch.equal(full.autocorr(kind, layer), lean.autocorr(kind, layer))
            assert torch.equal(full.input_mean(kind, layer), lean.input_mean(kind, layer))


@pytest.mark.parametrize(("method", "mlp", "reads_gate"), [
    ("masa", "neurons", False), ("masa", "lowrank", True), ("flap", None, False), ("modegpt", None, False),
    ("svd-llm", None, True),
])  # fmt: skip
def test_a_run_sums_the_gate_input_only_for_a_method_that_reads_it(
    tmp_path, monkeypatch, method, mlp, reads_gate
):
    """The whole-model run collects gate/up's input autocorrelation only where the method reads it, and the run
    (every method reads what it needs: a missing input is an error, never a silent substitute) completes."""
    from conftest import tiny_model_dir

    import compressor.api.holding as holding_module
    from compressor.api import CompressOptions, compress

    collected = []

    def recording(*args, **kwargs):
        stats = collect_statistics(*args, **kwargs)
        collected.append(stats.inputs)
        return stats

    monkeypatch.setattr(holding_module, "collect_statistics", recording)
    text = tmp_path / "calib.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 200)
    options = CompressOptions(
        calib=str(text), calib_samples=2, seq_len=32, evaluate=False, save=False, stats_cache=False,
        method=method, targets="attn,mlp", ratio=0.2, **({"mlp": mlp} if mlp else {}),
    )  # fmt: skip
    compress(str(tiny_model_dir(tmp_path / "tiny")), options, device="cpu", progress=False)
    assert collected == [("attn", "o", "mlp", "down") if reads_gate else ("attn", "o", "down")]


def test_an_unknown_calibration_precision_is_one_line_naming_the_choices(capsys):
    from compressor.cli import main

    with pytest.raises(SystemExit):
        main(["smollm2-135m", "--calib-precision", "half", "--dry-run"])
    err = capsys.readouterr().err
    assert (
        "--calib-precision" in err and "'model' or 'bfloat16'" in err and len(err.strip().splitlines()) <= 2
    )
