"""Parameter accounting and rank allocation for the residual factors (method.md, stage 5).

All ranks index discarded-energy tails from `whitening.discarded_energy`: `tail[r]` is the squared
(whitened) error of keeping rank `r`, for `r = 0..min(out, in)`. A rank-`r` factor pair of an
`out×in` matrix stores `r·(out + in)` numbers.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

Shape = tuple[int, int]  # (out, in)
Tail = torch.Tensor | Sequence[float]


@dataclass(frozen=True)
class Steps:
    """What one step of an allocation unit that is not a matrix's rank costs: e.g. one more neuron of an MLP
    (a row of gate and up, a column of down). `limit`: the most steps; `convex`: whether its tail's gains never
    grow (a rank's do, by Eckart–Young; a neuron order's need not, so the greedy reads its convex hull)."""

    cost: int
    limit: int
    convex: bool = False


#: A unit of the global allocation: a matrix shape (a rank step costs out + in, at most min(out, in) of them)
#: or explicit `Steps`.
Unit = Shape | Steps


def step_cost(unit: Unit) -> int:
    """Numbers one step of the unit stores."""
    return unit.cost if isinstance(unit, Steps) else sum(unit)


def step_limit(unit: Unit) -> int:
    """The most steps the unit takes (its tail has that many + 1 entries)."""
    return unit.limit if isinstance(unit, Steps) else min(unit)


def lowrank_params(out: int, in_: int, rank: int) -> int:
    """Numbers stored by rank-`rank` factors `A (out, r)`, `B (r, in)` of an `out×in` matrix."""
    if min(out, in_, rank) < 0:
        raise ValueError(f"negative size: out={out}, in={in_}, rank={rank}")
    return rank * (out + in_)


def max_rank_within(out: int, in_: int, budget: int) -> int:
    """Largest rank whose factors fit in `budget` numbers, at most `min(out, in)`, at least 0."""
    if out <= 0 or in_ <= 0:
        raise ValueError(f"matrix sizes must be positive, got out={out}, in={in_}")
    return max(0, min(min(out, in_), budget // (out + in_)))


@dataclass(frozen=True)
class PairSplit:
    """Ranks chosen for the two matrices of a pair, e.g. (Q, K) or (V, O)."""

    rank_a: int
    rank_b: int
    error: float  # tail_a[rank_a] + tail_b[rank_b]
    params: int  # lowrank_params of both; never above the pair budget
    initial: tuple[int, int]  # the equal-fraction starting ranks (r_a0, r_b0)


def _as_list(tail: Tail, unit: Unit, name: str) -> list[float]:
    """The tail as Python floats (the walk is scalar work), checked against the unit's shape or steps."""
    values = tail.detach().to(torch.float64).tolist() if isinstance(tail, torch.Tensor) else list(tail)
    if isinstance(unit, Steps):
        if unit.cost <= 0 or unit.limit < 0:
            raise ValueError(f"{name}: a step must cost > 0 numbers and the limit be >= 0, got {unit}")
    elif unit[0] <= 0 or unit[1] <= 0:
        raise ValueError(f"{name}: matrix sizes must be positive, got {unit}")
    if len(values) != step_limit(unit) + 1:
        what = f"{unit.limit} steps" if isinstance(unit, Steps) else f"a {unit[0]}x{unit[1]} matrix"
        raise ValueError(f"{name}: a tail for {what} has {step_limit(unit) + 1} entries, got {len(values)}")
    if not all(math.isfinite(v) for v in values):
        raise ValueError(f"{name}: non-finite discarded energy")
    return [float(v) for v in values]


def convex_moves(tail: list[float]) -> list[int]:
    """The steps at which the lower convex hull of `tail` (points (r, tail[r])) has its vertices, 0 and the last
    included: moving from one vertex to the next buys the largest mean gain per step available there, so a
    greedy over these moves is not stopped by a small gain that a larger one follows (Andrew's monotone chain)."""
    hull: list[int] = []
    for r, value in enumerate(tail):
        while len(hull) >= 2:
            a, b = hull[-2], hull[-1]
            # b lies on or above the segment a -> r: not a vertex of the lower hull.
            if (tail[b] - tail[a]) * (r - a) >= (value - tail[a]) * (b - a):
                hull.pop()
            else:
                break
        hull.append(r)
    return hull


