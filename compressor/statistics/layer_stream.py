"""The layer-sequential pipeline (`--layerwise`): every pass over calibration or evaluation windows runs ALL the
windows through one decoder layer before the next, with only that layer on the device (`offload.OffloadedModel`),
so memory does not grow with depth and a model larger than memory can be compressed.

- Statistics: per layer, the fp64 autocorrelations of its inputs are accumulated by hooks (the same reduction as
  `capture.collect_statistics`, in the same order, so the numbers are bitwise the same) and spilled to a file;
  the block-output means (what grouping reads) stay in memory (L × N × hidden floats).
- Loss sensitivity (`--allocation global-loss`): the inputs of the sensitivity windows are spilled per layer
  during the statistics pass; the gradient of the loss is then carried back one layer at a time (forward of one
  layer from its spilled input, backward from the gradient at its output), the hooks at the projections'
  outputs measuring the same sums as `sensitivity.collect_sensitivity`'s single backward pass.
- Evaluation (`layer_evaluation.py`): chunks of windows advanced through the layers the same way, the last hidden
  states through the model's own head by `LayerStream.log_probs`.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from compressor.modeling.adapters import DecoderAdapter
from compressor.modeling.offload import OffloadedModel, trim_heap
from compressor.runtime.device import add_in_float64, autocast_to, float64_zeros, statistics_device
from compressor.runtime.errors import NumericalError
from compressor.runtime.progress import progress_bar
from compressor.statistics import capture
from compressor.statistics.capture import add_input, captured_inputs, check_gram, token_mean
from compressor.statistics.sensitivity import Sensitivity, squared_norm


class _StandIn(nn.Module):
    """Takes a decoder layer's place for one forward pass: records what the layer would have received (its
    input hidden states and keyword arguments) and returns `replacement(hidden)` instead of running it."""

    def __init__(self, layer: nn.Module, index: int, on_call: Callable):
        super().__init__()
        object.__setattr__(self, "_layer", layer)  # not a submodule: the stand-in owns no tensors
        self.index, self.on_call = index, on_call

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:  # the decoder loop may read the layer's attributes (e.g. attention_type)
            return getattr(object.__getattribute__(self, "_layer"), name)

    def forward(self, hidden_states, *args, **kwargs):
        return self.on_call(self.index, hidden_states, kwargs)


@contextmanager
def _stand_ins(adapter: DecoderAdapter, on_call: Callable) -> Iterator[None]:
    layers = adapter.layers
    originals = list(layers)
    for i, layer in enumerate(originals):
        layers[i] = _StandIn(layer, i, on_call)
    try:
        yield
    finally:
        for i, layer in enumerate(originals):
            layers[i] = layer


@torch.no_grad()
def layer_inputs(
    adapter: DecoderAdapter, batches: list[torch.Tensor], device: torch.device
) -> tuple[list[torch.Tensor], dict[tuple[int, int], dict]]:
    """Each batch of windows' hidden states at the first layer's input, and the keyword arguments every layer
    receives in a normal forward pass ((layer, batch size) → kwargs: rotary tables, masks; per layer, as
    sliding-window families differ), from decoder passes whose layers are stand-ins: no layer runs, so a model
    whose layers are on disk gives them too."""
    hidden: list[torch.Tensor] = []
    kwargs: dict[tuple[int, int], dict] = {}

    def record(index: int, h: torch.Tensor, layer_kwargs: dict) -> torch.Tensor:
        if index == 0:
            hidden.append(h.detach())
        kwargs.setdefault((index, len(h)), layer_kwargs)
        return h

    with _stand_ins(adapter, record):
        for batch in batches:
            adapter.decoder(input_ids=batch.to(device), use_cache=False)
    return hidden, kwargs


class LayerStream:
    """The hidden states of some windows at the input of the next layer, and the keyword arguments every layer
    receives in a normal forward pass (`layer_inputs`)."""

    def __init__(self, om: OffloadedModel, windows: torch.Tensor, batch_size: int = 1):
        self.om = om
        self.windows = windows
        self.batches = [windows[i : i + batch_size] for i in range(0, len(windows), batch_size)]
        self.hidden, self.kwargs = layer_inputs(om.adapter, self.batches, om.device)

    def run(self, layer: nn.Module, index: int, hidden: torch.Tensor) -> torch.Tensor:
        out = layer(hidden, **self.kwargs[(index, len(hidden))])
        return out[0] if isinstance(out, tuple) else out

    def log_probs(self, batch_index: int, hidden: torch.Tensor) -> torch.Tensor:
        """Next-token log-probabilities (fp32) of a batch whose last hidden states are `hidden`, through the
        model's own head: a forward pass whose last layer hands back `hidden`."""
        last = self.om.adapter.num_layers - 1

        def replay(index: int, h: torch.Tensor, kwargs: dict) -> torch.Tensor:
            return hidden if index == last else h

        with _stand_ins(self.om.adapter, replay):
            batch = self.batches[batch_index].to(self.om.device)
            logits = self.om.model(input_ids=batch, use_cache=False).logits[:, :-1]
        return torch.log_softmax(logits.float(), dim=-1)


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


