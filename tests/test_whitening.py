"""Whitened residual SVD: Eckart–Young tails, factor exactness, damping, error reporting."""

from __future__ import annotations

import pytest
import torch

from compressor.math.whitening import (
    discarded_energy,
    low_rank_factors,
    plain_svd,
    plain_svd_factors,
    symmetrize_,
    symmetrized,
    whitened_singular_values,
    whitened_svd,
    whitening_factor,
)
from compressor.runtime.errors import FINITE_CHECK_ROWS, NumericalError, all_finite

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _setup(n_out: int = 6, n_in: int = 8, n_tokens: int = 50, seed: int = 0, device: str = "cpu"):
    gen = torch.Generator().manual_seed(seed)
    # Channels of different scales, as in real activations, so whitening matters.
    x = torch.randn(n_tokens, n_in, generator=gen, dtype=torch.float64) * torch.linspace(0.1, 5.0, n_in)
    delta = torch.randn(n_out, n_in, generator=gen, dtype=torch.float64)
    return x.to(device), delta.to(device)


@pytest.mark.parametrize("device", DEVICES)
def test_whitened_error_matches_tail_and_output_error(device: str) -> None:
    x, delta = _setup(device=device)
    factor = whitening_factor(x.T @ x)
    assert factor.damping == 0.0 and factor.attempts == 1
    assert factor.S.device == delta.device
    torch.testing.assert_close(factor.S @ factor.S.T, x.T @ x, rtol=1e-12, atol=1e-10)
    u, sigma, vh = whitened_svd(delta, factor.S)
    tail = discarded_energy(sigma)
    assert tail.shape == (7,)
    for rank in range(0, 6):
        a, b = low_rank_factors(u, sigma, vh, factor.S, rank)
        assert a.shape == (6, rank) and b.shape == (rank, 8)
        error = delta - a @ b
        whitened = (error @ factor.S).square().sum()
        # Eckart–Young: the whitened error is the discarded tail.
        torch.testing.assert_close(whitened, tail[rank], rtol=1e-8, atol=0)
        # ...and it is the output error on the calibration tokens: ‖E Xᵀ‖ = ‖E S‖ when XᵀX = S Sᵀ.
        torch.testing.assert_close((error @ x.T).square().sum(), whitened, rtol=1e-8, atol=0)
    # Full rank reproduces the residual exactly.
    a, b = low_rank_factors(u, sigma, vh, factor.S, 6)
    torch.testing.assert_close(a @ b, delta, rtol=0, atol=1e-10)
    assert float(tail[6]) == 0.0


def test_singular_values_alone_give_the_installed_factors_error() -> None:
    """The allocation's tails come from `whitened_singular_values` (no vectors), the installed factors from
    `whitened_svd`: the error a tail promises is the error the factors at that rank make."""
    x, delta = _setup(seed=3)
    factor = whitening_factor(x.T @ x)
    sigma = whitened_singular_values(delta, factor.S)
    u, full_sigma, vh = whitened_svd(delta, factor.S)
    torch.testing.assert_close(sigma, full_sigma, rtol=1e-12, atol=1e-12)
    tail = discarded_energy(sigma)
    for rank in range(0, 7):
        a, b = low_rank_factors(u, full_sigma, vh, factor.S, rank)
        torch.testing.assert_close(
            ((delta - a @ b) @ factor.S).square().sum(), tail[rank], rtol=1e-8, atol=1e-12
        )
    with pytest.raises(NumericalError, match="non-finite"):
        whitened_singular_values(torch.full_like(delta, float("nan")), factor.S)


