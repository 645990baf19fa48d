"""Stages 2-5 orchestrated: grouping, Matrix PCA, whitened residuals, rank allocation, module install.

Every method is a small function on the same stage interfaces (`MethodContext` → `CompressionPlan`):
- `masa` / `masa-paper`: the paper's training-free path (grouping by logit-lens KL, Matrix PCA atoms,
  Cholesky-whitened residuals, Algorithm 1 per (Q,K) and (V,O) pair);
- `svd-llm`: whitened truncated SVD of every projection (SVD-LLM), the same kept fraction per matrix;
- `svd`: plain truncated SVD of every projection;
- `shared-mean`: pure cross-layer sharing, one mean weight per group, as many groups as the budget holds.
The pure math lives in `pca.py`, `whitening.py`, `allocation.py`; this module only orchestrates.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from compressor.adapters import INPUT_OF, MLP_PROJECTIONS, DecoderAdapter, target_projections
from compressor.allocation import allocate_global, allocate_global_with_dense, balance_pair_paper
from compressor.capture import CalibrationStats
from compressor.errors import NumericalError, UserError
from compressor.grouping import Grouping, consecutive_kl, group_layers, logit_lens_distributions
from compressor.modules import LowRankLinear, SharedBasisLinear
from compressor.pca import captured_energy_fraction, matrix_pca, refit_coefficients, whitened_matrix_pca
from compressor.plan import CompressionPlan, layer_dense_params, lowrank_plan, shared_plan
from compressor.progress import progress_bar
from compressor.recipes.schema import CompressionSettings
from compressor.whitening import (
    WhiteningFactor,
    discarded_energy,
    low_rank_factors,
    plain_svd_factors,
    whitened_svd,
    whitening_factor,
)

METHODS = ("masa", "masa-paper", "svd-llm", "svd", "shared-mean")
# What `masa-paper` pins: plain Matrix PCA, Algorithm 1, singletons kept whole, statistics of the original
# model, end boundaries allowed (groups, bases and the logit lens still come from the recipe/options).
PAPER_SETTINGS = {
    "atoms": "plain",
    "allocation": "paper",
    "singletons": "keep",
    "statistics": "original",
    "end_boundaries": True,
}


@contextmanager
def numerical_context(where: str):
    """Prefix numerical failures with the layer/projection they happened in (never hide them)."""
    try:
        yield
    except NumericalError as err:
        raise NumericalError(f"{where}: {err}") from err


@dataclass
class MethodContext:
    """What every method gets: the model, its statistics, the settings, and where to record things."""

    model: nn.Module
    adapter: DecoderAdapter
    stats: CalibrationStats
    settings: CompressionSettings
    ratio: float
    compute_device: torch.device
    progress: bool
    windows: torch.Tensor | None = None  # calibration token windows (sequential statistics only)
    seconds: dict[str, float] = field(default_factory=dict)
    report: dict = field(default_factory=dict)
    _whitening: dict[tuple[int, str], WhiteningFactor] = field(default_factory=dict)
    _output_energy: dict[tuple[int, str], float] = field(default_factory=dict)

    # -- shared stage interfaces ----------------------------------------------------------------------
    def weight(self, layer: int, projection: str) -> torch.Tensor:
        """The original (out, in) weight in fp64 on the compute device; non-finite weights are an error."""
        w = self.adapter.projection(layer, projection).weight.detach().to(self.compute_device, torch.float64)
        if not torch.isfinite(w).all():
            raise NumericalError(
                f"non-finite weights in {self.adapter.projection_path(layer, projection)}: the model file is damaged"
            )
        return w

    @property
    def projections(self) -> tuple[str, ...]:
        """The projection types compressed (`targets`): q/k/v/o by default."""
        return target_projections(self.settings.targets)

    def bias(self, layer: int, projection: str) -> torch.Tensor | None:
        b = self.adapter.projection(layer, projection).bias
        return None if b is None else b.detach().clone()

    def whitening(self, layer: int, projection: str) -> WhiteningFactor:
        """Cholesky factor of the projection's input autocorrelation (q/k/v share one per layer, gate/up too)."""
        key = (layer, INPUT_OF[projection])
        if any(cached[0] != layer for cached in self._whitening):
            # Keep only the current layer's factors (the stages go layer by layer): memory stays flat with
            # depth; a later pass recomputes them (one Cholesky per input, cheap next to the SVDs).
            self._whitening.clear()
        if key not in self._whitening:
            autocorr = self.stats.autocorr(key[1], layer)
            with numerical_context(f"the {key[1]} input autocorrelation of layer {layer}"):
                factor = whitening_factor(autocorr.to(self.compute_device))
            self._whitening[key] = factor
            entry = {"layer": layer, "input": key[1], "damping": factor.damping, "attempts": factor.attempts}
            if factor.damping > 0 and entry not in self.report.setdefault("damping", []):
                self.report["damping"].append(entry)
        return self._whitening[key]

    def output_energy(self, layer: int, projection: str) -> float:
        """‖W S‖²: the whitened output energy of the original weight, the scale of `global-relative` errors.
        Memoized: the G/B search allocates once per candidate, over the same matrices."""
        key = (layer, projection)
        if key not in self._output_energy:
            w = self.weight(layer, projection)
            self._output_energy[key] = float(((w @ self.whitening(layer, projection).S) ** 2).sum())
        return self._output_energy[key]

    def autocorr(self, layer: int, projection: str) -> torch.Tensor:
        """Input autocorrelation of a projection: the layer input for q/k/v, the attention output for o, the
        post-attention-norm hidden state for gate/up, the gated activation for down."""
        return self.stats.autocorr(INPUT_OF[projection], layer)

    def biases(self) -> dict[tuple[int, str], int]:
        return {
            (layer, p): self.adapter.projection(layer, p).bias.numel()
            for layer in range(self.adapter.num_layers)
            for p in self.projections
            if self.adapter.projection(layer, p).bias is not None
        }

    def attention_params_before(self) -> int:
        """Numbers stored by the targeted projections before compression (the ratio's denominator)."""
        return self.adapter.attention_parameter_count(self.projections)

    def grouping(self, n_groups: int) -> Grouping:
        start = time.perf_counter()
        p = logit_lens_distributions(
            self.stats.block_output_means,
            self.adapter.final_norm,
            self.adapter.unembedding,
            apply_final_norm=self.settings.logit_lens == "final_norm",
        )
        grouping = group_layers(consecutive_kl(p), n_groups, end_boundaries=self.settings.end_boundaries)
        self.seconds["grouping"] = self.seconds.get("grouping", 0.0) + time.perf_counter() - start
        self.report["grouping"] = {
            "kl": grouping.kl,
            "boundaries": grouping.boundaries,
            "groups": grouping.groups,
            "rule": grouping.rule,
            "logit_lens": self.settings.logit_lens,
            "end_boundaries": self.settings.end_boundaries,
        }
        return grouping

    def install(self, layer: int, projection: str, module: nn.Module) -> None:
        self.adapter.set_projection(layer, projection, module)

    @property
    def model_dtype(self) -> torch.dtype:
        return self.adapter.unembedding.weight.dtype

    @property
    def model_device(self) -> torch.device:
        return self.adapter.unembedding.weight.device


