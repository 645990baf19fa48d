"""`shared-mean`: pure cross-layer sharing. Each group of consecutive layers stores one mean weight per
projection type (coefficient 1), no residual; the most groups the budget holds."""

from __future__ import annotations

import time

import torch
from torch import nn

from compressor.math.accounting import CompressionPlan, shared_plan
from compressor.methods.base import Method, MethodContext
from compressor.modeling.remote_code.masa_modules import SharedBasisLinear
from compressor.runtime.errors import UserError


class SharedMean(Method):
    name = "shared-mean"
    summary = "one mean weight per group of layers, no residual (pure sharing), the most groups that fit"
    settings_read = frozenset({"logit_lens", "end_boundaries"})
    uses_groups = True

    def check_before_calibration(self, shape, settings, ratio) -> None:
        """Even one group stores a whole layer's worth of numbers."""
        per_layer = shape.params_before // shape.num_layers
        if per_layer > (1.0 - ratio) * shape.params_before:
            raise UserError(
                f"--ratio {ratio:g} is infeasible for shared-mean: even one group exceeds the budget"
            )

    def layout(self, shape, settings, ratio, groups, check_feasible: bool = True) -> CompressionPlan:
        """One atom per shared group, no residual (rank 0)."""
        plan = shared_plan(
            self.name, ratio, shape.params_before, shape.geometry, groups, 1, None, shape.biases,
            projections_compressed=shape.targets, check_feasible=check_feasible,
        )  # fmt: skip
        for pp in plan.projections:
            if pp.mode == "shared":
                pp.rank = 0
        return plan

    def plan(self, shape, settings, ratio, groups_of, check_feasible: bool = True) -> CompressionPlan:
        """The most groups whose layout fits the budget (from L groups down)."""
        for n_groups in range(shape.num_layers, 0, -1):
            try:
                candidate = self.layout(shape, settings, ratio, groups_of(n_groups))
            except UserError:
                continue
            if candidate.params_after() <= candidate.budget:
                return candidate
        if not check_feasible:
            return self.layout(shape, settings, ratio, groups_of(1), check_feasible=False)
        raise UserError(f"--ratio {ratio:g} is infeasible for shared-mean: even one group exceeds the budget")

    def apply(self, ctx: MethodContext) -> CompressionPlan:
        plan = self.plan(ctx.shape, ctx.settings, ctx.ratio, ctx.groups_of)
        start = time.perf_counter()
        dtype, device = ctx.model_dtype, ctx.model_device
        for group in plan.groups:
            if group.singleton:
                continue
            for p in ctx.projections:
                mean = torch.stack([ctx.weight(layer, p) for layer in group.layers]).mean(dim=0)
                atoms = nn.Parameter(
                    mean[None].to(device=device, dtype=dtype).contiguous(), requires_grad=False
                )
                for layer in group.layers:
                    bias = ctx.bias(layer, p)
                    module = SharedBasisLinear(atoms, 0, bias=bias is not None, dtype=dtype, device=device)
                    module.coefficients.data.fill_(1.0)
                    if bias is not None:
                        module.bias.data.copy_(bias)
                    ctx.install(layer, p, module)
            ctx.finished(group.layers)
        ctx.seconds["pca"] = time.perf_counter() - start
        return plan
