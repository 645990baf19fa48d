"""`--sharing auto`: which projection types of which runs share an input basis, chosen by the proxy before
anything is built.

The global allocation ends at a price: the discarded (relative, whitened) energy per parameter of the last rank
step it bought. At that price each way of storing a run's matrices of one type has a Lagrangian cost, its error
plus price × numbers (`allocation.cost_at_price`): every matrix on its own (each at its best rank, or whole), or
all of them reading one shared basis (one rank). A candidate is shared when sharing costs less. The price moves
with the choice, so the choice and the allocation are repeated until the choice stops changing (a few rounds),
and the layout with the lowest proxy error after allocation among those visited is kept — no sharing (the
first round) among them, so `auto` never ends above `none` on the proxy.
"""

from __future__ import annotations

from collections.abc import Callable

from compressor.math.accounting import CompressionPlan
from compressor.math.allocation import cost_at_price, marginal_price
from compressor.methods.allocation_policies import ErrorWeight, GlobalAllocator

#: Per run index, its shared bases: basis name -> the projection types reading it.
Shared = dict[int, dict[str, tuple[str, ...]]]
Layout = Callable[[Shared], tuple[CompressionPlan, dict]]

MAX_ROUNDS = 6


def choose_shared(
    offered: Shared, layout: Layout, allocator: GlobalAllocator, weight: ErrorWeight
) -> tuple[Shared, dict]:
    """The bases among `offered` (one type per basis) that pay at the allocation's price, and a record of why:
    per candidate its cost on its own and shared at the final price, and per round the price and the proxy."""
    own = allocator.problem(*layout({}), weight)
    together = allocator.problem(*layout(offered), weight)
    chosen: Shared = {}
    rounds, seen = [], []
    for _ in range(MAX_ROUNDS):
        price, proxy = _allocate(layout, chosen, allocator, weight)
        rounds.append({"shared": _count(chosen), "price": price, "proxy_error": proxy})
        seen.append((proxy, chosen))
        costs = _costs(offered, own, together, price, allocator.dense_when_cheaper)
        following = {
            index: {
                name: offered[index][name]
                for name in names
                if costs[(index, name)][1] < costs[(index, name)][0]
            }
            for index, names in offered.items()
        }
        following = {index: bases for index, bases in following.items() if bases}
        if following == chosen:
            break
        chosen = following
    best_proxy, best = min(seen, key=lambda item: item[0])
    record = {
        "rule": "per run and projection type: shared basis when its cost (relative error + price × numbers) at the "
        "allocation's price is below the matrices' own; repeated until stable, lowest proxy kept",
        "rounds": rounds,
        "proxy_error": best_proxy,
        "candidates": [
            {
                "group": index,
                "projection": name,
                "own_cost": c[0],
                "shared_cost": c[1],
                "chosen": "basis" if name in best.get(index, {}) else "own",
            }
            for (index, name), c in costs.items()  # at the last round's price
        ],
    }
    return best, record


def _allocate(
    layout: Layout, shared: Shared, allocator: GlobalAllocator, weight: ErrorWeight
) -> tuple[float, float]:
    """Allocate `shared`'s layout on a scratch plan: the price it ends at and its proxy error."""
    plan, tails = layout(shared)
    problem = allocator.problem(plan, tails, weight)
    allocator.allocate(plan, tails, weight)
    ranks = {n: problem.steps_of(n, m[0].rank) for n, m in problem.units.items() if m[0].mode != "dense"}
    proxy = sum(float(problem.tails[n][r]) for n, r in ranks.items())
    return marginal_price({n: problem.tails[n] for n in ranks}, problem.shapes, ranks), proxy


def _costs(
    offered: Shared, own, together, price: float, whole: bool
) -> dict[tuple[int, str], tuple[float, float]]:
    """(cost on their own, cost shared) of every candidate's matrices at `price` (`whole`: see `_cost`)."""
    out = {}
    for index, bases in offered.items():
        for name in bases:
            shared_name = f"basis.{index}.{name}"
            members = together.units[shared_name]
            alone = sum(_cost(own, f"{pp.layer}.{pp.projection}", price, whole) for pp in members)
            out[(index, name)] = (alone, _cost(together, shared_name, price, whole))
    return out


def _cost(problem, name: str, price: float, whole: bool) -> float:
    """One unit's cost at `price`; `whole`: it may be kept whole instead (`dense_when_cheaper`)."""
    dense = problem.dense_costs[name] if whole else None
    return cost_at_price(problem.tails[name], problem.shapes[name], price, dense)[0]


def _count(shared: Shared) -> int:
    return sum(len(bases) for bases in shared.values())