@dataclass
class CompressionOutcome:
    plan: CompressionPlan
    seconds: dict[str, float]
    report: dict


# ------------------------------------------------------------------------------------------------------
# MASA


def group_atoms(
    ctx: MethodContext, layers: list[int], n_atoms: int, p: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Matrix PCA of one group's weights for projection type `p`: atoms (B', out, in), coefficients (L, B'),
    eigenvalues; B' < `n_atoms` when the stacked weights have a lower numerical rank."""
    stacked = torch.stack([ctx.weight(layer, p) for layer in layers])  # (L, out, in)
    if ctx.settings.atoms == "whitened":
        autocorrs = [ctx.autocorr(layer, p).to(ctx.compute_device) for layer in layers]
        group_factor = whitening_factor(torch.stack(autocorrs).sum(dim=0))
        d, _, eigenvalues = whitened_matrix_pca(stacked, group_factor.S, n_atoms)
        return d, refit_coefficients(stacked, d, autocorrs), eigenvalues
    return matrix_pca(stacked, n_atoms)


def _group_atoms(
    ctx: MethodContext, plan: CompressionPlan
) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """Matrix PCA per shared group and projection type: {(group, proj): (atoms (B,out,in), coeffs (L,B))}."""
    start = time.perf_counter()
    atoms: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    energy = []
    shared = [g for g in plan.groups if g.n_atoms > 0]
    with progress_bar("Matrix PCA", total=len(shared) * len(ctx.projections), enabled=ctx.progress) as bar:
        for group in shared:
            for p in ctx.projections:
                d, c, eigenvalues = group_atoms(ctx, group.layers, group.n_atoms, p)
                atoms[(group.index, p)] = (d, c)
                # PCA returns fewer atoms when the group's weights have a lower numerical rank.
                for layer in group.layers:
                    plan.get(layer, p).n_atoms = d.shape[0]
                energy.append(
                    {
                        "group": group.index,
                        "projection": p,
                        "layers": len(group.layers),
                        "atoms": group.n_atoms,
                        "energy_captured": captured_energy_fraction(eigenvalues, group.n_atoms),
                    }
                )
                bar.advance()
    ctx.report["atom_energy"] = energy
    ctx.seconds["pca"] = time.perf_counter() - start
    return atoms


def _residual(ctx: MethodContext, plan: CompressionPlan, atoms, layer: int, p: str) -> torch.Tensor:
    pp = plan.get(layer, p)
    w = ctx.weight(layer, p)
    if pp.mode != "shared":
        return w
    d, c = atoms[(pp.group, p)]
    return w - shared_part(d, c, plan.groups[pp.group].layers.index(layer))


def shared_part(atoms: torch.Tensor, coefficients: torch.Tensor, row: int) -> torch.Tensor:
    """Σ_s c_(row, s) D_s: what the atoms reconstruct of the group's `row`-th layer."""
    return torch.einsum("s,soi->oi", coefficients[row], atoms)


def residual_tail(ctx: MethodContext, layer: int, p: str, residual: torch.Tensor) -> torch.Tensor:
    """Discarded whitened energy of the residual at every rank (`tail[r]`), on the CPU."""
    with numerical_context(f"layer {layer} {p}"):
        _, sigma, _ = whitened_svd(residual, ctx.whitening(layer, p).S)
    return discarded_energy(sigma).cpu()


def _allocate_paper(ctx: MethodContext, plan: CompressionPlan, tails: dict) -> None:
    """Algorithm 1: the residual budget spread evenly over compressed layers, split per layer between
    (Q,K) and (V,O) in proportion to their dense sizes, then balanced within each pair."""
    layers = sorted({pp.layer for pp in plan.projections if pp.mode != "dense"})
    if not layers:
        return
    geometry = plan.geometry
    size = {p: math.prod(geometry.shape(p)) for p in plan.targets}
    layer_budget = plan.residual_budget() // len(layers)
    qk_budget = layer_budget * (size["q_proj"] + size["k_proj"]) // layer_dense_params(geometry)
    pair_budgets = {("q_proj", "k_proj"): qk_budget, ("o_proj", "v_proj"): layer_budget - qk_budget}
    splits = []
    for layer in layers:
        for (a, b), budget in pair_budgets.items():
            split = balance_pair_paper(
                tails[(layer, a)], tails[(layer, b)], geometry.shape(a), geometry.shape(b), budget
            )
            plan.get(layer, a).rank, plan.get(layer, b).rank = split.rank_a, split.rank_b
            splits.append(
                {
                    "layer": layer,
                    "pair": [a, b],
                    "ranks": [split.rank_a, split.rank_b],
                    "initial": list(split.initial),
                    "error": split.error,
                }
            )
    ctx.report["algorithm1"] = splits


def _allocate_global(ctx: MethodContext, plan: CompressionPlan, tails: dict) -> None:
    """Ranks across all residuals by discarded energy per parameter under the one residual budget.

    `global-relative` divides each matrix's tail by the output energy of its original weight
    (‖W S‖²), so that errors of projections read from different inputs (V vs O) share one scale.
    """
    keys = [(pp.layer, pp.projection) for pp in plan.projections if pp.mode != "dense"]
    names = {f"{layer}.{p}": (layer, p) for layer, p in keys}
    scale = {k: 1.0 for k in keys}
    if ctx.settings.allocation == "global-relative":
        for layer, p in keys:
            # An all-zero weight has no output energy and nothing to approximate (its tail is all zeros): it
            # keeps scale 1 rather than 0/0, and the allocation gives it rank 0.
            scale[(layer, p)] = ctx.output_energy(layer, p) or 1.0
    scaled = {n: tails[k] / scale[k] for n, k in names.items()}
    shapes = {n: plan.geometry.shape(k[1]) for n, k in names.items()}
    if not ctx.settings.dense_when_cheaper:
        ranks, dense = allocate_global(scaled, shapes, plan.residual_budget()), set()
    else:
        # Keeping a projection whole costs its weight and gives back its coefficients, within the residual budget.
        dense_costs = {n: plan.get(*k).dense_params - plan.get(*k).n_atoms for n, k in names.items()}
        ranks, dense = allocate_global_with_dense(scaled, shapes, plan.residual_budget(), dense_costs)
    for n, k in names.items():
        pp = plan.get(*k)
        if n in dense:
            pp.mode, pp.n_atoms, pp.rank = "dense", 0, None
        else:
            pp.rank = ranks[n]
    if dense:
        ctx.report["kept_whole_by_allocation"] = sorted(names[n] for n in dense)


def _install_projection(
    ctx: MethodContext,
    plan: CompressionPlan,
    atoms,
    shared_atoms,
    layer: int,
    p: str,
    factor: WhiteningFactor,
) -> None:
    """Residual factors at the allocated rank under `factor`'s whitening, installed as the projection."""
    dtype, device = ctx.model_dtype, ctx.model_device
    pp = plan.get(layer, p)
    with numerical_context(f"layer {layer} {p}"):
        u, sigma, vh = whitened_svd(_residual(ctx, plan, atoms, layer, p), factor.S)
        a, b = low_rank_factors(u, sigma, vh, factor.S, pp.rank)
    bias = ctx.bias(layer, p)
    if pp.mode == "shared":
        module = SharedBasisLinear(
            shared_atoms[(pp.group, p)], pp.rank, bias=bias is not None, dtype=dtype, device=device
        )
        d, c = atoms[(pp.group, p)]
        module.coefficients.data.copy_(c[plan.groups[pp.group].layers.index(layer)])
        module.lowrank_a.data.copy_(a)
        module.lowrank_b.data.copy_(b)
        if bias is not None:
            module.bias.data.copy_(bias)
    else:
        module = LowRankLinear.from_factors(a, b, bias, dtype=dtype, device=device)
    ctx.install(layer, p, module)


def masa_plan(ctx: MethodContext, groups: list[list[int]], bases: int, largest_group_bases: int | None):
    """The MASA layout of a grouping under the budget (ranks not yet allocated)."""
    return shared_plan(
        ctx.settings.method,
        ctx.ratio,
        ctx.attention_params_before(),
        ctx.adapter.geometry,
        groups,
        bases,
        largest_group_bases,
        ctx.biases(),
        compress_singletons=ctx.settings.singletons == "compress",
        projections_compressed=ctx.projections,
    )


def allocate_ranks(ctx: MethodContext, plan: CompressionPlan, tails: dict) -> None:
    (_allocate_paper if ctx.settings.allocation == "paper" else _allocate_global)(ctx, plan, tails)


def compress_masa(ctx: MethodContext) -> CompressionPlan:
    if ctx.settings.auto_groups:
        from compressor.shape_search import choose_groups_and_bases

        choice = choose_groups_and_bases(ctx)
        ctx.settings = ctx.settings.model_copy(
            update={"groups": choice.groups, "bases": choice.bases, "largest_group_bases": None}
        )
        ctx.report["effective_settings"] = ctx.settings.model_dump()
    s = ctx.settings
    grouping = ctx.grouping(s.groups)
    plan = masa_plan(ctx, grouping.groups, s.bases, s.largest_group_bases)
    atoms = _group_atoms(ctx, plan)
    targets = [(pp.layer, pp.projection) for pp in plan.projections if pp.mode != "dense"]

    # Pass 1: discarded-energy tails of every whitened residual (only the spectra are kept, so memory
    # does not grow with depth); pass 2 recomputes the SVD of each residual at its allocated rank.
    start = time.perf_counter()
    tails = {}
    with progress_bar("Residual spectra", total=len(targets), enabled=ctx.progress) as bar:
        for layer, p in targets:
            tails[(layer, p)] = residual_tail(ctx, layer, p, _residual(ctx, plan, atoms, layer, p))
            bar.advance()
    allocate_ranks(ctx, plan, tails)
    plan.check_budget()
    targets = [k for k in targets if plan.get(*k).mode != "dense"]  # the allocation may keep some whole
    # The whitened output error left by the residuals (Eckart–Young tails): the allocation's objective.
    ctx.report["residual_error"] = float(sum(tails[k][plan.get(*k).rank] for k in targets))
    ctx.seconds["residual_svd"] = time.perf_counter() - start

    start = time.perf_counter()
    dtype, device = ctx.model_dtype, ctx.model_device
    shared_atoms = {
        key: nn.Parameter(d.to(device=device, dtype=dtype).contiguous(), requires_grad=False)
        for key, (d, _) in atoms.items()
    }
    if s.statistics == "sequential":
        from compressor.sequential import install_sequentially

        install_sequentially(ctx, plan, targets, lambda layer, p, f: _install_projection(
            ctx, plan, atoms, shared_atoms, layer, p, f))  # fmt: skip
    else:
        with progress_bar("Residual factors", total=len(targets), enabled=ctx.progress) as bar:
            for layer, p in targets:
                _install_projection(ctx, plan, atoms, shared_atoms, layer, p, ctx.whitening(layer, p))
                bar.advance()
    ctx.seconds["residual_svd"] += time.perf_counter() - start
    return plan


# ------------------------------------------------------------------------------------------------------
# Baselines


def _compress_lowrank(ctx: MethodContext, whitened: bool) -> CompressionPlan:
    plan = lowrank_plan(
        ctx.settings.method,
        ctx.ratio,
        ctx.attention_params_before(),
        ctx.adapter.geometry,
        ctx.adapter.num_layers,
        ctx.biases(),
        ctx.projections,
    )
    start = time.perf_counter()
    dtype, device = ctx.model_dtype, ctx.model_device
    with progress_bar(
        "SVD" + (" (whitened)" if whitened else ""), total=len(plan.projections), enabled=ctx.progress
    ) as bar:
        for pp in plan.projections:
            w = ctx.weight(pp.layer, pp.projection)
            with numerical_context(f"layer {pp.layer} {pp.projection}"):
                if whitened:
                    factor = ctx.whitening(pp.layer, pp.projection)
                    u, sigma, vh = whitened_svd(w, factor.S)
                    a, b = low_rank_factors(u, sigma, vh, factor.S, pp.rank)
                else:
                    a, b = plain_svd_factors(w, pp.rank)
            ctx.install(
                pp.layer,
                pp.projection,
                LowRankLinear.from_factors(a, b, ctx.bias(pp.layer, pp.projection), dtype, device),
            )
            bar.advance()
    ctx.seconds["residual_svd"] = time.perf_counter() - start
    return plan


def compress_svd_llm(ctx: MethodContext) -> CompressionPlan:
    return _compress_lowrank(ctx, whitened=True)


def compress_plain_svd(ctx: MethodContext) -> CompressionPlan:
    return _compress_lowrank(ctx, whitened=False)


def compress_shared_mean(ctx: MethodContext) -> CompressionPlan:
    """One mean weight per group (coefficient 1), no residual; the most groups the budget holds."""
    n_layers = ctx.adapter.num_layers
    before = ctx.attention_params_before()
    geometry = ctx.adapter.geometry
    biases = ctx.biases()

    def plan_for(n_groups: int) -> CompressionPlan:
        grouping = ctx.grouping(n_groups)
        plan = shared_plan(
            ctx.settings.method, ctx.ratio, before, geometry, grouping.groups, 1, None, biases,
            projections_compressed=ctx.projections,
        )  # fmt: skip
        for pp in plan.projections:
            if pp.mode == "shared":
                pp.rank = 0
        return plan

    plan = None
    for n_groups in range(n_layers, 0, -1):
        try:
            candidate = plan_for(n_groups)
        except UserError:
            continue
        if candidate.attention_params_after() <= candidate.budget:
            plan = candidate
            break
    if plan is None:
        raise UserError(
            f"--ratio {ctx.ratio:g} is infeasible for shared-mean: even one group exceeds the budget"
        )
    start = time.perf_counter()
    dtype, device = ctx.model_dtype, ctx.model_device
    for group in plan.groups:
        if group.singleton:
            continue
        for p in ctx.projections:
            mean = torch.stack([ctx.weight(layer, p) for layer in group.layers]).mean(dim=0)
            atoms = nn.Parameter(mean[None].to(device=device, dtype=dtype).contiguous(), requires_grad=False)
            for layer in group.layers:
                bias = ctx.bias(layer, p)
                module = SharedBasisLinear(atoms, 0, bias=bias is not None, dtype=dtype, device=device)
                module.coefficients.data.fill_(1.0)
                if bias is not None:
                    module.bias.data.copy_(bias)
                ctx.install(layer, p, module)
    ctx.seconds["pca"] = time.perf_counter() - start
    return plan


METHOD_FUNCTIONS: dict[str, Callable[[MethodContext], CompressionPlan]] = {
    "masa": compress_masa,
    "masa-paper": compress_masa,
    "svd-llm": compress_svd_llm,
    "svd": compress_plain_svd,
    "shared-mean": compress_shared_mean,
}


def check_targets(settings: CompressionSettings) -> None:
    """Refuse, before any heavy work, the settings that have no rule for MLP projections."""
    if "mlp" not in settings.targets:
        return
    if settings.method == "masa-paper" or settings.allocation == "paper":
        raise UserError(
            "--targets mlp: Algorithm 1 (--allocation paper, --method masa-paper) balances (Q,K) and (V,O) pairs "
            "and has no rule for MLP projections: use --method masa with --allocation global-relative"
        )
    if settings.statistics == "sequential" and settings.method.startswith("masa"):
        raise UserError(
            "--targets mlp: --statistics sequential collects attention inputs only: use --statistics original"
        )


@torch.no_grad()
def compress_model(
    model: nn.Module,
    adapter: DecoderAdapter,
    stats: CalibrationStats,
    settings: CompressionSettings,
    ratio: float,
    progress: bool = True,
    compute_device: torch.device | None = None,
    windows: torch.Tensor | None = None,
) -> CompressionOutcome:
    """Replace the attention projections of `model` in place; return the exact plan and a report."""
    if settings.method not in METHOD_FUNCTIONS:
        raise UserError(f"unknown method '{settings.method}': use one of {', '.join(METHODS)}")
    if not 0.0 < ratio < 1.0:
        raise UserError(
            f"--ratio {ratio:g} is outside (0, 1): it is the fraction of attention parameters removed"
        )
    device = compute_device or next(model.parameters()).device
    if settings.method == "masa-paper":
        # The paper's training-free path, whatever the recipe's improved defaults are.
        settings = settings.model_copy(update=PAPER_SETTINGS)
    check_targets(settings)
    projections = target_projections(settings.targets)
    if set(projections) & set(MLP_PROJECTIONS):
        if not stats.has_mlp:
            raise ValueError(
                "--targets mlp needs the MLP inputs' statistics: collect_statistics(..., mlp=True)"
            )
    if settings.statistics == "sequential" and windows is None:
        raise ValueError("sequential statistics need the calibration windows: pass `windows`")
    ctx = MethodContext(model, adapter, stats.to(device), settings, ratio, device, progress, windows)
    ctx.report["effective_settings"] = settings.model_dump()
    plan = METHOD_FUNCTIONS[settings.method](ctx)
    plan.check_budget()
    counted = adapter.attention_parameter_count(projections)
    if counted != plan.attention_params_after():
        raise AssertionError(
            f"installed modules store {counted} numbers, the plan says {plan.attention_params_after()}"
        )
    return CompressionOutcome(plan=plan, seconds=ctx.seconds, report=ctx.report)
