"""Matrix PCA (method.md, stage 3): a shared basis of weight matrices for a group of layers.

The `L` weights of one projection type in a group are stacked as columns of
`M = [vec(W_1), ..., vec(W_L)]` (`out·in × L`). The atoms are the top-`B` left singular vectors of
`M`, obtained through the small `L×L` Gram matrix `MᵀM = V Λ Vᵀ` (never `M Mᵀ`, which would be
`out·in × out·in`): `D = M V_B Λ_B^{-1/2}`, coefficients `c_l = Dᵀ vec(W_l)`.
"""

from __future__ import annotations

import torch

from compressor.runtime.errors import NumericalError, all_finite

# Eigen-directions of the Gram matrix with `λ ≤ RANK_RTOL · λ_max` are treated as numerically
# zero. Such a direction carries at most that fraction of the group's energy, and its atom
# `M v / sqrt(λ)` would be mostly amplified rounding error (the error in `M v` is ~eps·sqrt(λ_max),
# divided by sqrt(λ)), so it is not returned as an atom.
RANK_RTOL = 1e-10


def matrix_pca(weights: torch.Tensor, n_atoms: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Matrix PCA of the `L` weights of one projection type in a group.

    Args:
        weights: `(L, out, in)`, any float dtype, any device.
        n_atoms: `B`, the number of atoms wanted, `0 ≤ B ≤ L`.

    Returns:
        atoms `(B', out, in)` float64 with orthonormal vec'd atoms, coefficients `(L, B')` float64,
        and the Gram eigenvalues `(L,)` float64, descending, clamped at 0 (the energy captured by
        the top-`B` atoms is `eigenvalues[:B].sum() / eigenvalues.sum()`). All on the input's device.

        `B' = min(B, numerical rank)`: directions whose eigenvalue is at most
        `RANK_RTOL · λ_max` carry no energy and have no well-defined atom, so fewer atoms than asked
        are returned for a rank-deficient group (e.g. tied or all-zero weights). Callers must size
        their parameter accounting from `atoms.shape[0]`.

    The sign of each atom is fixed (its largest-magnitude entry is positive; the first one on
    ties) so that runs are reproducible. When eigenvalues are repeated, only the subspace they
    span is unique, not the individual atoms.

    Raises:
        ValueError: `weights` is not 3-D with `L ≥ 1`, or `n_atoms` is outside `[0, L]`.
        NumericalError: `weights` has non-finite entries.
    """
    if weights.ndim != 3 or weights.shape[0] < 1:
        raise ValueError(f"matrix_pca expects weights of shape (L>=1, out, in), got {tuple(weights.shape)}")
    n_layers, n_out, n_in = weights.shape
    if not 0 <= n_atoms <= n_layers:
        raise ValueError(f"n_atoms must be in [0, L={n_layers}], got {n_atoms}")

    # Row l of m_t is vec(W_l): m_t is Mᵀ, (L, out·in).
    m_t = weights.detach().to(torch.float64).reshape(n_layers, n_out * n_in)
    if not all_finite(m_t):
        raise NumericalError(f"matrix_pca: non-finite entries in weights of shape {tuple(weights.shape)}")

    gram = m_t @ m_t.T  # (L, L) = MᵀM
    gram = 0.5 * (gram + gram.T)  # exact symmetry for eigh, which reads one triangle only
    eigenvalues, eigenvectors = torch.linalg.eigh(gram)  # ascending
    # Descending order, as in PCA; rounding can make zero eigenvalues slightly negative.
    eigenvalues = eigenvalues.flip(0).clamp_min(0.0)
    eigenvectors = eigenvectors.flip(1)

    numerical_rank = int((eigenvalues > RANK_RTOL * eigenvalues[0]).sum())
    n_kept = min(n_atoms, numerical_rank)

    v_b = eigenvectors[:, :n_kept]  # (L, B')
    # (M V_B Λ_B^{-1/2})ᵀ computed as Λ_B^{-1/2} V_Bᵀ Mᵀ: (B', out·in), one atom per row.
    atoms_flat = (v_b.T @ m_t) / eigenvalues[:n_kept].sqrt().unsqueeze(1)

    # eigh's eigenvector signs are arbitrary: make the largest-|.| entry of each atom positive.
    if n_kept > 0:
        peak = atoms_flat.abs().argmax(dim=1, keepdim=True)  # (B', 1)
        signs = torch.sign(atoms_flat.gather(1, peak))  # (B', 1), never 0 for a unit-norm atom
        atoms_flat = atoms_flat * signs

    # Projection onto the atoms, rather than V_B Λ_B^{1/2}: the same in exact arithmetic, and it
    # gives the best coefficients for the atoms actually returned.
    coeffs = m_t @ atoms_flat.T  # (L, B')
    atoms = atoms_flat.reshape(n_kept, n_out, n_in)  # (B', out, in)
    return atoms, coeffs, eigenvalues


def reconstruct_from_atoms(atoms: torch.Tensor, coeffs: torch.Tensor) -> torch.Tensor:
    """`Ŵ_l = Σ_s c_ls D_s` for every layer: atoms `(B, out, in)`, coeffs `(L, B)` → `(L, out, in)` float64."""
    if atoms.ndim != 3 or coeffs.ndim != 2 or coeffs.shape[1] != atoms.shape[0]:
        raise ValueError(
            f"reconstruct_from_atoms expects atoms (B, out, in) and coeffs (L, B), "
            f"got {tuple(atoms.shape)} and {tuple(coeffs.shape)}"
        )
    n_atoms, n_out, n_in = atoms.shape
    atoms_flat = atoms.to(torch.float64).reshape(n_atoms, n_out * n_in)  # (B, out·in)
    recon = coeffs.to(device=atoms.device, dtype=torch.float64) @ atoms_flat  # (L, out·in); zeros if B=0
    return recon.reshape(coeffs.shape[0], n_out, n_in)  # (L, out, in)


def captured_energy_fraction(eigenvalues: torch.Tensor, n_atoms: int) -> float:
    """Fraction of the group's weight energy `Σ_l ‖W_l‖_F²` captured by the top `n_atoms` atoms."""
    total = float(eigenvalues.sum())
    if total == 0.0:
        # An all-zero group: nothing to capture, and the atoms reconstruct it exactly.
        return 1.0
    return float(eigenvalues[:n_atoms].sum()) / total


