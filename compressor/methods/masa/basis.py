"""MASA's input-basis forms of sharing (`--sharing basis|qkv|none|auto`): layers are taken in runs of
`basis_layers` consecutive layers; a projection type of a run either shares ONE whitened input basis B (r × in),
each layer keeping its own output coefficients A_l (W_l ≈ A_l B), or every matrix gets its own whitened factors.
One global allocation decides every rank and basis size under the budget.

- `basis`: k_proj and v_proj of each run share a basis per type (measured on the bundled model's validation
  split: the form that paid most among k/v, q/k/v and joint q/k/v bases over runs of 2 and 4 layers);
- `qkv`: one basis for q, k and v of all the run's layers (they read the same input);
- `none`: per-matrix factors only (the same as `--sharing atoms --bases 0`);
- `auto`: per run and projection type, shared basis or own factors, whichever the proxy prefers (`choose`).

A basis of rank r is the first r rows of the whitened factorization of the stacked weights [W_l] under the
run's summed input autocorrelation (Basis Sharing's construction); each A_l is refit on its own layer's
statistics, so the error of each matrix at every basis size is exact (`whitening.refit_tail`): the allocation,
the proxy and the built model agree. A basis costs r·in once plus r·out per reader: a rank-r factorization of
the stacked matrix, so the allocation treats the readers of a basis as one unit with one rank.
"""

from __future__ import annotations

import time

import torch

from compressor.math.accounting import (
    HEADS_READER,
    HEADS_ROWS,
    NEURON_READER,
    CompressionPlan,
    GroupPlan,
    ProjectionPlan,
)
from compressor.math.grouping import consecutive_runs
from compressor.math.heads import HeadTail
from compressor.math.neurons import NeuronTail
from compressor.math.whitening import (
    refit_on_basis,
    refit_tail,
    whitened_basis,
    whitened_svd,
    whitening_factor,
)
from compressor.methods.allocation_policies import GlobalAllocator, allocator_for
from compressor.methods.base import MethodContext, ModelShape, numerical_context
from compressor.methods.masa import attention_heads
from compressor.methods.masa.byte_structure import allocate_to_size
from compressor.methods.masa.choice import Shared, choose_shared
from compressor.methods.masa.mlp import install_neurons, neuron_tails, tails_for_allocation
from compressor.methods.masa.stages import install_projection, residual_tail
from compressor.modeling.adapters import MLP_PROJECTIONS
from compressor.modeling.remote_code.masa_modules import SharedInputLinear
from compressor.recipes.schema import CompressionSettings
from compressor.runtime.errors import UserError
from compressor.runtime.progress import progress_bar

#: The input-basis forms (the other form, `atoms`, is `masa.stages`').
BASIS_FORMS = ("basis", "qkv", "none", "auto")
#: Projection types sharing a basis per type in the `basis` form.
BASIS_TYPES = ("k_proj", "v_proj")
#: Projection types sharing one joint basis in the `qkv` form, and its name.
JOINT_TYPES, JOINT_NAME = ("q_proj", "k_proj", "v_proj"), "qkv"


def settings_read(form: str) -> frozenset[str]:
    """The settings an input-basis form reads (besides method and targets)."""
    read = {
        "sharing",
        "allocation",
        "dense_when_cheaper",
        "statistics",
        "sensitivity_samples",
        "attention",
        "mlp",
        "uniform_mlp",
        "width_multiple",
        "neuron_order",
        "refit",
    }
    return frozenset(read if form == "none" else read | {"basis_layers"})


def head_projections(shape: ModelShape, settings: CompressionSettings) -> tuple[str, ...]:
    """The attention projections of `--attention heads`: q/o in `heads` mode, k/v kept whole (`dense`)."""
    attention = ("q_proj", "k_proj", "v_proj", "o_proj")
    return tuple(p for p in shape.targets if p in attention) if settings.attention == "heads" else ()


