"""The evaluation of `--layerwise` (`layer_runner.LayerRunner`'s walk over the layers): chunks of evaluation windows
advanced through the layers, the original's last hidden states spilled before compression and the compressed
model's computed after, both through the model's own head (final norm, LM head, any soft-capping) by replaying
them in a forward pass whose layers are stand-ins, as `evaluation.perplexity.evaluate_against` computes them.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from compressor.evaluation.perplexity import (
    Faithfulness,
    PerplexityResult,
    checked_window_nll,
    faithfulness,
    kl_and_agreement,
    perplexity_result,
)
from compressor.modeling.offload import OffloadedModel, trim_heap
from compressor.runtime.progress import progress_bar
from compressor.statistics.layer_runner import LayerRunner


def final_hidden_states(
    om: OffloadedModel,
    stream: LayerRunner,
    replaced: Mapping[str, torch.Tensor] | None = None,
    progress: bool = True,
    description: str = "Perplexity (layer by layer)",
) -> list[torch.Tensor]:
    """The last layer's output for every batch of `stream` (advanced through every layer: `stream.hidden` after),
    the layers' compressed tensors taken from `replaced` where it holds them (the original weights elsewhere)."""
    with progress_bar(description, total=om.adapter.num_layers, enabled=progress) as bar:
        for index in range(om.adapter.num_layers):
            with om.onloaded(index, replaced):
                stream.advance(index)
            trim_heap()
            bar.advance()
    return stream.hidden


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
        stream = LayerRunner(om.adapter, chunk, batch_size)
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
    token_kl: list[torch.Tensor] = []  # per window, each token's KL
    agreements = 0
    for first, chunk in _chunks(windows, chunk_windows):
        t = time.perf_counter()
        stream = LayerRunner(om.adapter, chunk, batch_size)
        where = f"windows {first + 1}-{first + len(chunk)} of {n}"
        candidate = final_hidden_states(om, stream, compressed, progress, f"Perplexity, compressed ({where})")
        seconds["compressed"] += time.perf_counter() - t
        with torch.no_grad(), safe_open(directory / f"{first:07d}.safetensors", framework="pt") as f:
            for b, batch in enumerate(stream.batches):
                t = time.perf_counter()
                reference = stream.log_probs(b, f.get_tensor(f"b{b}").to(om.device))
                nll["original"].extend(checked_window_nll(reference, batch, first, "the original model"))
                seconds["original"] += time.perf_counter() - t
                t = time.perf_counter()
                log_probs = stream.log_probs(b, candidate[b])
                nll["compressed"].extend(checked_window_nll(log_probs, batch, first, "the compressed model"))
                kl, agree = kl_and_agreement(reference, log_probs, per_token=True)
                token_kl.extend(kl.cpu())
                agreements += int(agree.sum())
                seconds["compressed"] += time.perf_counter() - t
    tokens = [seq_len - 1] * n
    before = perplexity_result(nll["original"], tokens, seq_len, seconds["original"])
    after = perplexity_result(nll["compressed"], tokens, seq_len, seconds["compressed"])
    return before, after, faithfulness(after, before, token_kl, agreements)
