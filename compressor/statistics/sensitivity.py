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
from compressor.runtime.device import add_in_float64, autocast_to, float64_zeros, statistics_device
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


class LossGradients:
    """Hooks adding ‖∂L/∂y_t‖² at every listed projection's output y over the windows `backward` is given (L the
    summed next-token cross-entropy); the gradients reach the activations only (every parameter's
    `requires_grad` is off inside the context, then restored). `collect_sensitivity` runs its own forward passes
    under it; `capture.collect_statistics` runs it on its first windows, so their forward pass is shared."""

    def __init__(self, model: nn.Module, adapter: DecoderAdapter, projections: tuple[str, ...]):
        self.model, self.adapter = model, adapter
        device = next(model.parameters()).device
        self.sums = {
            (layer, p): float64_zeros(device=device)
            for layer in range(adapter.num_layers)
            for p in projections
        }
        # Each output's width, read from the output itself: a compressed projection (factors, kept rows) need
        # not have a `weight` of its output's shape.
        self.widths: dict[tuple[int, str], int] = {}
        self.tokens = self.windows = 0
        self._handles: list = []
        self._frozen: list = []
        self._was_training = model.training

    def __enter__(self) -> LossGradients:
        def output_hook(key):
            def on_gradient(grad: torch.Tensor) -> None:
                add_in_float64(self.sums[key], squared_norm(grad.detach()))

            def on_output(module, args, output):
                self.widths[key] = output.shape[-1]
                output.register_hook(on_gradient)

            return on_output

        def embeddings_require_grad(module, args, output):
            # With every parameter frozen nothing downstream would have a graph: start it at the embeddings.
            return output.detach().requires_grad_(True)

        self._frozen = [(p, p.requires_grad) for p in self.model.parameters()]
        for p, _ in self._frozen:
            p.requires_grad_(False)
        self._handles = [self.model.get_input_embeddings().register_forward_hook(embeddings_require_grad)]
        self._handles += [
            self.adapter.projection(*key).register_forward_hook(output_hook(key)) for key in self.sums
        ]
        self._was_training = self.model.training
        self.model.eval()
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for p, flag in self._frozen:
            p.requires_grad_(flag)
        self.model.train(self._was_training)

    def backward(self, batch: torch.Tensor, logits: torch.Tensor) -> None:
        """The summed next-token loss of `batch` (B, T) from its `logits`, back to every hooked output."""
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), batch[:, 1:].flatten(), reduction="sum")
        loss.backward()
        self.tokens += int(batch.numel())
        self.windows += int(batch.shape[0])

    def result(self, seconds: float) -> Sensitivity:
        """Each projection's mean over the tokens of ‖∂L/∂y_t‖² / d_out."""
        weights = {}
        for (layer, p), total in self.sums.items():
            value = float(total) / (self.tokens * self.widths[(layer, p)])
            if not math.isfinite(value):
                raise NumericalError(f"non-finite loss gradient at the output of layer {layer} {p}")
            weights[(layer, p)] = value
        return Sensitivity(weights, self.tokens, self.windows, seconds)


def collect_sensitivity(
    model: nn.Module,
    adapter: DecoderAdapter,
    windows: torch.Tensor,
    projections: tuple[str, ...],
    batch_size: int = 1,
    progress: bool = True,
    autocast: torch.dtype | None = None,
) -> Sensitivity:
    """Forward and backward over the windows (N, T) with hooks at every listed projection's output
    (`LossGradients`); with `autocast`, computing in that dtype as the calibration did."""
    device = next(model.parameters()).device
    start = time.perf_counter()
    n = windows.shape[0]
    with (
        autocast_to(device, autocast),
        LossGradients(model, adapter, projections) as gradients,
        torch.enable_grad(),
        progress_bar("Loss sensitivity", total=n, enabled=progress) as bar,
    ):
        for first in range(0, n, batch_size):
            batch = windows[first : first + batch_size].to(device)
            gradients.backward(batch, model(input_ids=batch, use_cache=False).logits)
            bar.advance(len(batch))
    return gradients.result(time.perf_counter() - start)
