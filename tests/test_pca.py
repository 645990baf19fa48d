"""Matrix PCA: exactness, planted-basis recovery, energy bookkeeping, determinism, edge cases."""

from __future__ import annotations

import pytest
import torch

from compressor.math.pca import captured_energy_fraction, matrix_pca, reconstruct_from_atoms
from compressor.runtime.errors import NumericalError

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _random_weights(n_layers: int, n_out: int, n_in: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n_layers, n_out, n_in, generator=gen, dtype=torch.float64)


@pytest.mark.parametrize("device", DEVICES)
def test_full_basis_reconstructs_exactly(device: str) -> None:
    weights = _random_weights(5, 6, 4).to(device)
    atoms, coeffs, eigenvalues = matrix_pca(weights, n_atoms=5)
    assert atoms.shape == (5, 6, 4) and coeffs.shape == (5, 5) and eigenvalues.shape == (5,)
    assert atoms.dtype == coeffs.dtype == eigenvalues.dtype == torch.float64
    assert atoms.device == weights.device
    torch.testing.assert_close(reconstruct_from_atoms(atoms, coeffs), weights, rtol=0, atol=1e-10)
    # The vec'd atoms are orthonormal.
    flat = atoms.reshape(5, -1)
    torch.testing.assert_close(
        flat @ flat.T, torch.eye(5, dtype=torch.float64, device=device), rtol=0, atol=1e-12
    )
    # Eigenvalues are descending and sum to the total weight energy.
    assert bool((eigenvalues[:-1] >= eigenvalues[1:]).all())
    torch.testing.assert_close(eigenvalues.sum(), weights.square().sum(), rtol=1e-12, atol=0)


def test_planted_basis_is_recovered() -> None:
    gen = torch.Generator().manual_seed(1)
    n_layers, n_out, n_in, n_planted = 8, 5, 7, 2
    # Two orthonormal planted atoms (orthonormal as vectors of length out·in).
    basis, _ = torch.linalg.qr(torch.randn(n_out * n_in, n_planted, generator=gen, dtype=torch.float64))
    planted = basis.T.reshape(n_planted, n_out, n_in)  # (2, out, in)
    # Well-separated coefficient scales so the two eigenvalues are distinct.
    true_coeffs = torch.randn(n_layers, n_planted, generator=gen, dtype=torch.float64) * torch.tensor(
        [3.0, 1.0], dtype=torch.float64
    )
    noise = 1e-3 * torch.randn(n_layers, n_out, n_in, generator=gen, dtype=torch.float64)
    weights = reconstruct_from_atoms(planted, true_coeffs) + noise

    atoms, coeffs, eigenvalues = matrix_pca(weights, n_atoms=n_planted)
    assert atoms.shape == (n_planted, n_out, n_in) and coeffs.shape == (n_layers, n_planted)

    # Same subspace: projecting the planted atoms onto the recovered span loses ~nothing.
    recovered = atoms.reshape(n_planted, -1).T  # (out·in, 2)
    projection_error = basis - recovered @ (recovered.T @ basis)
    assert float(projection_error.norm()) < 1e-2  # a random 2-D subspace would give ~1.4

    # Reconstruction error equals the discarded eigenvalues (Eckart–Young on M).
    residual_energy = (weights - reconstruct_from_atoms(atoms, coeffs)).square().sum()
    torch.testing.assert_close(residual_energy, eigenvalues[n_planted:].sum(), rtol=1e-8, atol=0)
    # The noise is all that is left, so the energy captured is almost everything...
    assert 0.0 < float(residual_energy) <= float(noise.square().sum())
    fraction = captured_energy_fraction(eigenvalues, n_planted)
    assert fraction == pytest.approx(1.0 - float(residual_energy / weights.square().sum()), rel=1e-12)
    assert 1.0 - 1e-4 < fraction < 1.0
    # ...and one atom captures the energy of the dominant planted direction only.
    one = captured_energy_fraction(eigenvalues, 1)
    assert one == pytest.approx(float(eigenvalues[0] / eigenvalues.sum()), rel=1e-15)
    assert 0.5 < one < 0.99


