"""MASA ("Share Your Attention"), training-free: grouping of consecutive layers by logit-lens KL, Matrix PCA
atoms shared within each group, Cholesky-whitened low-rank residuals, ranks by an allocator under one budget.
`masa-paper` is the same method with the paper's choices pinned (a preset).

`--sharing` picks the form of sharing: `atoms` (the paper's, `masa.stages`) or an input-basis form
(`basis`, `qkv`, `none`, `auto`: `masa.basis`), every form under the same budget and global allocation."""

from __future__ import annotations

import time

from torch import nn

from compressor.math.accounting import (
    HEADS_READER,
    NEURON_READER,
    CompressionPlan,
    check_feasible_before_calibration,
)
from compressor.methods.allocation_policies import allocator_for
from compressor.methods.base import GroupsOf, Method, MethodContext, ModelShape
from compressor.methods.masa.basis import (
    BASIS_FORMS,
    apply_basis_form,
    basis_layout,
    check_basis_settings,
)
from compressor.methods.masa.basis import (
    settings_read as basis_settings_read,
)
from compressor.methods.masa.mlp import install_neurons, neuron_layers, neuron_tails, tails_for_allocation
from compressor.methods.masa.shapes import choose_groups_and_bases
from compressor.methods.masa.stages import (
    all_group_atoms,
    install_projection,
    masa_layout,
    residual,
    residual_tail,
)
from compressor.modeling.adapters import MLP_PROJECTIONS, target_projections
from compressor.recipes.schema import CompressionSettings
from compressor.runtime.errors import UserError
from compressor.runtime.progress import progress_bar
from compressor.statistics.partly_compressed import (
    STREAM_MATRICES,
    install_sequentially,
    original_layers,
    refit_on_stream,
)

#: The settings of the MLP's form, read only when the targets hold the MLP.
MLP_SETTINGS = frozenset({"mlp", "uniform_mlp", "width_multiple", "neuron_order"})


def refit_forms(settings: CompressionSettings) -> tuple[str, ...]:
    """The matrices `--refit stream` may refit in a run of these settings: heads' o_proj, neurons' down_proj."""
    targets = set(target_projections(settings.targets))
    return tuple(
        p
        for p, form in (("o_proj", settings.attention == "heads"), ("down_proj", settings.mlp == "neurons"))
        if form and p in targets
    )


def stream_matrices(plan: CompressionPlan) -> dict[int, tuple[str, ...]]:
    """Per layer, its plain narrowed matrices a stream refit reads: o_proj in `heads` mode, down_proj in
    `neurons` mode."""
    found: dict[int, list[str]] = {}
    for pp in plan.projections:
        if (pp.mode, pp.projection) in (("heads", HEADS_READER), ("neurons", NEURON_READER)):
            found.setdefault(pp.layer, []).append(pp.projection)
    return {layer: tuple(sorted(ps, key=STREAM_MATRICES.index)) for layer, ps in found.items()}