def whitened_matrix_pca(
    weights: torch.Tensor, S_group: torch.Tensor, n_atoms: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Data-aware Matrix PCA: atoms that minimize the group's output error, not its weight error.

    With the group-summed input autocorrelation `C_g = Σ_l C_l = S_g S_gᵀ`, the output error of the
    shared part per calibration token, summed over the group's layers, is `Σ_l ‖(W_l − Σ_s c_ls D_s) S_g‖_F²`
    (as Basis Sharing whitens). Matrix PCA of the whitened weights `W_l S_g` gives the optimal
    whitened atoms `D̃`; the atoms themselves are `D = D̃ S_g⁻¹` (triangular solve).

    Returns atoms `(B', out, in)`, coefficients `(L, B')` (optimal under `C_g`; see
    `refit_coefficients` for per-layer ones) and the whitened Gram eigenvalues, all float64.
    """
    S = S_group.to(device=weights.device, dtype=torch.float64)
    whitened = weights.detach().to(torch.float64) @ S  # (L, out, in)
    atoms_w, coeffs, eigenvalues = matrix_pca(whitened, n_atoms)
    # D = D̃ S⁻¹  ⇔  D S = D̃  ⇔  Sᵀ Dᵀ = D̃ᵀ: an upper-triangular solve, no explicit inverse.
    atoms = torch.linalg.solve_triangular(S.T, atoms_w.transpose(1, 2), upper=True).transpose(1, 2)
    return atoms.contiguous(), coeffs, eigenvalues


def refit_coefficients(
    weights: torch.Tensor, atoms: torch.Tensor, autocorrs: list[torch.Tensor]
) -> torch.Tensor:
    """Per-layer coefficients that minimize each layer's own output error, in closed form.

    For layer `l` with input autocorrelation `C_l`, `min_c tr((W_l − Σ c_s D_s) C_l (…)ᵀ)` has the normal
    equations `G c = b` with `G_st = ⟨D_s C_l, D_t⟩` and `b_s = ⟨W_l C_l, D_s⟩` (a B×B system).
    """
    n_atoms = atoms.shape[0]
    rows = []
    for w, c in zip(weights, autocorrs, strict=True):
        if n_atoms == 0:
            rows.append(torch.zeros(0, dtype=torch.float64, device=atoms.device))
            continue
        c = c.to(device=atoms.device, dtype=torch.float64)
        dc = atoms @ c  # (B, out, in)
        gram = torch.einsum("soi,toi->st", dc, atoms)  # (B, B)
        rhs = torch.einsum("oi,soi->s", w.to(torch.float64) @ c, atoms)  # (B,)
        rows.append(torch.linalg.lstsq(gram, rhs[:, None]).solution[:, 0])
    return torch.stack(rows)  # (L, B)


def shared_input_basis_energy(weights: list[torch.Tensor], size: int) -> tuple[float, float]:
    """How well one input basis of `size` directions serves several matrices `W_l (out, in)` at once, from the
    weights alone: the fraction of Σ‖W_l‖² captured by the top `size` right singular vectors of the stacked
    `[W_1; …; W_n]` (one shared basis, each matrix projected on it), and by each matrix's own top `size`
    (the best any basis of that size can do for it). Equal fractions: the matrices read one common subspace."""
    stacked = torch.cat([w.detach().to(torch.float64) for w in weights])  # (Σ out, in)
    total = float((stacked**2).sum())
    if total == 0.0:
        return 1.0, 1.0
    basis = torch.linalg.svd(stacked, full_matrices=False)[2][:size]  # (size, in)
    shared = float(((stacked @ basis.T) ** 2).sum())
    own = sum(float((torch.linalg.svdvals(w.to(torch.float64))[:size] ** 2).sum()) for w in weights)
    return shared / total, own / total
