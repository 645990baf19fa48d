"""Perplexity under the protocol of method.md: non-overlapping windows, mean NLL over all predicted tokens."""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

import torch
from torch import nn

from compressor.errors import NumericalError
from compressor.progress import progress_bar


@dataclass
class PerplexityResult:
    ppl: float
    nll: float  # mean negative log-likelihood per predicted token (nats)
    tokens: int  # predicted tokens
    windows: int
    seq_len: int
    seconds: float
    text: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


def window_nll(model: nn.Module, input_ids: torch.Tensor) -> tuple[float, int]:
    """Summed NLL (fp64) and token count of next-token predictions in a batch of windows (B, T)."""
    logits = model(input_ids=input_ids, use_cache=False).logits  # (B, T, V)
    logits = logits[:, :-1].float()
    targets = input_ids[:, 1:]
    nll = nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none"
    )
    return nll.double().sum().item(), targets.numel()


@torch.no_grad()
def evaluate_perplexity(
    model: nn.Module,
    windows: torch.Tensor,
    batch_size: int = 1,
    progress: bool = True,
    description: str = "Perplexity",
) -> PerplexityResult:
    """Perplexity over `windows` (n, T) of token ids. Non-finite losses are an error, never dropped."""
    device = next(model.parameters()).device
    total_nll, total_tokens = 0.0, 0
    start = time.perf_counter()
    n = windows.shape[0]
    with progress_bar(description, total=n, enabled=progress) as bar:
        for first in range(0, n, batch_size):
            batch = windows[first : first + batch_size].to(device)
            nll, count = window_nll(model, batch)
            if not math.isfinite(nll):
                raise NumericalError(
                    f"non-finite loss in evaluation windows {first}..{first + len(batch) - 1}: "
                    "the model produces NaN/inf logits (try --dtype float32)"
                )
            total_nll += nll
            total_tokens += count
            bar.advance(len(batch))
    mean = total_nll / total_tokens
    return PerplexityResult(
        ppl=math.exp(mean),
        nll=mean,
        tokens=total_tokens,
        windows=n,
        seq_len=int(windows.shape[1]),
        seconds=time.perf_counter() - start,
    )
