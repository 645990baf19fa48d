"""MASA's stages on one group or one projection: Matrix PCA atoms, residuals, their whitened spectra, and the
installed module. The method (`masa.method`) and the G/B search (`masa.shapes`) both use them."""

from __future__ import annotations

import time

import torch
from torch import nn

from compressor.math.accounting import CompressionPlan, shared_plan
from compressor.math.pca import captured_energy_fraction, matrix_pca, refit_coefficients, whitened_matrix_pca
from compressor.math.whitening import (
    WhiteningFactor,
    discarded_energy,
    low_rank_factors,
    whitened_singular_values,
    whitened_svd,
    whitening_factor,
)
from compressor.methods.base import MethodContext, ModelShape, numerical_context
from compressor.modeling.adapters import MLP_PROJECTIONS
from compressor.modeling.remote_code.masa_modules import LowRankLinear, SharedBasisLinear
from compressor.recipes.schema import CompressionSettings
from compressor.runtime.progress import progress_bar

Atoms = dict[
    tuple[int, str], tuple[torch.Tensor, torch.Tensor]
]  # (group, proj) -> (atoms (B,out,in), coeffs (L,B))


def masa_layout(
    shape: ModelShape,
    settings: CompressionSettings,
    ratio: float,
    groups: list[list[int]],
    bases: int,
    largest_group_bases: int | None,
    check_feasible: bool = True,
) -> CompressionPlan:
    """The MASA layout of a grouping under the budget (ranks not yet allocated)."""
    neurons = tuple(p for p in shape.targets if p in MLP_PROJECTIONS) if settings.mlp == "neurons" else ()
    return shared_plan(
        settings.method, ratio, shape.params_before, shape.geometry, groups, bases, largest_group_bases,
        shape.biases, compress_singletons=settings.singletons == "compress", projections_compressed=shape.targets,
        check_feasible=check_feasible, neuron_projections=neurons, uniform_mlp=settings.uniform_mlp,
        width_multiple=settings.width_multiple,
    )  # fmt: skip


def group_atoms(
    ctx: MethodContext, layers: list[int], n_atoms: int, p: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Matrix PCA of one group's weights for projection type `p`: atoms (B', out, in), coefficients (L, B'),
    eigenvalues; B' < `n_atoms` when the stacked weights have a lower numerical rank."""
    stacked = torch.stack([ctx.weight(layer, p) for layer in layers])  # (L, out, in)
    if ctx.settings.atoms == "whitened":
        autocorrs = [ctx.autocorr(layer, p).to(ctx.compute_device) for layer in layers]
        with numerical_context(f"the summed {p} input autocorrelation of layers {layers}"):
            group_factor = whitening_factor(torch.stack(autocorrs).sum(dim=0))
        ctx.record_damping(
            group_factor, layers=list(layers), projection=p, input="group sum (whitened atoms)"
        )
        d, _, eigenvalues = whitened_matrix_pca(stacked, group_factor.S, n_atoms)
        return d, refit_coefficients(stacked, d, autocorrs), eigenvalues
    return matrix_pca(stacked, n_atoms)


def all_group_atoms(ctx: MethodContext, plan: CompressionPlan) -> Atoms:
    """Matrix PCA per shared group and projection type; the plan's atom counts follow what PCA returned."""
    start = time.perf_counter()
    atoms: Atoms = {}
    energy = []
    shared = [g for g in plan.groups if g.n_atoms > 0]
    types = [
        p
        for p in ctx.projections
        if any(pp.mode == "shared" for pp in plan.projections if pp.projection == p)
    ]
    with progress_bar("Matrix PCA", total=len(shared) * len(types), enabled=ctx.progress) as bar:
        for group in shared:
            for p in types:
                d, c, eigenvalues = group_atoms(ctx, group.layers, group.n_atoms, p)
                atoms[(group.index, p)] = (d, c)
                # PCA returns fewer atoms when the group's weights have a lower numerical rank.
                for layer in group.layers:
                    plan.get(layer, p).n_atoms = d.shape[0]
                energy.append({"group": group.index, "projection": p, "layers": len(group.layers),
                               "atoms": group.n_atoms,
                               "energy_captured": captured_energy_fraction(eigenvalues, group.n_atoms)})  # fmt: skip
                bar.advance()
    ctx.report["atom_energy"] = energy
    ctx.seconds["pca"] = time.perf_counter() - start
    return atoms


def shared_part(atoms: torch.Tensor, coefficients: torch.Tensor, row: int) -> torch.Tensor:
    """Σ_s c_(row, s) D_s: what the atoms reconstruct of the group's `row`-th layer."""
    return torch.einsum("s,soi->oi", coefficients[row], atoms)


def residual(ctx: MethodContext, plan: CompressionPlan, atoms: Atoms, layer: int, p: str) -> torch.Tensor:
    """What the residual factors approximate: the weight minus its shared part (the weight when not shared)."""
    pp = plan.get(layer, p)
    w = ctx.weight(layer, p)
    if pp.mode != "shared":
        return w
    d, c = atoms[(pp.group, p)]
    return w - shared_part(d, c, plan.groups[pp.group].layers.index(layer))


def residual_tail(ctx: MethodContext, layer: int, p: str, residual: torch.Tensor) -> torch.Tensor:
    """Discarded whitened energy of the residual at every rank (`tail[r]`), on the CPU."""
    with numerical_context(f"layer {layer} {p}"):
        sigma = whitened_singular_values(residual, ctx.whitening(layer, p).S)
    return discarded_energy(sigma).cpu()


def install_projection(
    ctx: MethodContext,
    plan: CompressionPlan,
    atoms: Atoms,
    shared_atoms: dict[tuple[int, str], nn.Parameter],
    layer: int,
    p: str,
    factor: WhiteningFactor,
) -> None:
    """Residual factors at the allocated rank under `factor`'s whitening, installed as the projection."""
    dtype, device = ctx.model_dtype, ctx.model_device
    pp = plan.get(layer, p)
    with numerical_context(f"layer {layer} {p}"):
        u, sigma, vh = whitened_svd(residual(ctx, plan, atoms, layer, p), factor.S)
        a, b = low_rank_factors(u, sigma, vh, factor.S, pp.rank)
    bias = ctx.bias(layer, p)
    if pp.mode != "shared":
        ctx.install(layer, p, LowRankLinear.from_factors(a, b, bias, dtype=dtype, device=device))
        return
    module = SharedBasisLinear(
        shared_atoms[(pp.group, p)], pp.rank, bias=bias is not None, dtype=dtype, device=device
    )
    _, c = atoms[(pp.group, p)]
    module.coefficients.data.copy_(c[plan.groups[pp.group].layers.index(layer)])
    module.lowrank_a.data.copy_(a)
    module.lowrank_b.data.copy_(b)
    if bias is not None:
        module.bias.data.copy_(bias)
    ctx.install(layer, p, module)
