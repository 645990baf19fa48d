"""Perplexity and faithfulness to the original under the protocol of docs/method.md.

Non-overlapping windows; the perplexity is the exp of the mean NLL over all predicted tokens. Every
number is also kept per window, so that :mod:`compressor.evaluation.intervals` can bootstrap it. A compressed model
can be scored *against* its original in one pass over the windows (:func:`evaluate_against`): both see
each window, which gives both perplexities, the mean KL divergence of the compressed next-token
distribution from the original's, and how often their top-1 predictions agree.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from compressor.evaluation.intervals import paired_difference, perplexity_interval
from compressor.runtime.device import statistics_device
from compressor.runtime.errors import NumericalError, all_finite
from compressor.runtime.progress import progress_bar


@dataclass
class PerplexityResult:
    ppl: float
    nll: float  # mean negative log-likelihood per predicted token (nats)
    tokens: int  # predicted tokens
    windows: int
    seq_len: int
    seconds: float
    text: str = ""
    split: str = ""
    ppl_ci95: list[float] | None = None  # bootstrap over windows (compressor.evaluation.intervals)
    # Per window: summed NLL (nats) and predicted tokens. Kept for paired comparisons, not serialised.
    window_nll: list[float] = field(default_factory=list, repr=False)
    window_tokens: list[int] = field(default_factory=list, repr=False)

    def to_dict(self) -> dict:
        return {
            "ppl": self.ppl,
            "ppl_ci95": self.ppl_ci95,
            "nll": self.nll,
            "tokens": self.tokens,
            "windows": self.windows,
            "seq_len": self.seq_len,
            "split": self.split,
            "text": self.text,
            "seconds": self.seconds,
        }


@dataclass
class Faithfulness:
    """How closely a compressed model follows its original on the same windows."""

    kl_to_original: float  # mean KL(p_original ‖ p_compressed) per predicted token (nats)
    top1_agreement: float  # fraction of predicted positions where both argmaxes agree
    ppl_ratio: float  # ppl_compressed / ppl_original
    window_kl: list[float] = field(
        default_factory=list, repr=False
    )  # summed KL per window (paired intervals)
    kl_percentiles: dict[str, float] = field(
        default_factory=dict
    )  # per-token KL's p99 and p99.9, as llama.cpp's

    def to_dict(self) -> dict:
        percentiles = {
            f"kl_{k.replace('.', '')}": v for k, v in self.kl_percentiles.items()
        }  # kl_p99, kl_p999
        return {
            "kl_to_original": self.kl_to_original,
            **percentiles,
            "top1_agreement": self.top1_agreement,
            "ppl_ratio": self.ppl_ratio,
        }


def _next_token_log_probs(model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """Log-probabilities (fp32) of the next token at every position but the last: ``(B, T-1, V)``."""
    logits = model(input_ids=input_ids, use_cache=False).logits[:, :-1]
    return torch.log_softmax(logits.float(), dim=-1)


def _window_nll(log_probs: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Summed NLL per window (fp64), ``(B,)``."""
    targets = input_ids[:, 1:].to(log_probs.device)
    picked = log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # (B, T-1)
    return -picked.to(statistics_device(picked.device)).double().sum(dim=1)  # MPS has no fp64


def checked_window_nll(
    log_probs: torch.Tensor, input_ids: torch.Tensor, first: int, what: str
) -> list[float]:
    """Summed NLL per window (fp64), refused where not finite: windows `first`.. of `what` named."""
    values = _window_nll(log_probs, input_ids)
    if not all_finite(values):
        raise NumericalError(
            f"non-finite loss in evaluation windows {first}..{first + len(values) - 1} of {what}: "
            "the model produces NaN/inf logits (try --dtype float32)"
        )
    return values.tolist()


def perplexity_result(
    window_nll: list[float], window_tokens: list[int], seq_len: int, seconds: float
) -> PerplexityResult:
    """The perplexity, its interval over windows and the per-window sums a paired difference reads."""
    total_tokens = sum(window_tokens)
    mean = sum(window_nll) / total_tokens
    return PerplexityResult(
        ppl=math.exp(mean),
        nll=mean,
        tokens=total_tokens,
        windows=len(window_nll),
        seq_len=seq_len,
        seconds=seconds,
        ppl_ci95=list(perplexity_interval(window_nll, window_tokens)),
        window_nll=window_nll,
        window_tokens=window_tokens,
    )


