"""Rank allocators: how a plan's residual budget becomes ranks, from each matrix's discarded-energy tail.

The pure math (Algorithm 1's pair walk, the greedy) is `compressor.math.allocation`'s; an allocator applies it to a
`CompressionPlan` and says what it did. `plan` previews the same rules (`PaperAllocator.initial_ranks`).
"""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from compressor.math.accounting import NEURON_READER, CompressionPlan, layer_dense_params
from compressor.math.allocation import (
    Steps,
    Unit,
    _initial_ranks,
    allocate_global,
    allocate_global_with_dense,
    balance_pair_paper,
)

#: Per matrix, (layer, projection) -> its whitened error at every rank of its allocation unit.
Tails = dict[tuple[int, str], torch.Tensor]
#: Per matrix, what one unit of its whitened error costs in the allocation's objective
#: (`MethodContext.error_weight`: 1, 1 / ‖W S‖², or the loss sensitivity).
ErrorWeight = Callable[[int, str], float]

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

    def allocate(self, plan: CompressionPlan, tails: Tails, weight: ErrorWeight) -> dict:
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


@dataclass(frozen=True)
class AllocationProblem:
    """What the greedy sees of a plan: per unit (`_unit_name`) its scaled tail, its (Σ out, in) shape, and the
    cost of keeping it whole."""

    units: dict[str, list]  # name -> the ProjectionPlans sharing its rank
    tails: dict[str, torch.Tensor]  # one entry per step (an MLP's: every `width_multiple`-th width)
    shapes: dict[str, Unit]  # a matrix's (Σ out, in), or the Steps of an MLP's neurons
    dense_costs: dict[str, int]
    step_widths: dict[str, int] = field(default_factory=dict)  # a step's width, when not 1 (neurons per step)
    floors: dict[str, int] = field(
        default_factory=dict
    )  # the rank at 0 steps, when not 0 (heads: one per group)

    def rank_of(self, name: str, steps: int) -> int:
        """The rank (an MLP's width, a layer's heads per KV group) of `steps` steps of the unit."""
        return self.floors.get(name, 0) + steps * self.step_widths.get(name, 1)

    def steps_of(self, name: str, rank: int) -> int:
        return (rank - self.floors.get(name, 0)) // self.step_widths.get(name, 1)


class GlobalAllocator:
    """Ranks across all residuals by discarded energy per parameter under the one residual budget.

    The unit of allocation is a matrix, or the matrices reading one shared input basis (one rank for all of
    them, a step costing the basis row plus one coefficient column per matrix): `plan.allocation_units`. Tails
    are per matrix, `tails[(layer, projection)][r]`: the whitened error of that matrix when its unit has rank r
    (for a basis reader, with its coefficients refit on its own statistics), so a unit's tail is the sum of its
    matrices', each matrix's times its weight (from the run: `MethodContext.error_weight`). `global` weighs every
    error alike; `global-relative` divides it by the matrix's output energy ‖W S‖², so that errors of projections
    read from different inputs (V vs O) share one scale; `global-loss` multiplies it by the matrix's loss
    sensitivity (`compressor.statistics.sensitivity`), so that errors are compared by what they cost the loss. With
    `dense_when_cheaper`, a unit whose factors would cost at least its weights is kept whole and the numbers
    saved go to the others. Shared atoms whose every
    reader ends up kept whole are dropped and their numbers allocated again (nobody would use them).
    """

    def __init__(self, name: str, dense_when_cheaper: bool):
        self.name, self.dense_when_cheaper = name, dense_when_cheaper

    def problem(self, plan: CompressionPlan, tails: Tails, weight: ErrorWeight) -> AllocationProblem:
        units = {_unit_name(key): members for key, members in plan.allocation_units().items()}

        def scaled(pp) -> torch.Tensor:
            return tails[(pp.layer, pp.projection)] * weight(pp.layer, pp.projection)

        multiple = plan.width_multiple

        def unit_tail(members) -> torch.Tensor:
            # An MLP's neurons: its error is measured once, at down_proj's output (gate/up carry none of their own);
            # a step of `width_multiple` neurons reads every such entry of the per-neuron tail. A layer's heads:
            # measured at o_proj's output, from one head per KV group on (the tail's first entry).
            readers = [pp for pp in members if pp.carries_error()]
            tail = functools.reduce(operator.add, map(scaled, readers))
            return tail[::multiple] if members[0].mode == "neurons" else tail

        def unit(members) -> Unit:
            if (
                members[0].mode == "neurons"
            ):  # one step: `width_multiple` more neurons in every MLP of the unit
                neurons = next(pp.in_features for pp in members if pp.projection == NEURON_READER)
                return Steps(multiple * sum(pp.neuron_step() for pp in members), neurons // multiple)
            if members[0].mode == "heads":  # one step: one more query head in every KV group of the layer
                per_group = members[0].out_features // members[0].head_block
                return Steps(sum(pp.head_step() for pp in members), per_group - 1)
            return (sum(pp.out_features for pp in members), members[0].in_features)

        return AllocationProblem(
            units,
            {n: unit_tail(members) for n, members in units.items()},
            {n: unit(members) for n, members in units.items()},
            # Keeping a unit whole costs its weights (and the bias entries a width pays for) and gives back its
            # coefficients.
            {
                n: sum(
                    pp.dense_params + pp.bias - pp.fixed_bias() - pp.floor_params() - pp.n_atoms for pp in m
                )
                for n, m in units.items()
            },
            {n: multiple for n, m in units.items() if m[0].mode == "neurons" and multiple != 1},
            {n: 1 for n, m in units.items() if m[0].mode == "heads"},
        )

    def allocate(self, plan: CompressionPlan, tails: Tails, weight: ErrorWeight) -> dict:
        whole, dropped = [], []
        while True:
            problem = self.problem(plan, tails, weight)
            if self.dense_when_cheaper:
                ranks, dense = allocate_global_with_dense(
                    problem.tails, problem.shapes, plan.residual_budget(), problem.dense_costs
                )
            else:
                ranks, dense = allocate_global(problem.tails, problem.shapes, plan.residual_budget()), set()
            atoms_before = _atom_sets(plan)
            for n, members in problem.units.items():
                for pp in members:
                    if n in dense:
                        pp.mode, pp.n_atoms, pp.rank, pp.basis = "dense", 0, None, None
                    else:
                        pp.rank = problem.rank_of(n, ranks[n])
            whole += [(pp.layer, pp.projection) for n in dense for pp in problem.units[n]]
            # Atoms whose readers were all kept whole are no longer counted: allocate their numbers again.
            freed = sorted(atoms_before - _atom_sets(plan))
            if not freed:
                break
            dropped += freed
        report = {"kept_whole_by_allocation": sorted(whole)} if whole else {}
        return report | ({"atoms_dropped_unused": [list(k) for k in dropped]} if dropped else {})


def _atom_sets(plan: CompressionPlan) -> set[tuple[int, str]]:
    """(group, projection type) of every set of shared atoms some projection still reads."""
    return {(pp.group, pp.projection) for pp in plan.projections if pp.mode == "shared" and pp.n_atoms}


def _unit_name(key: tuple) -> str:
    """`12.q_proj` for a matrix, `basis.3.k_proj` for the matrices reading group 3's k_proj basis."""
    return ".".join(map(str, key))


def allocator_for(allocation: str, dense_when_cheaper: bool) -> PaperAllocator | GlobalAllocator:
    if allocation == "paper":
        return PaperAllocator()
    return GlobalAllocator(allocation, dense_when_cheaper)
