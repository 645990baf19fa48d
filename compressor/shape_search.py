"""Automatic choice of the number of groups G and atoms B from a cheap proxy (issue 8).

For each candidate (G, B) the MASA layout is planned, Matrix PCA run, the whitened spectrum of every residual
computed and the ranks allocated exactly as the real run would, but no module is built and nothing is
evaluated. The proxy is what is left: Σ over compressed projections of the discarded whitened energy at the
allocated rank, relative to that projection's whitened output energy ‖W S‖² (so V's and O's errors, read from
different inputs, add on one scale). The candidate with the lowest proxy is chosen.

Spectra are cached by (group layers, atoms, layer, projection): consecutive G share most of their groups,
and with B = 0 a residual is the weight itself whatever the grouping (such layouts differ only by their
singletons, so one candidate stands for all groupings with the same singletons).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from compressor.errors import UserError
from compressor.pipeline import (
    MethodContext,
    allocate_ranks,
    group_atoms,
    masa_plan,
    residual_tail,
    shared_part,
)
from compressor.progress import progress_bar

MAX_GROUPS = 8
MAX_BASES = 2


@dataclass(frozen=True)
class ShapeChoice:
    groups: int
    bases: int
    proxy: float


def choose_groups_and_bases(
    ctx: MethodContext, max_groups: int = MAX_GROUPS, max_bases: int = MAX_BASES
) -> ShapeChoice:
    """The (G, B) with the lowest proxy; every candidate's proxy goes to `ctx.report["shape_search"]`."""
    start = time.perf_counter()
    candidates = [
        (g, b) for g in range(1, min(max_groups, ctx.adapter.num_layers) + 1) for b in range(max_bases + 1)
    ]
    tails: dict[tuple, tuple[torch.Tensor, int]] = {}  # key -> (discarded-energy tail, atoms stored)
    rows, seen = [], set()
    progress, ctx.progress = ctx.progress, False  # one bar for the search, not one per stage
    try:
        with progress_bar("Choosing G and B (proxy)", total=len(candidates), enabled=progress) as bar:
            for n_groups, bases in candidates:
                try:
                    groups = ctx.grouping(n_groups).groups
                except UserError:  # more groups than the transitions allowed to be boundaries
                    bar.advance()
                    continue
                # Without atoms a grouping matters only through its singletons (kept whole or compressed
                # alone): groupings with the same singletons are the same layout.
                singletons = tuple(g[0] for g in groups if len(g) == 1)
                key = (singletons, 0) if bases == 0 else (tuple(map(tuple, groups)), bases)
                if key not in seen:
                    seen.add(key)
                    proxy = _proxy(ctx, groups, bases, tails)
                    if proxy is not None:
                        rows.append({"groups": n_groups, "bases": bases, "layers": groups, "proxy": proxy})
                bar.advance()
    finally:
        ctx.progress = progress
    if not rows:
        raise UserError(
            f"--ratio {ctx.ratio:g} is infeasible for every G ≤ {max_groups} and B ≤ {max_bases}: use a smaller "
            "--ratio or --method svd-llm"
        )
    best = min(rows, key=lambda r: (r["proxy"], r["bases"], r["groups"]))
    ctx.report["shape_search"] = {
        "proxy": "relative whitened error left under the budget (lower is better)",
        "candidates": rows,
        "chosen": {"groups": best["groups"], "bases": best["bases"]},
    }
    ctx.seconds["shape_search"] = time.perf_counter() - start
    return ShapeChoice(best["groups"], best["bases"], best["proxy"])


def _proxy(
    ctx: MethodContext,
    groups: list[list[int]],
    bases: int,
    tails: dict[tuple, tuple[torch.Tensor, int]],
) -> float | None:
    """Relative whitened error left by the layout under the budget; None when it does not fit."""
    try:
        plan = masa_plan(ctx, groups, bases, None)
    except UserError:
        return None
    targets = [(pp.layer, pp.projection) for pp in plan.projections if pp.mode != "dense"]
    keyed = {}
    for layer, p in targets:
        pp = plan.get(layer, p)
        members = tuple(plan.groups[pp.group].layers) if pp.mode == "shared" else ()
        keyed[(layer, p)] = (members, pp.n_atoms, layer, p)
    # Matrix PCA only for groups some of whose spectra are not cached yet.
    atoms = {}
    for key in keyed.values():
        members, n_atoms, _, p = key
        if key not in tails and n_atoms and (members, p) not in atoms:
            atoms[(members, p)] = group_atoms(ctx, list(members), n_atoms, p)
    for (layer, p), key in sorted(keyed.items()):  # layer by layer: one whitening factor at a time
        if key not in tails:
            members, n_atoms = key[0], key[1]
            residual, stored_atoms = ctx.weight(layer, p), 0
            if n_atoms:
                d, c, _ = atoms[(members, p)]
                residual = residual - shared_part(d, c, members.index(layer))
                stored_atoms = d.shape[0]  # fewer than asked when the weights have a lower numerical rank
            tails[key] = (residual_tail(ctx, layer, p, residual), stored_atoms)
        if plan.get(layer, p).mode == "shared":
            plan.get(layer, p).n_atoms = tails[key][1]
    if plan.residual_budget() < 0:
        return None
    allocate_ranks(ctx, plan, {k: tails[key][0] for k, key in keyed.items()})
    plan.check_budget()
    return sum(
        float(tails[key][0][plan.get(*k).rank]) / ctx.output_energy(*k)
        for k, key in keyed.items()
        if plan.get(*k).mode != "dense"  # kept whole by the allocation: exact
    )
