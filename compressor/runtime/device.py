"""Device and dtype selection, the same on CPU and GPU; where float64 work goes on a device without float64."""

from __future__ import annotations

import contextlib
import platform

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


def cpu_name() -> str:
    """This CPU's model as Linux names it (`/proc/cpuinfo`), else what `platform` says: what a timing measured on
    it is cached under (`platform.processor()` alone is only the architecture on many Linux systems)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            return next(line.split(":", 1)[1].strip() for line in info if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


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


def weight_loading(dtype: torch.dtype) -> dict:
    """transformers' `from_pretrained` keywords for the weights the tool loads: the dtype, and no Hub kernels.
    From transformers 5.2x, `from_pretrained` swaps layers (rotary embeddings, norms) for kernels it fetches from
    the Hugging Face Hub wherever `device_map` places them on a GPU (as `--layerwise` does): that reaches the
    network, fails offline, and runs other arithmetic than the model's own modules, which the tool's statistics
    and checkpoints are made from and checked against."""
    return {"dtype": dtype, "use_kernels": False}


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


#: `--calib-precision`: what the calibration's forward passes compute in.
CALIBRATION_PRECISIONS = ("model", "bfloat16")


def native_bfloat16_cpu() -> bool:
    """Whether this CPU multiplies bfloat16 matrices natively (AVX512-BF16 or AMX), as oneDNN reports it; without
    them bfloat16 is emulated and slower than float32."""
    try:
        return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a build without oneDNN's query: treat as not native
        return False


def calibration_autocast(precision: str, model_dtype: torch.dtype) -> torch.dtype | None:
    """The dtype the calibration's forward passes run in under autocast; None: the model's own dtype.

    `model` (the default): the model's dtype. `bfloat16`: a float32 model computes its matrix products in
    bfloat16 (a model already in 16 bits is left as it is); the statistics are still summed in fp64. On the
    bundled model the whole-model capture then takes about 0.6x the time on a CPU with native bfloat16; on the
    validation split the model 20% smaller moved by −0.11 to +0.14 perplexity across three calibration seeds
    (less than another seed moves it) and attention 0.2 by +0.03 at every seed (BENCHMARKS.md, section 6): not
    the default."""
    if precision not in CALIBRATION_PRECISIONS:
        raise UserError(
            f"unknown calibration precision '{precision}': use {' or '.join(CALIBRATION_PRECISIONS)}"
        )
    if precision == "bfloat16" and model_dtype == torch.float32:
        return torch.bfloat16
    return None


def emulated_bfloat16_warning(autocast: torch.dtype | None, device: torch.device) -> str | None:
    """A line for a bfloat16 calibration on a CPU that only emulates it (slower than float32 there), else None."""
    if autocast == torch.bfloat16 and torch.device(device).type == "cpu" and not native_bfloat16_cpu():
        return "--calib-precision bfloat16: this CPU has no native bfloat16, so the calibration runs slower than in float32"
    return None


def autocast_to(device: torch.device, dtype: torch.dtype | None):
    """A context computing in `dtype` under autocast on `device`'s type; none (the model's dtype) for None."""
    if dtype is None:
        return contextlib.nullcontext()
    # No cast cache: it would keep a 16-bit copy of every weight until the context ends (half the model again
    # in memory; with --layerwise, every onloaded layer's). Each weight is read once per window anyway.
    return torch.autocast(torch.device(device).type, dtype=dtype, cache_enabled=False)


def computed_in(precision: str, model_dtype: torch.dtype) -> str:
    """How a summary names what a calibration of `precision` computes in: `float32`, or `bfloat16 (autocast)`."""
    autocast = calibration_autocast(precision, model_dtype)
    return str(autocast or model_dtype).removeprefix("torch.") + (" (autocast)" if autocast else "")
