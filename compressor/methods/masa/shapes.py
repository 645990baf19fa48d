"""Automatic choice of the number of groups G and atoms B from a cheap proxy (`--auto-groups`).

For each candidate (G, B) the MASA layout is planned, Matrix PCA run, the whitened spectrum of every residual
computed and the ranks allocated exactly as the real run would, but no module is built and nothing is
evaluated. The proxy is what is left: Σ over compressed projections of the discarded whitened energy at the
allocated rank, weighted as the allocation weighs it (`MethodContext.error_weight`: relative to the projection's
whitened output energy ‖W S‖² under `global-relative`, times its loss sensitivity under `global-loss`). The
candidate with the lowest proxy is chosen.

Spectra are cached by (group layers, atoms, layer, projection): consecutive G share most of their groups,
and with B = 0 a residual is the weight itself whatever the grouping (such layouts differ only by their
singletons, so one candidate stands for all groupings with the same singletons).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from compressor.math.accounting import NEURON_READER
from compressor.methods.allocation_policies import allocator_for
from compressor.methods.base import MethodContext
from compressor.methods.masa.mlp import neuron_layers, neuron_tails
from compressor.methods.masa.stages import group_atoms, masa_layout, residual_tail, shared_part
from compressor.runtime.errors import UserError
from compressor.runtime.progress import progress_bar

MAX_GROUPS = 8
MAX_BASES = 2

SpectrumCache = dict[tuple, tuple[torch.Tensor, int]]  # key -> (discarded-energy tail, atoms stored)


@dataclass(frozen=True)
class ShapeChoice:
    groups: int
    bases: int
    proxy: float


def choose_groups_and_bases(
    ctx: MethodContext, max_groups: int = MAX_GROUPS, max_bases: int = MAX_BASES
) -> tuple[ShapeChoice, dict]:
    """The (G, B) with the lowest proxy, and the record of every candidate's proxy for the report."""
    start, neuron_before = time.perf_counter(), ctx.seconds.get("neuron_selection", 0.0)
    candidates = [
        (g, b) for g in range(1, min(max_groups, ctx.adapter.num_layers) + 1) for b in range(max_bases + 1)
    ]
    tails: SpectrumCache = {}
    rows, seen = [], set()
    with progress_bar("Choosing G and B (proxy)", total=len(candidates), enabled=ctx.progress) as bar:
        for n_groups, bases in candidates:
            bar.advance()
            try:
                groups = ctx.grouping(n_groups).groups
            except UserError:  # more groups than the transitions allowed to be boundaries
                continue
            # Without atoms a grouping matters only through its singletons (kept whole or compressed alone):
            # groupings with the same singletons are the same layout.
            singletons = tuple(g[0] for g in groups if len(g) == 1)
            key = (singletons, 0) if bases == 0 else (tuple(map(tuple, groups)), bases)
            if key not in seen:
                seen.add(key)
                proxy = _proxy(ctx, groups, bases, tails)
                if proxy is not None:
                    rows.append({"groups": n_groups, "bases": bases, "layers": groups, "proxy": proxy})
    if not rows:
        raise UserError(
            f"--ratio {ctx.ratio:g} is infeasible for every G ≤ {max_groups} and B ≤ {max_bases}: use a smaller "
            "--ratio or --method svd-llm"
        )
    best = min(rows, key=lambda r: (r["proxy"], r["bases"], r["groups"]))
    # The neuron orders found here are timed under their own name (`neuron_selection`): not counted twice.
    ctx.seconds["shape_search"] = (
        time.perf_counter() - start - (ctx.seconds.get("neuron_selection", 0.0) - neuron_before)
    )
    record = {
        "proxy": f"whitened error left under the budget, weighted as {ctx.settings.allocation} weighs it "
        "(lower is better)",
        "candidates": rows,
        "chosen": {"groups": best["groups"], "bases": best["bases"]},
    }
    return ShapeChoice(best["groups"], best["bases"], best["proxy"]), record


def _proxy(ctx: MethodContext, groups: list[list[int]], bases: int, tails: SpectrumCache) -> float | None:
    """Relative whitened error left by the layout under the budget; None when it does not fit."""
    try:
        plan = masa_layout(ctx.shape, ctx.settings, ctx.ratio, groups, bases, None)
    except UserError:
        return None
    keyed = {}
    for pp in plan.projections:
        if pp.mode not in ("dense", "neurons"):
            members = tuple(plan.groups[pp.group].layers) if pp.mode == "shared" else ()
            keyed[(pp.layer, pp.projection)] = (members, pp.n_atoms, pp.layer, pp.projection)
    _fill_spectra(ctx, keyed, tails)
    for k, key in keyed.items():
        if plan.get(*k).mode == "shared":
            plan.get(*k).n_atoms = tails[key][1]
    if plan.residual_budget() < 0:
        return None
    # The MLPs' neuron tails do not depend on the grouping: computed once, for the first candidate.
    missing = [layer for layer in neuron_layers(plan) if ("neurons", layer) not in tails]
    for layer, found in neuron_tails(ctx, missing).items():
        tails[("neurons", layer)] = (found.tail, 0)
    spectra = {k: tails[key][0] for k, key in keyed.items()}
    spectra |= {(layer, NEURON_READER): tails[("neurons", layer)][0] for layer in neuron_layers(plan)}
    allocator = allocator_for(ctx.settings.allocation, ctx.settings.dense_when_cheaper)
    allocator.allocate(plan, spectra, ctx.error_weight)
    plan.check_budget()
    return sum(
        float(spectra[(pp.layer, pp.projection)][pp.rank]) * ctx.error_weight(pp.layer, pp.projection)
        for pp in plan.projections
        if pp.carries_error()  # kept whole by the allocation: exact
    )


def _fill_spectra(ctx: MethodContext, keyed: dict, tails: SpectrumCache) -> None:
    """The residual spectra of `keyed` not cached yet; Matrix PCA only for the groups that need it."""
    atoms = {}
    for key in keyed.values():
        members, n_atoms, _, p = key
        if key not in tails and n_atoms and (members, p) not in atoms:
            atoms[(members, p)] = group_atoms(ctx, list(members), n_atoms, p)
    for (layer, p), key in sorted(keyed.items()):  # layer by layer: one whitening factor at a time
        if key in tails:
            continue
        members, n_atoms = key[0], key[1]
        residual, stored_atoms = ctx.weight(layer, p), 0
        if n_atoms:
            d, c, _ = atoms[(members, p)]
            residual = residual - shared_part(d, c, members.index(layer))
            stored_atoms = d.shape[0]  # fewer than asked when the weights have a lower numerical rank
        tails[key] = (residual_tail(ctx, layer, p, residual), stored_atoms)
