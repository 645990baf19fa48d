"""The statistics of `--layerwise`: every pass over the calibration windows runs ALL the windows through one decoder
layer before the next (`layer_runner.LayerRunner`), with only that layer on the device (`offload.OffloadedModel`),
so memory does not grow with depth and a model larger than memory can be compressed.

- Statistics: per layer, the fp64 autocorrelations of its inputs, measured in the layer's pass
  (`LayerRunner.advance_measuring`: the same reduction as `capture.collect_statistics`, in the same order, so the
  numbers are bitwise the same), spilled to a file;
  the block-output means (what grouping reads) stay in memory (L × N × hidden floats).
- Loss sensitivity (`--allocation global-loss`): the inputs of the sensitivity windows are spilled per layer
  during the statistics pass; the gradient of the loss is then carried back one layer at a time (forward of one
  layer from its spilled input, backward from the gradient at its output), the hooks at the projections'
  outputs measuring the same sums as `sensitivity.collect_sensitivity`'s single backward pass.
- Evaluation (`layer_evaluation.py`): chunks of windows advanced through the layers the same way, the last hidden
  states through the model's own head by `LayerRunner.log_probs`.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from compressor.modeling.offload import OffloadedModel, trim_heap
from compressor.runtime.device import add_in_float64, autocast_to, statistics_device
from compressor.runtime.errors import NumericalError
from compressor.runtime.progress import progress_bar
from compressor.statistics import capture
from compressor.statistics.capture import captured_inputs
from compressor.statistics.layer_runner import LayerRunner
from compressor.statistics.sensitivity import Sensitivity, squared_norm

# ------------------------------------------------------------------------------------------------------
# statistics


@dataclass
class SpilledStats:
    """`capture.CalibrationStats`' interface with the autocorrelations in one file per layer, read on demand."""

    directory: Path
    num_layers: int
    inputs: tuple[str, ...]  # the input kinds the files hold (`capture.captured_inputs`)
    block_output_means: torch.Tensor  # (L, N, hidden) fp32
    tokens: int
    windows: int
    seconds: float = 0.0
    sensitivity: Sensitivity | None = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    autocast: torch.dtype | None = None  # as `CalibrationStats.autocast`
    input_means: dict[str, torch.Tensor] | None = None  # as `CalibrationStats.input_means`, in memory

    @property
    def has_mlp(self) -> bool:
        return "down" in self.inputs

    def path(self, layer: int) -> Path:
        return self.directory / f"stats-{layer:05d}.safetensors"

    def autocorr(self, kind: str, layer: int) -> torch.Tensor:
        """The autocorrelation of input `kind` at `layer`, read from its file."""
        if kind not in self.inputs:
            raise ValueError(
                f"the {kind} input autocorrelations were not collected: {capture.not_collected_fix(kind)}"
            )
        with safe_open(self.path(layer), framework="pt") as f:
            return f.get_tensor(kind).to(self.device)

    input_mean = capture.CalibrationStats.input_mean

    def to(self, device: torch.device) -> SpilledStats:
        """Read onto where the fp64 work for a model on `device` runs (the CPU for MPS: no fp64 there)."""
        device = statistics_device(device)
        means = None if self.input_means is None else {k: v.to(device) for k, v in self.input_means.items()}
        return dataclasses.replace(self, device=device, input_means=means)


@torch.no_grad()
def collect_statistics_layerwise(
    om: OffloadedModel,
    windows: torch.Tensor,
    directory: Path,
    batch_size: int = 1,
    progress: bool = True,
    mlp: bool = False,
    sensitivity_windows: int = 0,
    autocast: torch.dtype | None = None,
    gate_input: bool = True,
) -> tuple[SpilledStats, LayerRunner | None]:
    """Statistics of the original model, one layer at a time, spilled to `directory`. With
    `sensitivity_windows`, the inputs of the first that many windows at every layer are spilled too, and their
    stream (at the last layer's output) is returned for `collect_sensitivity_layerwise`. With `autocast`, the
    layers compute in that dtype, and `mlp`/`gate_input` choose the inputs, as `capture.collect_statistics`
    does."""
    with autocast_to(om.device, autocast):
        stats, tail = _collect_statistics_layerwise(
            om,
            windows,
            directory,
            batch_size,
            progress,
            captured_inputs(mlp, gate_input),
            sensitivity_windows,
        )
    stats.autocast = autocast
    return stats, tail


