"""MoDeGPT (Lin et al., ICLR 2025) as a peer: each module of a layer decomposed by its own rule
(`compressor.math.modular`), every layer at the sparsity its block influence gives, nothing shared.

- key–query: the dimensions of the best rotary pairs kept in q and k (CR decomposition), the same ones for the
  query heads of a KV group; stored as the kept rows (`rows` mode), the others zero;
- value–output: each KV group's value head reduced to a rank by a whitened SVD in the output metric of its query
  heads' o_proj columns (`rows` mode for v, `columns` mode for o, which reads only those value dimensions);
- the MLP: the neurons of largest ridge leverage, down_proj refit by least squares (Nyström; `neurons` mode);
- per layer the removed fraction `φ = L φ̄ softmax(−s / ε)` over the layers' block influences `s`, capped at
  `CAP`; within a layer the same fraction of every module; `φ̄` the least that meets the budget exactly.

Where the paper leaves a choice, or our models differ (each said in docs/method.md): grouped-query attention (the
paper's models have none: a KV group shares the kept key dimensions, scored over its query heads, and its value
rank, fitted to all of its heads' outputs); a value bias (Qwen2) is folded into o_proj's bias, exactly, since the
attention weights of a query sum to 1; the ridge of the leverage is `LEVERAGE_RIDGE · mean(diag C)`; the
smoothing `SMOOTHING` and the cap `CAP`.
"""

from __future__ import annotations

import copy
import math
import time

import torch

from compressor.math.accounting import NEURON_READER, CompressionPlan, ProjectionPlan
from compressor.math.modular import (
    kept_rotary_dims,
    layer_sparsities,
    rotary_pair_scores,
    row_energies,
    value_output_factors,
)
from compressor.math.neurons import leverage_order, order_tail
from compressor.methods.base import Method, MethodContext, numerical_context
from compressor.methods.masa.mlp import RIDGE, install_neurons
from compressor.modeling.adapters import MLP_PROJECTIONS
from compressor.modeling.remote_code.masa_modules import subset_linear
from compressor.runtime.errors import UserError
from compressor.runtime.progress import progress_bar

MODES = {"q_proj": "rows", "k_proj": "rows", "v_proj": "rows", "o_proj": "columns"} | {
    p: "neurons" for p in MLP_PROJECTIONS
}
#: The smoothing ε of the layers' softmax, and the most any layer loses (MoDeGPT's allocation).
SMOOTHING, CAP = 0.15, 0.8
#: The ridge of the leverage scores, relative to mean(diag C): without one every leverage is 1.
LEVERAGE_RIDGE = 1e-2
#: Calibration windows the block influence reads (one forward pass each).
INFLUENCE_WINDOWS = 8