class Masa(Method):
    name = "masa"
    summary = "whitened low-rank factors, shared input bases, the MLP by neurons, one allocation (default)"
    #: With `--sharing atoms`; the input-basis forms read `masa.basis.settings_read(form)`.
    settings_read = frozenset(CompressionSettings.model_fields) - {"method", "targets", "basis_layers"}
    uses_groups = True

    def settings_read_for(self, settings: CompressionSettings) -> frozenset[str]:
        read = (
            basis_settings_read(settings.sharing) if settings.sharing in BASIS_FORMS else self.settings_read
        )
        if not set(MLP_PROJECTIONS) & set(target_projections(settings.targets)):
            return read - MLP_SETTINGS
        return read if settings.mlp == "neurons" else read - {"uniform_mlp", "width_multiple", "neuron_order"}

    def uses_groups_for(self, settings: CompressionSettings) -> bool:
        return settings.sharing == "atoms"

    def reads_gate_input(self, settings: CompressionSettings) -> bool:
        return settings.mlp == "lowrank"  # neurons: gate/up keep their rows, down_proj's input decides

    def groups_rule(self, settings: CompressionSettings) -> str:
        if settings.sharing == "none":
            return "no groups: every projection its own whitened factors"
        what = {
            "basis": "k_proj and v_proj share an input basis per type",
            "qkv": "q/k/v share one input basis",
            "auto": "each projection type shares an input basis or not, as the proxy chooses at run time",
        }[settings.sharing]
        return f"fixed: runs of {settings.basis_layers} consecutive layers (--basis-layers); {what}"

    def describe(self, settings: CompressionSettings) -> str:
        return f"--method {self.name} --sharing {settings.sharing}"

    def instead(self, settings: CompressionSettings, key: str) -> str:
        if key in MLP_SETTINGS:
            if not set(MLP_PROJECTIONS) & set(target_projections(settings.targets)):
                return "it applies to the MLP: add --targets attn,mlp (or mlp)"
            return "it applies to --mlp neurons: drop it or use --mlp neurons"
        forms = [
            f
            for f in ("atoms", *BASIS_FORMS)
            if key in self.settings_read_for(settings.model_copy(update={"sharing": f}))
        ]
        return f"drop it, or use --sharing {forms[0]}" if forms else "drop it"

    def check_settings(self, settings: CompressionSettings) -> None:
        if settings.refit == "stream" and not refit_forms(settings):
            raise UserError(
                "--refit stream refits --attention heads' o_proj and --mlp neurons' down_proj: this run has "
                "neither (use --native, or drop --refit)"
            )
        if settings.sharing in BASIS_FORMS:
            check_basis_settings(settings, target_projections(settings.targets))
            return
        if not set(MLP_PROJECTIONS) & set(target_projections(settings.targets)):
            return
        if settings.allocation == "paper":
            raise UserError(
                "--targets mlp: Algorithm 1 (--allocation paper, --method masa-paper) balances (Q,K) and (V,O) "
                "pairs and has no rule for MLP projections: use --method masa with --allocation global-loss"
            )
        if settings.statistics == "sequential":
            raise UserError(
                "--targets mlp: --statistics sequential collects attention inputs only: use --statistics original"
            )

    def check_before_calibration(
        self, shape: ModelShape, settings: CompressionSettings, ratio: float
    ) -> None:
        if settings.sharing in BASIS_FORMS:
            basis_layout(shape, settings, ratio)
            return
        if settings.auto_groups:  # the search skips what does not fit, and says so when nothing does
            return
        check_feasible_before_calibration(
            ratio, shape.params_before, shape.geometry, shape.num_layers, settings.groups, settings.bases,
            settings.largest_group_bases, settings.singletons == "compress", shape.targets,
        )  # fmt: skip

    def plan(self, shape, settings, ratio, groups_of: GroupsOf | None, check_feasible: bool = True):
        if settings.sharing in BASIS_FORMS:
            return basis_layout(shape, settings, ratio)
        if groups_of is None:
            raise ValueError("MASA plans on groups: pass the calibrated grouping or assumed groups")
        groups = groups_of(settings.groups)
        return masa_layout(
            shape, settings, ratio, groups, settings.bases, settings.largest_group_bases, check_feasible
        )

    def apply(self, ctx: MethodContext) -> CompressionPlan:
        if ctx.settings.refit != "stream":
            return self._apply(ctx)
        if ctx.windows is None:
            raise ValueError("--refit stream needs the calibration windows: pass `windows`")
        # Copied before anything is installed (with --layerwise: meta copies, onloaded layer by layer).
        originals = original_layers(ctx.adapter)
        plan = self._apply(ctx)
        ctx.finished(range(ctx.shape.num_layers))  # every module installed: the refit changes weights only
        refit_on_stream(ctx, originals, stream_matrices(plan))
        return plan

    def _apply(self, ctx: MethodContext) -> CompressionPlan:
        settings = ctx.settings
        if settings.sharing in BASIS_FORMS:
            return apply_basis_form(ctx)
        if settings.auto_groups:
            # Only G and B change: every stage reads the rest of the settings from the context.
            choice, record = choose_groups_and_bases(ctx)
            settings = settings.model_copy(
                update={"groups": choice.groups, "bases": choice.bases, "largest_group_bases": None}
            )
            ctx.report["shape_search"] = record
            ctx.report["effective_settings"] = settings.model_dump()
        plan = self.plan(ctx.shape, settings, ctx.ratio, ctx.groups_of)
        atoms = all_group_atoms(ctx, plan)
        neurons = neuron_tails(ctx, neuron_layers(plan))
        targets = self._allocate(ctx, plan, atoms, neurons)
        start = time.perf_counter()
        dtype, device = ctx.model_dtype, ctx.model_device
        shared_atoms = {
            key: nn.Parameter(d.to(device=device, dtype=dtype).contiguous(), requires_grad=False)
            for key, (d, _) in atoms.items()
        }

        def install(layer: int, p: str, factor) -> None:
            install_projection(ctx, plan, atoms, shared_atoms, layer, p, factor)

        for layer in neuron_layers(plan):  # the MLPs first: they share nothing with a group
            if plan.get(layer, NEURON_READER).mode == "neurons":
                install_neurons(ctx, plan, layer, neurons[layer])

        if ctx.settings.statistics == "sequential":
            install_sequentially(ctx, targets, install, [group.layers for group in plan.groups])
        else:
            with progress_bar("Residual factors", total=len(targets), enabled=ctx.progress) as bar:
                for group in plan.groups:  # a group's layers share its atoms: finished together
                    for layer, p in targets:
                        if layer in group.layers:
                            install(layer, p, ctx.whitening(layer, p))
                            bar.advance()
                    ctx.finished(group.layers)
        ctx.seconds["residual_svd"] += time.perf_counter() - start
        return plan

    @staticmethod
    def _allocate(ctx: MethodContext, plan: CompressionPlan, atoms, neurons) -> list[tuple[int, str]]:
        """Pass 1: the discarded-energy tail of every whitened residual (only the spectra are kept, so memory
        does not grow with depth) and the MLPs' neuron tails (`neurons`), then the ranks and widths; returns the
        projections left to factor (pass 2)."""
        start = time.perf_counter()
        targets = [
            (pp.layer, pp.projection) for pp in plan.projections if pp.mode not in ("dense", "neurons")
        ]
        tails = tails_for_allocation(neurons)
        with progress_bar("Residual spectra", total=len(targets), enabled=ctx.progress) as bar:
            for layer, p in targets:
                tails[(layer, p)] = residual_tail(ctx, layer, p, residual(ctx, plan, atoms, layer, p))
                bar.advance()
        allocator = allocator_for(ctx.settings.allocation, ctx.settings.dense_when_cheaper)
        ctx.report.update(allocator.allocate(plan, tails, ctx.error_weight))
        plan.check_budget()
        targets = [k for k in targets if plan.get(*k).mode != "dense"]  # the allocation may keep some whole
        # The whitened output error left by the residuals (Eckart–Young tails) and the MLPs: what the
        # allocation weighed.
        ctx.report["residual_error"] = float(
            sum(tails[(pp.layer, pp.projection)][pp.rank] for pp in plan.projections if pp.carries_error())
        )
        ctx.seconds["residual_svd"] = time.perf_counter() - start
        return targets


class MasaPaper(Masa):
    name = "masa-paper"
    summary = "the paper's choices: plain Matrix PCA, Algorithm 1, singletons kept whole, original statistics"
    # Groups, atoms and the logit lens still come from the recipe/options.
    preset = {
        "sharing": "atoms",
        "atoms": "plain",
        "allocation": "paper",
        "singletons": "keep",
        "statistics": "original",
        "end_boundaries": True,
    }
