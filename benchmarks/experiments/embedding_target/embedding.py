"""A low-rank token embedding `E ≈ A B` (`A (V, r)`, `B (r, d)`), whitened by what the model reads and writes
through it: the measurement behind `--targets embed` (not built: see docs/method.md, "The embedding").

A token embedding `E (V, d)` is used twice (once when tied): row `E_v` is the input vector of token v, and
`E h_t` are the logits at the final hidden state `h_t`. An error `ΔE` raises the next-token loss by about

    ½ Σ_t Σ_v p_tv (ΔE_v h_t)²       (output: the loss's Hessian in the logits is diag(p) − p pᵀ ⪯ diag(p))
  + ½ Σ_t ḡ² ‖ΔE_{x_t}‖²            (input: the isotropic Fisher at the embedding's output, as for a projection)

and with `Σ_t p_tv h_t h_tᵀ ≈ c_v · H` (c_v: how often token v occurs, H = Σ_t h_t h_tᵀ / T) both terms are
`½ Σ_v c_v ΔE_v M ΔE_vᵀ` with `M = H + ḡ² I`: a norm weighted on both sides, whose best rank-r approximation is
an SVD (`weighted_low_rank`). Tokens never seen in calibration get `pseudo_count` occurrences, so their rows are
not left to chance.
"""

from __future__ import annotations

import torch

from compressor.math.whitening import low_rank_factors, whitened_svd, whitening_factor
from compressor.runtime.progress import note


def token_row_weights(counts: torch.Tensor, pseudo_count: float) -> torch.Tensor:
    """Per token, its share of the calibration tokens with `pseudo_count` added to every count (fp64, sums to
    1): the row weights of the embedding's error."""
    if pseudo_count <= 0:
        raise ValueError(
            f"pseudo_count must be positive (a token never seen still occurs), got {pseudo_count}"
        )
    smoothed = counts.to(torch.float64) + pseudo_count
    return smoothed / smoothed.sum()


def weighted_low_rank(
    weight: torch.Tensor, row_weights: torch.Tensor, metric: torch.Tensor, rank: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`A (V, r)`, `B (r, d)` minimizing `Σ_v w_v ‖(E − A B)_v M^½‖²`, and the error at every rank.

    With `M = L Lᵀ` (damped Cholesky, `whitening_factor`) and `D = diag(√w)`, the error is `‖D (E − A B) L‖²`, so
    the best rank r is `D⁻¹ [D E L]_r L⁻¹` (Eckart–Young on `D E L`); `tail[k]` is its error at rank k, the sum
    of the squared singular values after the k-th."""
    if row_weights.shape != (weight.shape[0],) or metric.shape != (weight.shape[1], weight.shape[1]):
        raise ValueError(
            f"weighted_low_rank expects E (V, d), w (V,), M (d, d); got {tuple(weight.shape)}, "
            f"{tuple(row_weights.shape)}, {tuple(metric.shape)}"
        )
    if not bool((row_weights > 0).all()):
        raise ValueError("every row weight must be positive (smooth the token counts: token_row_weights)")
    root = row_weights.to(torch.float64).sqrt().unsqueeze(1)
    whitening = whitening_factor(metric)
    if whitening.damping:  # reported, never silent: M was not positive definite to working precision
        note(f"the embedding's metric M was damped by {whitening.damping:.3g} (attempt {whitening.attempts})")
    factor = whitening.S
    u, sigma, vh = whitened_svd(root * weight.to(torch.float64), factor)
    a, b = low_rank_factors(u, sigma, vh, factor, rank)
    energy = sigma.square()
    tail = torch.cat([energy.flip(0).cumsum(0).flip(0), energy.new_zeros(1)])
    return a / root, b, tail


def factored_params(vocab: int, width: int, rank: int) -> int:
    """Numbers in `A (V, r)` and `B (r, d)`; fewer than `V d` only below `V d / (V + d)`."""
    return rank * (vocab + width)