def test_whitening_beats_plain_svd_in_output_error() -> None:
    x, delta = _setup(seed=1)
    factor = whitening_factor(x.T @ x)
    u, sigma, vh = whitened_svd(delta, factor.S)
    a_w, b_w = low_rank_factors(u, sigma, vh, factor.S, 2)
    a_p, b_p = plain_svd_factors(delta, 2)
    out_w = ((delta - a_w @ b_w) @ x.T).square().sum()
    out_p = ((delta - a_p @ b_p) @ x.T).square().sum()
    assert out_w < out_p
    # The plain baseline is optimal in the plain Frobenius norm instead.
    _, sigma_p, _ = plain_svd(delta)
    torch.testing.assert_close(
        (delta - a_p @ b_p).square().sum(), discarded_energy(sigma_p)[2], rtol=1e-10, atol=0
    )
    # √σ on each side: A = U_r Σ_r^½, B = Σ_r^½ Vh_r (orthogonal columns / rows of squared norm σ_i).
    diag = torch.diag(sigma_p[:2])
    torch.testing.assert_close(b_p @ b_p.T, diag, rtol=0, atol=1e-12)
    torch.testing.assert_close(a_p.T @ a_p, diag, rtol=0, atol=1e-12)


def test_discarded_energy_values() -> None:
    tail = discarded_energy(torch.tensor([3.0, 2.0, 1.0]))
    assert tail.dtype == torch.float64
    assert tail.tolist() == [14.0, 5.0, 1.0, 0.0]
    assert discarded_energy(torch.zeros(0)).tolist() == [0.0]


