"""Stage 2: group consecutive layers by the KL divergence of their logit-lens distributions."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from compressor.errors import UserError


@torch.no_grad()
def logit_lens_distributions(
    block_means: torch.Tensor,
    final_norm: nn.Module,
    unembedding: nn.Module,
    apply_final_norm: bool = True,
) -> torch.Tensor:
    """p_l = mean over windows of softmax(lm_head(norm(ȳ_l))). block_means: (L, N, H) -> (L, V) fp64.

    The standard logit lens applies the final norm first; the paper applies the unembedding directly
    (`apply_final_norm=False`).
    """
    weight = unembedding.weight
    probs = []
    for layer_means in block_means:  # (N, H)
        h = layer_means.to(device=weight.device, dtype=weight.dtype)
        if apply_final_norm:
            h = final_norm(h)
        logits = unembedding(h).double()  # (N, V)
        probs.append(torch.softmax(logits, dim=-1).mean(dim=0))
    return torch.stack(probs).cpu()


def consecutive_kl(p: torch.Tensor, eps: float = 1e-30) -> torch.Tensor:
    """kl_l = KL(p_l ‖ p_{l+1}) for l = 0..L-2 (fp64)."""
    p = p.double().clamp_min(eps)
    return (p[:-1] * (p[:-1].log() - p[1:].log())).sum(dim=-1)


def local_maxima(values: torch.Tensor) -> list[int]:
    """Indices that are local maxima; the sequence ends count as maxima when larger than their neighbour."""
    v = values.tolist()
    n = len(v)
    if n == 1:
        return [0]
    out = []
    for i in range(n):
        left = v[i - 1] if i > 0 else float("-inf")
        right = v[i + 1] if i < n - 1 else float("-inf")
        if v[i] > left and v[i] >= right:
            out.append(i)
    return out


@dataclass
class Grouping:
    groups: list[list[int]]  # consecutive layer indices
    boundaries: list[int]  # transition indices t: a split between layer t and t+1
    kl: list[float]
    rule: str

    @property
    def sizes(self) -> list[int]:
        return [len(g) for g in self.groups]

    def largest_group(self) -> int:
        return max(range(len(self.groups)), key=lambda g: (len(self.groups[g]), -g))


def group_layers(kl: torch.Tensor, n_groups: int, end_boundaries: bool = True) -> Grouping:
    """Place the G-1 boundaries at the largest local maxima of kl.

    If there are fewer local maxima than needed, the largest remaining transitions fill in (reported
    in `rule`). With `end_boundaries=False` the first and last transitions may not be boundaries, so
    the first and last layers are never singletons.
    """
    n_layers = len(kl) + 1
    if not 1 <= n_groups <= n_layers:
        raise UserError(
            f"--groups {n_groups} is impossible for a model with {n_layers} layers: use 1..{n_layers}"
        )
    allowed = set(range(len(kl)))
    if not end_boundaries:
        allowed -= {0, len(kl) - 1}
    if n_groups - 1 > len(allowed):
        raise UserError(
            f"--groups {n_groups} needs {n_groups - 1} boundaries but only {len(allowed)} transitions may be "
            f"boundaries (end boundaries {'allowed' if end_boundaries else 'excluded'}): use fewer groups"
        )
    values = kl.tolist()
    maxima = [i for i in local_maxima(kl) if i in allowed]
    chosen = sorted(maxima, key=lambda i: (-values[i], i))[: n_groups - 1]
    rule = "largest local maxima of KL" + ("" if end_boundaries else " (first/last transitions excluded)")
    if len(chosen) < n_groups - 1:
        rest = sorted((i for i in allowed if i not in chosen), key=lambda i: (-values[i], i))
        chosen += rest[: n_groups - 1 - len(chosen)]
        rule += "; too few local maxima, filled with the largest remaining transitions"
    boundaries = sorted(chosen)
    groups, start = [], 0
    for b in boundaries:
        groups.append(list(range(start, b + 1)))
        start = b + 1
    groups.append(list(range(start, n_layers)))
    return Grouping(groups=groups, boundaries=boundaries, kl=values, rule=rule)


def contiguous_groups(n_layers: int, n_groups: int) -> list[list[int]]:
    """Equal-size consecutive groups (used where no statistics exist, e.g. planning before calibration)."""
    bounds = torch.linspace(0, n_layers, n_groups + 1).round().long().tolist()
    return [list(range(bounds[g], bounds[g + 1])) for g in range(n_groups)]
