"""Numerics that survive long calibrations, half precision and degenerate weights (issue "Scale").

The input autocorrelations are token means (`capture`), and the residual factors carry √σ on each side
(`whitening.low_rank_factors`), so the stored factors do not grow with the number of calibration tokens and a
compressed model stored in fp16 or bf16 gives finite logits as close to its fp32 self as the original model's
are. Before, C was the token sum: the factors grew as √tokens (|A| = |U_r Σ_r|, B shrinking), and the longer
calibration below overflowed fp16 (svd-llm's max |A| ≈ 8.5e4 > 65504: NaN logits).

An all-zero projection, and the input it leaves dead downstream (o_proj's behind an all-zero v_proj), has nothing
to approximate: it gets no rank and nothing divides by its zero statistics (before: a NumericalError).
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import random_windows, tiny_model

from compressor.api.pipeline import compress_model
from compressor.checkpoint import load_compressed, save_compressed
from compressor.modeling.adapters import get_adapter
from compressor.modeling.remote_code.masa_modules import dense_weight
from compressor.recipes.schema import CompressionSettings
from compressor.statistics.capture import collect_statistics

#: Every RMSNorm weight: the inputs of q/k/v and gate/up have scale ~10, as in real models.
ACTIVATION_SCALE = 10.0
#: v_proj's weights this much above their init scale: a value path of large norm (as in trained models) puts
#: o_proj's input at scale ~10² too, which made the summed statistics' factors overflow fp16 at 102k tokens.
VALUE_GAIN = 150.0
SEQ_LEN = 512
LAYERS = 4
SHORT, LONG = 8, 200  # calibration windows: 4,096 and 102,400 tokens
METHODS = ("svd-llm", "masa")  # masa: the default form (shared k/v input bases) and allocation (global-loss)
HALF = (torch.float16, torch.bfloat16)


def _model():
    model = tiny_model("llama", max_position_embeddings=SEQ_LEN, num_hidden_layers=LAYERS)
    for layer in model.model.layers:
        layer.input_layernorm.weight.data.fill_(ACTIVATION_SCALE)
        layer.post_attention_layernorm.weight.data.fill_(ACTIVATION_SCALE)
        layer.self_attn.v_proj.weight.data.mul_(VALUE_GAIN)
    return model


def _compressed(method: str, windows: torch.Tensor, stats) -> torch.nn.Module:
    model = _model()
    adapter = get_adapter(model)
    # The loss sensitivity on 4 windows rather than 16: it is one weight per matrix, and the backward pass over
    # 512-token windows is most of this file's time.
    settings = CompressionSettings(method=method, sensitivity_samples=4)
    outcome = compress_model(model, adapter, stats, settings, 0.3, progress=False, windows=windows)
    model.plan = outcome.plan  # kept for saving
    return model


@pytest.fixture(scope="module")
def compressed() -> dict[tuple[str, int], torch.nn.Module]:
    """Each method's compressed model after a short and a long calibration (one calibration per length)."""
    models = {}
    for n in (SHORT, LONG):
        windows = random_windows(n, SEQ_LEN)
        model = _model()
        stats = collect_statistics(model, get_adapter(model), windows, batch_size=32, progress=False)
        assert stats.tokens == n * SEQ_LEN
        for method in METHODS:
            models[(method, n)] = _compressed(method, windows, stats)
    return models


def _largest_factor_entry(model: torch.nn.Module) -> float:
    """The largest |number| any replacement module stores (factors, coefficients, shared bases)."""
    stored = [
        float(p.detach().abs().max())
        for name, p in model.named_parameters()
        if p.numel() and any(part in name for part in ("lowrank_", "basis", "coefficients"))
    ]
    assert stored, "nothing was compressed"
    return max(stored)


@pytest.mark.parametrize("method", METHODS)
def test_factor_magnitudes_do_not_grow_with_the_calibration_tokens(compressed, method):
    short, long = (_largest_factor_entry(compressed[(method, n)]) for n in (SHORT, LONG))
    # 25 times the tokens: the summed statistics made the factors √25 = 5 times larger (2.0e4 → 8.5e4 for
    # svd-llm); as token means they estimate the same statistics, and the factors stay where they were (~10).
    assert 1 / 1.5 < long / short < 1.5, (short, long)
    assert long < 1e3  # far from fp16's 65504, whatever the calibration length


def _relative_error(model: torch.nn.Module, reference: torch.Tensor, tokens: torch.Tensor) -> float:
    with torch.no_grad():
        logits = model(tokens).logits.float()
    assert bool(torch.isfinite(logits).all()), "non-finite logits"
    return float((logits - reference).abs().max() / reference.abs().max())


def _half_precision_error(model: torch.nn.Module, dtype: torch.dtype, tokens: torch.Tensor) -> float:
    """How far the model's logits move when its weights are cast to `dtype` (relative to the largest logit)."""
    with torch.no_grad():
        reference = model(tokens).logits.float()
    return _relative_error(copy.deepcopy(model).to(dtype), reference, tokens)


@pytest.mark.parametrize("dtype", HALF, ids=["fp16", "bf16"])
@pytest.mark.parametrize("method", METHODS)
def test_a_long_calibration_round_trips_through_half_precision(compressed, tmp_path, method, dtype):
    """The compressed model saved in fp16 / bf16 and loaded back: finite logits, no further from the fp32
    compressed model's than the original model's own cast moves them (twice that at most). Before, svd-llm's
    fp16 factors overflowed here (bf16, with fp32's range, did not)."""
    tokens = random_windows(2, 64, seed=5)
    model = compressed[(method, LONG)]
    with torch.no_grad():
        reference = model(tokens).logits.float()
    path = save_compressed(copy.deepcopy(model).to(dtype), model.plan, tmp_path / "half")
    loaded = load_compressed(path)
    assert {p.dtype for p in loaded.parameters()} == {dtype}
    budget = _half_precision_error(_model(), dtype, tokens)
    assert _relative_error(loaded, reference, tokens) <= 2 * budget


# -- all-zero weights -------------------------------------------------------------------------------------------
ZEROED = ((2, "v_proj"), (3, "k_proj"), (4, "q_proj"))


@pytest.mark.parametrize("allocation", ["global-loss", "global-relative"])
def test_all_zero_projections_get_nothing_and_break_nothing(allocation):
    """v_proj of layer 2 zeroed also zeroes o_proj's input there at every token (an all-zero autocorrelation):
    before, its whitening raised "no calibration signal reached this projection"."""
    model = tiny_model("llama")
    adapter = get_adapter(model)
    for layer, p in ZEROED:
        adapter.projection(layer, p).weight.data.zero_()
    windows = random_windows()
    stats = collect_statistics(model, adapter, windows, progress=False)
    settings = CompressionSettings(allocation=allocation)  # the default recipe's form (shared k/v bases)
    outcome = compress_model(model, adapter, stats, settings, 0.3, progress=False, windows=windows)
    assert {"layer": 2, "input": "o"} in outcome.report["zero_inputs"]
    # Nothing to approximate: the dead input's o_proj and the zeroed q_proj (own factors) get rank 0, and every
    # zeroed matrix stays exactly zero (a basis reader's refit coefficients are zero).
    assert outcome.plan.get(2, "o_proj").rank == 0 and outcome.plan.get(4, "q_proj").rank == 0
    for layer, p in ZEROED:
        assert not dense_weight(adapter.projection(layer, p)).any(), (layer, p)
    with torch.no_grad():
        assert bool(torch.isfinite(model(random_windows(2, 32, seed=1)).logits).all())
