"""The low-rank baselines: every targeted projection replaced by rank-r factors, the same kept fraction of
every matrix. `svd-llm` whitens by the input's Cholesky factor (SVD-LLM); `svd` is the plain truncated SVD."""

from __future__ import annotations

import time

from compressor.math.accounting import CompressionPlan, ProjectionPlan, lowrank_plan
from compressor.math.whitening import low_rank_factors, plain_svd_factors, whitened_svd
from compressor.methods.base import Method, MethodContext, numerical_context
from compressor.modeling.remote_code.masa_modules import LowRankLinear
from compressor.runtime.progress import progress_bar


def install_lowrank(ctx: MethodContext, pp: ProjectionPlan, whitened: bool, dtype, device) -> None:
    """Replace one projection by its rank-`pp.rank` factors: whitened by its input's Cholesky factor (SVD-LLM)
    or the plain truncated SVD."""
    w = ctx.weight(pp.layer, pp.projection)
    with numerical_context(f"layer {pp.layer} {pp.projection}"):
        if whitened:
            factor = ctx.whitening(pp.layer, pp.projection)
            u, sigma, vh = whitened_svd(w, factor.S)
            a, b = low_rank_factors(u, sigma, vh, factor.S, pp.rank)
        else:
            a, b = plain_svd_factors(w, pp.rank)
    bias = ctx.bias(pp.layer, pp.projection)
    ctx.install(pp.layer, pp.projection, LowRankLinear.from_factors(a, b, bias, dtype, device))


class LowRank(Method):
    whitened: bool

    def plan(self, shape, settings, ratio, groups_of=None, check_feasible: bool = True) -> CompressionPlan:
        return lowrank_plan(
            self.name,
            ratio,
            shape.params_before,
            shape.geometry,
            shape.num_layers,
            shape.biases,
            shape.targets,
        )

    def apply(self, ctx: MethodContext) -> CompressionPlan:
        plan = self.plan(ctx.shape, ctx.settings, ctx.ratio)
        start = time.perf_counter()
        dtype, device = ctx.model_dtype, ctx.model_device
        title = "SVD" + (" (whitened)" if self.whitened else "")
        with progress_bar(title, total=len(plan.projections), enabled=ctx.progress) as bar:
            for pp in plan.projections:
                install_lowrank(ctx, pp, self.whitened, dtype, device)
                if pp.projection == plan.targets[-1]:  # the plan lists each layer's projections together
                    ctx.finished([pp.layer])
                bar.advance()
        ctx.seconds["residual_svd"] = time.perf_counter() - start
        return plan


class SvdLlm(LowRank):
    name = "svd-llm"
    summary = "whitened truncated SVD of every projection, the same kept fraction of each (SVD-LLM)"
    whitened = True


class PlainSvd(LowRank):
    name = "svd"
    summary = "plain truncated SVD of every projection, the same kept fraction of each"
    whitened = False
