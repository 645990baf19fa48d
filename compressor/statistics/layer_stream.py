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
- Evaluation: chunks of windows are advanced through the layers; the last hidden states go through the model's
  own head (final norm, LM head, any soft-capping) by replaying them in a forward pass whose layers are stand-ins.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from compressor.evaluation.perplexity import (
    Faithfulness,
    PerplexityResult,
    checked_window_nll,
    kl_and_agreement,
    perplexity_result,
)
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
def _stand_ins(om: OffloadedModel, on_call: Callable) -> Iterator[None]:
    layers = om.adapter.layers
    originals = list(layers)
    for i, layer in enumerate(originals):
        layers[i] = _StandIn(layer, i, on_call)
    try:
        yield
    finally:
        for i, layer in enumerate(originals):
            layers[i] = layer


class LayerStream:
    """The hidden states of some windows at the input of the next layer, and the keyword arguments every layer
    receives in a normal forward pass (rotary tables, masks: per layer, as sliding-window families differ)."""

    def __init__(self, om: OffloadedModel, windows: torch.Tensor, batch_size: int = 1):
        self.om = om
        self.windows = windows
        self.batches = [windows[i : i + batch_size] for i in range(0, len(windows), batch_size)]
        self.hidden: list[torch.Tensor] = []
        self.kwargs: dict[tuple[int, int], dict] = {}

        def record(index: int, hidden: torch.Tensor, kwargs: dict) -> torch.Tensor:
            if index == 0:
                self.hidden.append(hidden.detach())
            self.kwargs.setdefault((index, len(hidden)), kwargs)
            return hidden

        with torch.no_grad(), _stand_ins(om, record):
            for batch in self.batches:
                om.adapter.decoder(input_ids=batch.to(om.device), use_cache=False)

    def run(self, layer: nn.Module, index: int, hidden: torch.Tensor) -> torch.Tensor:
        out = layer(hidden, **self.kwargs[(index, len(hidden))])
        return out[0] if isinstance(out, tuple) else out

    def log_probs(self, batch_index: int, hidden: torch.Tensor) -> torch.Tensor:
        """Next-token log-probabilities (fp32) of a batch whose last hidden states are `hidden`, through the
        model's own head: a forward pass whose last layer hands back `hidden`."""
        last = self.om.adapter.num_layers - 1

        def replay(index: int, h: torch.Tensor, kwargs: dict) -> torch.Tensor:
            return hidden if index == last else h

        with _stand_ins(self.om, replay):
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
    handles = []
    for kind, projection in inputs.items():
        module = om.adapter.projection(index, projection)
        hook = lambda m, a, kind=kind: add_input(grams[kind], sums[kind][index], a[0])  # noqa: E731
        handles.append(module.register_forward_pre_hook(hook))
    return handles


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


# ------------------------------------------------------------------------------------------------------
# evaluation


def final_hidden_states(
    om: OffloadedModel,
    stream: LayerStream,
    replaced: Mapping[str, torch.Tensor] | None = None,
    progress: bool = True,
    description: str = "Perplexity (layer by layer)",
) -> list[torch.Tensor]:
    """The last layer's output for every batch of `stream`, the layers' compressed tensors taken from
    `replaced` where it holds them (the original weights elsewhere)."""
    hidden = list(stream.hidden)
    with torch.no_grad(), progress_bar(description, total=om.adapter.num_layers, enabled=progress) as bar:
        for index in range(om.adapter.num_layers):
            with om.onloaded(index, replaced) as layer:
                hidden = [stream.run(layer, index, h) for h in hidden]
            trim_heap()
            bar.advance()
    return hidden


def _chunks(windows: torch.Tensor, chunk_windows: int) -> list[tuple[int, torch.Tensor]]:
    return [
        (first, windows[first : first + chunk_windows]) for first in range(0, len(windows), chunk_windows)
    ]


def spill_original_outputs(
    om: OffloadedModel,
    windows: torch.Tensor,
    directory: Path,
    batch_size: int = 1,
    chunk_windows: int = 32,
    progress: bool = True,
) -> None:
    """The original model's last hidden states on the evaluation windows, written to `directory` (chunk by chunk,
    before compression: the layers then hold the compressed modules) for `evaluate_layerwise`."""
    directory.mkdir(parents=True, exist_ok=True)
    for first, chunk in _chunks(windows, chunk_windows):
        stream = LayerStream(om, chunk, batch_size)
        where = f"windows {first + 1}-{first + len(chunk)} of {len(windows)}"
        hidden = final_hidden_states(om, stream, None, progress, f"Perplexity, original ({where})")
        save_file(
            {f"b{b}": h.contiguous().cpu() for b, h in enumerate(hidden)},
            str(directory / f"{first:07d}.safetensors"),
        )


def evaluate_layerwise(
    om: OffloadedModel,
    windows: torch.Tensor,
    compressed: Mapping[str, torch.Tensor],
    directory: Path,
    batch_size: int = 1,
    chunk_windows: int = 32,
    progress: bool = True,
) -> tuple[PerplexityResult, PerplexityResult, Faithfulness]:
    """The original's and the compressed model's perplexity on `windows` and the compressed model's faithfulness
    (`evaluate.evaluate_against`'s numbers): the compressed model advanced layer by layer over chunks of
    `chunk_windows` windows, the original's last hidden states read from `spill_original_outputs`' files."""
    n, seq_len = windows.shape
    nll: dict[str, list[float]] = {"original": [], "compressed": []}
    # Each model's own time, as `evaluate_against` splits it (the KL counts as the compressed model's); the
    # original's layers ran in `spill_original_outputs`, so here only its head.
    seconds = {"original": 0.0, "compressed": 0.0}
    kl_sum, agree_sum = 0.0, 0
    for first, chunk in _chunks(windows, chunk_windows):
        t = time.perf_counter()
        stream = LayerStream(om, chunk, batch_size)
        where = f"windows {first + 1}-{first + len(chunk)} of {n}"
        candidate = final_hidden_states(om, stream, compressed, progress, f"Perplexity, compressed ({where})")
        seconds["compressed"] += time.perf_counter() - t
        with torch.no_grad(), safe_open(directory / f"{first:07d}.safetensors", framework="pt") as f:
            for b, batch in enumerate(stream.batches):
                batch = batch.to(om.device)
                t = time.perf_counter()
                reference = stream.log_probs(b, f.get_tensor(f"b{b}").to(om.device))
                nll["original"].extend(checked_window_nll(reference, batch, first, "the original model"))
                seconds["original"] += time.perf_counter() - t
                t = time.perf_counter()
                log_probs = stream.log_probs(b, candidate[b])
                nll["compressed"].extend(checked_window_nll(log_probs, batch, first, "the compressed model"))
                kl, agree = kl_and_agreement(reference, log_probs)
                kl_sum, agree_sum = kl_sum + float(kl.sum()), agree_sum + int(agree.sum())
                seconds["compressed"] += time.perf_counter() - t
    tokens = [seq_len - 1] * n
    before = perplexity_result(nll["original"], tokens, seq_len, seconds["original"])
    after = perplexity_result(nll["compressed"], tokens, seq_len, seconds["compressed"])
    faith = Faithfulness(kl_sum / after.tokens, agree_sum / after.tokens, after.ppl / before.ppl)
    return before, after, faith