def test_deterministic_and_sign_convention() -> None:
    weights = _random_weights(6, 4, 5, seed=2)
    first = matrix_pca(weights, n_atoms=3)
    second = matrix_pca(weights.clone(), n_atoms=3)
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)
    # The largest-magnitude entry of each atom is positive.
    flat = first[0].reshape(3, -1)
    peaks = flat.gather(1, flat.abs().argmax(dim=1, keepdim=True))
    assert bool((peaks > 0).all())
    # Flipping the sign of every weight flips the coefficients, not the atoms.
    atoms_neg, coeffs_neg, _ = matrix_pca(-weights, n_atoms=3)
    torch.testing.assert_close(atoms_neg, first[0], rtol=0, atol=1e-12)
    torch.testing.assert_close(coeffs_neg, -first[1], rtol=0, atol=1e-12)


def test_low_precision_input_is_computed_in_float64() -> None:
    weights = _random_weights(4, 3, 5, seed=3).to(torch.bfloat16)
    atoms, coeffs, _ = matrix_pca(weights, n_atoms=4)
    assert atoms.dtype == torch.float64
    # Exact reconstruction of the bf16 values themselves: no rounding back to bf16 inside.
    torch.testing.assert_close(reconstruct_from_atoms(atoms, coeffs), weights.double(), rtol=0, atol=1e-10)


def test_zero_atoms() -> None:
    weights = _random_weights(3, 4, 2, seed=4)
    atoms, coeffs, eigenvalues = matrix_pca(weights, n_atoms=0)
    assert atoms.shape == (0, 4, 2) and coeffs.shape == (3, 0) and eigenvalues.shape == (3,)
    assert torch.equal(reconstruct_from_atoms(atoms, coeffs), torch.zeros(3, 4, 2, dtype=torch.float64))
    assert captured_energy_fraction(eigenvalues, 0) == 0.0


def test_rank_deficient_group_returns_fewer_atoms() -> None:
    # Tied weights: two identical layers and a scaled copy span one direction only.
    base = _random_weights(1, 4, 3, seed=5)
    weights = torch.cat([base, base, 2.0 * base])
    atoms, coeffs, eigenvalues = matrix_pca(weights, n_atoms=3)
    assert atoms.shape == (1, 4, 3) and coeffs.shape == (3, 1)
    torch.testing.assert_close(reconstruct_from_atoms(atoms, coeffs), weights, rtol=0, atol=1e-12)
    assert float(eigenvalues[1:].max()) <= 1e-12 * float(eigenvalues[0])
    # An all-zero group has no atoms at all.
    atoms0, coeffs0, _ = matrix_pca(torch.zeros(2, 3, 3), n_atoms=2)
    assert atoms0.shape == (0, 3, 3) and coeffs0.shape == (2, 0)


def test_singleton_group_is_exact() -> None:
    weights = _random_weights(1, 5, 5, seed=6)
    atoms, coeffs, _ = matrix_pca(weights, n_atoms=1)
    torch.testing.assert_close(reconstruct_from_atoms(atoms, coeffs), weights, rtol=0, atol=1e-12)
    torch.testing.assert_close(coeffs.abs(), weights.norm().reshape(1, 1), rtol=1e-14, atol=0)


def test_invalid_inputs() -> None:
    weights = _random_weights(3, 2, 2)
    with pytest.raises(ValueError, match="n_atoms"):
        matrix_pca(weights, n_atoms=4)
    with pytest.raises(ValueError, match="n_atoms"):
        matrix_pca(weights, n_atoms=-1)
    with pytest.raises(ValueError, match="shape"):
        matrix_pca(weights[0], n_atoms=1)
    bad = weights.clone()
    bad[1, 0, 0] = float("nan")
    with pytest.raises(NumericalError):
        matrix_pca(bad, n_atoms=1)