def _input_hooks(om: OffloadedModel, index: int, inputs: dict[str, str], grams: dict, sums: dict):
    """Hooks that add each input of layer `index` to its autocorrelation (`grams`) and its sum (`sums`' row)."""

    def adding(kind: str):
        return lambda module, args: add_input(grams[kind], sums[kind][index], args[0])

    return [
        om.adapter.projection(index, projection).register_forward_pre_hook(adding(kind))
        for kind, projection in inputs.items()
    ]


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
) -> tuple[SpilledStats, LayerStream | None]:
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
) -> tuple[SpilledStats, LayerStream | None]:
    start = time.perf_counter()
    directory.mkdir(parents=True, exist_ok=True)
    stream = LayerStream(om, windows, batch_size)
    # The sensitivity runs window by window (as `collect_sensitivity` does): with batches of one window, the
    # calibration stream already carries those windows' hidden states.
    tail = None
    if sensitivity_windows:
        tail = stream if batch_size == 1 else LayerStream(om, windows[:sensitivity_windows], 1)
    num_layers = om.adapter.num_layers
    means = torch.zeros(num_layers, len(windows), om.adapter.geometry.hidden_size, dtype=torch.float32)
    widths = {kind: om.adapter.geometry.input_size(kind) for kind in inputs}
    sums = {kind: float64_zeros(num_layers, width, device=om.device) for kind, width in widths.items()}
    with progress_bar("Calibration (layer by layer)", total=num_layers, enabled=progress) as bar:
        for index in range(num_layers):
            grams = {kind: float64_zeros(width, width, device=om.device) for kind, width in widths.items()}
            with om.onloaded(index) as layer:
                if tail is not None:
                    layer_inputs = {
                        f"w{w}": h.contiguous().cpu() for w, h in enumerate(tail.hidden[:sensitivity_windows])
                    }
                    save_file(layer_inputs, str(_input_path(directory, index)))
                    if tail is not stream:
                        tail.hidden = [tail.run(layer, index, h) for h in tail.hidden]
                handles = _input_hooks(om, index, inputs, grams, sums)
                try:
                    first = 0
                    for b, hidden in enumerate(stream.hidden):
                        out = stream.run(layer, index, hidden)
                        means[index, first : first + len(out)] = out.float().mean(dim=1).cpu()
                        stream.hidden[b] = out
                        first += len(out)
                finally:
                    for handle in handles:
                        handle.remove()
            for kind, gram in grams.items():
                check_gram(gram, f"layer {index} {inputs[kind]}")
            tensors = {kind: token_mean(gram, windows.numel()).cpu() for kind, gram in grams.items()}
            save_file(tensors, str(directory / f"stats-{index:05d}.safetensors"))
            del grams, tensors
            trim_heap()
            bar.advance()
    tokens = int(windows.numel())
    input_means = {kind: total.div_(tokens) for kind, total in sums.items()}
    seconds = time.perf_counter() - start
    stats = SpilledStats(
        directory, num_layers, tuple(inputs), means, tokens, len(windows), seconds, input_means=input_means
    )
    if tail is stream:  # the calibration stream is done with: keep only the sensitivity windows
        del stream.hidden[sensitivity_windows:], stream.batches[sensitivity_windows:]
        stream.windows = windows[:sensitivity_windows]
    return stats, tail


def _input_path(directory: Path, layer: int) -> Path:
    return directory / f"inputs-{layer:05d}.safetensors"


def collect_sensitivity_layerwise(
    om: OffloadedModel,
    tail: LayerStream,
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
    om: OffloadedModel, tail: LayerStream, directory: Path, projections: tuple[str, ...], progress: bool
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
            with om.onloaded(index) as layer:
                handles = [
                    om.adapter.projection(index, p).register_forward_hook(_gradient_sum(sums[(index, p)]))
                    for p in projections
                ]
                try:
                    for w, x in enumerate(inputs):
                        x = x.requires_grad_(True)
                        with torch.enable_grad():
                            tail.run(layer, index, x).backward(grads[w])
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