def neuron_projections(shape: ModelShape, settings: CompressionSettings) -> tuple[str, ...]:
    """The targeted projections kept in `neurons` mode: the MLP's, unless `--mlp lowrank`."""
    return tuple(p for p in shape.targets if p in MLP_PROJECTIONS) if settings.mlp == "neurons" else ()


def check_basis_settings(settings: CompressionSettings, targets: tuple[str, ...]) -> None:
    """Refuse, before any heavy work, what the input-basis forms have no rule for."""
    flag = f"--sharing {settings.sharing}"
    if settings.attention == "heads":
        if settings.sharing != "none":
            raise UserError(
                f"--attention heads keeps whole heads, which {flag} would factor and share: use --sharing none"
            )
        if "q_proj" not in targets or "o_proj" not in targets:
            raise UserError(
                "--attention heads removes query heads (q_proj rows, o_proj columns): --targets must hold both"
            )
    if settings.allocation == "paper":
        raise UserError(
            f"{flag}: Algorithm 1 (--allocation paper) balances per-layer (Q,K)/(V,O) pairs and has no rule for a "
            "basis shared across layers: use --allocation global-loss (or global-relative, global)"
        )
    if settings.statistics == "sequential":
        why = (
            "factors each layer from the statistics collected once, before any layer changes"
            if settings.sharing == "none"
            else "reads several layers' statistics at once"
        )
        raise UserError(
            f"{flag} {why}: --statistics sequential works with --sharing atoms only: use --statistics original, "
            "or --sharing atoms"
        )
    if settings.auto_groups:
        raise UserError(
            f"{flag}: --auto-groups chooses groups and atoms for --sharing atoms: use --fixed-groups"
        )


def runs_of(shape: ModelShape, settings: CompressionSettings) -> list[list[int]]:
    """The runs of consecutive layers (one run per layer for `none`: nothing is shared)."""
    return consecutive_runs(shape.num_layers, 1 if settings.sharing == "none" else settings.basis_layers)


def fixed_shared(shape: ModelShape, settings: CompressionSettings) -> Shared:
    """The bases of the fixed forms; none for `none` and for `auto` before its choice."""
    shared: Shared = {}
    for index, layers in enumerate(runs_of(shape, settings)):
        if len(layers) < 2:  # a run of one layer shares nothing
            continue
        if settings.sharing == "basis":
            shared[index] = {p: (p,) for p in BASIS_TYPES if p in shape.targets}
        elif settings.sharing == "qkv":
            joint = tuple(p for p in JOINT_TYPES if p in shape.targets)
            if joint:  # none of q/k/v among the targets: nothing to share
                shared[index] = {JOINT_NAME: joint}
    return {index: bases for index, bases in shared.items() if bases}


def candidates(shape: ModelShape, settings: CompressionSettings) -> Shared:
    """What `auto` chooses from: a basis per projection type (but the MLP's in `neurons` mode) for every run of
    several layers."""
    runs = runs_of(shape, settings)
    types = [p for p in shape.targets if p not in neuron_projections(shape, settings)]
    return {i: {p: (p,) for p in types} for i, layers in enumerate(runs) if len(layers) > 1}