def _device_of(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


@torch.no_grad()
def evaluate_perplexity(
    model: nn.Module,
    windows: torch.Tensor,
    batch_size: int = 1,
    progress: bool = True,
    description: str = "Perplexity",
) -> PerplexityResult:
    """Perplexity over `windows` (n, T) of token ids. Non-finite losses are an error, never dropped."""
    device = _device_of(model)
    window_nll: list[float] = []
    start = time.perf_counter()
    n = windows.shape[0]
    with progress_bar(description, total=n, enabled=progress) as bar:
        for first in range(0, n, batch_size):
            batch = windows[first : first + batch_size].to(device)
            window_nll.extend(
                checked_window_nll(_next_token_log_probs(model, batch), batch, first, "the model")
            )
            bar.advance(len(batch))
    tokens = [int(windows.shape[1]) - 1] * n
    return perplexity_result(window_nll, tokens, int(windows.shape[1]), time.perf_counter() - start)


def kl_and_agreement(
    reference: torch.Tensor, candidate: torch.Tensor, per_token: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per window: summed KL(reference ‖ candidate) (fp64; with `per_token`, each token's, (B, T)) and the count
    of equal argmaxes.

    Both inputs are next-token log-probabilities ``(B, T, V)``. KL in this direction (the original as the
    true distribution) is the faithfulness measure used for quantized models (llama.cpp's KLD).
    """
    kl = (reference.exp() * (reference - candidate)).sum(dim=-1)  # (B, T)
    agree = (reference.argmax(dim=-1) == candidate.argmax(dim=-1)).sum(dim=1)
    kl = kl.to(statistics_device(kl.device)).double()
    return (kl if per_token else kl.sum(dim=1)), agree


@torch.no_grad()
def evaluate_against(
    reference: nn.Module,
    candidates: Mapping[str, nn.Module],
    windows: torch.Tensor,
    batch_size: int = 1,
    progress: bool = True,
    description: str = "Perplexity (original vs compressed)",
) -> tuple[PerplexityResult, dict[str, tuple[PerplexityResult, Faithfulness]]]:
    """Score a reference model and any number of candidates on the same windows, in one pass.

    Each window runs through the reference once and through every candidate; the reference's
    distribution never leaves the device (a vocabulary-sized tensor per token would not fit on disk for
    long texts). Returns the reference's perplexity and, per candidate, its perplexity and faithfulness.
    """
    n, seq_len = windows.shape
    ref_nll: list[float] = []
    cand_nll: dict[str, list[float]] = {name: [] for name in candidates}
    cand_kl: dict[str, list[torch.Tensor]] = {name: [] for name in candidates}  # per-token KL, per window
    cand_agree: dict[str, int] = dict.fromkeys(candidates, 0)
    seconds: dict[str, float] = dict.fromkeys(["reference", *candidates], 0.0)
    with progress_bar(description, total=n, enabled=progress) as bar:
        for first in range(0, n, batch_size):
            t = time.perf_counter()
            batch = windows[first : first + batch_size].to(_device_of(reference))
            ref_lp = _next_token_log_probs(reference, batch)
            ref_nll.extend(checked_window_nll(ref_lp, batch, first, "the original model"))
            seconds["reference"] += time.perf_counter() - t
            for name, model in candidates.items():
                t = time.perf_counter()
                cand_batch = batch.to(_device_of(model))
                lp = _next_token_log_probs(model, cand_batch)
                cand_nll[name].extend(checked_window_nll(lp, cand_batch, first, f"model {name}"))
                kl, agree = kl_and_agreement(ref_lp, lp.to(ref_lp.device), per_token=True)
                cand_kl[name].extend(kl.cpu())
                cand_agree[name] += int(agree.sum())
                seconds[name] += time.perf_counter() - t
            bar.advance(len(batch))
    tokens = [seq_len - 1] * n
    ref = perplexity_result(ref_nll, tokens, seq_len, seconds["reference"])
    scored = {}
    for name in candidates:
        result = perplexity_result(cand_nll[name], tokens, seq_len, seconds[name])
        scored[name] = (result, faithfulness(result, ref, cand_kl[name], cand_agree[name]))
    return ref, scored


def faithfulness(
    result: PerplexityResult, reference: PerplexityResult, token_kl: list[torch.Tensor], agreements: int
) -> Faithfulness:
    """A candidate's faithfulness to the reference scored on the same windows: `token_kl`, each window's
    per-token KL (`kl_and_agreement(per_token=True)`); `agreements`, the positions whose argmaxes agree."""
    window_kl = [float(kl.sum()) for kl in token_kl]
    tokens_kl = torch.cat(token_kl).numpy() if token_kl else np.zeros(1)
    return Faithfulness(
        kl_to_original=sum(window_kl) / result.tokens,
        top1_agreement=agreements / result.tokens,
        ppl_ratio=result.ppl / reference.ppl,
        window_kl=window_kl,
        kl_percentiles={
            "p99": float(np.percentile(tokens_kl, 99)),
            "p99.9": float(np.percentile(tokens_kl, 99.9)),
        },
    )


def quality_summary(before: PerplexityResult, after: PerplexityResult, faith: Faithfulness | None) -> dict:
    """A compression run's quality entries (summary, `--json`, report): both perplexities with their intervals,
    and, when the models were compared on the same windows, the faithfulness and the paired interval of the rise."""
    quality = {
        "ppl_before": before.ppl,
        "ppl_before_ci95": before.ppl_ci95,
        "ppl_after": after.ppl,
        "ppl_after_ci95": after.ppl_ci95,
        "tokens": after.tokens,
        "windows": after.windows,
        "seq_len": after.seq_len,
    }
    if faith is not None:
        quality.update(faith.to_dict())
        quality["ppl_rise_ci95"] = list(
            paired_difference(after.window_nll, before.window_nll, after.window_tokens).ci95
        )
    return quality
