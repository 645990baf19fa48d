"""Rank allocation: Algorithm 1 vs brute force, exact budgets, greedy global allocation."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from compressor.math.allocation import (
    PairSplit,
    Steps,
    allocate_global,
    allocate_global_with_dense,
    balance_pair_bruteforce,
    balance_pair_paper,
    convex_moves,
    lowrank_params,
    max_rank_within,
    step_cost,
    step_limit,
)
from compressor.math.whitening import discarded_energy


def _random_tail(rng: random.Random, shape: tuple[int, int], flat_tail: bool = False) -> torch.Tensor:
    """Tail of a random descending spectrum; optionally with exact zeros to force ties."""
    k = min(shape)
    sigma = sorted((rng.lognormvariate(0.0, 1.5) for _ in range(k)), reverse=True)
    if flat_tail:
        cut = rng.randrange(0, k + 1)
        sigma = sigma[:cut] + [0.0] * (k - cut)
    return discarded_energy(torch.tensor(sigma, dtype=torch.float64))


def test_param_counts() -> None:
    assert lowrank_params(576, 576, 3) == 3 * 1152
    assert lowrank_params(192, 576, 0) == 0
    assert max_rank_within(192, 576, 768 * 5 + 767) == 5
    assert max_rank_within(4, 6, 10_000) == 4  # capped at min(out, in)
    assert max_rank_within(4, 6, 9) == 0
    assert max_rank_within(4, 6, -5) == 0


def test_gqa_example_split_and_budget() -> None:
    # Q 576×576 costs 1152 per rank, K 192×576 costs 768 per rank: moving rank changes the cost.
    shape_q, shape_k = (576, 576), (192, 576)
    tail_q = discarded_energy(torch.linspace(10.0, 0.1, 576, dtype=torch.float64))
    tail_k = discarded_energy(torch.linspace(30.0, 0.3, 192, dtype=torch.float64))
    budget = (576 * 576 + 192 * 576) // 5
    split = balance_pair_paper(tail_q, tail_k, shape_q, shape_k, budget)
    assert isinstance(split, PairSplit)
    r_q0, r_k0 = split.initial
    assert (r_q0, r_k0) == (57, 28)  # floor(0.2·576·576/1152), floor(0.2·192·576/768)
    assert split.params == lowrank_params(576, 576, split.rank_a) + lowrank_params(192, 576, split.rank_b)
    assert split.params <= budget
    assert split.rank_a + split.rank_b == r_q0 + r_k0
    # K's spectrum is larger, so rank moves from Q to K.
    assert split.rank_b > r_k0
    assert split.error == pytest.approx(float(tail_q[split.rank_a] + tail_k[split.rank_b]), rel=0, abs=0)
    assert split.error <= float(tail_q[r_q0] + tail_k[r_k0])


def test_paper_walk_moves_both_ways() -> None:
    # A's spectrum dominates: the best split moves rank from B to A, which the paper's one-way
    # walk (A→B only) would never find.
    shape = (4, 4)
    tail_a = discarded_energy(torch.tensor([10.0, 9.0, 8.0, 7.0], dtype=torch.float64))
    tail_b = discarded_energy(torch.tensor([1.0, 0.5, 0.2, 0.1], dtype=torch.float64))
    split = balance_pair_paper(tail_a, tail_b, shape, shape, 2 * 2 * 8)
    assert split.initial == (2, 2)
    assert (split.rank_a, split.rank_b) == (4, 0)
    assert split.params == 32


def test_ties_go_to_the_start() -> None:
    # Zero spectra everywhere: every split has error 0, so the start is kept.
    tail = discarded_energy(torch.zeros(4, dtype=torch.float64))
    split = balance_pair_paper(tail, tail, (4, 4), (4, 4), 32)
    assert (split.rank_a, split.rank_b) == split.initial == (2, 2)


def test_equal_distance_ties_go_to_the_paper_direction() -> None:
    # A hand-made (non-convex) tail so that the start is not optimal and the two moves of
    # distance 1 tie: (1, 3) and (3, 1) both have error 9. The paper's move (A→B) wins.
    tail = [10.0, 9.0, 8.5, 0.0, 0.0]
    for balance in (balance_pair_paper, balance_pair_bruteforce):
        split = balance(tail, tail, (4, 4), (4, 4), 32)
        assert split.initial == (2, 2)
        assert (split.rank_a, split.rank_b, split.error) == (1, 3, 9.0)


def test_paper_equals_bruteforce_on_random_cases() -> None:
    rng = random.Random(0)
    shapes = [(8, 8), (4, 8), (2, 8), (8, 4), (6, 3), (12, 12), (3, 12), (1, 5), (5, 1)]
    n_moved = 0
    for case in range(600):
        shape_a, shape_b = rng.choice(shapes), rng.choice(shapes)
        flat = case % 3 == 0
        tail_a = _random_tail(rng, shape_a, flat)
        tail_b = _random_tail(rng, shape_b, flat)
        dense = shape_a[0] * shape_a[1] + shape_b[0] * shape_b[1]
        budget = rng.randrange(0, dense + 10)
        paper = balance_pair_paper(tail_a, tail_b, shape_a, shape_b, budget)
        brute = balance_pair_bruteforce(tail_a, tail_b, shape_a, shape_b, budget)
        assert paper == brute, (case, shape_a, shape_b, budget)
        assert paper.params <= budget
        assert paper.params == lowrank_params(*shape_a, paper.rank_a) + lowrank_params(*shape_b, paper.rank_b)
        assert 0 <= paper.rank_a <= min(shape_a) and 0 <= paper.rank_b <= min(shape_b)
        n_moved += (paper.rank_a, paper.rank_b) != paper.initial
    # The comparison is only meaningful if the walk actually moved in many cases.
    assert n_moved > 100


def test_pair_rejects_wrong_tail_length() -> None:
    tail = discarded_energy(torch.ones(3, dtype=torch.float64))
    with pytest.raises(ValueError, match="entries"):
        balance_pair_paper(tail, tail, (4, 4), (3, 3), 20)
    with pytest.raises(ValueError, match="pair_budget"):
        balance_pair_bruteforce(tail, tail, (3, 3), (3, 3), -1)


def _brute_global(tails, shapes, budget) -> float:
    names = list(tails)
    best = float("inf")
    for ranks in itertools.product(*(range(min(shapes[n]) + 1) for n in names)):
        if sum(r * sum(shapes[n]) for r, n in zip(ranks, names, strict=True)) <= budget:
            best = min(best, sum(float(tails[n][r]) for r, n in zip(ranks, names, strict=True)))
    return best


def _error(tails, ranks) -> float:
    return sum(float(tails[n][r]) for n, r in ranks.items())


def test_allocate_global_equal_costs_is_optimal() -> None:
    rng = random.Random(1)
    for _ in range(150):
        shape = rng.choice([(3, 5), (4, 4), (2, 6)])  # out + in = 8 for all: equal cost per rank
        names = ["q", "k", "v", "o"][: rng.randrange(1, 5)]
        shapes = {n: shape for n in names}
        tails = {n: _random_tail(rng, shape) for n in names}
        budget = rng.randrange(0, 8 * min(shape) * len(names) + 10)
        ranks = allocate_global(tails, shapes, budget)
        assert sum(lowrank_params(*shapes[n], r) for n, r in ranks.items()) <= budget
        assert _error(tails, ranks) == pytest.approx(
            _brute_global(tails, shapes, budget), rel=1e-12, abs=1e-12
        )


def test_allocate_global_mixed_costs_within_budget_and_knapsack_bound() -> None:
    rng = random.Random(2)
    n_optimal = 0
    for _ in range(150):
        shapes = {"q": (6, 6), "k": (2, 6), "v": (2, 6), "o": (6, 2)}
        tails = {n: _random_tail(rng, s) for n, s in shapes.items()}
        budget = rng.randrange(0, 12 * 6 + 8 * 6 + 10)
        ranks = allocate_global(tails, shapes, budget)
        spent = sum(lowrank_params(*shapes[n], r) for n, r in ranks.items())
        assert spent <= budget
        assert all(0 <= ranks[n] <= min(shapes[n]) for n in shapes)
        error = _error(tails, ranks)
        optimum = _brute_global(tails, shapes, budget)
        assert error >= optimum - 1e-12
        # Greedy by ratio is optimal for the budget it spent before its first skipped step, which
        # is more than budget - max cost; so it is at least as good as the optimum of that budget.
        max_cost = max(sum(s) for s in shapes.values())
        assert error <= _brute_global(tails, shapes, budget - max_cost + 1) + 1e-12
        n_optimal += error <= optimum + 1e-12
    assert n_optimal > 75  # usually optimal outright


def test_allocate_global_does_not_spend_on_nothing() -> None:
    shapes = {"a": (3, 3), "b": (3, 3)}
    tails = {
        "a": discarded_energy(torch.tensor([2.0, 0.0, 0.0], dtype=torch.float64)),
        "b": discarded_energy(torch.tensor([1.0, 0.5, 0.0], dtype=torch.float64)),
    }
    assert allocate_global(tails, shapes, 1000) == {"a": 1, "b": 2}
    assert allocate_global(tails, shapes, 6) == {"a": 1, "b": 0}
    assert allocate_global(tails, shapes, 5) == {"a": 0, "b": 0}
    with pytest.raises(ValueError, match="different"):
        allocate_global(tails, {"a": (3, 3)}, 10)


def test_dense_when_cheaper_keeps_whole_what_factors_would_overpay_and_never_loses() -> None:
    gen = torch.Generator().manual_seed(3)
    shapes = {"q": (16, 16), "v": (4, 16), "o": (16, 8), "w": (12, 12)}
    trials_with_dense = 0
    for _trial in range(40):
        tails = {}
        for name, (out, in_) in shapes.items():
            sigma2 = (
                torch.rand(min(out, in_), generator=gen, dtype=torch.float64).sort(descending=True).values
            )
            sigma2 = sigma2 * (10.0 if name == "v" else 1.0)  # v matters most: the greedy wants its full rank
            tails[name] = torch.cat([sigma2.flip(0).cumsum(0).flip(0), torch.zeros(1, dtype=torch.float64)])
        dense_costs = {name: out * in_ for name, (out, in_) in shapes.items()}
        budget = int(torch.randint(50, 500, (1,), generator=gen))
        plain = allocate_global(tails, shapes, budget)
        ranks, dense = allocate_global_with_dense(tails, shapes, budget, dense_costs)
        spent = sum(dense_costs[n] for n in dense) + sum(r * sum(shapes[n]) for n, r in ranks.items())
        assert spent <= budget
        # Nothing left as factors that cost at least the matrix itself.
        assert all(r * sum(shapes[n]) < dense_costs[n] for n, r in ranks.items())
        # The total error is at most plain greedy's (the budget no longer buys overpriced factors).
        total = sum(float(tails[n][r]) for n, r in ranks.items())
        assert total <= sum(float(tails[n][r]) for n, r in plain.items()) + 1e-12
        trials_with_dense += bool(dense)
    assert 5 <= trials_with_dense < 40  # the rule was exercised, and not everywhere
    # With room for everything, every matrix is kept whole (exact): full-rank factors would cost more.
    ranks, dense = allocate_global_with_dense(tails, shapes, 10_000, dense_costs)
    assert dense == set(shapes) and ranks == {}


def test_convex_moves_are_the_lower_hull():
    tail = [10.0, 9.5, 4.0, 3.9, 1.0, 0.9, 0.0]
    hull = convex_moves(tail)
    assert hull[0] == 0 and hull[-1] == len(tail) - 1
    # every point lies on or above the segments between consecutive hull vertices
    for a, b in zip(hull, hull[1:], strict=False):
        for r in range(a, b + 1):
            assert tail[r] >= tail[a] + (tail[b] - tail[a]) * (r - a) / (b - a) - 1e-12
    assert 1 not in hull  # the small first gain is bridged: 0 -> 2 gains more per step than 0 -> 1


def test_steps_units_with_non_convex_tails_stay_in_budget_and_near_the_optimum() -> None:
    """An MLP's neuron tail need not be convex: a small gain may come before a large one. The greedy then moves
    along the tail's convex hull, and is as good as the optimum of the budget it spent before its last move."""
    rng = random.Random(4)
    units = {"mlp0": Steps(5, 6), "mlp1": Steps(5, 6), "q": (3, 4)}
    for _ in range(150):
        tails = {}
        for name, unit in units.items():
            drops = [rng.random() ** 3 for _ in range(step_limit(unit))]  # any order: not convex
            if name == "q":
                drops.sort(reverse=True)  # a rank's gains never grow
            tails[name] = [sum(drops[r:]) for r in range(len(drops) + 1)]
        budget = rng.randrange(0, 70)
        ranks = allocate_global(tails, units, budget)
        assert sum(r * step_cost(units[n]) for n, r in ranks.items()) <= budget
        error = _error(tails, ranks)
        best = min(
            _error(tails, dict(zip(units, rs, strict=True)))
            for rs in itertools.product(*(range(step_limit(u) + 1) for u in units.values()))
            if sum(r * step_cost(u) for r, u in zip(rs, units.values(), strict=True)) <= budget
        )
        assert error >= best - 1e-12
        bound = (
            min(
                _error(tails, dict(zip(units, rs, strict=True)))
                for rs in itertools.product(*(range(step_limit(u) + 1) for u in units.values()))
                if sum(r * step_cost(u) for r, u in zip(rs, units.values(), strict=True))
                <= budget - 6 * 5 + 1
            )
            if budget >= 6 * 5
            else _error(tails, dict.fromkeys(units, 0))
        )
        assert error <= bound + 1e-12
