"""FLAP (An et al., AAAI 2024) as a peer: whole attention heads and MLP neurons removed by the fluctuation metric,
the structure searched globally on standardized scores, what was removed compensated by a bias
(`compressor.math.fluctuation`). The forms are the engine-native ones of `--native` (a layer keeps the same number
of query heads in every KV group, at least one; k/v whole; the MLP narrower), so the comparison with the default's
`--native` is like for like; unlike it, nothing is refit by least squares and no loss sensitivity weighs the
choice: FLAP as published.

Where the paper leaves a choice for a model with grouped-query attention (it prunes multi-head attention, where a
head takes its k/v rows with it): a step removes the lowest-scored query head of every KV group of a layer at once,
scored by their mean, so the result stays a layout engines run. The bias of o_proj and down_proj is new on a model
without one, stored in the checkpoint and counted in the budget.
"""

from __future__ import annotations

import time

import torch

from compressor.math.accounting import HEADS_READER, HEADS_ROWS, NEURON_READER, CompressionPlan
from compressor.math.fluctuation import (
    compensation_bias,
    fluctuation,
    head_removal_steps,
    head_scores,
    neuron_removal_order,
    removal_counts,
    standardized,
)
from compressor.math.heads import head_columns
from compressor.methods.base import Method, MethodContext
from compressor.methods.masa.basis import basis_layout
from compressor.methods.masa.mlp import GATED, install_rows, plain_linear
from compressor.modeling.adapters import INPUT_OF
from compressor.runtime.errors import UserError
from compressor.runtime.progress import progress_bar

#: The forms FLAP builds: whole heads and neurons, nothing shared, every width allowed.
FORMS = {"attention": "heads", "mlp": "neurons", "sharing": "none", "width_multiple": 1, "uniform_mlp": False}


class Flap(Method):
    name = "flap"
    summary = "FLAP: whole heads and MLP neurons removed by the fluctuation metric, biases compensate (peer)"

    def groups_rule(self, settings) -> str:
        return "no groups: heads and neurons removed per layer, chosen across all layers"

    def reads_gate_input(self, settings) -> bool:
        return False  # gate/up keep their rows: the neurons are chosen on down_proj's input

    def plan(self, shape, settings, ratio, groups_of=None, check_feasible: bool = True) -> CompressionPlan:
        plan = basis_layout(shape, settings.model_copy(update=FORMS), ratio)
        for pp in plan.projections:  # the compensation bias: the source's, or a new one, counted either way
            if _reads_removed(pp):
                pp.bias = pp.out_features
        if check_feasible and plan.residual_budget() < 0:
            raise UserError(
                f"--ratio {ratio:g} is infeasible for FLAP: what every layer keeps at least (one head per KV "
                f"group, the biases) needs {plan.fixed_params():,} of the {plan.budget:,} numbers allowed"
            )
        return plan

    def apply(self, ctx: MethodContext) -> CompressionPlan:
        if ctx.stats.input_means is None:
            raise ValueError("--method flap needs the inputs' means: collect_statistics holds them")
        start = time.perf_counter()
        plan = self.plan(ctx.shape, ctx.settings, ctx.ratio)
        order = _removal_orders(ctx, plan)
        _allocate(plan, order)
        with progress_bar("FLAP heads and neurons", total=ctx.shape.num_layers, enabled=ctx.progress) as bar:
            for layer in range(ctx.shape.num_layers):
                if ("heads", layer) in order:
                    _install_heads(ctx, layer, order[("heads", layer)][0])
                if ("mlp", layer) in order:
                    _install_neurons(ctx, layer, order[("mlp", layer)][0])
                ctx.finished([layer])
                bar.advance()
        ctx.report["flap"] = {
            "heads_removed": {
                layer: len(order[("heads", layer)][0]) for (kind, layer) in order if kind == "heads"
            },
            "neurons_removed": {
                layer: len(order[("mlp", layer)][0]) for (kind, layer) in order if kind == "mlp"
            },
        }
        ctx.seconds["residual_svd"] = time.perf_counter() - start
        return plan


def _reads_removed(pp) -> bool:
    """o_proj of a layer losing heads, down_proj of a layer losing neurons: where the compensation bias goes."""
    return (pp.mode == "heads" and pp.projection == HEADS_READER) or (
        pp.mode == "neurons" and pp.projection == NEURON_READER
    )