def basis_layout(
    shape: ModelShape, settings: CompressionSettings, ratio: float, shared: Shared | None = None
) -> CompressionPlan:
    """The layout (ranks and basis sizes not yet allocated): projections reading a basis of `shared` (default:
    the fixed form's) in `basis` mode, every other one `lowrank`."""
    shared = fixed_shared(shape, settings) if shared is None else shared
    neurons = neuron_projections(shape, settings)
    heads = head_projections(shape, settings)
    head_block = shape.geometry.num_kv_heads * shape.geometry.head_dim
    groups, projections = [], []
    for index, layers in enumerate(runs_of(shape, settings)):
        groups.append(GroupPlan(index, layers, 0))
        reads = {p: name for name, types in shared.get(index, {}).items() for p in types}
        for layer in layers:
            for p in shape.targets:
                out, inp = shape.geometry.shape(p)
                mode = "basis" if p in reads else "neurons" if p in neurons else "lowrank"
                if p in heads:
                    mode = "heads" if p in (HEADS_ROWS, HEADS_READER) else "dense"
                projections.append(ProjectionPlan(
                    layer, p, out, inp, mode, group=index, bias=shape.biases.get((layer, p), 0), basis=reads.get(p),
                    head_block=head_block if mode == "heads" else 0,
                ))  # fmt: skip
    plan = CompressionPlan(
        settings.method,
        ratio,
        shape.params_before,
        shape.geometry,
        groups,
        projections,
        shape.targets,
        uniform_mlp=settings.uniform_mlp and bool(neurons),
        width_multiple=settings.width_multiple if neurons else 1,
    )
    if plan.residual_budget() < 0:
        raise UserError(
            f"--ratio {ratio:g} is infeasible: what is stored whatever the ranks (biases, projections kept whole, "
            f"one head per KV group) needs {plan.fixed_params():,} of the {plan.budget:,} numbers allowed; use a "
            "smaller --ratio"
        )
    return plan


def group_whitening(ctx: MethodContext, layers: list[int], p: str):
    """Cholesky factor of the summed input autocorrelation of `p` over `layers` (damping reported)."""
    with numerical_context(f"the summed {p} input autocorrelation of layers {layers}"):
        factor = whitening_factor(
            torch.stack([ctx.autocorr(layer, p).to(ctx.compute_device) for layer in layers]).sum(dim=0)
        )
    ctx.record_damping(factor, layers=list(layers), projection=p, input="group sum (shared basis)")
    return factor


def full_basis(ctx: MethodContext, layers: list[int], types: tuple[str, ...]) -> torch.Tensor:
    """Every row of a run's shared basis, most important first (`(k, in)`, k = min(Σ out, in)): the whitened
    factorization of the stacked weights of `types` over `layers` under their summed input autocorrelation."""
    factor = group_whitening(ctx, layers, types[0])  # the types of one basis read the same input
    stacked = torch.cat([ctx.weight(layer, p) for layer in layers for p in types])  # (Σ out, in)
    with numerical_context(f"layers {layers} {'/'.join(types)}"):
        _, _, vh = whitened_svd(stacked, factor.S)
        return whitened_basis(vh, factor.S)


def shared_tails(
    ctx: MethodContext, layers: list[int], types: tuple[str, ...]
) -> dict[tuple[int, str], torch.Tensor]:
    """Each reader's exact whitened error at every size of the run's basis, its coefficients refit."""
    basis = full_basis(ctx, layers, types)
    return {
        (layer, p): refit_tail(ctx.weight(layer, p), basis, ctx.whitening(layer, p).S).cpu()
        for layer in layers
        for p in types
    }


