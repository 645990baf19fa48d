"""Block influence (Men et al. 2024, as MoDeGPT's global sparsity reads it): per decoder layer, one minus the mean
cosine similarity between the hidden state it reads and the one it writes, over calibration tokens. A layer that
barely turns its input (influence near 0) is the one that can lose most. Measured by forward passes through the
model in memory, or layer by layer through one whose layers stay on disk (`--layerwise`).
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import nn

from compressor.modeling.adapters import DecoderAdapter
from compressor.modeling.offload import OffloadedModel
from compressor.runtime.progress import progress_bar
from compressor.statistics.layer_stream import LayerStream


def _hidden(value) -> torch.Tensor:
    """The hidden state of a decoder layer's input or output (a tensor, or the first item of a tuple)."""
    return value[0] if isinstance(value, tuple) else value


@torch.no_grad()
def block_influence(
    model: nn.Module, adapter: DecoderAdapter, windows: torch.Tensor, progress: bool = True
) -> tuple[torch.Tensor, float]:
    """`(influence (L,) fp64, seconds)`: `1 − mean_t cos(x_t, y_t)` per layer over the tokens of `windows`
    (N, T), one window per forward pass."""
    start = time.perf_counter()
    layers = adapter.layers
    cosine_sums = torch.zeros(len(layers), dtype=torch.float64)
    inputs: dict[int, torch.Tensor] = {}
    handles = []
    for index, layer in enumerate(layers):

        def read(module, args, kwargs, index=index):
            inputs[index] = _hidden(args[0] if args else kwargs["hidden_states"])

        def wrote(module, args, kwargs, output, index=index):
            cosine_sums[index] += _cosine_sum(inputs.pop(index), _hidden(output))

        handles.append(layer.register_forward_pre_hook(read, with_kwargs=True))
        handles.append(layer.register_forward_hook(wrote, with_kwargs=True))
    device = next(model.parameters()).device
    try:
        with progress_bar("Block influence", total=len(windows), enabled=progress) as bar:
            for window in windows:
                model(window.unsqueeze(0).to(device), use_cache=False)
                bar.advance()
    finally:
        for handle in handles:
            handle.remove()
    tokens = windows.numel()
    return 1.0 - cosine_sums / max(tokens, 1), time.perf_counter() - start


def _cosine_sum(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Σ over the tokens of cos(x_t, y_t) (fp64, on the CPU): what one window adds to a layer's sum."""
    return F.cosine_similarity(x.float(), y.float(), dim=-1).to(torch.float64).sum().cpu()


@torch.no_grad()
def block_influence_layerwise(
    om: OffloadedModel, windows: torch.Tensor, progress: bool = True
) -> tuple[torch.Tensor, float]:
    """`block_influence` of a model whose layers stay on disk (`--layerwise`): the windows advanced through one
    layer at a time, one window per pass as there, so the numbers are the in-memory ones bit for bit."""
    start = time.perf_counter()
    num_layers = om.adapter.num_layers
    cosine_sums = torch.zeros(num_layers, dtype=torch.float64)
    stream = LayerStream(om, windows, batch_size=1)
    with progress_bar("Block influence (layer by layer)", total=num_layers, enabled=progress) as bar:
        for index in range(num_layers):
            with om.onloaded(index) as layer:
                for b, hidden in enumerate(stream.hidden):
                    out = stream.run(layer, index, hidden)
                    cosine_sums[index] += _cosine_sum(hidden, out)
                    stream.hidden[b] = out
            bar.advance()
    tokens = windows.numel()
    return 1.0 - cosine_sums / max(tokens, 1), time.perf_counter() - start