def layer_sizes(shape, keep: float) -> dict[str, int]:
    """What one layer keeping the fraction `keep` of every module stores: rotary pairs per head, the value rank
    per KV group, neurons (each at least 1)."""
    g = shape.geometry
    return {
        "pairs": min(g.head_dim // 2, max(1, math.floor(keep * g.head_dim / 2))),
        "value_rank": min(g.head_dim, max(1, math.floor(keep * g.head_dim))),
        "neurons": min(g.intermediate_size, max(1, math.floor(keep * g.intermediate_size))),
    }


def _set_ranks(plan: CompressionPlan, shape, keeps: list[float]) -> None:
    g = shape.geometry
    for pp in plan.projections:
        sizes = layer_sizes(shape, keeps[pp.layer])
        pp.rank = {
            "q_proj": g.num_heads * 2 * sizes["pairs"],
            "k_proj": g.num_kv_heads * 2 * sizes["pairs"],
            "v_proj": g.num_kv_heads * sizes["value_rank"],
            "o_proj": g.num_heads * sizes["value_rank"],
        }.get(pp.projection, sizes["neurons"])


def fit_budget(plan: CompressionPlan, shape, influence: torch.Tensor | None) -> torch.Tensor:
    """Set every rank from the layers' sparsities at the least mean sparsity that meets the budget (uniform
    without `influence`); return the sparsities."""

    def sparsities(mean: float) -> torch.Tensor:
        if influence is None:
            return torch.full((shape.num_layers,), mean, dtype=torch.float64)
        return layer_sparsities(influence, mean, SMOOTHING, CAP)

    def fits(mean: float) -> bool:
        _set_ranks(plan, shape, (1.0 - sparsities(mean)).tolist())
        return plan.params_after() <= plan.budget

    if not fits(CAP):
        raise UserError(
            f"--ratio {plan.ratio:g} is infeasible for MoDeGPT: every layer losing {CAP:.0%} of every module "
            f"still stores {plan.params_after():,} of the {plan.budget:,} numbers allowed: use --ratio ≤ "
            f"{math.floor(1000 * plan.achieved_ratio()) / 1000:g}"
        )
    low, high = 0.0, CAP  # fits(high) holds
    for _ in range(60):
        middle = 0.5 * (low + high)
        low, high = (low, middle) if fits(middle) else (middle, high)
    fits(high)
    plan.check_budget()
    return sparsities(high)


class ModeGpt(Method):
    name = "modegpt"
    summary = "MoDeGPT: q/k dimensions, v/o ranks and MLP neurons per layer by block influence (peer)"

    def groups_rule(self, settings) -> str:
        return "no groups: every layer at the sparsity of its block influence"

    def reads_gate_input(self, settings) -> bool:
        return False  # gate/up keep their rows: the neurons are chosen on down_proj's input

    def largest_ratio(self, plan: CompressionPlan, shape) -> float:
        """Every layer at the cap: each module loses at most `CAP` of its dimensions (a copy's ranks are set)."""
        at_cap = copy.deepcopy(plan)
        _set_ranks(at_cap, shape, [1.0 - CAP] * shape.num_layers)
        return at_cap.achieved_ratio()

    def plan(self, shape, settings, ratio, groups_of=None, check_feasible: bool = True) -> CompressionPlan:
        """The layout, its ranks left to the run (they follow the block influence); `check_feasible`: refuse a
        ratio that even every layer at the cap cannot meet."""
        g = shape.geometry
        if g.head_dim % 2:
            raise UserError(f"--method modegpt keeps rotary pairs: a head dimension of {g.head_dim} is odd")
        projections = []
        for layer in range(shape.num_layers):
            for p in shape.targets:
                out, inp = g.shape(p)
                bias = shape.biases.get((layer, p), 0)
                if shape.biases.get((layer, "v_proj")) and p in ("v_proj", "o_proj"):
                    bias = out if p == "o_proj" else 0  # the value bias folded into o_proj's
                projections.append(ProjectionPlan(layer, p, out, inp, MODES[p], bias=bias))
        plan = CompressionPlan(self.name, ratio, shape.params_before, g, [], projections, shape.targets)
        if check_feasible:
            fit_budget(plan, shape, None)
            for pp in plan.projections:
                pp.rank = None
        return plan

    def apply(self, ctx: MethodContext) -> CompressionPlan:
        if ctx.windows is None:
            raise ValueError(
                "--method modegpt needs the calibration windows (block influence): pass `windows`"
            )
        influence, seconds = ctx.block_influence(ctx.windows[:INFLUENCE_WINDOWS])
        ctx.seconds["block_influence"] = seconds
        start = time.perf_counter()
        plan = self.plan(ctx.shape, ctx.settings, ctx.ratio, check_feasible=False)
        sparsity = fit_budget(plan, ctx.shape, influence)
        with progress_bar("MoDeGPT modules", total=ctx.shape.num_layers, enabled=ctx.progress) as bar:
            for layer in range(ctx.shape.num_layers):
                if "q_proj" in ctx.projections:
                    _install_query_key(ctx, plan, layer)
                    _install_value_output(ctx, plan, layer)
                if NEURON_READER in ctx.projections:
                    _install_mlp(ctx, plan, layer)
                ctx.finished([layer])
                bar.advance()
        ctx.report["modegpt"] = {
            "block_influence": influence.tolist(),
            "sparsity": sparsity.tolist(),
            "smoothing": SMOOTHING,
            "cap": CAP,
        }
        ctx.seconds["residual_svd"] = time.perf_counter() - start
        return plan


def _install_query_key(ctx: MethodContext, plan: CompressionPlan, layer: int) -> None:
    """q and k keep the dimensions of each KV group's best rotary pairs (the rows of every head of the group)."""
    g = ctx.shape.geometry
    autocorr = ctx.autocorr(layer, "q_proj").to(ctx.compute_device)
    wq, wk = ctx.weight(layer, "q_proj"), ctx.weight(layer, "k_proj")
    query = row_energies(wq, autocorr).view(g.num_heads, g.head_dim)
    key = row_energies(wk, autocorr).view(g.num_kv_heads, g.head_dim)
    per_group = g.num_heads // g.num_kv_heads
    pairs = plan.get(layer, "k_proj").rank // (2 * g.num_kv_heads)
    kept = [
        kept_rotary_dims(rotary_pair_scores(query[k * per_group : (k + 1) * per_group], key[k]), pairs).cpu()
        for k in range(g.num_kv_heads)
    ]
    key_rows = torch.cat([k * g.head_dim + dims for k, dims in enumerate(kept)])
    query_rows = torch.cat([h * g.head_dim + kept[h // per_group] for h in range(g.num_heads)])
    for projection, rows, weight in (("q_proj", query_rows, wq), ("k_proj", key_rows, wk)):
        bias = ctx.bias(layer, projection)
        kept_bias = None if bias is None else bias[rows.to(bias.device)]
        module = subset_linear("rows", weight[rows.to(weight.device)], rows, kept_bias, *weight.shape,
                               ctx.model_dtype, ctx.model_device)  # fmt: skip
        ctx.install(layer, projection, module)


def _install_value_output(ctx: MethodContext, plan: CompressionPlan, layer: int) -> None:
    """Each KV group's value head at its rank (`value_output_factors`), o_proj reading those dimensions."""
    g = ctx.shape.geometry
    rank = plan.get(layer, "v_proj").rank // g.num_kv_heads
    wv, wo = ctx.weight(layer, "v_proj"), ctx.weight(layer, "o_proj")
    value_bias = ctx.bias(layer, "v_proj")  # read before v_proj is replaced
    whitening = ctx.whitening(layer, "v_proj")
    per_group = g.num_heads // g.num_kv_heads
    values, outputs = [], [None] * g.num_heads
    for k in range(g.num_kv_heads):
        heads = range(k * per_group, (k + 1) * per_group)
        columns = [wo[:, h * g.head_dim : (h + 1) * g.head_dim] for h in heads]
        with numerical_context(f"layer {layer} value head {k}"):
            r, p, damping = value_output_factors(
                wv[k * g.head_dim : (k + 1) * g.head_dim], columns, whitening.S, rank
            )
        if damping:
            entry = {"layer": layer, "input": f"o_proj columns of KV head {k}", "damping": damping}
            ctx.report.setdefault("damping", []).append(entry)
        values.append(r)
        for h, o in zip(heads, columns, strict=True):
            outputs[h] = o @ p
    positions = torch.arange(rank)
    value_rows = torch.cat([k * g.head_dim + positions for k in range(g.num_kv_heads)])
    output_columns = torch.cat([h * g.head_dim + positions for h in range(g.num_heads)])
    dtype, device = ctx.model_dtype, ctx.model_device
    ctx.install(
        layer, "v_proj", subset_linear("rows", torch.cat(values), value_rows, None, *wv.shape, dtype, device)
    )
    bias = ctx.bias(layer, "o_proj")
    if value_bias is not None:  # Σ_t a_t (V x_t + b) = Σ_t a_t V x_t + b: b reaches o_proj whole
        expanded = (
            value_bias.to(wo).view(g.num_kv_heads, g.head_dim).repeat_interleave(per_group, dim=0).flatten()
        )
        folded = wo @ expanded
        bias = folded if bias is None else bias.to(folded) + folded
    ctx.install(layer, "o_proj", subset_linear("columns", torch.cat(outputs, dim=1), output_columns, bias, *wo.shape,
                                               dtype, device))  # fmt: skip


def _install_mlp(ctx: MethodContext, plan: CompressionPlan, layer: int) -> None:
    """The neurons of largest ridge leverage, gate/up keeping their rows, down_proj refit (Nyström): the default's
    installation (`masa.mlp.install_neurons`) of MoDeGPT's order."""
    autocorr = ctx.autocorr(layer, NEURON_READER).to(ctx.compute_device)
    with numerical_context(f"layer {layer} MLP neurons"):
        order = leverage_order(autocorr, LEVERAGE_RIDGE)
        neurons = order_tail(autocorr, ctx.weight(layer, NEURON_READER), order, RIDGE)
    ctx.record_damping(neurons, layer=layer, input="down (neuron selection)")
    install_neurons(ctx, plan, layer, neurons)
