"""FLAP's fluctuation metric, its global structure search and its bias compensation (An et al., "Fluctuation-based
Adaptive Structured Pruning for Large Language Models", AAAI 2024; pure math, no model code).

A projection `y = W x` reads `x` (o_proj: the heads' outputs; down_proj: the MLP's neurons). FLAP removes input
channels whose value barely moves over the calibration tokens: a removed channel `j` is replaced by its mean `μ_j`,
which a bias carries (`b = W[:, R] μ[R]`, the *bias compensation*), so the output error of removing it is
`Var(x_j) ‖W[:, j]‖²` per token when the channel is alone: the *fluctuation* score. An MLP neuron is one channel
of down_proj's input; an attention head its `head_dim` channels of o_proj's input.

The structure search (the paper's AL-AM, as its code runs it): the channel scores of each layer and structure type
are standardized within that layer (`(s − mean) / std`), a head's score is the mean of its channels', and heads and
neurons of every layer then compare on that one scale: the structures are removed in increasing standardized score
until the budget holds. Nothing is refit: the kept columns of `W` stay as they are.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch

from compressor.runtime.errors import UserError


def fluctuation(autocorr: torch.Tensor, mean: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`Var(x_j) · ‖W[:, j]‖²` for every input channel `j` (fp64), the variance over the calibration tokens
    (`E[x_j²] − μ_j²`, from the input's autocorrelation and mean; clamped at 0 against rounding)."""
    variance = (torch.diagonal(autocorr).to(torch.float64) - mean.to(torch.float64).square()).clamp_min(0.0)
    return variance * weight.to(torch.float64).square().sum(dim=0)


def head_scores(channel_scores: torch.Tensor, head_dim: int) -> torch.Tensor:
    """A head's score: the mean of its `head_dim` channels' (o_proj's input is the heads' outputs side by side)."""
    return channel_scores.reshape(-1, head_dim).mean(dim=1)


def standardized(scores: torch.Tensor) -> torch.Tensor:
    """One layer's scores of one structure type standardized: `(s − mean) / std` over that layer's (all zeros when
    they are all equal), as FLAP's code does before it compares layers."""
    spread = float(scores.std()) if scores.numel() > 1 else 0.0
    return (scores - scores.mean()) / spread if spread > 0 else torch.zeros_like(scores)


def head_removal_steps(scores: torch.Tensor, kv_heads: int) -> tuple[list[list[int]], torch.Tensor]:
    """How a layer's query heads go, for engines' layouts (every KV group keeps the same number, at least one):
    step `k` removes the `k`-th lowest-scored head of every KV group. Returns the heads each step removes and
    the step's score, the mean of its heads' (non-decreasing in `k`: each group's `k`-th lowest is)."""
    per_group = scores.numel() // kv_heads
    ranked = [
        sorted(range(g * per_group, (g + 1) * per_group), key=lambda h: (float(scores[h]), h))
        for g in range(kv_heads)
    ]
    steps = [[ranked[g][k] for g in range(kv_heads)] for k in range(per_group - 1)]
    return steps, torch.tensor([float(scores[step].mean()) for step in steps], dtype=torch.float64)


def neuron_removal_order(scores: torch.Tensor) -> torch.Tensor:
    """A layer's neurons from the lowest score up (ties: lower index first)."""
    return torch.sort(scores, stable=True).indices


def removal_counts(steps: dict[Hashable, tuple[torch.Tensor, int]], excess: int) -> dict[Hashable, int]:
    """How many leading steps of each unit to remove so that at least `excess` numbers are freed: the steps
    of every unit in increasing score (`steps[unit] = (scores, numbers one step frees)`, each unit's scores
    non-decreasing), the lowest first, and no more once the freed numbers reach `excess`."""
    counts = dict.fromkeys(steps, 0)
    if excess <= 0:
        return counts
    queue = sorted(
        (float(score), str(unit), k, unit)
        for unit, (scores, _) in steps.items()
        for k, score in enumerate(scores.tolist())
    )
    freed = 0
    for _, _, k, unit in queue:
        if k != counts[unit]:  # unreachable for non-decreasing scores: a unit's steps leave in their order
            raise ValueError(f"the steps of {unit!r} are not in increasing score")
        counts[unit] += 1
        freed += steps[unit][1]
        if freed >= excess:
            return counts
    raise UserError(
        f"the ratio is infeasible for FLAP: removing every head but one per KV group and every neuron frees "
        f"{freed:,} of the {excess:,} numbers to remove; use a smaller --ratio"
    )


def compensation_bias(weight: torch.Tensor, mean: torch.Tensor, removed: torch.Tensor) -> torch.Tensor:
    """`W[:, R] μ[R]` (fp64): what the removed input channels `R` added to the output on average."""
    if removed.numel() == 0:
        return torch.zeros(weight.shape[0], dtype=torch.float64, device=weight.device)
    return weight.to(torch.float64)[:, removed] @ mean.to(torch.float64)[removed]
