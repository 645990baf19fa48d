"""The memory a run will need, from the model's config and the run's settings (`runtime/memory.py`'s formulas): what
`plan` prints, and the check `compress` makes before it reads a weight, so that a run that cannot fit stops with
one line naming the option that fits (`--layerwise`) instead of being killed for memory hours later."""

from __future__ import annotations

from compressor.api.model_loading import ModelSource, needs_conversion
from compressor.api.packaged_models import gguf_size, packaged_model
from compressor.api.pipeline import reads_loss_sensitivity
from compressor.api.run_options import CompressOptions
from compressor.api.session import RunSpec
from compressor.modeling.adapters import MLP_PROJECTIONS, target_projections
from compressor.runtime.errors import UserError
from compressor.runtime.memory import (
    GIB,
    RUNTIME_BASE,
    Shape,
    Workload,
    available_memory,
    conversion_peak,
    cpu_peak,
    device_peak,
    in_memory_peak,
)
from compressor.statistics.partly_compressed import stream_refit_window_count


def run_workload(
    run: RunSpec, options: CompressOptions, gpu: bool, dtype_bytes: int | None = None
) -> Workload:
    """What the run does: its calibration, sensitivity windows, targets, evaluation and dtype (`dtype_bytes`, by
    default `--dtype auto`'s: fp32 on the CPU, bf16 on a GPU)."""
    settings = run.compression
    mlp = bool(set(target_projections(settings.targets)) & set(MLP_PROJECTIONS))
    return Workload(
        windows=run.calibration.samples,
        seq_len=run.calibration.seq_len,
        sensitivity=settings.sensitivity_samples if reads_loss_sensitivity(settings) else 0,
        mlp=mlp,
        dtype_bytes=dtype_bytes or (2 if gpu else 4),
        gpu=gpu,
        basis_layers=run_layers(settings),
        eval_seq_len=run.evaluation.seq_len if options.evaluate else 0,
        gate_input=mlp and run.method.reads_gate_input(settings),
        stream_refit=stream_refit_window_count(run.calibration.samples) if settings.refit == "stream" else 0,
    )


#: The methods whose layers are compressed in runs of several (a basis or a mean shared by a run), whatever
#: `--sharing` says.
RUN_METHODS = frozenset({"basis-sharing", "shared-mean"})


def run_layers(settings) -> int:
    """How many layers' weights and factors the compression holds at once: one where nothing is shared
    (`--sharing none`, the default: `masa.basis.runs_of`), else a run of `--basis-layers`."""
    return settings.basis_layers if settings.sharing != "none" or settings.method in RUN_METHODS else 1


def memory_estimate(
    config, run: RunSpec, options: CompressOptions, gpu: bool = False, dtype_bytes: int | None = None
) -> dict:
    """Peak memory in bytes of the run in memory and with `--layerwise` (host RAM on the CPU; the GPU's memory
    on a GPU), the memory available now, and which pipeline the options choose."""
    shape, work = Shape.from_config(config), run_workload(run, options, gpu, dtype_bytes)
    return {
        "device": "gpu" if gpu else "cpu",
        # On a GPU the device's memory: the runtime's base is host memory.
        "in_memory_bytes": int(in_memory_peak(shape, work, runtime=0 if gpu else RUNTIME_BASE)),
        "layerwise_bytes": int(
            device_peak(shape, work) if gpu else cpu_peak(shape, work, RUNTIME_BASE)  # cpu_peak: --layerwise
        ),
        "available_bytes": None if gpu else available_memory(),
        "layerwise": options.layerwise,
        # Host memory, on a GPU too: the conversion runs on the CPU.
        "first_use_bytes": first_use_bytes(run.source, shape),
    }


def first_use_bytes(source: ModelSource, shape: Shape) -> int | None:
    """The peak of a packaged model's one-time conversion where it has not run yet in this cache (None where
    nothing is converted): for the 1.5B model it is above a --layerwise run's own peak."""
    return conversion_bytes(source, shape) if needs_conversion(source) else None


def conversion_bytes(source: ModelSource, shape: Shape) -> int:
    """The peak of a packaged model's conversion (`runtime.memory.conversion_peak`), whether it has run or not."""
    return int(conversion_peak(shape, gguf_size(packaged_model(source.packaged))))


def check_memory(estimate: dict) -> None:
    """Refuse, in one line and before any weight is read, a CPU run whose estimated peak exceeds the memory
    available now; name `--layerwise` when that fits."""
    available = estimate["available_bytes"]
    first_use = estimate.get("first_use_bytes")
    if first_use is not None and available is not None and first_use > available:
        raise UserError(
            f"the model's first use converts its GGUF to safetensors once, which needs about {first_use / GIB:.1f} "
            f"GiB of memory, {available / GIB:.1f} GiB is available: free memory, then run again (later runs "
            "read the converted copy)"
        )
    if estimate["device"] != "cpu" or available is None:
        return
    needed = estimate["layerwise_bytes"] if estimate["layerwise"] else estimate["in_memory_bytes"]
    if needed <= available:
        return
    have = f"about {needed / GIB:.1f} GiB of memory, {available / GIB:.1f} GiB is available"
    if estimate["layerwise"]:
        raise UserError(
            f"this run needs {have} even with --layerwise: free memory, or calibrate on fewer tokens (-n)"
        )
    if estimate["layerwise_bytes"] <= available:
        raise UserError(
            f"this run needs {have}: add --layerwise (about {estimate['layerwise_bytes'] / GIB:.1f} GiB: the "
            "layers stay on disk, the checkpoint is the same)"
        )
    raise UserError(
        f"this run needs {have}, and about {estimate['layerwise_bytes'] / GIB:.1f} GiB with --layerwise: free "
        "memory, or calibrate on fewer tokens (-n)"
    )


def run_memory(
    config, run: RunSpec, options: CompressOptions, device: str = "auto", dtype: str = "auto"
) -> dict:
    """`memory_estimate` for a resolved run on `device` in `dtype` (the CLI's names), from its model's config
    (`preview.read_model_config`: no weights read)."""
    import torch

    from compressor.runtime.device import resolve_device

    gpu = resolve_device(device).type == "cuda"
    dtype_bytes = None if dtype == "auto" else getattr(torch, dtype).itemsize
    return memory_estimate(config, run, options, gpu=gpu, dtype_bytes=dtype_bytes)
