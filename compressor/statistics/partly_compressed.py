"""Sequential calibration: layer l's statistics are collected on the model whose layers < l (and, for o_proj,
whose own q/k/v) are already compressed, so each residual corrects the error that reaches it.

The calibration windows are run through the decoder one layer at a time (hidden states of all windows kept:
N·T·hidden numbers), with the keyword arguments each layer received in a normal forward pass (rotary
embeddings, masks: they differ per layer in some families, e.g. Gemma's sliding-window layers).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from compressor.math.whitening import WhiteningFactor, whitening_factor
from compressor.modeling.adapters import ATTN_INPUT_PROJECTIONS, INPUT_OF, PROJECTIONS
from compressor.runtime.device import autocast_to, float64_zeros
from compressor.runtime.progress import progress_bar
from compressor.statistics.capture import add_gram, check_gram, token_mean


class _Stop(Exception):
    """Raised by a hook to end a forward pass once it has what it needs."""


class LayerRunner:
    """The calibration windows' hidden states, advanced through the decoder one layer at a time."""

    def __init__(self, model, adapter, windows: torch.Tensor, batch_size: int = 1):
        self.adapter = adapter
        device = next(model.parameters()).device
        self.batches = [windows[i : i + batch_size].to(device) for i in range(0, len(windows), batch_size)]
        self.hidden: list[torch.Tensor] = []
        self.layer_kwargs: dict[tuple[int, int], dict] = {}  # (layer, batch size) -> kwargs
        sizes_seen: set[int] = set()
        for batch in self.batches:
            capture_kwargs = len(batch) not in sizes_seen
            sizes_seen.add(len(batch))
            self._first_pass(model, batch, capture_kwargs)

    def _first_pass(self, model, batch: torch.Tensor, capture_kwargs: bool) -> None:
        handles = []

        def grab(index):
            def hook(module, args, kwargs):
                hidden = args[0] if args else kwargs["hidden_states"]
                if index == 0:
                    self.hidden.append(hidden.detach())
                if capture_kwargs:
                    self.layer_kwargs[(index, len(batch))] = {
                        k: v for k, v in kwargs.items() if k != "hidden_states"
                    }
                if not capture_kwargs:
                    raise _Stop

            return hook

        for i, layer in enumerate(self.adapter.layers):
            handles.append(layer.register_forward_pre_hook(grab(i), with_kwargs=True))
        try:
            # A full pass only for the first batch of each size (to record every layer's kwargs).
            model(input_ids=batch, use_cache=False)
        except _Stop:
            pass
        finally:
            for h in handles:
                h.remove()

    def _run(self, layer_index: int, batch_index: int) -> torch.Tensor:
        hidden = self.hidden[batch_index]
        out = self.adapter.layers[layer_index](hidden, **self.layer_kwargs[(layer_index, len(hidden))])
        return out[0] if isinstance(out, tuple) else out

    @torch.no_grad()
    def autocorr(self, layer_index: int, projection: str) -> torch.Tensor:
        """Σ xᵀx / T (fp64, the token mean as `capture` stores it) of a projection's input over all windows, with
        the layer as it is now."""
        module = self.adapter.projection(layer_index, projection)
        size = self.adapter.geometry.input_size(INPUT_OF[projection])
        total = float64_zeros(size, size, device=self.hidden[0].device)
        tokens = 0

        def hook(_, args):
            nonlocal tokens
            x = args[0]
            add_gram(total, x)
            tokens += x.numel() // x.shape[-1]
            raise _Stop

        handle = module.register_forward_pre_hook(hook)
        try:
            for b in range(len(self.hidden)):
                try:
                    self._run(layer_index, b)
                except _Stop:
                    pass
        finally:
            handle.remove()
        check_gram(total, f"layer {layer_index} {projection}")
        return token_mean(total, tokens)

    @torch.no_grad()
    def advance(self, layer_index: int) -> None:
        self.hidden = [self._run(layer_index, b).detach() for b in range(len(self.hidden))]


def install_sequentially(ctx, targets, install: Callable[[int, str, WhiteningFactor], None]) -> None:
    """Per layer: whiten q/k/v by the current layer input, install them, then whiten o by the attention output
    of the partly compressed layer, install it, and advance the hidden states through the compressed layer."""
    if any(p not in PROJECTIONS for _, p in targets):
        raise ValueError("sequential statistics cover the attention projections only")
    # The forward passes compute as the original statistics' did (`--calib-precision`).
    with autocast_to(next(ctx.model.parameters()).device, ctx.stats.autocast):
        _install_sequentially(ctx, targets, install)


def _install_sequentially(ctx, targets, install: Callable[[int, str, WhiteningFactor], None]) -> None:
    runner = LayerRunner(ctx.model, ctx.adapter, ctx.windows)
    wanted = set(targets)
    with progress_bar(
        "Residual factors (sequential)", total=ctx.adapter.num_layers, enabled=ctx.progress
    ) as bar:
        for layer in range(ctx.adapter.num_layers):
            for group in (ATTN_INPUT_PROJECTIONS, ("o_proj",)):
                todo = [p for p in group if (layer, p) in wanted]
                if not todo:
                    continue
                factor = whitening_factor(runner.autocorr(layer, todo[0]).to(ctx.compute_device))
                kind = "attn" if group != ("o_proj",) else "o"
                ctx.record_damping(factor, layer=layer, input=kind, statistics="sequential")
                for p in todo:
                    install(layer, p, factor)
            runner.advance(layer)
            bar.advance()