def _collect_statistics_layerwise(
    om: OffloadedModel,
    windows: torch.Tensor,
    directory: Path,
    batch_size: int,
    progress: bool,
    inputs: dict[str, str],
    sensitivity_windows: int,
) -> tuple[SpilledStats, LayerRunner | None]:
    start = time.perf_counter()
    directory.mkdir(parents=True, exist_ok=True)
    stream = LayerRunner(om.adapter, windows, batch_size)
    # The sensitivity runs window by window (as `collect_sensitivity` does): with batches of one window, the
    # calibration stream already carries those windows' hidden states.
    tail = None
    if sensitivity_windows:
        tail = stream if batch_size == 1 else LayerRunner(om.adapter, windows[:sensitivity_windows], 1)
    num_layers = om.adapter.num_layers
    means = torch.zeros(num_layers, len(windows), om.adapter.geometry.hidden_size, dtype=torch.float32)
    input_means: dict[str, list[torch.Tensor]] = {kind: [] for kind in inputs}
    with progress_bar("Calibration (layer by layer)", total=num_layers, enabled=progress) as bar:
        for index in range(num_layers):
            with om.onloaded(index):
                if tail is not None:
                    spilled = {
                        f"w{w}": h.contiguous().cpu() for w, h in enumerate(tail.hidden[:sensitivity_windows])
                    }
                    save_file(spilled, str(_input_path(directory, index)))
                    if tail is not stream:
                        tail.advance(index)
                measured = stream.advance_measuring(index, inputs)
            first = 0
            for out in stream.hidden:
                means[index, first : first + len(out)] = out.float().mean(dim=1).cpu()
                first += len(out)
            for kind, moments in measured.items():
                input_means[kind].append(moments.mean)
            save_file(
                {kind: moments.autocorr.cpu() for kind, moments in measured.items()},
                str(directory / f"stats-{index:05d}.safetensors"),
            )
            del measured
            trim_heap()
            bar.advance()
    seconds = time.perf_counter() - start
    stats = SpilledStats(
        directory,
        num_layers,
        tuple(inputs),
        means,
        int(windows.numel()),
        len(windows),
        seconds,
        input_means={kind: torch.stack(rows) for kind, rows in input_means.items()},
    )
    if tail is stream:  # the calibration stream is done with: keep only the sensitivity windows
        stream.keep_first(sensitivity_windows)
    return stats, tail


def _input_path(directory: Path, layer: int) -> Path:
    return directory / f"inputs-{layer:05d}.safetensors"


def collect_sensitivity_layerwise(
    om: OffloadedModel,
    tail: LayerRunner,
    directory: Path,
    projections: tuple[str, ...],
    progress: bool = True,
    autocast: torch.dtype | None = None,
) -> Sensitivity:
    """`sensitivity.collect_sensitivity`, one layer at a time: the loss gradient at the last hidden state of each
    window, then carried back through every layer from its spilled input (no weight gets a gradient); with
    `autocast`, computing in that dtype as the calibration did."""
    with autocast_to(om.device, autocast):
        return _collect_sensitivity_layerwise(om, tail, directory, projections, progress)


def _collect_sensitivity_layerwise(
    om: OffloadedModel, tail: LayerRunner, directory: Path, projections: tuple[str, ...], progress: bool
) -> Sensitivity:
    start = time.perf_counter()
    num_layers = om.adapter.num_layers
    sums = {
        (layer, p): torch.zeros((), dtype=torch.float64) for layer in range(num_layers) for p in projections
    }
    grads = []
    for w, hidden in enumerate(tail.hidden):
        last = hidden.detach().requires_grad_(True)
        with torch.enable_grad(), _frozen(om.model):
            log_probs = tail.log_probs(w, last)
            batch = tail.batches[w].to(log_probs.device)
            loss = F.nll_loss(log_probs.flatten(0, 1), batch[:, 1:].flatten(), reduction="sum")
            loss.backward()
        grads.append(last.grad)
    with progress_bar("Loss sensitivity (layer by layer)", total=num_layers, enabled=progress) as bar:
        for index in reversed(range(num_layers)):
            with safe_open(_input_path(directory, index), framework="pt") as f:
                inputs = [f.get_tensor(f"w{w}").to(om.device) for w in range(len(grads))]
            with om.onloaded(index):
                handles = [
                    om.adapter.projection(index, p).register_forward_hook(_gradient_sum(sums[(index, p)]))
                    for p in projections
                ]
                try:
                    for w, x in enumerate(inputs):
                        x = x.requires_grad_(True)
                        with torch.enable_grad():
                            tail.run(index, x).backward(grads[w])
                        grads[w] = x.grad
                finally:
                    for handle in handles:
                        handle.remove()
            _input_path(directory, index).unlink()
            del inputs
            trim_heap()
            bar.advance()
    tokens = int(tail.windows.numel())
    weights = {}
    for (layer, p), total in sums.items():
        value = float(total) / (tokens * om.adapter.projection(layer, p).weight.shape[0])
        if not math.isfinite(value):
            raise NumericalError(f"non-finite loss gradient at the output of layer {layer} {p}")
        weights[(layer, p)] = value
    return Sensitivity(weights, tokens, len(tail.windows), time.perf_counter() - start)


@contextmanager
def _frozen(model: nn.Module) -> Iterator[None]:
    """No parameter takes a gradient (the head's weights would otherwise collect one: the embeddings' size)."""
    flags = [(p, p.requires_grad) for p in model.parameters()]
    try:
        for p, _ in flags:
            p.requires_grad_(False)
        yield
    finally:
        for p, flag in flags:
            p.requires_grad_(flag)


def _gradient_sum(total: torch.Tensor):
    def on_gradient(grad: torch.Tensor) -> None:
        add_in_float64(total, squared_norm(grad.detach()))

    def on_output(module, args, output):
        output.register_hook(on_gradient)

    return on_output
