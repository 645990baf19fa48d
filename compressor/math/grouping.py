"""Stage 2: group consecutive layers by the KL divergence of their logit-lens distributions."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from compressor.runtime.device import statistics_device
from compressor.runtime.errors import UserError


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
        logits = unembedding(h).to(statistics_device(h.device)).double()  # (N, V); MPS has no fp64
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


ASSUMED_RULE_ENDS = (
    "assumed, not measured (the real groups need calibration: see `masa-compress inspect`): end boundaries "
    "allowed, so the first two boundaries go to the first and last transitions, where the bundled model's KL "
    "peaks (first and last layers kept whole), and the rest split the middle evenly"
)
ASSUMED_RULE_EVEN = (
    "assumed, not measured (the real groups need calibration: see `masa-compress inspect`): end boundaries "
    "excluded, so G nearly equal consecutive groups"
)


def assumed_groups(n_layers: int, n_groups: int, end_boundaries: bool) -> list[list[int]]:
    """A grouping for planning without statistics (rules in `ASSUMED_RULE_ENDS` / `ASSUMED_RULE_EVEN`): what
    `plan` and `--dry-run` count on, since the real groups need calibration statistics."""
    if not 1 <= n_groups <= n_layers:
        raise UserError(
            f"--groups {n_groups} is impossible for a model with {n_layers} layers: use 1..{n_layers}"
        )
    if n_groups == 1:
        return [list(range(n_layers))]
    if end_boundaries:
        if n_groups == 2:
            return [[0], list(range(1, n_layers))]
        middle = contiguous_groups(n_layers - 2, n_groups - 2)
        return [[0], *([layer + 1 for layer in g] for g in middle), [n_layers - 1]]
    if n_groups - 1 > n_layers - 3:
        raise UserError(
            f"--groups {n_groups} needs {n_groups - 1} boundaries but only {max(0, n_layers - 3)} transitions may "
            "be boundaries (end boundaries excluded): use fewer groups"
        )
    groups = contiguous_groups(n_layers, n_groups)
    if len(groups[0]) > 1 and len(groups[-1]) > 1:
        return groups
    middle = contiguous_groups(n_layers - 4, n_groups - 2)
    return [[0, 1], *([layer + 2 for layer in g] for g in middle), [n_layers - 2, n_layers - 1]]


def groups_from_layout(sizes: list[int], n_layers: int) -> list[list[int]]:
    if any(s < 1 for s in sizes) or sum(sizes) != n_layers:
        raise UserError(
            f"--layout {','.join(map(str, sizes))} must be positive group sizes summing to the {n_layers} layers"
        )
    groups, start = [], 0
    for s in sizes:
        groups.append(list(range(start, start + s)))
        start += s
    return groups


def consecutive_runs(num_layers: int, size: int) -> list[list[int]]:
    """Consecutive runs of `size` layers, first to last; the last one shorter when the depth does not divide."""
    if size < 1:
        raise ValueError(f"size must be >= 1, got {size}")
    return [list(range(i, min(i + size, num_layers))) for i in range(0, num_layers, size)]
