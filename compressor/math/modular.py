"""MoDeGPT's modular decompositions (Lin et al., ICLR 2025), as pure functions on weights and statistics.

- Key–query (the paper's type II, CR decomposition): a head's attention scores are `Σ_j q_j k_j`; keeping the
  dimensions j whose columns of `C_q^½` and `C_k^½` have the largest norm product keeps the largest terms. A
  column norm of `C^½` is `√C_jj`, so the score of dimension j needs only the diagonals of the query and key
  output autocorrelations, `(W C Wᵀ)_jj`. Under rotary embeddings dimension j rotates with its partner
  `j + head_dim/2`, so the two are kept or dropped together; under grouped-query attention a key head serves
  several query heads, so the kept dimensions are shared by the group, scored by the sum over its query heads.
- Value–output (type III, SVD): the heads of a KV group read one value head `V` (d_h × hidden); the group's
  output error `Σ_i ‖O_i (V − P R) X‖²` is minimized by a whitened SVD of `Lᵀ V` with `L Lᵀ = Σ_i O_iᵀ O_i`
  (the output metric: for one query head per KV head this is the paper's SVD of `C^½ W_V W_O`); `R` (r × hidden)
  becomes the value head, `O_i P` the head's output columns.
- The MLP (type I, Nyström) is `compressor.math.neurons`'s `leverage` order and least-squares refit.
- Global sparsity (the paper's §3.3): `φ = L · φ̄ · softmax(−s / ε)` over the layers' block influences `s`,
  each capped, the excess spread over the others.
"""

from __future__ import annotations

import torch

from compressor.math.whitening import low_rank_factors, whitened_svd, whitening_factor


def row_energies(weight: torch.Tensor, autocorr: torch.Tensor) -> torch.Tensor:
    """`(W C Wᵀ)_jj` for every output row j: the mean square of each output over the calibration tokens."""
    w = weight.to(torch.float64)
    return ((w @ autocorr.to(w)) * w).sum(dim=1)


def rotary_pair_scores(query_energy: torch.Tensor, key_energy: torch.Tensor) -> torch.Tensor:
    """Per rotary pair (j, j + d/2) of one KV group: `Σ_heads q_j k_j + q_j' k_j'` with q (heads, d) and k (d,)
    the output energies (the squared norm products of the paper's CR score, summed over the pair)."""
    half = key_energy.shape[0] // 2
    product = query_energy * key_energy.unsqueeze(0)
    return (product[:, :half] + product[:, half:]).sum(dim=0)


def kept_rotary_dims(scores: torch.Tensor, pairs: int) -> torch.Tensor:
    """The head dimensions kept when `pairs` rotary pairs of the best `scores` stay, in increasing order."""
    half = scores.shape[0]
    best = torch.sort(-scores, stable=True).indices[:pairs]
    return torch.sort(torch.cat([best, best + half])).values


def value_output_factors(
    value: torch.Tensor, outputs: list[torch.Tensor], S: torch.Tensor, rank: int
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """`(R, P, damping)`: the value head `V` (d_h, hidden) ≈ `P R`, R (rank, hidden), P (d_h, rank), minimizing
    `Σ_i ‖O_i (V − P R) S‖²` over the group's output columns `O_i` (hidden, d_h) with the input whitened by S.
    `damping`: what the Cholesky of the output metric needed (0: none)."""
    v = value.to(torch.float64)
    metric = sum(o.to(torch.float64).T @ o.to(torch.float64) for o in outputs)
    factor = whitening_factor(metric)
    lower = torch.eye(v.shape[0], dtype=v.dtype, device=v.device) if factor.input_is_zero else factor.S
    u, sigma, vh = whitened_svd(lower.T @ v, S)
    a, r = low_rank_factors(u, sigma, vh, S, rank)  # Lᵀ V S ≈ a r S
    p = torch.linalg.solve_triangular(lower.T, a, upper=True)  # P = L⁻ᵀ a
    return r, p, factor.damping


def layer_sparsities(
    influence: torch.Tensor, mean_sparsity: float, smoothing: float, cap: float
) -> torch.Tensor:
    """Per layer, the fraction removed: `L · φ̄ · softmax(−s / ε)` (a layer that changes its input least loses
    most), none above `cap`, what a capped layer could not take spread over the others by their weights."""
    if mean_sparsity > cap:
        raise ValueError(f"a mean sparsity of {mean_sparsity:g} exceeds the cap {cap:g} of every layer")
    weights = torch.softmax(-influence.to(torch.float64) / smoothing, dim=0)
    sparsity = weights * mean_sparsity * influence.numel()
    while (over := sparsity > cap + 1e-12).any():
        excess = float((sparsity[over] - cap).sum())
        sparsity[over] = cap
        free = sparsity < cap - 1e-12
        sparsity[free] += excess * weights[free] / weights[free].sum()
    return sparsity
