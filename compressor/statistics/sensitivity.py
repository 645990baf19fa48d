"""Loss sensitivity of each projection's output, from one backward pass over calibration windows (no weight
is updated): what `--allocation global-loss` weighs each matrix's whitened error by.

A projection's output error e_t = (W − Ŵ) x_t raises the calibration loss by about ½ Σ_t e_tᵀ F_t e_t, F_t the
(empirical) Fisher of the loss at that output, g_t g_tᵀ with g_t = ∂L/∂y_t. Taking F_t as isotropic on average,
ḡ² · I with ḡ² = mean_t ‖g_t‖² / d_out, the rise is ½ ḡ² Σ_t ‖e_t‖² = ½ T ḡ² ‖(W − Ŵ) S‖² over T tokens: the
whitened error the tails already measure (S Sᵀ = Σ_t x_t x_tᵀ / T, the token mean `capture` stores), times one
number per matrix (T is the same for every matrix, so it changes no choice). So the allocation compares a unit of
error in k_proj with one in down_proj by what it costs the loss, where `global-relative` compares them by their
share of each matrix's own output energy.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from compressor.modeling.adapters import DecoderAdapter
from compressor.runtime.device import add_in_float64, float64_zeros, statistics_device
from compressor.runtime.errors import NumericalError
from compressor.runtime.progress import progress_bar


@dataclass(frozen=True)
class Sensitivity:
    """Per (layer, projection), mean over calibration tokens of ‖∂L/∂y_t‖² / d_out (L: the summed next-token
    cross-entropy), fp64; and how it was measured."""

    weights: dict[tuple[int, str], float]
    tokens: int
    windows: int
    seconds: float

    def __getitem__(self, key: tuple[int, str]) -> float:
        return self.weights[key]


def squared_norm(grad: torch.Tensor) -> torch.Tensor:
    """‖grad‖² as a 0-d tensor where `grad` lives: in fp64 where the device has it, else (MPS) in fp32, the
    sum of one batch's squares, which the fp64 accumulator then adds (`device.add_in_float64`)."""
    wide = grad.double() if statistics_device(grad.device) == grad.device else grad.float()
    return wide.pow(2).sum()


def collect_sensitivity(
    model: nn.Module,
    adapter: DecoderAdapter,
    windows: torch.Tensor,
    projections: tuple[str, ...],
    batch_size: int = 1,
    progress: bool = True,
) -> Sensitivity:
    """Forward and backward over the windows (N, T) with hooks at every listed projection's output; the
    gradients reach the activations only (the parameters' `requires_grad` is off for the pass, then restored)."""
    device = next(model.parameters()).device
    start = time.perf_counter()
    sums = {
        (layer, p): float64_zeros(device=device) for layer in range(adapter.num_layers) for p in projections
    }

    def output_hook(key):
        def on_gradient(grad: torch.Tensor) -> None:
            add_in_float64(sums[key], squared_norm(grad.detach()))

        def on_output(module, args, output):
            output.register_hook(on_gradient)

        return on_output

    def embeddings_require_grad(module, args, output):
        # With every parameter frozen nothing downstream would have a graph: start it at the embeddings.
        return output.detach().requires_grad_(True)

    frozen = [(p, p.requires_grad) for p in model.parameters()]
    handles = [model.get_input_embeddings().register_forward_hook(embeddings_require_grad)]
    handles += [adapter.projection(*key).register_forward_hook(output_hook(key)) for key in sums]
    was_training = model.training
    try:
        for p, _ in frozen:
            p.requires_grad_(False)
        model.eval()
        n = windows.shape[0]
        with torch.enable_grad(), progress_bar("Loss sensitivity", total=n, enabled=progress) as bar:
            for first in range(0, n, batch_size):
                batch = windows[first : first + batch_size].to(device)
                logits = model(input_ids=batch, use_cache=False).logits
                loss = F.cross_entropy(
                    logits[:, :-1].flatten(0, 1).float(), batch[:, 1:].flatten(), reduction="sum"
                )
                loss.backward()
                bar.advance(len(batch))
    finally:
        for handle in handles:
            handle.remove()
        for p, flag in frozen:
            p.requires_grad_(flag)
        model.train(was_training)
    tokens = int(windows.numel())
    weights = {}
    for (layer, p), total in sums.items():
        value = float(total) / (tokens * adapter.projection(layer, p).weight.shape[0])
        if not math.isfinite(value):
            raise NumericalError(f"non-finite loss gradient at the output of layer {layer} {p}")
        weights[(layer, p)] = value
    return Sensitivity(weights, tokens, windows.shape[0], time.perf_counter() - start)
