"""The MLP in `neurons` form (`--mlp neurons`, the default whenever the targets hold the MLP): every layer keeps
a subset of its intermediate neurons, their gate/up rows unchanged and down_proj refit by least squares on the
calibration statistics (`compressor.math.neurons`), so the MLP stays a plain one, only narrower.

Per layer the neurons are put in one order (`--neuron-order`), and the output error at every width is exact for that
order (`neurons.order_tail`); that tail, weighted by the loss sensitivity at down_proj's output, is one unit of
the global allocation (`GlobalAllocator`: a step is one more neuron, costing its gate and up rows and its down
column), so the same objective decides each layer's width and the split of the budget between attention and MLP.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from compressor.math.accounting import NEURON_READER, CompressionPlan
from compressor.math.neurons import NeuronTail, neuron_order, order_tail, refit_down
from compressor.methods.base import MethodContext, numerical_context
from compressor.runtime.progress import progress_bar

#: The ridge of the refit (`neurons.regularized`): none, chosen on the bundled model's validation split with the
#: order (`settings.neuron_order`): a ridge of 0.01 or 0.1 of mean(diag C) was a tie for the `energy` order and
#: worse for `greedy` (`benchmarks/experiments/neuron_selection/run.py`, BENCHMARKS.md).
RIDGE = 0.0
#: The projections of a layer's MLP, the one reading the neurons last.
GATED = ("gate_proj", "up_proj")


def neuron_layers(plan: CompressionPlan) -> list[int]:
    """The layers whose MLP the plan keeps in `neurons` mode."""
    return sorted({pp.layer for pp in plan.projections if pp.mode == "neurons"})


def neuron_tails(ctx: MethodContext, layers: list[int]) -> dict[int, NeuronTail]:
    """Per layer, its neurons in the settings' order and the output error at every width (damping reported), on
    the CPU."""
    tails, start = {}, time.perf_counter()
    with progress_bar("MLP neuron orders", total=len(layers), enabled=ctx.progress) as bar:
        for layer in layers:
            autocorr = ctx.autocorr(layer, NEURON_READER).to(ctx.compute_device)
            down = ctx.weight(layer, NEURON_READER)
            with numerical_context(f"layer {layer} MLP neurons"):
                order = neuron_order(ctx.settings.neuron_order, autocorr, down, RIDGE)
                found = order_tail(autocorr, down, order, RIDGE)
            ctx.record_damping(found, layer=layer, input="down (neuron selection)")
            tails[layer] = NeuronTail(found.order.cpu(), found.tail.cpu(), found.damping, found.attempts)
            bar.advance()
    if layers:
        ctx.seconds["neuron_selection"] = (
            ctx.seconds.get("neuron_selection", 0.0) + time.perf_counter() - start
        )
    return tails


def tails_for_allocation(neurons: dict[int, NeuronTail]) -> dict[tuple[int, str], torch.Tensor]:
    """The allocation's tails of the neuron units: each layer's error, measured at down_proj's output."""
    return {(layer, NEURON_READER): found.tail for layer, found in neurons.items()}


def install_neurons(ctx: MethodContext, plan: CompressionPlan, layer: int, neurons: NeuronTail) -> None:
    """The layer's MLP at its allocated width: gate/up keep the rows of the kept neurons, down_proj is refit."""
    width = plan.get(layer, NEURON_READER).rank
    kept = neurons.kept(width)
    plan.kept_inputs[(layer, NEURON_READER)] = kept.tolist()
    dtype, device = ctx.model_dtype, ctx.model_device
    for p in GATED:
        install_rows(ctx, layer, p, kept)
    with numerical_context(f"layer {layer} MLP neurons"):
        refit = refit_down(ctx.autocorr(layer, NEURON_READER).to(ctx.compute_device), ctx.weight(layer, NEURON_READER),
                           NeuronTail(neurons.order.to(ctx.compute_device), neurons.tail, neurons.damping,
                                      neurons.attempts), width, RIDGE)  # fmt: skip
    ctx.install(layer, NEURON_READER, plain_linear(refit, ctx.bias(layer, NEURON_READER), dtype, device))


def install_rows(ctx: MethodContext, layer: int, projection: str, rows: torch.Tensor) -> None:
    """`projection` keeping only `rows` of its weight and bias (a kept head's q rows, a kept neuron's gate/up),
    indexed where each lives (the weight on the compute device, the bias on the model's)."""
    weight, bias = ctx.weight(layer, projection), ctx.bias(layer, projection)
    kept_bias = None if bias is None else bias[rows.to(bias.device)]
    ctx.install(
        layer,
        projection,
        plain_linear(weight[rows.to(weight.device)], kept_bias, ctx.model_dtype, ctx.model_device),
    )


def plain_linear(weight: torch.Tensor, bias: torch.Tensor | None, dtype, device) -> nn.Linear:
    """A plain nn.Linear holding `weight` (out, in) and `bias`, in the model's dtype and device."""
    out_features, in_features = weight.shape
    module = nn.Linear(in_features, out_features, bias=bias is not None, dtype=dtype, device=device)
    with torch.no_grad():
        module.weight.copy_(weight)
        if bias is not None:
            module.bias.copy_(bias)
    return module
