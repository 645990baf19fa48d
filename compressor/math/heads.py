"""Attention heads kept whole (the `heads` form), with a least-squares refit of `o_proj` (pure math, no model code).

The attention's output is `y = O z`, `z` the concatenated head outputs (`H` heads of `d` values; `O`: o_proj,
`(hidden, H·d)`). Dropping a query head drops its `d` rows of q_proj, so the kept heads' outputs `z_S` are exact
(their queries, keys and values are unchanged), and only `O` has to change: as for an MLP's neurons
(`neurons.py`), with `C = E[z zᵀ]` (o_proj's input autocorrelation, which `capture` holds),

    O' = O C[:, S] C[S, S]⁻¹,     error(S) = tr(O C Oᵀ) − ‖O C[:, S] L⁻ᵀ‖²,   C[S, S] = L Lᵀ.

Engines map query head `i` of a layer to KV head `i // (heads per KV head)`: a layer must keep the same number
`r` of query heads for each of its `G` KV heads (and at least one: a KV head nobody reads is not a form
llama.cpp's layouts have). So the unit of a layer is `r = 1..H/G`, a step one more query head in every KV group.
For each step the heads are chosen greedily, one KV group after the other: the head adding the most explained
output energy given those kept so far (in every group). The sets are nested, so one order gives the error at
every `r`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from compressor.math.neurons import regularized
from compressor.runtime.errors import NumericalError

#: Relative damping tried, in order, when C[S, S] is not positive definite (reported by the caller).
DAMPINGS = (0.0, 1e-10, 1e-8, 1e-6, 1e-4)


@dataclass
class HeadTail:
    """A layer's heads in the order they are kept (`order[s]`: the `G` heads added at step `s`, one per KV group)
    and `tail[r - 1]`: the output error keeping `r` heads per group, `r = 1..H/G`."""

    order: list[list[int]]
    tail: torch.Tensor
    damping: float = 0.0

    def kept(self, per_group: int) -> list[int]:
        """The heads kept at `per_group` heads per KV group, grouped by KV head (the order engines read)."""
        return sorted(h for step in self.order[:per_group] for h in step)


def head_columns(heads: list[int], head_dim: int) -> torch.Tensor:
    """The columns of `z` (rows of q_proj) of `heads`, in that order."""
    return (
        torch.cat([torch.arange(h * head_dim, (h + 1) * head_dim) for h in heads])
        if heads
        else torch.zeros(0, dtype=torch.long)
    )


def _damped_block(c: torch.Tensor, columns: torch.Tensor, damping: float) -> torch.Tensor:
    """C[S, S] + damping · mean(diag C) · I, a new matrix (indexing copies), damped on its diagonal where it is."""
    block = c[columns][:, columns]
    if damping:
        block.diagonal().add_(damping * float(torch.diagonal(c).mean()))
    return block


def _explained(c: torch.Tensor, oc: torch.Tensor, columns: torch.Tensor, damping: float) -> float | None:
    """‖O C[:, S] L⁻ᵀ‖² for `S` = `columns` (None when C[S, S] + damping is not positive definite)."""
    factor, info = torch.linalg.cholesky_ex(_damped_block(c, columns, damping))
    if int(info):
        return None
    projected = torch.linalg.solve_triangular(factor, oc[:, columns].T, upper=False)
    return float(projected.square().sum())


def head_tail(autocorr: torch.Tensor, o_weight: torch.Tensor, kv_heads: int, head_dim: int) -> HeadTail:
    """The greedy order of a layer's query heads and the error at every heads-per-group count."""
    c = regularized(autocorr, 0.0)
    o = o_weight.detach().to(torch.float64)
    heads = o.shape[1] // head_dim
    per_group = heads // kv_heads
    oc = o @ c
    total = float(torch.einsum("ij,ij->", oc, o))
    for damping in DAMPINGS:
        order, tail = _greedy(c, oc, heads, per_group, head_dim, damping)
        if order is not None:
            return HeadTail(
                order, torch.tensor([total - e for e in tail], dtype=torch.float64).clamp_min(0), damping
            )
    raise NumericalError(
        "the attention output's autocorrelation is not positive definite even damped by 1e-4 of its mean "
        "diagonal: too few calibration tokens (raise --calib-samples)"
    )


def _greedy(c, oc, heads, per_group, head_dim, damping):
    kept: list[int] = []
    order, explained = [], []
    for _ in range(per_group):
        step = []
        for group in range(heads // per_group):
            candidates = [h for h in range(group * per_group, (group + 1) * per_group) if h not in kept]
            best, best_value = None, -1.0
            for h in candidates:
                value = _explained(c, oc, head_columns(sorted(kept + [h]), head_dim), damping)
                if value is None:
                    return None, None
                if value > best_value:
                    best, best_value = h, value
            kept.append(best)
            step.append(best)
        order.append(step)
        explained.append(best_value)
    return order, explained


def refit_o(
    autocorr: torch.Tensor, o_weight: torch.Tensor, kept: list[int], head_dim: int, damping: float
) -> torch.Tensor:
    """`O C[:, S] C[S, S]⁻¹` for the columns of the `kept` heads (fp64): the o_proj that reads them."""
    c = regularized(autocorr, 0.0)
    o = o_weight.detach().to(torch.float64)
    columns = head_columns(kept, head_dim)
    factor = torch.linalg.cholesky(_damped_block(c, columns, damping))
    return torch.cholesky_solve((o @ c[:, columns]).T, factor).T