def _removal_orders(
    ctx: MethodContext, plan: CompressionPlan
) -> dict[tuple[str, int], tuple[list, torch.Tensor]]:
    """Per unit (`("heads", layer)`, `("mlp", layer)`): what each removal step takes (heads, or one neuron) and the
    steps' standardized scores, non-decreasing."""
    geometry = ctx.shape.geometry
    readers = {(pp.mode, pp.layer): pp for pp in plan.projections if _reads_removed(pp)}
    order = {}
    for (mode, layer), pp in sorted(readers.items()):
        scores = fluctuation(
            ctx.autocorr(layer, pp.projection),
            ctx.stats.input_mean(INPUT_OF[pp.projection], layer),
            ctx.weight(layer, pp.projection),
        ).cpu()
        scores = standardized(scores)
        if mode == "heads":
            order[("heads", layer)] = head_removal_steps(
                head_scores(scores, geometry.head_dim), geometry.num_kv_heads
            )
        else:
            neurons = neuron_removal_order(scores)
            order[("mlp", layer)] = (neurons.tolist(), scores[neurons])
    return order


def _allocate(plan: CompressionPlan, order: dict) -> None:
    """Every unit at full size, then the lowest-scored steps removed across all layers until the budget holds."""
    units = plan.allocation_units()
    freed = {}
    for (kind, layer), members in units.items():
        if kind == "heads":  # the rank: query heads per KV group
            q = next(pp for pp in members if pp.projection == HEADS_ROWS)
            full, freed[(kind, layer)] = q.out_features // q.head_block, sum(pp.head_step() for pp in members)
        else:  # the rank: the MLP's width
            full = next(pp.in_features for pp in members if pp.projection == NEURON_READER)
            freed[(kind, layer)] = sum(pp.neuron_step() for pp in members)
        for pp in members:
            pp.rank = full
    steps = {unit: (order[unit][1], freed[unit]) for unit in order}
    counts = removal_counts(steps, plan.params_after() - plan.budget)
    for unit, removed in counts.items():
        for pp in units[unit]:
            pp.rank -= removed
        order[unit] = (order[unit][0][:removed], order[unit][1])
    plan.check_budget()


def _install_heads(ctx: MethodContext, layer: int, removed_steps: list[list[int]]) -> None:
    """q keeps the kept heads' rows, o_proj their columns, and a bias for what the removed heads added on average."""
    head_dim, heads = ctx.shape.geometry.head_dim, ctx.shape.geometry.num_heads
    removed = sorted(h for step in removed_steps for h in step)
    kept = [h for h in range(heads) if h not in removed]
    rows = head_columns(kept, head_dim)
    install_rows(ctx, layer, HEADS_ROWS, rows)
    _install_compensated(ctx, layer, HEADS_READER, rows, head_columns(removed, head_dim))


def _install_neurons(ctx: MethodContext, layer: int, removed: list[int]) -> None:
    """gate/up keep the kept neurons' rows, down_proj their columns, and a bias for the removed neurons' mean."""
    gone = torch.tensor(sorted(removed), dtype=torch.long)
    keep = torch.ones(ctx.adapter.projection(layer, NEURON_READER).in_features, dtype=torch.bool)
    keep[gone] = False
    kept = torch.nonzero(keep).flatten()
    for p in GATED:
        install_rows(ctx, layer, p, kept)
    _install_compensated(ctx, layer, NEURON_READER, kept, gone)


def _install_compensated(
    ctx: MethodContext, layer: int, projection: str, kept: torch.Tensor, gone: torch.Tensor
) -> None:
    """`projection` reading only its `kept` input channels, plus the bias `W[:, gone] μ[gone]` (and its own)."""
    weight = ctx.weight(layer, projection).cpu()
    bias = compensation_bias(weight, ctx.stats.input_mean(INPUT_OF[projection], layer).cpu(), gone)
    own = ctx.bias(layer, projection)
    bias = bias if own is None else bias + own.to(torch.float64).cpu()
    ctx.install(layer, projection, plain_linear(weight[:, kept], bias, ctx.model_dtype, ctx.model_device))