def test_rank_zero_and_invalid_rank() -> None:
    x, delta = _setup(seed=2)
    factor = whitening_factor(x.T @ x)
    u, sigma, vh = whitened_svd(delta, factor.S)
    a, b = low_rank_factors(u, sigma, vh, factor.S, 0)
    assert a.shape == (6, 0) and b.shape == (0, 8)
    assert torch.equal(a @ b, torch.zeros(6, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="rank"):
        low_rank_factors(u, sigma, vh, factor.S, 7)


def test_damping_for_a_dead_channel() -> None:
    x, delta = _setup(seed=3)
    x[:, 2] = 0.0  # a dead channel: C is exactly singular
    c = x.T @ x
    assert int(torch.linalg.cholesky_ex(c).info) != 0
    factor = whitening_factor(c, initial_damping=1e-6)
    mean_diag = float(torch.diagonal(c).mean())
    assert factor.attempts == 2
    assert factor.damping == pytest.approx(1e-6 * mean_diag, rel=1e-15)
    # The factor is valid for the damped matrix, and the tail identity still holds in its metric.
    damped = c + factor.damping * torch.eye(8, dtype=torch.float64)
    torch.testing.assert_close(factor.S @ factor.S.T, damped, rtol=1e-12, atol=1e-10)
    assert torch.equal(factor.S, torch.tril(factor.S))
    u, sigma, vh = whitened_svd(delta, factor.S)
    a, b = low_rank_factors(u, sigma, vh, factor.S, 3)
    assert bool(torch.isfinite(b).all())
    torch.testing.assert_close(
        ((delta - a @ b) @ factor.S).square().sum(), discarded_energy(sigma)[3], rtol=1e-8, atol=0
    )


@pytest.mark.parametrize("n_tokens", [3, 5, 7])
@pytest.mark.parametrize("seed", [1, 3, 4])
def test_damping_for_too_few_tokens(n_tokens: int, seed: int) -> None:
    # Fewer tokens than channels: C = XᵀX has rank < 8. Depending on rounding, Cholesky either
    # fails or "succeeds" with tiny pivots; both must be damped.
    x, _ = _setup(n_tokens=n_tokens, seed=seed)
    factor = whitening_factor(x.T @ x)
    assert factor.damping > 0.0 and factor.attempts >= 2
    ratio = torch.diagonal(factor.S).square() / torch.diagonal(x.T @ x + factor.damping * torch.eye(8))
    assert float(ratio.min()) > 1e-8


def test_tiny_pivot_counts_as_singular() -> None:
    # Cholesky succeeds here (last pivot² = 1e-12 > 0), but channel 2 is channel 1 to 1e-12
    # relative precision: S⁻¹ would amplify by 1e6, so the factor must be damped.
    c = torch.tensor([[1.0, 1.0], [1.0, 1.0 + 1e-12]], dtype=torch.float64)
    assert int(torch.linalg.cholesky_ex(c).info) == 0
    factor = whitening_factor(c)
    assert factor.attempts == 2 and factor.damping == pytest.approx(1e-6 * (1.0 + 0.5e-12), rel=1e-12)
    # A well-conditioned but badly scaled C (an outlier channel) needs no damping.
    scaled = torch.diag(torch.tensor([1e8, 1.0, 1e-4], dtype=torch.float64))
    assert whitening_factor(scaled).damping == 0.0


def test_damping_grows_and_failure_lists_what_was_tried() -> None:
    c = torch.diag(torch.tensor([1.0, 1.0, -1.0], dtype=torch.float64))  # indefinite: mean diag 1/3
    # Needs damping > 1: tried 1e-2/3·(1, 10, 100, ...) → the fourth damped attempt (≈3.3) works.
    factor = whitening_factor(c, initial_damping=1e-2, max_attempts=8, growth=10.0)
    assert factor.attempts == 5
    assert factor.damping == pytest.approx(1e-2 / 3 * 1e3, rel=1e-12)
    with pytest.raises(NumericalError, match=r"0, 0\.00333, 0\.0333"):
        whitening_factor(c, initial_damping=1e-2, max_attempts=3)


def test_numerical_errors() -> None:
    x, delta = _setup(seed=5)
    c = x.T @ x
    bad = c.clone()
    bad[0, 1] = float("nan")
    with pytest.raises(NumericalError):
        whitening_factor(bad)
    with pytest.raises(NumericalError, match="mean diagonal"):
        whitening_factor(torch.diag(torch.tensor([1.0, -1.0, 0.0, 0.0])))  # not an autocorrelation
    s = whitening_factor(c).S
    bad_delta = delta.clone()
    bad_delta[3, 3] = float("inf")
    with pytest.raises(NumericalError):
        whitened_svd(bad_delta, s)
    with pytest.raises(NumericalError):
        plain_svd(bad_delta)


def test_svd_failure_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    def failing_svd(*args, **kwargs):
        raise torch.linalg.LinAlgError("linalg.svd: The algorithm failed to converge")

    monkeypatch.setattr(torch.linalg, "svd", failing_svd)
    with pytest.raises(NumericalError, match=r"\(6, 8\)"):
        plain_svd(torch.ones(6, 8, dtype=torch.float64))


def _lapack_svd_of_whitened(delta: torch.Tensor, S: torch.Tensor):
    return torch.linalg.svd(delta @ S, full_matrices=False)


@pytest.mark.parametrize("n_out", [8, 12, 40])
def test_the_gram_path_is_an_svd_where_inputs_do_not_outnumber_outputs(n_out: int) -> None:
    """q/o (square) and stacked k/v (tall) take the Gram's eigenvectors: against LAPACK's SVD, the same σ² to
    n·eps·σ₁², an orthonormal Vh, full rank exact, and at every rank the error the tail promises (Eckart–Young),
    on activations whose channel scales span 1e4 as outlier channels do."""
    gen = torch.Generator().manual_seed(n_out)
    scales = torch.logspace(-2, 2, 8, dtype=torch.float64)
    x = torch.randn(200, 8, generator=gen, dtype=torch.float64) * scales
    delta = torch.randn(n_out, 8, generator=gen, dtype=torch.float64)
    factor = whitening_factor(x.T @ x)
    u, sigma, vh = whitened_svd(delta, factor.S)
    assert u.shape == (n_out, 8) and sigma.shape == (8,) and vh.shape == (8, 8)
    assert bool((sigma[:-1] >= sigma[1:]).all())
    _, lapack_sigma, _ = _lapack_svd_of_whitened(delta, factor.S)
    bound = 8 * 8 * torch.finfo(torch.float64).eps * float(lapack_sigma[0]) ** 2
    torch.testing.assert_close(sigma.square(), lapack_sigma.square(), rtol=0, atol=bound)
    torch.testing.assert_close(vh @ vh.T, torch.eye(8, dtype=torch.float64), rtol=0, atol=1e-13)
    values = whitened_singular_values(delta, factor.S)
    torch.testing.assert_close(values.square(), sigma.square(), rtol=0, atol=bound)
    tail = discarded_energy(sigma)
    for rank in range(0, 9):
        a, b = low_rank_factors(u, sigma, vh, factor.S, rank)
        error = ((delta - a @ b) @ factor.S).square().sum()
        torch.testing.assert_close(error, tail[rank], rtol=1e-10, atol=bound)
        # No worse than the optimal rank-r error LAPACK's vectors give, beyond the squaring's resolution.
        assert float(error) <= float(discarded_energy(lapack_sigma)[rank]) + bound
    a, b = low_rank_factors(u, sigma, vh, factor.S, 8)
    torch.testing.assert_close(a @ b, delta, rtol=0, atol=1e-10)


def test_the_gram_path_of_a_rank_deficient_residual() -> None:
    """A residual of rank 2 (e.g. stacked readers, some all zero): its zero σ give zero columns of U and zero
    factors, Vh stays orthonormal (what `whitened_basis` reads), and rank 2 is already exact."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(100, 6, generator=gen, dtype=torch.float64)
    left = torch.randn(10, 2, generator=gen, dtype=torch.float64)
    delta = left @ torch.randn(2, 6, generator=gen, dtype=torch.float64)
    delta[5:] = 0.0
    factor = whitening_factor(x.T @ x)
    u, sigma, vh = whitened_svd(delta, factor.S)
    assert bool(torch.isfinite(u).all())
    torch.testing.assert_close(vh @ vh.T, torch.eye(6, dtype=torch.float64), rtol=0, atol=1e-13)
    assert float(sigma[2:].max()) <= 1e-6 * float(sigma[0])
    a, b = low_rank_factors(u, sigma, vh, factor.S, 2)
    torch.testing.assert_close(a @ b, delta, rtol=0, atol=1e-9)


def test_gram_eigendecomposition_failure_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    def failing(*args, **kwargs):
        raise torch.linalg.LinAlgError("linalg.eigh: The algorithm failed to converge")

    x, delta = _setup(n_out=8, n_in=8, seed=2)
    factor = whitening_factor(x.T @ x)
    monkeypatch.setattr(torch.linalg, "eigh", failing)
    with pytest.raises(NumericalError, match=r"Gram of the whitened residual of shape \(8, 8\)"):
        whitened_svd(delta, factor.S)
    monkeypatch.setattr(torch.linalg, "eigvalsh", failing)
    with pytest.raises(NumericalError, match=r"\(8, 8\)"):
        whitened_singular_values(delta, factor.S)


def test_low_precision_inputs() -> None:
    x, delta = _setup(seed=6)
    factor = whitening_factor((x.T @ x).float())
    assert factor.S.dtype == torch.float64
    u, sigma, vh = whitened_svd(delta.to(torch.bfloat16), factor.S)
    a, b = low_rank_factors(u, sigma, vh, factor.S, 6)
    assert a.dtype == b.dtype == torch.float64
    torch.testing.assert_close(a @ b, delta.to(torch.bfloat16).double(), rtol=0, atol=1e-9)


def test_the_factors_split_the_singular_values_evenly() -> None:
    """A = U_r Σ_r^½ and B = Σ_r^½ Vh_r S⁻¹: A's columns and B S's rows both have squared norm σ_i, so neither
    carries the whole scale (A = U_r Σ_r did: |A| grew with the autocorrelation's scale, B shrank)."""
    x, delta = _setup(seed=7)
    for scale in (1.0, 1e8):
        factor = whitening_factor(scale * (x.T @ x))
        u, sigma, vh = whitened_svd(delta, factor.S)
        a, b = low_rank_factors(u, sigma, vh, factor.S, 4)
        tolerance = {"rtol": 0, "atol": 1e-10 * float(sigma[0])}
        torch.testing.assert_close(a.T @ a, torch.diag(sigma[:4]), **tolerance)
        bs = b @ factor.S
        torch.testing.assert_close(bs @ bs.T, torch.diag(sigma[:4]), **tolerance)
        torch.testing.assert_close(a @ bs, (u[:, :4] * sigma[:4]) @ vh[:4], **tolerance)


def test_an_input_that_is_zero_at_every_token_has_nothing_to_approximate() -> None:
    """An all-zero autocorrelation (o_proj's input behind an all-zero v_proj) is not an error: its factor is S = 0,
    every whitened error is 0, and the factors at any rank are zero (nothing divides by the zero S)."""
    factor = whitening_factor(torch.zeros(8, 8, dtype=torch.float64))
    assert factor.input_is_zero and factor.damping == 0.0
    assert torch.equal(factor.S, torch.zeros(8, 8, dtype=torch.float64))
    _, delta = _setup(seed=8)
    u, sigma, vh = whitened_svd(delta, factor.S)
    assert torch.equal(discarded_energy(sigma), torch.zeros(7, dtype=torch.float64))
    for rank in (0, 3, 6):
        a, b = low_rank_factors(u, sigma, vh, factor.S, rank)
        assert torch.equal(a @ b, torch.zeros(6, 8, dtype=torch.float64))
    x, _ = _setup(seed=8)
    assert not whitening_factor(x.T @ x).input_is_zero


def test_an_all_zero_weight_costs_nothing_and_its_factors_are_zero() -> None:
    x, _ = _setup(seed=9)
    factor = whitening_factor(x.T @ x)
    u, sigma, vh = whitened_svd(torch.zeros(6, 8, dtype=torch.float64), factor.S)
    tail = discarded_energy(sigma)
    assert torch.equal(tail, torch.zeros(7, dtype=torch.float64))  # no rank step removes anything
    a, b = low_rank_factors(u, sigma, vh, factor.S, 4)
    assert bool(torch.isfinite(b).all()) and torch.equal(a @ b, torch.zeros(6, 8, dtype=torch.float64))
    a, b = plain_svd_factors(torch.zeros(6, 8), 4)
    assert torch.equal(a @ b, torch.zeros(6, 8, dtype=torch.float64))


@pytest.mark.parametrize("n", [1, 7, 300, 513])
def test_symmetrizing_in_place_gives_the_out_of_place_numbers_bit_for_bit(n: int) -> None:
    # Block rows of 256: one block, a partial last block, several blocks.
    gen = torch.Generator().manual_seed(n)
    c = torch.randn(n, n, generator=gen, dtype=torch.float64)
    expected, before = 0.5 * (c + c.T), c.clone()
    assert torch.equal(symmetrized(c), expected) and torch.equal(
        c, before
    )  # a new matrix; the input untouched
    assert torch.equal(symmetrized(c.float()), 0.5 * (c.float().double() + c.float().double().T))
    assert symmetrize_(c) is c and torch.equal(c, expected)


def test_a_whitening_factor_leaves_its_input_unless_it_is_given_up() -> None:
    x, _ = _setup(seed=3)
    x[:, 2] = 0.0  # a dead channel: damped on the second attempt
    c = x.T @ x
    c[0, 1] += 1e-9  # symmetric only up to rounding, as accumulated sums are
    kept = c.clone()
    factor = whitening_factor(c)
    assert factor.attempts == 2 and torch.equal(c, kept)
    # Given up (`overwrite=True`), the same factor, and the matrix symmetrized and damped in place.
    given_up = whitening_factor(c, overwrite=True)
    assert torch.equal(given_up.S, factor.S) and given_up.damping == factor.damping
    damped = 0.5 * (kept + kept.T)
    damped.diagonal().add_(factor.damping)
    assert torch.equal(c, damped)
    # An fp32 input is never written: the factor is made from its fp64 copy.
    c32 = kept.float()
    whitening_factor(c32, overwrite=True)
    assert torch.equal(c32, kept.float())


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_all_finite_finds_one_bad_entry_in_any_row_block(bad: float) -> None:
    # Rows span several blocks of FINITE_CHECK_ROWS and the last block is partial: a bad entry anywhere is found.
    rows = 2 * FINITE_CHECK_ROWS + 3
    matrix = torch.randn(rows, 5, dtype=torch.float64)
    assert all_finite(matrix) and all_finite(matrix[0]) and all_finite(torch.zeros(0, 5))
    for row in (0, FINITE_CHECK_ROWS - 1, FINITE_CHECK_ROWS, rows - 1):
        spoiled = matrix.clone()
        spoiled[row, 3] = bad
        assert not all_finite(spoiled)
        assert not all_finite(spoiled[row])
