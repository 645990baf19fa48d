"""`basis-sharing`: the Basis Sharing baseline (Wang et al., ICLR 2025), faithful to its defaults.

Consecutive layers are paired (groups of 2; an odd last layer stands alone). In each pair, q/k/v (and gate/up
when the MLP is targeted) each get ONE input basis shared by both layers, with per-layer coefficients: the
stacked weights [W_1; W_2] are factored by a whitened SVD under the Cholesky factor of the pair's summed input
autocorrelation (the inputs of both layers concatenated, as the paper does), W_l ≈ A_l B. o_proj and down_proj
(whose inputs are layer-specific) get per-layer whitened SVD factors. Every matrix — stacked or not — keeps the
same fraction of its numbers (uniform ranks), biases paid out of their own projection's share.
"""

from __future__ import annotations

import time

from compressor.math.accounting import CompressionPlan, GroupPlan, ProjectionPlan, uniform_rank
from compressor.math.grouping import consecutive_runs
from compressor.math.whitening import shared_basis_factors, whitening_factor
from compressor.methods.base import GroupsOf, Method, MethodContext, ModelShape, numerical_context
from compressor.methods.lowrank import install_lowrank
from compressor.modeling.remote_code.masa_modules import SharedInputLinear
from compressor.recipes.schema import CompressionSettings
from compressor.runtime.progress import progress_bar

#: Projection types whose input basis a pair of layers shares (the paper's choice).
SHARED_TYPES = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
GROUP_SIZE = 2


class BasisSharing(Method):
    name = "basis-sharing"
    summary = (
        "Basis Sharing (Wang et al. 2025): pairs of layers share a whitened input basis per q/k/v (gate/up), "
        "per-layer coefficients; o/down per layer; the same kept fraction of every matrix"
    )

    def plan(
        self,
        shape: ModelShape,
        settings: CompressionSettings,
        ratio: float,
        groups_of: GroupsOf | None = None,
        check_feasible: bool = True,
    ) -> CompressionPlan:
        projections, groups = [], []
        for index, layers in enumerate(consecutive_runs(shape.num_layers, GROUP_SIZE)):
            groups.append(GroupPlan(index, layers, 0))
            for p in shape.targets:
                out, inp = shape.geometry.shape(p)
                biases = [shape.biases.get((layer, p), 0) for layer in layers]
                if p in SHARED_TYPES and len(layers) > 1:
                    # the stacked (|g|·out × in) matrix keeps the kept fraction: r·(in + |g|·out) + Σ biases
                    rank = uniform_rank(len(layers) * out, inp, sum(biases), ratio)
                    projections += [
                        ProjectionPlan(layer, p, out, inp, "basis", group=index, rank=rank, bias=b, basis=p)
                        for layer, b in zip(layers, biases, strict=True)
                    ]
                else:
                    projections += [
                        ProjectionPlan(
                            layer, p, out, inp, "lowrank", rank=uniform_rank(out, inp, b, ratio), bias=b
                        )
                        for layer, b in zip(layers, biases, strict=True)
                    ]
        projections.sort(key=lambda pp: (pp.layer, shape.targets.index(pp.projection)))
        plan = CompressionPlan(
            self.name, ratio, shape.params_before, shape.geometry, groups, projections, shape.targets
        )
        plan.check_budget()
        return plan

    def apply(self, ctx: MethodContext) -> CompressionPlan:
        plan = self.plan(ctx.shape, ctx.settings, ctx.ratio)
        start = time.perf_counter()
        dtype, device = ctx.model_dtype, ctx.model_device
        with progress_bar("Basis Sharing", total=len(plan.projections), enabled=ctx.progress) as bar:
            for group in plan.groups:
                for p in plan.targets:
                    members = [plan.get(layer, p) for layer in group.layers]
                    if members[0].mode == "basis":
                        self._install_shared(ctx, group, p, members[0].rank, dtype, device)
                    else:
                        for pp in members:
                            install_lowrank(ctx, pp, True, dtype, device)
                    bar.advance(len(members))
                ctx.finished(group.layers)
        ctx.seconds["residual_svd"] = time.perf_counter() - start
        return plan

    @staticmethod
    def _install_shared(ctx: MethodContext, group: GroupPlan, p: str, rank: int, dtype, device) -> None:
        where = f"layers {group.layers} {p}"
        with numerical_context(where):
            factor = whitening_factor(
                sum(ctx.autocorr(layer, p) for layer in group.layers).to(ctx.compute_device)
            )
            coefficients, basis = shared_basis_factors(
                [ctx.weight(layer, p) for layer in group.layers], factor.S, rank
            )
        ctx.record_damping(factor, layers=group.layers, projection=p)
        shared = SharedInputLinear.shared_basis(basis, dtype, device)
        for layer, a in zip(group.layers, coefficients, strict=True):
            ctx.install(
                layer, p, SharedInputLinear.from_factors(shared, a, ctx.bias(layer, p), dtype, device)
            )
