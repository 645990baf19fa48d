"""Device and dtype selection, the same on CPU and GPU; where float64 work goes on a device without float64."""

from __future__ import annotations

import torch

from compressor.runtime.errors import UserError

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def resolve_device(name: str = "auto") -> torch.device:
    """`auto` picks CUDA, then Apple MPS, then CPU; an explicit device must exist."""
    name = (name or "auto").lower()
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        device = torch.device(name)
    except RuntimeError as err:
        raise UserError(f"unknown device '{name}': use auto, cpu, cuda, cuda:N or mps") from err
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UserError(f"device '{name}' requested but CUDA is not available: use --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise UserError(
                f"device '{name}' does not exist ({torch.cuda.device_count()} CUDA devices): pick another index"
            )
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise UserError(f"device '{name}' requested but MPS is not available: use --device cpu")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """`auto` is float32 on CPU (bf16 matmuls are slow there) and bf16 (or fp16) on accelerators."""
    name = (name or "auto").lower()
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        if device.type == "mps":
            return torch.float16
        return torch.float32
    if name not in DTYPES:
        raise UserError(f"unknown dtype '{name}': use auto, float32, bfloat16 or float16")
    return DTYPES[name]


def statistics_device(device: torch.device) -> torch.device:
    """Where fp64 statistics and linear algebra live for a model on `device`: the device itself, except MPS,
    which has no float64 (the CPU then accumulates what the device computes in float32)."""
    device = torch.device(device)
    return torch.device("cpu") if device.type == "mps" else device


#: Columns per block of an autocorrelation's products (`statistics.capture.add_gram`): only the blocks on and above
#: the diagonal are computed (the rest is their transpose), about (1 + 256/width)/2 of the full product's work:
#: 0.63x its time at width 1536 on the 2-core CPU measured; one block row of the product is held at once.
GRAM_BLOCK_COLUMNS = 256


def float64_zeros(*shape: int, device: torch.device | str) -> torch.Tensor:
    """An fp64 accumulator of `shape` (none: a 0-d one) for statistics of a model on `device`, on
    `statistics_device(device)`."""
    return torch.zeros(shape, dtype=torch.float64, device=statistics_device(device))


def add_in_float64(total: torch.Tensor, value: torch.Tensor) -> None:
    """`total += value` into an fp64 accumulator: the value is moved to the accumulator's device first and only
    then widened, since an MPS tensor cannot be made fp64 where it is."""
    total.add_(value.to(total.device).double())
