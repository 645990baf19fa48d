"""One compression of a loaded model, whatever the method: settings resolved by the method, its plan checked,
its modules installed, the stored numbers counted against the plan.

The methods live in `compressor/methods/` (one class each, registered once); the pure math in `pca.py`,
`whitening.py`, `allocation.py`; this module only runs a method and checks what it did.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from compressor.math.accounting import CompressionPlan, check_ratio
from compressor.methods import MethodContext, ModelShape, get_method
from compressor.methods.offloaded_context import CompressedLayers, OffloadedContext
from compressor.modeling.adapters import MLP_PROJECTIONS, PROJECTIONS, DecoderAdapter, target_projections
from compressor.modeling.offload import OffloadedModel
from compressor.recipes.schema import CompressionSettings
from compressor.statistics.capture import CalibrationStats
from compressor.statistics.sensitivity import collect_sensitivity

if TYPE_CHECKING:
    from compressor.methods.masa.byte_structure import SizeTarget


@dataclass
class CompressionOutcome:
    plan: CompressionPlan
    seconds: dict[str, float]
    report: dict
    # `--layerwise`: the compressed layers' tensors on disk (the model holds meta tensors in their place)
    compressed: CompressedLayers | None = None


@torch.no_grad()
def compress_model(
    model: nn.Module,
    adapter: DecoderAdapter,
    stats: CalibrationStats,
    settings: CompressionSettings,
    ratio: float,
    progress: bool = True,
    compute_device: torch.device | None = None,
    windows: torch.Tensor | None = None,
    offloaded: OffloadedModel | None = None,
    spill_dir: Path | None = None,
    size: SizeTarget | None = None,
) -> CompressionOutcome:
    """Replace the targeted projections of `model` in place; return the exact plan and a report.

    With `offloaded` (`--layerwise`: `model` is `offloaded.model`, its layers on disk), the original weights are
    read from disk, and each finished layer is written to `spill_dir` (`outcome.compressed`). With `size`, the
    method chooses the structure under a file's bytes instead."""
    method = get_method(settings.method)
    check_ratio(ratio)
    settings = method.effective_settings(settings)
    projections = target_projections(settings.targets)
    if set(projections) & set(MLP_PROJECTIONS) and not stats.has_mlp:
        raise ValueError("--targets mlp needs the MLP inputs' statistics: collect_statistics(..., mlp=True)")
    if settings.statistics == "sequential" and windows is None:
        raise ValueError("sequential statistics need the calibration windows: pass `windows`")
    device = compute_device or next(model.parameters()).device
    loss_weighted = reads_loss_sensitivity(settings)
    if loss_weighted:
        _measure_sensitivity(model, adapter, stats, windows, settings.sensitivity_samples, progress)
    shape = ModelShape.from_adapter(adapter, projections)
    args = (model, adapter, stats.to(device), settings, ratio, device, progress, shape, windows)
    if offloaded is None:
        ctx = MethodContext(*args)
    else:
        compressed = CompressedLayers(spill_dir / "compressed", offloaded, projections)
        ctx = OffloadedContext(*args, offloaded=offloaded, compressed=compressed)
    ctx.size = size
    ctx.report["effective_settings"] = settings.model_dump()
    if loss_weighted:
        ctx.seconds["sensitivity"] = stats.sensitivity.seconds
        ctx.report["sensitivity"] = {"windows": stats.sensitivity.windows, "tokens": stats.sensitivity.tokens}
    plan = method.apply(ctx)
    ctx.finished(range(adapter.num_layers))  # whatever a method did not finish itself
    plan.check_budget()
    counted = adapter.target_parameter_count(projections)
    if counted != plan.params_after():
        raise AssertionError(
            f"installed modules store {counted} numbers, the plan says {plan.params_after()}"
        )
    compressed = ctx.compressed if isinstance(ctx, OffloadedContext) else None
    return CompressionOutcome(plan=plan, seconds=ctx.seconds, report=ctx.report, compressed=compressed)


def reads_loss_sensitivity(settings: CompressionSettings) -> bool:
    """Whether a run with these effective settings (its method's preset applied: `compress_model`'s, a
    `RunSpec`'s) weighs by the loss sensitivity: only a method that reads the allocation does (a baseline keeps
    the recipe's `global-loss` unread)."""
    method = get_method(settings.method)
    return "allocation" in method.settings_read_for(settings) and settings.allocation == "global-loss"


def _measure_sensitivity(
    model, adapter, stats: CalibrationStats, windows, samples: int, progress: bool
) -> None:
    """The loss sensitivity of every projection (`--allocation global-loss`), measured on the original model
    before anything is replaced, on the first `samples` calibration windows; kept on `stats` (a calibration
    statistic: several compressions of the same model from the same statistics measure it once)."""
    if stats.sensitivity is not None:
        if stats.sensitivity.windows != min(samples, stats.windows):
            raise ValueError(
                f"the statistics carry a loss sensitivity over {stats.sensitivity.windows} windows, the settings "
                f"ask for {samples}: collect the statistics again"
            )
        return
    if windows is None:
        raise ValueError("--allocation global-loss needs the calibration windows: pass `windows`")
    projections = sensitivity_projections(stats.has_mlp)
    stats.sensitivity = collect_sensitivity(
        model, adapter, windows[:samples], projections, progress=progress, autocast=stats.autocast
    )


def sensitivity_projections(mlp: bool) -> tuple[str, ...]:
    """The projections whose loss sensitivity is measured: the attention's, and the MLP's when its statistics
    were collected."""
    return PROJECTIONS + (MLP_PROJECTIONS if mlp else ())
