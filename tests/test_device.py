"""Where the fp64 work goes: on the model's device, except Apple MPS (no float64 there), where it runs on the CPU.

No MPS device is needed: only the choice of device is tested, with `torch.device('mps')` objects on which nothing
is ever allocated.
"""

from __future__ import annotations

import pytest
import torch
from conftest import random_windows, tiny_model

from compressor.methods.base import MethodContext, ModelShape
from compressor.modeling.adapters import PROJECTIONS, get_adapter
from compressor.recipes.schema import CompressionSettings
from compressor.runtime import device as device_module
from compressor.runtime.device import (
    add_in_float64,
    calibration_autocast,
    computed_in,
    emulated_bfloat16_warning,
    float64_zeros,
    statistics_device,
)
from compressor.runtime.errors import UserError
from compressor.statistics.capture import _Accumulator, collect_statistics

MPS = torch.device("mps")


@pytest.mark.parametrize(
    ("device", "expected"),
    [("cpu", "cpu"), ("mps", "cpu"), ("mps:0", "cpu"), ("cuda", "cuda"), ("cuda:1", "cuda:1")],
)
def test_statistics_device_is_the_models_except_on_mps(device, expected):
    assert statistics_device(torch.device(device)) == torch.device(expected)
    assert statistics_device(device) == torch.device(expected)


def test_an_accumulator_for_an_mps_model_lives_on_the_cpu():
    total = float64_zeros(3, 3, device=MPS)
    assert total.device.type == "cpu" and total.dtype == torch.float64
    assert float64_zeros(device=MPS).shape == ()  # a 0-d accumulator (the loss sensitivity's)
    adapter = get_adapter(tiny_model("llama", num_hidden_layers=2))
    acc = _Accumulator(adapter, n_windows=4, device=MPS, mlp=True)
    assert {(t.device.type, t.dtype) for t in acc.accumulators()} == {("cpu", torch.float64)}
    assert len(acc.accumulators()) == 4 * adapter.num_layers


class _MpsValue:
    """A value as an MPS tensor behaves: it can be moved, but not made fp64 where it is."""

    def __init__(self, value: torch.Tensor):
        self.value = value

    def to(self, device):
        return self.value.to(device)

    def double(self):
        raise TypeError(
            "Cannot convert a MPS Tensor to float64 dtype as the MPS framework doesn't support float64"
        )


def test_a_value_is_moved_before_it_is_widened():
    total = float64_zeros(2, device=MPS)
    add_in_float64(total, _MpsValue(torch.tensor([1.5, 2.0])))
    assert total.tolist() == [1.5, 2.0]


def test_statistics_and_the_compute_device_of_an_mps_run_stay_on_the_cpu():
    """`compress_model` moves the statistics to the compute device it is given (the model's by default) and the
    method context runs the Cholesky factors and SVDs there: for MPS, both are the CPU."""
    model = tiny_model("llama", num_hidden_layers=2)
    adapter = get_adapter(model)
    stats = collect_statistics(model, adapter, random_windows(2, 8), progress=False).to(MPS)
    assert {c.device.type for c in stats.attn_autocorr + stats.o_autocorr} == {"cpu"}
    assert stats.block_output_means.device.type == "cpu"
    shape = ModelShape.from_adapter(adapter, PROJECTIONS)
    ctx = MethodContext(model, adapter, stats, CompressionSettings(), 0.3, MPS, False, shape)
    assert ctx.compute_device == torch.device("cpu")
    assert ctx.whitening(0, "q_proj").S.device.type == "cpu"


def test_the_calibration_computes_in_bfloat16_only_where_asked():
    fp32, bf16 = torch.float32, torch.bfloat16
    assert calibration_autocast("model", fp32) is None
    assert calibration_autocast("bfloat16", fp32) == bf16
    assert calibration_autocast("bfloat16", bf16) is None  # a model already in 16 bits computes as it is
    with pytest.raises(UserError, match="unknown calibration precision 'half': use model or bfloat16"):
        calibration_autocast("half", fp32)


@pytest.mark.parametrize("native", [True, False])
def test_bfloat16_on_a_cpu_that_emulates_it_is_said_in_one_line(monkeypatch, native):
    monkeypatch.setattr(device_module, "native_bfloat16_cpu", lambda: native)
    warning = emulated_bfloat16_warning(torch.bfloat16, torch.device("cpu"))
    assert (warning is None) == native
    if warning:
        assert "no native bfloat16" in warning and "\n" not in warning
    assert emulated_bfloat16_warning(None, torch.device("cpu")) is None
    assert emulated_bfloat16_warning(torch.bfloat16, torch.device("cuda")) is None


def test_a_summary_names_what_the_calibration_computed_in():
    assert computed_in("model", torch.float32) == "float32"
    assert computed_in("bfloat16", torch.float32) == "bfloat16 (autocast)"
    assert computed_in("bfloat16", torch.bfloat16) == "bfloat16"
