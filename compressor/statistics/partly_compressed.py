"""Sequential calibration: layer l's statistics are collected on the model whose layers < l (and, for o_proj,
whose own q/k/v) are already compressed, so each residual corrects the error that reaches it.

The calibration windows are run through the decoder one layer at a time by `layer_runner.LayerRunner` (hidden
states of all windows kept: N·T·hidden numbers).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable

import torch
from torch import nn

from compressor.math.whitening import WhiteningFactor, whitening_factor
from compressor.modeling.adapters import ATTN_INPUT_PROJECTIONS, PROJECTIONS
from compressor.runtime.device import autocast_to, float64_zeros
from compressor.runtime.errors import UserError
from compressor.runtime.progress import progress_bar
from compressor.statistics.capture import add_cross, add_gram, check_gram, token_mean
from compressor.statistics.layer_runner import LayerRunner

Install = Callable[[int, str, WhiteningFactor], None]


def install_sequentially(ctx, targets, install: Install, groups: list[list[int]]) -> None:
    """Per layer: whiten q/k/v by the current layer input, install them, then whiten o by the attention output
    of the partly compressed layer, install it, and advance the hidden states through the compressed layer.
    `groups`: the layers that share tensors (a group's atoms), each declared finished (`MethodContext.finished`)
    once its last layer is installed."""
    if any(p not in PROJECTIONS for _, p in targets):
        raise ValueError("sequential statistics cover the attention projections only")
    # The forward passes compute as the original statistics' did (`--calib-precision`).
    with autocast_to(ctx.model_device, ctx.stats.autocast):
        _install_sequentially(ctx, targets, install, {max(layers): layers for layers in groups})


def _install_sequentially(ctx, targets, install: Install, finishing: dict[int, list[int]]) -> None:
    runner = LayerRunner(ctx.adapter, ctx.windows)
    wanted = set(targets)
    with progress_bar(
        "Residual factors (sequential)", total=ctx.adapter.num_layers, enabled=ctx.progress
    ) as bar:
        for layer in range(ctx.adapter.num_layers):
            with ctx.held(layer):
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
            if layer in finishing:
                ctx.finished(finishing[layer])
            bar.advance()


#: The matrices `--refit stream` refits: what the layer adds to the residual stream from its attention and its MLP.
STREAM_MATRICES = ("o_proj", "down_proj")


def original_layers(adapter) -> list[tuple[nn.Module, dict[str, str]]]:
    """A copy of every decoder layer as it is now (before anything is installed), with the paths inside it of
    the matrices `--refit stream` reads (their names differ between families)."""
    copies = []
    for index, layer in enumerate(adapter.layers):
        paths = {}
        for projection in STREAM_MATRICES:
            module = adapter.projection(index, projection)
            paths[projection] = next(name for name, m in layer.named_modules() if m is module)
        copies.append((copy.deepcopy(layer), paths))
    return copies


#: The calibration windows the stream refit reads at most (evenly spaced among them; None: all of them). Its cost
#: grows with the windows (two models advanced through every layer), but on the bundled model's validation split
#: every smaller count tried (32, 64, 128 of 256) lost more than the refit gains: down_proj's refit, as wide as the
#: kept MLP, then fits the calibration text's own gap
#: (benchmarks/results/choices/stream-refit-windows-validation.json). A benchmark may set it.
STREAM_REFIT_WINDOWS: int | None = None


def stream_refit_window_count(windows: int) -> int:
    """How many of a calibration's `windows` `--refit stream` reads."""
    return windows if STREAM_REFIT_WINDOWS is None else min(windows, STREAM_REFIT_WINDOWS)


def stream_refit_windows(windows: torch.Tensor) -> torch.Tensor:
    """The windows `--refit stream` reads: at most `STREAM_REFIT_WINDOWS` of `windows`, evenly spaced."""
    count = stream_refit_window_count(len(windows))
    if count == len(windows):
        return windows
    return windows[torch.linspace(0, len(windows) - 1, count).round().long()]


def refit_on_stream(ctx, originals, matrices: dict[int, tuple[str, ...]]) -> None:
    """`--refit stream`: after the run has installed its layers, refit `matrices` (per layer: `o_proj`, `down_proj`
    or both, plain narrowed matrices) on the compressed model's own inputs, layer by layer over the calibration
    windows, each to bring the residual stream back to the original's at the point its output is added: o_proj to
    `h_o + attn_o − h_c` (the original layer's stream after its attention, less the compressed stream before it),
    down_proj to `out_o − mid_c` (the original layer's output, less the compressed stream after its attention).
    `originals`: the original decoder layers (a copy made before anything was installed), run on the original
    stream beside the compressed ones. The least-squares solve reads fp64 sums of x xᵀ and t xᵀ; a Cholesky that
    needed damping is reported like the whitening's."""
    with autocast_to(ctx.model_device, ctx.stats.autocast), torch.no_grad():
        _refit_on_stream(ctx, originals, matrices)


def _refit_on_stream(ctx, originals, matrices: dict[int, tuple[str, ...]]) -> None:
    adapter = ctx.adapter
    runner = LayerRunner(adapter, stream_refit_windows(ctx.windows))
    stream = [h.clone() for h in runner.hidden]  # the original model's, advanced by `originals`
    start = time.perf_counter()
    with progress_bar("Refits on the stream", total=adapter.num_layers, enabled=ctx.progress) as bar:
        for layer in range(adapter.num_layers):
            original, paths = originals[layer]
            with ctx.held(layer, original) as original, ctx.held(layer):
                _refit_layer(ctx, layer, runner, stream, original, paths, matrices.get(layer, ()))
            bar.advance()
    ctx.seconds["stream_refit"] = time.perf_counter() - start


def _refit_layer(ctx, layer: int, runner: LayerRunner, stream: list, original, paths, todo) -> None:
    """One layer of `_refit_on_stream`: the original layer on the original `stream`, the refits of `todo` on the
    compressed one; both streams advanced past the layer (`stream` in place)."""
    outputs = [_original_layer(original, paths, runner, layer, b, stream[b]) for b in range(len(stream))]
    # The compressed attention runs twice (up to o_proj, then up to down_proj): handing o_proj's refitted
    # output on instead measured no faster on the bundled model (32 windows, in turns: 66.0 and 62.2 s
    # against 61.7 and 64.5 s), for N×T×H more memory; the time is in the products and moments.
    if "o_proj" in todo:  # to the original stream after the attention, less the compressed input
        _refit_o_proj(ctx, layer, runner, [(o + h) for o, _, h in outputs])
    advanced = None
    if "down_proj" in todo:  # to the original layer's output, less the compressed stream at the MLP
        advanced = _refit_down_proj(ctx, layer, runner, [out for _, out, _ in outputs])
    if advanced is None:
        runner.advance(layer)
    else:  # the refit's own pass gave the layer's output: no third pass through the layer
        runner.hidden = advanced
    stream[:] = [out for _, out, _ in outputs]


def _original_layer(layer_module, paths, runner: LayerRunner, index: int, batch: int, hidden: torch.Tensor):
    """(o_proj's output, the layer's output, its input) of the original layer on the original stream of
    `batch`, checked to be a residual layer whose o_proj and down_proj outputs are what it adds to the stream."""
    seen = {}
    attention = layer_module.get_submodule(paths["o_proj"])
    down = layer_module.get_submodule(paths["down_proj"])
    handles = [
        attention.register_forward_hook(lambda m, a, out: seen.__setitem__("o", out.detach())),
        down.register_forward_hook(lambda m, a, out: seen.__setitem__("down", out.detach())),
    ]
    try:
        out = runner.run(index, hidden, layer_module)
    finally:
        for handle in handles:
            handle.remove()
    out = (out[0] if isinstance(out, tuple) else out).detach()
    added = hidden + seen["o"] + seen["down"]
    if not torch.allclose(added, out, rtol=1e-3, atol=1e-3 * float(out.abs().max())):
        raise UserError(
            "--refit stream: this family normalizes the attention's or the MLP's output before adding it to the "
            "residual stream, where the refit's target assumes it is added as it is: use --refit calibration"
        )
    return seen["o"], out, hidden


@torch.no_grad()
def _refit_o_proj(ctx, layer: int, runner: LayerRunner, targets: list) -> None:
    """Refit o_proj of the compressed `layer` by least squares on its inputs over every batch, to the targets less
    the layer's input (where its output is added)."""
    module = ctx.adapter.projection(layer, "o_proj")
    if module.in_features == 0:  # the layer kept no head: no column to refit (its output is its bias, if any)
        return
    pairs = ((x, targets[b] - runner.hidden[b]) for b, x, _ in runner.each_input(layer, "o_proj"))
    _least_squares(ctx, layer, "o_proj", module, pairs)


@torch.no_grad()
def _refit_down_proj(ctx, layer: int, runner: LayerRunner, targets: list) -> list[torch.Tensor] | None:
    """Refit down_proj of the compressed `layer` by least squares on its inputs over every batch, to the targets
    less the compressed stream where its output is added (the layer's input plus o_proj's output).

    Returns the layer's output on every batch with the refitted matrix, `stream + down_proj(x)` from what its pass
    kept (the inputs: tokens × width per batch), which is the sum the residual layer itself computes (checked on
    the original layers by `_original_layer`): the caller advances the stream by it instead of a third pass
    through the layer. None where the layer kept no neuron."""
    module = ctx.adapter.projection(layer, "down_proj")
    if module.in_features == 0:  # no column to refit (its output is its bias, if any)
        return None
    # per batch, the stream down_proj's output is added to and its input
    kept: list[tuple[torch.Tensor, torch.Tensor]] = []

    def pairs():
        for batch, x, outputs in runner.each_input(layer, "down_proj", ("o_proj",)):
            stream = runner.hidden[batch] + outputs["o_proj"]
            kept.append((stream, x))
            yield x, targets[batch] - stream

    _least_squares(ctx, layer, "down_proj", module, pairs())
    return [stream + module(x) for stream, x in kept]


def _least_squares(ctx, layer: int, projection: str, module: nn.Module, pairs) -> None:
    """Set `module`'s weight to the least-squares fit of the gaps (less its bias) from its inputs, over the
    (input, gap) `pairs`; the solve reads fp64 sums of x xᵀ and gap xᵀ. Where nothing reaches the input, the
    calibration's refit stays."""
    width = module.in_features
    gram = float64_zeros(width, width, device=module.weight.device)
    cross = torch.zeros(module.out_features, width, dtype=torch.float64, device=gram.device)
    tokens = 0
    for x, gap in pairs:
        if module.bias is not None:
            gap = gap - module.bias
        add_gram(gram, x)
        add_cross(cross, gap, x)
        tokens += x.numel() // width
    check_gram(gram, f"layer {layer} {projection} (stream refit)")
    gram = token_mean(gram, tokens)
    factor = whitening_factor(gram.to(ctx.compute_device))
    ctx.record_damping(factor, layer=layer, input=f"{projection} (stream refit)")
    if not factor.input_is_zero:
        refit = torch.cholesky_solve((cross / tokens).T.to(factor.S.device), factor.S).T
        module.weight.copy_(refit.to(dtype=module.weight.dtype, device=module.weight.device))
        ctx.refitted(layer, projection)
