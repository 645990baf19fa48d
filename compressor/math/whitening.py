"""Whitened low-rank residuals (method.md, stage 4), as in SVD-LLM.

With the input autocorrelation of a projection `C = Σ xᵀx / T = S Sᵀ` over the T calibration tokens `X`
(Cholesky, `S` lower), the mean output error of a weight error `E` is `‖E Xᵀ‖_F² / T = ‖E S‖_F²`. So the best
rank-`r` approximation of a residual `ΔW` in output error comes from the SVD of `ΔW S`, and by
Eckart–Young its error is the tail `Σ_{i≥r} σ_i²` of that SVD. (Every rule here is relative to C's own scale,
so its normalisation, the mean rather than the sum, changes no choice; it keeps the factors' scale independent
of how many tokens were seen.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from compressor.runtime.errors import NumericalError, all_finite

# A Cholesky pivot `p_i` with `p_i² ≤ PIVOT_RTOL·C_ii` means channel i is, to working precision, a
# linear combination of the earlier channels: `C` is numerically singular even though the
# factorization "succeeded" (rounding leaves tiny positive pivots, measured at up to ~1e3·n·eps·C_ii
# for exactly rank-deficient `XᵀX`), and `S⁻¹` would blow up the residual factor `B = V_rᵀ S⁻¹` by
# `1/p_i`. Such a factor counts as a failed attempt, so damping is used. The test is relative to
# each channel's own diagonal entry, not to max(diag C): activations have outlier channels orders
# of magnitude larger than the rest, and Cholesky's accuracy does not depend on diagonal scaling.
PIVOT_RTOL = 1e-8
#: Rows of a matrix `symmetrize_` and the finiteness check read at a time: their only temporary is this many rows.
SYMMETRIZE_BLOCK = 256


@dataclass(frozen=True)
class WhiteningFactor:
    """Lower Cholesky factor `S` of `C + damping·I`, and how it was obtained."""

    S: torch.Tensor  # (in, in), lower-triangular, float64
    damping: float  # absolute value added to the diagonal of C; 0.0 if none was needed
    attempts: int  # Cholesky factorizations tried, the successful one included (1: undamped; 0: zero input)

    @property
    def input_is_zero(self) -> bool:
        """The input was exactly zero at every calibration token (e.g. o_proj's, behind an all-zero v_proj):
        `S = 0`, so every weight error is invisible in the output and there is nothing to approximate."""
        return self.attempts == 0


def _check_finite(tensor: torch.Tensor, what: str) -> None:
    if not all_finite(tensor):
        raise NumericalError(f"{what} of shape {tuple(tensor.shape)} has non-finite entries")


def symmetrize_(matrix: torch.Tensor) -> torch.Tensor:
    """`matrix ← (matrix + matrixᵀ)/2` in place, block row by block row (no second matrix: an MLP's 8960² fp64
    autocorrelation is 0.6 GiB); the same numbers as `0.5 * (matrix + matrix.T)`, bit for bit."""
    n = matrix.shape[0]
    for start in range(0, n, SYMMETRIZE_BLOCK):
        stop = min(start + SYMMETRIZE_BLOCK, n)
        rows, columns = matrix[start:stop, start:], matrix[start:, start:stop]
        mean = (rows + columns.T) * 0.5  # the block row right of the diagonal, the diagonal block included
        rows.copy_(mean)
        columns.copy_(mean.T)
    return matrix


def symmetrized(matrix: torch.Tensor) -> torch.Tensor:
    """`(M + Mᵀ)/2` in fp64 as one new matrix (accumulated sums are symmetric only up to rounding; Cholesky and
    eigh read one triangle); `matrix` itself is left as it was."""
    m = matrix.detach().to(torch.float64)
    if m.data_ptr() != matrix.data_ptr():  # already a copy (another dtype or device): average it in place
        return symmetrize_(m)
    return (m + m.T).mul_(0.5)


def whitening_factor(
    autocorr: torch.Tensor,
    initial_damping: float = 1e-6,
    max_attempts: int = 8,
    growth: float = 10.0,
    overwrite: bool = False,
) -> WhiteningFactor:
    """Cholesky factor `S` (lower, `C = S Sᵀ`) of an input autocorrelation `C`, damped if needed.

    Its memory: `C`, one symmetrized copy that each attempt damps on its diagonal, and the factor (a failed
    attempt's factor is released before the next); with `overwrite=True` (the caller gives `autocorr` up, like
    SciPy's `overwrite_a`) an fp64 `autocorr` is symmetrized and damped in place: no copy at all.

    Attempt 1 factors `C` itself. Each later attempt `k ≥ 2` factors `C + d_k·I` with
    `d_k = initial_damping · mean(diag C) · growth^(k-2)`. An attempt fails when Cholesky fails or
    a pivot is numerically zero (`p_i² ≤ PIVOT_RTOL·(C + d_k·I)_ii`). The damping used is
    reported: nothing falls back silently. An all-zero `C` (an input that is exactly zero at every
    token) gives `S = 0` (`input_is_zero`): the factors built on it are zero, which is exact on that input.

    Raises:
        ValueError: `autocorr` is not square 2-D, or the damping settings are invalid.
        NumericalError: non-finite `C`, a `C` with `mean(diag C) ≤ 0` that is not all zero, or all
            `max_attempts` attempts failed (the message lists the damping values tried).
    """
    if autocorr.ndim != 2 or autocorr.shape[0] != autocorr.shape[1]:
        raise ValueError(f"whitening_factor expects a square (in, in) matrix, got {tuple(autocorr.shape)}")
    if max_attempts < 1 or initial_damping <= 0.0 or growth <= 1.0:
        raise ValueError(
            f"need max_attempts >= 1, initial_damping > 0, growth > 1; "
            f"got {max_attempts}, {initial_damping}, {growth}"
        )
    _check_finite(autocorr, "autocorrelation")
    # Accumulated sums are symmetric only up to rounding; cholesky reads one triangle only.
    in_place = overwrite and autocorr.dtype == torch.float64
    c = symmetrize_(autocorr.detach()) if in_place else symmetrized(autocorr)
    n = c.shape[0]
    if not bool(c.any()):
        return WhiteningFactor(S=torch.zeros_like(c), damping=0.0, attempts=0)
    diag = torch.diagonal(c)
    mean_diag = float(diag.mean())
    if not mean_diag > 0.0:
        raise NumericalError(
            f"autocorrelation of shape {tuple(c.shape)} has mean diagonal {mean_diag}: "
            f"no calibration signal reached this projection"
        )
    undamped = diag.clone()

    tried: list[float] = []
    for attempt in range(1, max_attempts + 1):
        damping = 0.0 if attempt == 1 else initial_damping * mean_diag * growth ** (attempt - 2)
        tried.append(damping)
        if damping:  # C + d·I, on the diagonal of the one working matrix
            diag.copy_(undamped + damping)
        factor = None  # the failed attempt's factor goes before the next one is made
        factor, info = torch.linalg.cholesky_ex(c)
        pivot_floor = PIVOT_RTOL * diag  # (n,)
        if int(info) == 0 and bool((torch.diagonal(factor).square() > pivot_floor).all()):
            return WhiteningFactor(S=factor, damping=damping, attempts=attempt)
    raise NumericalError(
        f"Cholesky of the {n}x{n} autocorrelation failed for every damping tried "
        f"({', '.join(f'{d:.3g}' for d in tried)}; mean(diag C) = {mean_diag:.3g}); "
        f"use more calibration tokens or a larger initial damping"
    )


def _svd(matrix: torch.Tensor, what: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Thin float64 SVD that turns non-convergence into a NumericalError instead of hiding it."""
    _check_finite(matrix, what)
    try:
        u, sigma, vh = torch.linalg.svd(matrix, full_matrices=False)
    except torch.linalg.LinAlgError as exc:
        raise NumericalError(
            f"SVD of the {what} of shape {tuple(matrix.shape)} did not converge: {exc}"
        ) from exc
    # Some backends report failure as NaNs rather than an exception.
    for part, name in ((u, "U"), (sigma, "singular values"), (vh, "Vh")):
        _check_finite(part, f"{name} of the SVD of the {what}")
    return u, sigma, vh


def _gram_svd(matrix: torch.Tensor, what: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Thin SVD `M = U diag(σ) Vh` of a float64 `M (m, n)` with `n ≤ m`, from the eigenvectors `V` of its Gram
    `MᵀM`: `U diag(σ) = M V`, each `σ_i = ‖M v_i‖`, ordered by it. Half the time of LAPACK's SVD on a CPU for the
    square whitened residuals of q/o (an `n×n` eigh costs less than an SVD).

    What it keeps exactly: `V` orthonormal (eigh's), so `U_r diag(σ_r) Vh_r = M V_r V_rᵀ` is an orthogonal
    projection of `M` whatever the rank, full rank reproduces `M`, and the error left at rank r is exactly
    `Σ_{i>r} σ_i²`. What squaring costs: a direction whose `σ_i²` is below about `n·eps·σ_1²` is not the exact
    singular vector (eigh resolves `σ²`, not `σ`), which changes the approximation by no more than that energy;
    and `U`'s columns are orthonormal only to that accuracy (a zero `σ_i` gives a zero column, whose factors
    are zero on both sides)."""
    _check_finite(matrix, what)
    try:
        _, v = torch.linalg.eigh(matrix.T @ matrix)  # ascending eigenvalues
    except torch.linalg.LinAlgError as exc:
        raise NumericalError(
            f"eigendecomposition of the Gram of the {what} of shape {tuple(matrix.shape)} did not converge: {exc}"
        ) from exc
    _check_finite(v, f"eigenvectors of the Gram of the {what}")
    scaled_u = matrix @ v  # (m, n): column i is σ_i u_i
    sigma = torch.linalg.vector_norm(scaled_u, dim=0)
    order = torch.argsort(sigma, descending=True, stable=True)
    sigma, scaled_u, v = sigma[order], scaled_u[:, order], v[:, order]
    u = scaled_u / torch.where(sigma > 0, sigma, torch.ones_like(sigma)).unsqueeze(0)
    return u, sigma, v.T.contiguous()


def _whitened_residual(delta: torch.Tensor, S: torch.Tensor, caller: str) -> torch.Tensor:
    """`ΔW S` in float64, both checked: delta `(out, in)` and S `(in, in)` finite and of matching shapes."""
    if delta.ndim != 2 or S.shape != (delta.shape[1], delta.shape[1]):
        raise ValueError(
            f"{caller} expects delta (out, in) and S (in, in), got {tuple(delta.shape)}, {tuple(S.shape)}"
        )
    delta64 = delta.detach().to(torch.float64)
    s64 = S.detach().to(device=delta.device, dtype=torch.float64)
    _check_finite(delta64, "residual")
    _check_finite(s64, "whitening factor")
    return delta64 @ s64


def whitened_svd(delta: torch.Tensor, S: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Thin SVD `ΔW S = U diag(σ) Vh` in float64: delta `(out, in)`, S `(in, in)` lower.

    Returns U `(out, k)`, sigma `(k,)` descending, Vh `(k, in)` with `k = min(out, in)`. With no more inputs than
    outputs (q/o, stacked k/v) from the Gram's eigenvectors (`_gram_svd`: Vh orthonormal, half the time), else
    by LAPACK's SVD (a wide k/v residual: its Gram would be the larger side).

    Raises:
        NumericalError: non-finite input, or the decomposition did not converge.
    """
    whitened = _whitened_residual(delta, S, "whitened_svd")
    if whitened.shape[1] <= whitened.shape[0]:
        return _gram_svd(whitened, "whitened residual")
    return _svd(whitened, "whitened residual")


def whitened_singular_values(delta: torch.Tensor, S: torch.Tensor) -> torch.Tensor:
    """The singular values of `ΔW S` alone (descending, float64): what a tail of discarded energy reads. From the
    eigenvalues of the smaller Gram (`σ_i² = λ_i`, negative rounding clipped to 0): no vectors, about two thirds of
    `whitened_svd`'s time on a square residual and a quarter of LAPACK's SVD (the allocation takes the values of
    every projection; only the installed ones need the vectors). Each `σ_i²` is `whitened_svd`'s to within about
    `n·eps·σ_1²` (tests/test_whitening.py), so a tail promises the error the installed factors make to that
    accuracy."""
    whitened = _whitened_residual(delta, S, "whitened_singular_values")
    gram = whitened.T @ whitened if whitened.shape[1] <= whitened.shape[0] else whitened @ whitened.T
    try:
        squares = torch.linalg.eigvalsh(gram)
    except torch.linalg.LinAlgError as exc:
        raise NumericalError(
            f"eigenvalues of the Gram of the whitened residual of shape {tuple(delta.shape)} did not converge: "
            f"{exc}"
        ) from exc
    _check_finite(squares, "eigenvalues of the Gram of the whitened residual")
    return squares.flip(0).clamp_(min=0.0).sqrt_()


def plain_svd(delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Thin SVD of `delta` itself in float64 (the unwhitened baseline); same outputs as `whitened_svd`."""
    if delta.ndim != 2:
        raise ValueError(f"plain_svd expects a 2-D matrix, got {tuple(delta.shape)}")
    return _svd(delta.detach().to(torch.float64), "residual")


def _truncate(
    u: torch.Tensor, sigma: torch.Tensor, vh: torch.Tensor, rank: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(U_r Σ_r^½, Σ_r^½ Vh_r)` for the top `rank` singular triplets: √σ_i on each side, so that neither factor
    carries the whole scale of the matrix (as `U_r Σ_r` did, with `Vh_r` of unit rows) and both stay far from the
    limits of half precision whatever that scale is."""
    if not 0 <= rank <= sigma.shape[0]:
        raise ValueError(f"rank must be in [0, {sigma.shape[0]}], got {rank}")
    root = sigma[:rank].sqrt()
    return u[:, :rank] * root.unsqueeze(0), root.unsqueeze(1) * vh[:rank]  # (out, r), (r, in)


def _is_zero(S: torch.Tensor) -> bool:
    """Whether a whitening factor is the zero one of an input that is zero at every token (`input_is_zero`)."""
    return not bool(S.any())


def low_rank_factors(
    U: torch.Tensor, sigma: torch.Tensor, Vh: torch.Tensor, S: torch.Tensor, rank: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual factors `A (out, r)`, `B (r, in)` with `A B S = U_r Σ_r Vh_r`.

    `A = U_r Σ_r^½` and `B = Σ_r^½ Vh_r S⁻¹`, the latter by a triangular solve of `B S = Σ_r^½ Vh_r` (no
    explicit inverse: it is both slower and less accurate). `rank = 0` gives `(out, 0)` and `(0, in)`.
    """
    a, scaled_vh = _truncate(U, sigma, Vh, rank)
    s64 = S.to(device=scaled_vh.device, dtype=torch.float64)
    b = torch.zeros_like(scaled_vh)
    # Rows with σ_i = 0 are zero on both sides and add nothing to A B; leaving them out of the solve means the
    # zero factor of a dead input (every σ_i = 0 there) is never divided by.
    live = 0 if _is_zero(s64) else int((sigma[:rank] > 0).sum())
    # left=False solves X S = Σ_r^½ Vh_r for X, with S lower-triangular.
    b[:live] = torch.linalg.solve_triangular(s64, scaled_vh[:live], upper=False, left=False)  # (r, in)
    return a, b


def whitened_basis(Vh: torch.Tensor, S: torch.Tensor) -> torch.Tensor:
    """The input basis `Vh S⁻¹ (k, in)` of a whitened SVD `M S = U Σ Vh`, most important row first, for readers
    whose coefficients are refit on it (`refit_on_basis`, where their scale follows from the basis's).

    Its rows have unit whitened norm (`B S = Vh`), not the `Σ^½` scale of `low_rank_factors`' B: a stack of
    weights of lower rank than k (an all-zero reader) has σ_i = 0, whose row would be zero, and a reader's refit
    would divide by its norm. The zero factor of an input that is zero for every reader gives `Vh` itself (their
    coefficients are zero on any basis).
    """
    vh = Vh.detach().to(torch.float64)
    s64 = S.to(device=vh.device, dtype=torch.float64)
    if _is_zero(s64):
        return vh
    return torch.linalg.solve_triangular(s64, vh, upper=False, left=False)  # (k, in)


def shared_basis_factors(
    weights: list[torch.Tensor], S: torch.Tensor, rank: int
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """One input basis `B (r, in)` for several matrices that read inputs whitened by `S`, and each one's
    coefficients `A_l (out_l, r)`: the whitened rank-r factors of the stacked `[W_1; …; W_n]`, which minimise
    `Σ_l ‖(W_l − A_l B) S‖²` over all such pairs (Eckart–Young on the stacked matrix; Basis Sharing)."""
    u, sigma, vh = whitened_svd(torch.cat(weights), S)
    a, b = low_rank_factors(u, sigma, vh, S, rank)
    return list(torch.split(a, [w.shape[0] for w in weights])), b


def _basis_qr(basis: torch.Tensor, S: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Reduced QR of `(B S)ᵀ = Q R`, Q `(in, k)` orthonormal, R `(k, k)` upper, float64: the whitened directions
    of the basis rows in one layer's metric. Leading blocks give every smaller basis (the first `r` rows of B)."""
    b = basis.detach().to(torch.float64)
    s = S.detach().to(device=b.device, dtype=torch.float64)
    return torch.linalg.qr((b @ s).T)  # (in, k), (k, k)


def refit_tail(weight: torch.Tensor, basis: torch.Tensor, S: torch.Tensor) -> torch.Tensor:
    """`tail[r] = min_A ‖(W − A B_r) S‖²` for r = 0..k, with `B_r` the first r rows of `basis (k, in)`: the
    whitened output error of a layer whose coefficients are refit on its own statistics (`C = S Sᵀ`) against a
    shared input basis. The best `A B_r S` is the projection of `W S` on the span of `Q_r` (`basis_qr`), so the
    error at every size comes from one QR: ‖W S‖² minus the cumulated energy of `W S` along each column of Q."""
    ws = weight.detach().to(torch.float64) @ S.to(device=weight.device, dtype=torch.float64)  # (out, in)
    q, _ = _basis_qr(basis, S)
    captured = torch.cumsum(((ws @ q) ** 2).sum(dim=0), dim=0)  # (k,)
    tail = (ws**2).sum() - torch.cat([captured.new_zeros(1), captured])
    return tail.clamp_min(0.0)  # rounding may leave -1e-16 where everything is captured


def refit_on_basis(weight: torch.Tensor, basis: torch.Tensor, S: torch.Tensor) -> torch.Tensor:
    """Coefficients `A (out, r)` on the input basis `B (r, in)` minimising the layer's own output error
    `‖(W − A B) S‖²`: with `(B S)ᵀ = Q R`, the optimum is `A B S = W S Q Qᵀ`, i.e. `A = W S Q R⁻ᵀ` (a triangular
    solve), float64. `refit_tail` gives its error at every r."""
    w = weight.detach().to(torch.float64)
    s = S.to(device=w.device, dtype=torch.float64)
    if basis.shape[0] == 0 or _is_zero(s):  # a dead input: any A is exact there, the zero one is the least
        return w.new_zeros(w.shape[0], basis.shape[0])
    q, r = _basis_qr(basis.to(w.device), s)
    # left=False solves X Rᵀ = W S Q for X, with Rᵀ lower-triangular.
    return torch.linalg.solve_triangular(r.T, w @ s @ q, upper=False, left=False)  # (out, r)


def plain_svd_factors(W: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Unwhitened rank-`rank` factors of `W`: `A = U_r Σ_r^½` `(out, r)`, `B = Σ_r^½ Vh_r` `(r, in)`, float64."""
    u, sigma, vh = plain_svd(W)
    return _truncate(u, sigma, vh, rank)


def discarded_energy(sigma: torch.Tensor) -> torch.Tensor:
    """Tails `tail[r] = Σ_{i≥r} σ_i²` (0-based), length `len(sigma) + 1`, float64, `tail[len] = 0`.

    `tail[r]` is the squared Frobenius error of keeping rank `r` (Eckart–Young), so it is computed
    once per matrix and the allocation reads any rank from it.
    """
    if sigma.ndim != 1:
        raise ValueError(
            f"discarded_energy expects a 1-D vector of singular values, got {tuple(sigma.shape)}"
        )
    sq = sigma.detach().to(torch.float64).square()
    # Cumulative sum from the smallest singular value up (the paper's flip/cumsum/flip), so that
    # small tails are not the difference of two large numbers.
    tail = sq.flip(0).cumsum(0).flip(0)  # (k,)
    return torch.cat([tail, tail.new_zeros(1)])  # (k + 1,)
