"""Rank allocators: how a plan's residual budget becomes ranks, from each matrix's discarded-energy tail.

The pure math (Algorithm 1's pair walk, the greedy) is `compressor.allocation`'s; an allocator applies it to a
`CompressionPlan` and says what it did. `plan` previews the same rules (`PaperAllocator.initial_ranks`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from compressor.allocation import (
    _initial_ranks,
    allocate_global,
    allocate_global_with_dense,
    balance_pair_paper,
)
from compressor.plan import CompressionPlan, layer_dense_params

Tails = dict[tuple[int, str], torch.Tensor]
OutputEnergy = Callable[[int, str], float]

PAIRS = (("q_proj", "k_proj"), ("o_proj", "v_proj"))


@dataclass(frozen=True)
class PairBudgets:
    """Algorithm 1's split of the residual budget: the same per compressed layer, then per pair by dense size."""

    layers: list[int]
    layer_budget: int
    budgets: dict[tuple[str, str], int]


class PaperAllocator:
    """Algorithm 1: the residual budget spread evenly over compressed layers, split per layer between (Q,K) and
    (V,O) in proportion to their dense sizes, then balanced within each pair."""

    name = "paper"

    def pair_budgets(self, plan: CompressionPlan) -> PairBudgets:
        layers = sorted({pp.layer for pp in plan.projections if pp.mode != "dense"})
        if not layers:
            return PairBudgets([], 0, {})
        geometry = plan.geometry
        size = {p: math.prod(geometry.shape(p)) for p in plan.targets}
        layer_budget = plan.residual_budget() // len(layers)
        qk_budget = layer_budget * (size["q_proj"] + size["k_proj"]) // layer_dense_params(geometry)
        return PairBudgets(
            layers, layer_budget, dict(zip(PAIRS, (qk_budget, layer_budget - qk_budget), strict=True))
        )

    def initial_ranks(self, plan: CompressionPlan) -> dict[str, int]:
        """The ranks the walk starts from (equal budget fractions within each pair): what `plan` shows."""
        split = self.pair_budgets(plan)
        ranks = {}
        for (a, b), budget in split.budgets.items():
            ranks[a], ranks[b] = _initial_ranks(plan.geometry.shape(a), plan.geometry.shape(b), budget)
        return ranks

    def allocate(self, plan: CompressionPlan, tails: Tails, output_energy: OutputEnergy) -> dict:
        split = self.pair_budgets(plan)
        shape = plan.geometry.shape
        rows = []
        for layer in split.layers:
            for (a, b), budget in split.budgets.items():
                pair = balance_pair_paper(tails[(layer, a)], tails[(layer, b)], shape(a), shape(b), budget)
                plan.get(layer, a).rank, plan.get(layer, b).rank = pair.rank_a, pair.rank_b
                rows.append({"layer": layer, "pair": [a, b], "ranks": [pair.rank_a, pair.rank_b],
                             "initial": list(pair.initial), "error": pair.error})  # fmt: skip
        return {"algorithm1": rows} if rows else {}


class GlobalAllocator:
    """Ranks across all residuals by discarded energy per parameter under the one residual budget.

    `relative` divides each matrix's tail by the output energy of its original weight (‖W S‖²), so that errors
    of projections read from different inputs (V vs O) share one scale. With `dense_when_cheaper`, a matrix
    whose factors would cost at least its weight is kept whole and the numbers saved go to the others.
    """

    def __init__(self, relative: bool, dense_when_cheaper: bool):
        self.name = "global-relative" if relative else "global"
        self.relative, self.dense_when_cheaper = relative, dense_when_cheaper

    def allocate(self, plan: CompressionPlan, tails: Tails, output_energy: OutputEnergy) -> dict:
        keys = [(pp.layer, pp.projection) for pp in plan.projections if pp.mode != "dense"]
        names = {f"{layer}.{p}": (layer, p) for layer, p in keys}
        # An all-zero weight has no output energy and nothing to approximate (its tail is all zeros): it keeps
        # scale 1 rather than 0/0, and the allocation gives it rank 0.
        scale = {k: (output_energy(*k) or 1.0) if self.relative else 1.0 for k in keys}
        scaled = {n: tails[k] / scale[k] for n, k in names.items()}
        shapes = {n: plan.geometry.shape(k[1]) for n, k in names.items()}
        if not self.dense_when_cheaper:
            ranks, dense = allocate_global(scaled, shapes, plan.residual_budget()), set()
        else:
            # Keeping a projection whole costs its weight and gives back its coefficients.
            dense_costs = {n: plan.get(*k).dense_params - plan.get(*k).n_atoms for n, k in names.items()}
            ranks, dense = allocate_global_with_dense(scaled, shapes, plan.residual_budget(), dense_costs)
        for n, k in names.items():
            pp = plan.get(*k)
            if n in dense:
                pp.mode, pp.n_atoms, pp.rank = "dense", 0, None
            else:
                pp.rank = ranks[n]
        return {"kept_whole_by_allocation": sorted(names[n] for n in dense)} if dense else {}


def allocator_for(allocation: str, dense_when_cheaper: bool) -> PaperAllocator | GlobalAllocator:
    if allocation == "paper":
        return PaperAllocator()
    return GlobalAllocator(relative=allocation == "global-relative", dense_when_cheaper=dense_when_cheaper)