def _initial_ranks(shape_a: Shape, shape_b: Shape, pair_budget: int) -> tuple[int, int]:
    """Algorithm 1's start: each matrix keeps the same fraction of its dense size.

    With `frac = pair_budget / (oA·iA + oB·iB)` (the paper's `1 - β`),
    `r = floor(frac · o·i / (o + i))`, capped at `min(o, i)`. Computed in integers so the floor is
    exact; the two costs are then at most `frac` of each dense size, so their sum fits the budget.
    """
    (out_a, in_a), (out_b, in_b) = shape_a, shape_b
    dense = out_a * in_a + out_b * in_b
    r_a = min(min(out_a, in_a), (pair_budget * out_a * in_a) // (dense * (out_a + in_a)))
    r_b = min(min(out_b, in_b), (pair_budget * out_b * in_b) // (dense * (out_b + in_b)))
    return r_a, r_b


def _pair_setup(
    tail_a: Tail, tail_b: Tail, shape_a: Shape, shape_b: Shape, pair_budget: int
) -> tuple[list[float], list[float], int, int, tuple[int, int]]:
    if pair_budget < 0:
        raise ValueError(f"pair_budget must be >= 0, got {pair_budget}")
    ta = _as_list(tail_a, shape_a, "tail_a")
    tb = _as_list(tail_b, shape_b, "tail_b")
    return ta, tb, sum(shape_a), sum(shape_b), _initial_ranks(shape_a, shape_b, pair_budget)


def balance_pair_paper(
    tail_a: Tail, tail_b: Tail, shape_a: Shape, shape_b: Shape, pair_budget: int
) -> PairSplit:
    """Algorithm 1 of the paper, made budget-exact.

    Start from the equal-fraction ranks `(r_a0, r_b0)` and move rank between the two matrices one
    step at a time along `r_a + r_b = r_a0 + r_b0`, in both directions (the paper only moves rank
    from A to B, and stops at `r_a = 1`; method.md asks for moves "from one matrix of the pair to
    the other", and rank 0 is a valid choice). Every split with ranks in `[0, min(out, in)]` and cost
    `r_a·(oA+iA) + r_b·(oB+iB) ≤ pair_budget` is visited (under GQA the two costs per rank differ,
    so some splits on the line cost more than the start). Keeps the split with the smallest
    `tail_a[r_a] + tail_b[r_b]`; a split replaces the best only when strictly better, and splits are
    visited by increasing distance from the start, A→B first, so ties go to the split closest to
    the start, and then to the one with the smaller `r_a`.
    """
    ta, tb, cost_a, cost_b, (r_a0, r_b0) = _pair_setup(tail_a, tail_b, shape_a, shape_b, pair_budget)
    max_a, max_b = len(ta) - 1, len(tb) - 1
    total = r_a0 + r_b0

    best = (r_a0, r_b0)
    best_error = ta[r_a0] + tb[r_b0]
    # Distance d from the start: first r_a0 - d (A→B, the paper's move), then r_a0 + d (B→A).
    for step in range(1, total + 1):
        for r_a in (r_a0 - step, r_a0 + step):
            r_b = total - r_a
            if not (0 <= r_a <= max_a and 0 <= r_b <= max_b):
                continue
            if r_a * cost_a + r_b * cost_b > pair_budget:
                continue
            error = ta[r_a] + tb[r_b]
            if error < best_error:
                best, best_error = (r_a, r_b), error
    r_a, r_b = best
    return PairSplit(r_a, r_b, best_error, r_a * cost_a + r_b * cost_b, (r_a0, r_b0))


def balance_pair_bruteforce(
    tail_a: Tail, tail_b: Tail, shape_a: Shape, shape_b: Shape, pair_budget: int
) -> PairSplit:
    """Reference for `balance_pair_paper`: every split on `r_a + r_b = r_a0 + r_b0` within budget.

    Minimizes `(error, |r_a - r_a0|, r_a)`, the same objective and tie-break as the walk.
    """
    ta, tb, cost_a, cost_b, (r_a0, r_b0) = _pair_setup(tail_a, tail_b, shape_a, shape_b, pair_budget)
    total = r_a0 + r_b0
    candidates = [
        (ta[r_a] + tb[total - r_a], abs(r_a - r_a0), r_a)
        for r_a in range(0, total + 1)
        if r_a < len(ta) and total - r_a < len(tb) and r_a * cost_a + (total - r_a) * cost_b <= pair_budget
    ]
    # The start itself is always a candidate (see _initial_ranks), so the list is never empty.
    error, _, r_a = min(candidates)
    r_b = total - r_a
    return PairSplit(r_a, r_b, error, r_a * cost_a + r_b * cost_b, (r_a0, r_b0))


def allocate_global(tails: Mapping[str, Tail], shapes: Mapping[str, Unit], budget: int) -> dict[str, int]:
    """Greedy ranks for many matrices under one budget: a candidate improvement over Algorithm 1.

    Repeatedly raises by one the rank with the largest discarded-energy reduction per parameter,
    `(tail[r] - tail[r+1]) / (out + in)`, among the steps that still fit; the total never exceeds
    `budget`. A matrix stops growing at `min(out, in)`, when its next step no longer fits (steps of
    one matrix all cost the same and the remaining budget only shrinks), or when its next step
    removes no energy. Ties go to the matrix listed first in `tails`.

    Tails from an SVD are convex (σ sorted), so each matrix's gains per step decrease and the
    greedy order is optimal when all matrices cost the same per rank; with different costs it is
    optimal for the budget it has spent before its first skipped step (a knapsack bound).

    A unit given as `Steps(convex=False)` (an MLP's neurons) moves from one vertex of its tail's lower convex
    hull to the next (`convex_moves`), at the mean gain per step of that move; a move that no longer fits
    whole takes the steps that fit, and the unit stops there.
    """
    if budget < 0:
        raise ValueError(f"budget must be >= 0, got {budget}")
    if set(tails) != set(shapes):
        raise ValueError(f"tails and shapes name different matrices: {sorted(tails)} vs {sorted(shapes)}")
    lists = {name: _as_list(tail, shapes[name], name) for name, tail in tails.items()}
    costs = {name: step_cost(shapes[name]) for name in lists}
    hulls = {
        name: convex_moves(values)
        for name, values in lists.items()
        if isinstance(shapes[name], Steps) and not shapes[name].convex
    }
    order = {name: i for i, name in enumerate(lists)}
    ranks = dict.fromkeys(lists, 0)
    remaining = budget

    def next_rank(name: str) -> int:
        r = ranks[name]
        if name not in hulls:
            return r + 1
        # The hull is increasing: its first vertex past r by bisection (a neuron unit's hull is ~I long).
        hull = hulls[name]
        i = bisect.bisect_right(hull, r)
        return hull[i] if i < len(hull) else r + 1

    def push(heap: list[tuple[float, int, str]], name: str) -> None:
        r, tail = ranks[name], lists[name]
        to = next_rank(name)
        if to < len(tail) and tail[r] - tail[to] > 0.0:
            # heapq is a min-heap: negate the gain per parameter.
            heapq.heappush(heap, (-(tail[r] - tail[to]) / (costs[name] * (to - r)), order[name], name))

    heap: list[tuple[float, int, str]] = []
    for name in lists:
        push(heap, name)
    while heap:
        _, _, name = heapq.heappop(heap)
        to = next_rank(name)
        steps = min(to - ranks[name], remaining // costs[name])
        if steps <= 0:
            continue  # this unit can never grow again: drop it
        ranks[name] += steps
        remaining -= steps * costs[name]
        if ranks[name] == to:  # a move cut short by the budget ends the unit
            push(heap, name)
    return ranks


def allocate_global_with_dense(
    tails: Mapping[str, Tail],
    shapes: Mapping[str, Unit],
    budget: int,
    dense_costs: Mapping[str, int],
) -> tuple[dict[str, int], set[str]]:
    """`allocate_global`, where a matrix may instead be stored whole (exact) for `dense_costs[name]` numbers.

    Factors of rank r cost r·(out + in); past r = out·in/(out + in) they cost more than the matrix itself
    and still lose energy. Whenever the greedy gives a matrix factors that cost at least its dense cost, the
    matrix is stored whole instead, the difference returns to the budget and the others are allocated again;
    repeated until no matrix crosses (the set of dense matrices only grows, so this ends). The dense costs
    and the remaining ranks' costs never exceed `budget`. (A single matrix may end with less rank than plain
    `allocate_global` gives it: the dense cost is paid up front, so a large step can stop fitting earlier.)
    """
    dense: set[str] = set()
    while True:
        free = {name: tail for name, tail in tails.items() if name not in dense}
        remaining = budget - sum(dense_costs[name] for name in dense)
        ranks = allocate_global(free, {name: shapes[name] for name in free}, remaining)
        crossing = {name for name, r in ranks.items() if r * step_cost(shapes[name]) >= dense_costs[name]}
        if not crossing:
            return ranks, dense
        dense |= crossing


def marginal_price(tails: Mapping[str, Tail], shapes: Mapping[str, Unit], ranks: Mapping[str, int]) -> float:
    """The discarded energy per parameter of the last rank step the greedy bought: the smallest
    `(tail[r−1] − tail[r]) / (out + in)` over the matrices given rank `r > 0` (the greedy buys steps in
    decreasing order of this gain, so it is the price the budget ended at). 0.0 when nothing got rank."""
    gains = [
        (float(tails[name][r - 1]) - float(tails[name][r])) / step_cost(shapes[name])
        for name, r in ranks.items()
        if r > 0
    ]
    return min(gains, default=0.0)


def cost_at_price(
    tail: Tail, shape: Unit, price: float, dense_cost: int | None = None
) -> tuple[float, int | None]:
    """The Lagrangian cost of one matrix at `price` (energy per parameter): `min_r tail[r] + price·r·(out+in)`,
    or `price·dense_cost` for storing it whole (no error) when `dense_cost` is given. Returns the cost and the
    rank that reaches it (None: whole). Under one price, comparing two ways of storing the same weights by this
    cost compares them as the global allocation would trade their error against the budget."""
    values = _as_list(tail, shape, "tail")
    step = step_cost(shape)
    cost, rank = min((v + price * r * step, r) for r, v in enumerate(values))
    if dense_cost is not None and price * dense_cost < cost:
        return price * dense_cost, None
    return cost, rank