def apply_basis_form(ctx: MethodContext) -> CompressionPlan:
    """Pass 1: every matrix's tail, on its own and as a reader of its run's basis; the form's (or `auto`'s)
    bases; the global allocation. Pass 2: the bases with their refit coefficients, then the per-matrix factors."""
    settings, shape = ctx.settings, ctx.shape
    start, neuron_before = time.perf_counter(), ctx.seconds.get("neuron_selection", 0.0)
    runs = runs_of(shape, settings)
    offered = candidates(shape, settings) if settings.sharing == "auto" else fixed_shared(shape, settings)
    neuron_types = neuron_projections(shape, settings)
    head_types = head_projections(shape, settings)
    own_needed = [
        (layer, p)
        for layer in range(shape.num_layers)
        for p in shape.targets
        if p not in neuron_types and p not in head_types
    ]
    if settings.sharing != "auto":  # a fixed form never factors a basis reader on its own
        read = {(layer, p) for i, b in offered.items() for t in b.values() for p in t for layer in runs[i]}
        own_needed = [key for key in own_needed if key not in read]
    total = len(own_needed) + sum(len(b) for b in offered.values())
    own, as_reader = {}, {}
    with progress_bar("Spectra", total=total, enabled=ctx.progress) as bar:
        for layer, p in own_needed:
            own[(layer, p)] = residual_tail(ctx, layer, p, ctx.weight(layer, p))
            bar.advance()
        for index, bases in offered.items():
            for name, types in bases.items():
                as_reader[(index, name)] = shared_tails(ctx, runs[index], types)
                bar.advance()
    neurons = neuron_tails(ctx, list(range(shape.num_layers))) if neuron_types else {}
    own.update(tails_for_allocation(neurons))
    heads = attention_heads.head_tails(ctx, list(range(shape.num_layers))) if head_types else {}
    own.update(attention_heads.tails_for_allocation(heads))
    if ctx.size is not None:  # a byte budget: the structure and the types in one allocation
        return _apply_size(ctx, offered, neurons, heads, start, neuron_before)
    allocator = allocator_for(settings.allocation, settings.dense_when_cheaper)
    assert isinstance(allocator, GlobalAllocator)  # check_basis_settings refuses the paper's

    def layout(shared: Shared) -> tuple[CompressionPlan, dict]:
        tails = dict(own)
        for index, bases in shared.items():
            for name in bases:
                tails.update(as_reader[(index, name)])
        return basis_layout(shape, settings, ctx.ratio, shared), tails

    if settings.sharing == "auto":
        shared, ctx.report["sharing_choice"] = choose_shared(offered, layout, allocator, ctx.error_weight)
    else:
        shared = offered
    shares = {"basis": BASIS_TYPES, "qkv": JOINT_TYPES}.get(settings.sharing, ())
    if shares and not set(shares) & set(shape.targets):  # e.g. the default form with --targets mlp
        ctx.report["sharing_note"] = (
            f"--sharing {settings.sharing} shares the input bases of {'/'.join(shares)}, which --targets "
            f"{settings.targets} leaves out: nothing is shared, every projection is compressed on its own"
        )
    plan, tails = layout(shared)
    ctx.report.update(allocator.allocate(plan, tails, ctx.error_weight))
    plan.check_budget()
    ctx.report["sharing"] = sharing_report(plan, tails, ctx.output_energy, ctx.error_weight)
    install_all(ctx, plan, neurons, heads)
    _time_factors(ctx, start, neuron_before)
    return plan


def _time_factors(ctx: MethodContext, start: float, neuron_before: float) -> None:
    # The neuron orders were timed under their own name (`neuron_selection`): not counted twice.
    ctx.seconds["residual_svd"] = (
        time.perf_counter() - start - (ctx.seconds.get("neuron_selection", 0.0) - neuron_before)
    )


def _apply_size(ctx: MethodContext, offered: Shared, neurons, heads, start: float, neuron_before: float):
    """`ctx.size`: every MLP's width and attention's heads chosen with every matrix's type under the file's
    bytes (`byte_structure`), then installed as the parameter allocation's would be."""
    plan = basis_layout(ctx.shape, ctx.settings, ctx.ratio, offered)
    if offered or any(pp.mode not in ("neurons", "heads", "dense") for pp in plan.projections):
        raise ValueError("a byte budget chooses engine-native forms only: --native, --sharing none")
    ctx.report["byte_budget"] = allocate_to_size(ctx, plan, neurons, heads)
    plan.check_budget()
    install_all(ctx, plan, neurons, heads)
    _time_factors(ctx, start, neuron_before)
    return plan


