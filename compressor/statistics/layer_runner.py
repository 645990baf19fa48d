"""The one walk over the decoder layers: calibration or evaluation windows advanced through the layers one at a
time, the hidden states of all of them kept (N·T·hidden numbers) between layers.

Every pass that needs a layer's inputs on a model other than the original one, or a model whose layers are on
disk, walks this way: `--layerwise`'s statistics, loss sensitivity and evaluation (`layer_stream.py`,
`layer_evaluation.py`, with each layer materialised by `offload.OffloadedModel.onloaded` for its step), the
sequential statistics and the stream refit (`partly_compressed.py`), the compensated rounding
(`quantize/rounding.py`) and the block influence. Each layer runs with the keyword arguments it receives in a
normal forward pass (rotary tables, masks: per layer, as sliding-window families differ), recorded once from a
forward pass whose layers are stand-ins, so a model whose layers are on disk gives them too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from compressor.modeling.adapters import INPUT_OF
from compressor.runtime.device import float64_zeros
from compressor.statistics.capture import add_gram, add_input, check_gram, token_mean


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
def _stand_ins(adapter, on_call: Callable) -> Iterator[None]:
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
    adapter, batches: list[torch.Tensor], device: torch.device
) -> tuple[list[torch.Tensor], dict[tuple[int, int], dict]]:
    """Each batch of windows' hidden states at the first layer's input, and the keyword arguments every layer
    receives in a normal forward pass ((layer, batch size) → kwargs), from decoder passes whose layers are
    stand-ins: no layer runs."""
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


class _Stop(Exception):
    """Raised by a hook to end a forward pass once it has what it needs."""


@dataclass
class InputMoments:
    """What `LayerRunner.advance_measuring` measured of one input: Σ xᵀx / T (fp64, the token mean as `capture`
    stores it) and Σ x / T (fp64) over all windows."""

    autocorr: torch.Tensor
    mean: torch.Tensor


class LayerRunner:
    """The hidden states of `windows` at the input of the next layer, per batch of `batch_size` windows. The layers
    run as they are when a step runs: in memory, or materialised from disk for that step (`--layerwise`:
    `OffloadedModel.onloaded`, `MethodContext.held`)."""

    def __init__(self, adapter, windows: torch.Tensor, batch_size: int = 1):
        self.adapter = adapter
        self.windows = windows
        device = adapter.unembedding.weight.device  # on the device also when the layers are on disk
        self.batches = [windows[i : i + batch_size].to(device) for i in range(0, len(windows), batch_size)]
        self.hidden, self.layer_kwargs = layer_inputs(adapter, self.batches, device)

    def run(self, layer_index: int, hidden: torch.Tensor, layer: nn.Module | None = None) -> torch.Tensor:
        """The output of decoder layer `layer_index` (or of `layer`, a copy of it) on `hidden`."""
        layer = self.adapter.layers[layer_index] if layer is None else layer
        out = layer(hidden, **self.layer_kwargs[(layer_index, len(hidden))])
        return out[0] if isinstance(out, tuple) else out

    def _run(self, layer_index: int, batch_index: int) -> torch.Tensor:
        return self.run(layer_index, self.hidden[batch_index])

    def keep_first(self, windows: int) -> None:
        """Drop every window after the first `windows` (batches of one window)."""
        if any(len(batch) != 1 for batch in self.batches):
            raise ValueError("keep_first needs batches of one window")
        del self.hidden[windows:], self.batches[windows:]
        self.windows = self.windows[:windows]

    def log_probs(self, batch_index: int, hidden: torch.Tensor) -> torch.Tensor:
        """Next-token log-probabilities (fp32) of a batch whose last hidden states are `hidden`, through the
        model's own head (final norm, LM head, any soft-capping): a forward pass whose last layer hands back
        `hidden`."""
        last = self.adapter.num_layers - 1

        def replay(index: int, h: torch.Tensor, kwargs: dict) -> torch.Tensor:
            return hidden if index == last else h

        with _stand_ins(self.adapter, replay):
            logits = self.adapter.model(input_ids=self.batches[batch_index], use_cache=False).logits[:, :-1]
        return torch.log_softmax(logits.float(), dim=-1)

    def each_input(self, layer_index: int, projection: str, watched: tuple[str, ...] = ()):
        """Per batch, with the layer as it is now: (the batch's index, `projection`'s input, the outputs of the
        `watched` projections, which run before it). Each pass stops where `projection` would run."""
        module = self.adapter.projection(layer_index, projection)
        seen: dict[str, torch.Tensor] = {}

        def on_input(_, args):
            seen["x"] = args[0].detach()
            raise _Stop

        def on_output(name: str):
            return lambda _, args, out: seen.__setitem__(name, out.detach())

        handles = [module.register_forward_pre_hook(on_input)]
        handles += [
            self.adapter.projection(layer_index, w).register_forward_hook(on_output(w)) for w in watched
        ]
        try:
            for b in range(len(self.hidden)):
                seen.clear()
                try:
                    self._run(layer_index, b)
                except _Stop:
                    pass
                yield b, seen["x"], {name: seen[name] for name in watched}
        finally:
            for handle in handles:
                handle.remove()

    @torch.no_grad()
    def autocorr(self, layer_index: int, projection: str) -> torch.Tensor:
        """Σ xᵀx / T (fp64, the token mean as `capture` stores it) of a projection's input over all windows, with
        the layer as it is now."""
        size = self.adapter.geometry.input_size(INPUT_OF[projection])
        total = float64_zeros(size, size, device=self.hidden[0].device)
        tokens = 0
        for _, x, _ in self.each_input(layer_index, projection):
            add_gram(total, x)
            tokens += x.numel() // x.shape[-1]
        check_gram(total, f"layer {layer_index} {projection}")
        return token_mean(total, tokens)

    @torch.no_grad()
    def advance(self, layer_index: int) -> None:
        self.hidden = [self._run(layer_index, b).detach() for b in range(len(self.hidden))]

    @torch.no_grad()
    def advance_measuring(
        self, layer_index: int, inputs: dict[str, str], advance: bool = True
    ) -> dict[str, InputMoments]:
        """`advance` through layer `layer_index` (unless not `advance`: the hidden states stay), and the moments
        of each of `inputs` (name → the projection of that layer whose input it is) over all windows, measured in
        that same pass by `capture.add_input` (what the in-memory capture adds: the numbers agree bit for bit)."""
        modules = {name: self.adapter.projection(layer_index, p) for name, p in inputs.items()}
        device = self.hidden[0].device
        grams = {n: float64_zeros(m.in_features, m.in_features, device=device) for n, m in modules.items()}
        sums = {n: float64_zeros(m.in_features, device=device) for n, m in modules.items()}
        tokens = dict.fromkeys(modules, 0)

        def on_input(name: str):
            def hook(_, args):
                add_input(grams[name], sums[name], args[0])
                tokens[name] += args[0].numel() // args[0].shape[-1]

            return hook

        handles = [m.register_forward_pre_hook(on_input(name)) for name, m in modules.items()]
        try:
            outputs = [self._run(layer_index, b).detach() for b in range(len(self.hidden))]
        finally:
            for handle in handles:
                handle.remove()
        if advance:
            self.hidden = outputs
        for name, gram in grams.items():
            check_gram(gram, f"layer {layer_index} {inputs[name]}")
        return {
            name: InputMoments(token_mean(gram, tokens[name]), sums[name].div_(tokens[name]))
            for name, gram in grams.items()
        }
