"""Block influence (Men et al. 2024, as MoDeGPT's global sparsity reads it): per decoder layer, one minus the mean
cosine similarity between the hidden state it reads and the one it writes, over calibration tokens. A layer that
barely turns its input (influence near 0) is the one that can lose most.

The windows are advanced one layer at a time (`layer_runner.LayerRunner`, one window per pass), each layer
held for its step by the caller (`MethodContext.held`: in memory it is there; with `--layerwise` it is onloaded
from disk), so one computation serves both and gives the same numbers.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch
import torch.nn.functional as F

from compressor.modeling.adapters import DecoderAdapter
from compressor.runtime.progress import progress_bar
from compressor.statistics.layer_runner import LayerRunner


@torch.no_grad()
def block_influence(
    adapter: DecoderAdapter,
    windows: torch.Tensor,
    held: Callable[[int], AbstractContextManager] | None = None,
    progress: bool = True,
) -> tuple[torch.Tensor, float]:
    """`(influence (L,) fp64, seconds)`: `1 − mean_t cos(x_t, y_t)` per layer over the tokens of `windows`
    (N, T); `held(layer)`: the layer ready to run for its step (None: the model is in memory)."""
    start = time.perf_counter()
    runner = LayerRunner(adapter, windows)
    cosine_sums = torch.zeros(adapter.num_layers, dtype=torch.float64)
    with progress_bar("Block influence", total=adapter.num_layers, enabled=progress) as bar:
        for index in range(adapter.num_layers):
            inputs = runner.hidden
            with held(index) if held is not None else nullcontext():
                runner.advance(index)
            for x, y in zip(inputs, runner.hidden, strict=True):
                cosine_sums[index] += (
                    F.cosine_similarity(x.float(), y.float(), dim=-1).to(torch.float64).sum().cpu()
                )
            bar.advance()
    return 1.0 - cosine_sums / max(windows.numel(), 1), time.perf_counter() - start