def install_all(
    ctx: MethodContext, plan: CompressionPlan, neurons: dict[int, NeuronTail], heads: dict[int, HeadTail]
) -> None:
    """Pass 2: build each shared basis at its allocated size with its readers, every other matrix's factors,
    each MLP in `neurons` mode at its width, and each attention in `heads` mode at its heads."""
    units = plan.allocation_units()
    with progress_bar("Factors", total=len(plan.groups), enabled=ctx.progress) as bar:
        for group in plan.groups:  # run by run, then it is finished
            for members in units.values():
                if members[0].mode == "basis" and members[0].group == group.index:
                    install_shared_basis(ctx, plan, members)
            for pp in plan.projections:
                if pp.group != group.index:
                    continue
                if pp.mode == "lowrank":
                    install_projection(
                        ctx, plan, {}, {}, pp.layer, pp.projection, ctx.whitening(pp.layer, pp.projection)
                    )
                elif pp.mode == "neurons" and pp.projection == NEURON_READER:
                    install_neurons(ctx, plan, pp.layer, neurons[pp.layer])
                elif pp.mode == "heads" and pp.projection == HEADS_READER:
                    attention_heads.install_heads(ctx, plan, pp.layer, heads[pp.layer])
            ctx.finished(group.layers)
            bar.advance()


def install_shared_basis(ctx: MethodContext, plan: CompressionPlan, members: list[ProjectionPlan]) -> None:
    """One shared basis at its allocated size, each reader installed on it with its own refit coefficients."""
    layers = plan.groups[members[0].group].layers
    types = tuple(dict.fromkeys(pp.projection for pp in members))
    basis = full_basis(ctx, layers, types)[: members[0].rank]
    shared = SharedInputLinear.shared_basis(basis, ctx.model_dtype, ctx.model_device)
    for pp in members:
        with numerical_context(f"layer {pp.layer} {pp.projection}"):
            a = refit_on_basis(
                ctx.weight(pp.layer, pp.projection), basis, ctx.whitening(pp.layer, pp.projection).S
            )
        module = SharedInputLinear.from_factors(
            shared, a, ctx.bias(pp.layer, pp.projection), ctx.model_dtype, ctx.model_device
        )
        ctx.install(pp.layer, pp.projection, module)


def sharing_report(plan: CompressionPlan, tails: dict, output_energy, weight) -> dict:
    """The proxy: Σ of each matrix's relative whitened error ‖(W − Ŵ) S‖² / ‖W S‖², exact for the built model
    (what `global-relative` minimises); the objective the allocation minimised, Σ of each error times its weight
    (`MethodContext.error_weight`: the relative error under `global-relative`, the loss-weighted one under
    `global-loss`); and per shared basis, its readers, size and their mean relative error."""

    def relative(pp) -> float:
        if not pp.carries_error():
            return 0.0
        tail = tails[(pp.layer, pp.projection)]
        # A neuron unit's error at width 0 is its whole output energy ‖D S‖² = tr(D C Dᵀ): no second Cholesky of C.
        energy = float(tail[0]) if pp.mode == "neurons" else output_energy(pp.layer, pp.projection)
        return float(tail[pp.rank]) / (energy or 1.0)

    bases = {}
    for pp in plan.projections:
        if pp.mode == "basis":
            row = bases.setdefault((pp.group, pp.basis), {
                "group": pp.group, "basis": pp.basis, "layers": plan.groups[pp.group].layers,
                "projections": [], "size": pp.rank, "errors": [],
            })  # fmt: skip
            row["projections"] = sorted(set(row["projections"]) | {pp.projection})
            row["errors"].append(relative(pp))
    rows = [{**{k: v for k, v in r.items() if k != "errors"}, "relative_error": sum(r["errors"]) / len(r["errors"])}
            for r in bases.values()]  # fmt: skip
    errors = [relative(pp) for pp in plan.projections]
    objective = sum(
        float(tails[(pp.layer, pp.projection)][pp.rank]) * weight(pp.layer, pp.projection)
        for pp in plan.projections
        if pp.carries_error()
    )
    return {
        "proxy_error": sum(errors), "proxy_error_mean": sum(errors) / len(errors), "objective": objective,
        "bases": rows,
    }  # fmt: skip