def test_whitened_pca_with_identity_whitening_is_plain_pca():
    from compressor.math.pca import whitened_matrix_pca

    g = torch.Generator().manual_seed(3)
    w = torch.randn(5, 6, 4, generator=g, dtype=torch.float64)
    atoms, coeffs, eig = whitened_matrix_pca(w, torch.eye(4, dtype=torch.float64), 2)
    plain_atoms, plain_coeffs, plain_eig = matrix_pca(w, 2)
    torch.testing.assert_close(atoms, plain_atoms)
    torch.testing.assert_close(coeffs, plain_coeffs)
    torch.testing.assert_close(eig, plain_eig)


def test_whitened_pca_minimizes_the_group_output_error():
    """Its shared part has a smaller output error under C_g than plain PCA's (and is optimal)."""
    from compressor.math.pca import whitened_matrix_pca

    g = torch.Generator().manual_seed(4)
    w = torch.randn(6, 8, 5, generator=g, dtype=torch.float64)
    x = torch.randn(200, 5, generator=g, dtype=torch.float64) * torch.tensor([10.0, 3.0, 1.0, 0.3, 0.1])
    c = x.T @ x
    s = torch.linalg.cholesky(c)

    def output_error(atoms, coeffs):
        residual = w - reconstruct_from_atoms(atoms, coeffs)
        return float(((residual @ s) ** 2).sum())

    atoms, coeffs, eig = whitened_matrix_pca(w, s, 2)
    plain_atoms, plain_coeffs, _ = matrix_pca(w, 2)
    assert output_error(atoms, coeffs) < output_error(plain_atoms, plain_coeffs)
    # Eckart–Young in the whitened space: the error is the discarded whitened eigenvalues.
    assert output_error(atoms, coeffs) == pytest.approx(float(eig[2:].sum()), rel=1e-8)


def test_refit_coefficients_are_optimal_per_layer():
    from compressor.math.pca import refit_coefficients

    g = torch.Generator().manual_seed(5)
    w = torch.randn(3, 6, 4, generator=g, dtype=torch.float64)
    atoms = torch.randn(2, 6, 4, generator=g, dtype=torch.float64)
    xs = [torch.randn(50, 4, generator=g, dtype=torch.float64) for _ in range(3)]
    cs = [x.T @ x for x in xs]
    coeffs = refit_coefficients(w, atoms, cs)
    for layer in range(3):
        # Least squares on the actual outputs: min_c ‖x (W − Σ c D)ᵀ‖ over the tokens.
        design = torch.stack([(xs[layer] @ atoms[s].T).reshape(-1) for s in range(2)], dim=1)
        target = (xs[layer] @ w[layer].T).reshape(-1)
        expected = torch.linalg.lstsq(design, target[:, None]).solution[:, 0]
        torch.testing.assert_close(coeffs[layer], expected, rtol=1e-8, atol=1e-10)


def test_shared_input_basis_energy_is_own_for_a_common_subspace_and_never_above_it():
    """Matrices reading one common `size`-dim input subspace: one shared basis captures all their energy, as
    their own bases do. Unrelated matrices: the shared basis captures less than each one's own."""
    from compressor.math.pca import shared_input_basis_energy

    g = torch.Generator().manual_seed(0)
    common = torch.randn(3, 12, generator=g, dtype=torch.float64)
    weights = [torch.randn(4, 3, generator=g, dtype=torch.float64) @ common for _ in range(3)]
    shared, own = shared_input_basis_energy(weights, 3)
    assert shared == pytest.approx(1.0) and own == pytest.approx(1.0)
    unrelated = [torch.randn(4, 12, generator=g, dtype=torch.float64) for _ in range(3)]
    shared, own = shared_input_basis_energy(unrelated, 3)
    assert shared < own <= 1.0
