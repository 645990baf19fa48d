"""The attention in `heads` form (`--attention heads`, part of `--native`): every layer keeps a number of query
heads per KV head, their q rows unchanged, k/v whole, and o_proj refit by least squares on the calibration
statistics (`compressor.math.heads`), so the attention stays a plain one with fewer heads: the form engines run
(llama.cpp's `deci` layout takes a head count per layer).

Per layer the heads are put in one greedy order and the output error at every count is exact for it
(`heads.head_tail`); that tail, weighted by the loss sensitivity at o_proj's output, is one unit of the global
allocation (a step: one more query head in every KV group), beside the MLP's neurons.
"""

from __future__ import annotations

import torch

from compressor.math.accounting import HEADS_READER, HEADS_ROWS, CompressionPlan
from compressor.math.heads import HeadTail, head_columns, head_tail, refit_o
from compressor.methods.base import MethodContext, numerical_context
from compressor.methods.masa.mlp import install_rows, plain_linear
from compressor.runtime.progress import progress_bar


def head_tails(ctx: MethodContext, layers: list[int]) -> dict[int, HeadTail]:
    """Per layer, its heads in greedy order and the output error at every heads-per-group count (damping
    reported)."""
    geometry = ctx.shape.geometry
    tails = {}
    with progress_bar("Attention head orders", total=len(layers), enabled=ctx.progress) as bar:
        for layer in layers:
            with numerical_context(f"layer {layer} attention heads"):
                found = head_tail(
                    ctx.autocorr(layer, HEADS_READER).cpu(),
                    ctx.weight(layer, HEADS_READER).cpu(),
                    geometry.num_kv_heads,
                    geometry.head_dim,
                )
            if found.damping:  # reported like a whitening's: the refit is then approximate
                ctx.report.setdefault("damping", []).append(
                    {"layer": layer, "input": "o (head selection)", "damping": found.damping}
                )
            tails[layer] = found
            bar.advance()
    return tails


def tails_for_allocation(heads: dict[int, HeadTail]) -> dict[tuple[int, str], torch.Tensor]:
    """The allocation's tails of the heads units: each layer's error at o_proj's output, from one head per group."""
    return {(layer, HEADS_READER): found.tail for layer, found in heads.items()}


def install_heads(ctx: MethodContext, plan: CompressionPlan, layer: int, found: HeadTail) -> None:
    """The layer's attention at its allocated heads per KV group: q keeps the kept heads' rows, o_proj is refit."""
    per_group = plan.get(layer, HEADS_READER).rank
    head_dim = ctx.shape.geometry.head_dim
    kept = found.kept(per_group)
    rows = head_columns(kept, head_dim)
    plan.kept_inputs[(layer, HEADS_READER)] = rows.tolist()  # o's columns are q's rows
    dtype, device = ctx.model_dtype, ctx.model_device
    install_rows(ctx, layer, HEADS_ROWS, rows)
    with numerical_context(f"layer {layer} attention heads"):
        refit = refit_o(
            ctx.autocorr(layer, HEADS_READER).cpu(), ctx.weight(layer, HEADS_READER).cpu(), kept, head_dim,
            found.damping,
        )  # fmt: skip
    o_bias = ctx.bias(layer, HEADS_READER)
    ctx.install(
        layer, HEADS_READER, plain_linear(refit, None if o_bias is None else o_bias.cpu(), dtype, device)
    )
