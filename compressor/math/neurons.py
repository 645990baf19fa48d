"""Neuron selection for a gated MLP, with a least-squares refit of `down_proj` (pure math, no model code).

A gated MLP is `y = D z`, `z = act(G x) ⊙ (U x)` (`D`: down_proj `(hidden, I)`, `z`: its input, `I` neurons).
Keeping a subset `S` of the neurons keeps their rows of G and U unchanged, so `z_S` is exact, and only `D` has
to change: the `D'` (hidden × |S|) minimising the mean output error `E‖D z − D' z_S‖²` over the calibration
tokens is, with `C = E[z zᵀ]` (the down_proj input autocorrelation `capture` holds),

    D' = D C[:, S] C[S, S]⁻¹,     error(S) = tr(D C Dᵀ) − tr(D C[:, S] C[S, S]⁻¹ C[S, :] Dᵀ).

The error is in the units of every other whitened error (‖(W − Ŵ) S‖² of `whitening`: the mean squared output
error per token), so it enters the same allocation. With `ridge > 0` every formula reads `C_λ = C + λ·m·I`
(`m = mean diag C`) instead of `C`: the refit then minimises `E‖D z − D' z_S‖² + λ m ‖D − D' Π_S‖²`, shrinking
the kept columns towards their original values, and the errors reported are that objective's.

For a fixed order of the neurons the sets are nested, and one Cholesky factor of `C` in that order gives the
error at every width `k` at once: with `C[π, π] = L Lᵀ` and `X = D C[:, π] L⁻ᵀ`, the explained energy of the
first `k` neurons is the sum of the squared norms of X's first `k` columns (`order_tail`). The orders:
`energy` (each neuron's own output energy `C_jj ‖D_:j‖²`), `leverage` (ridge leverage `[C (C + λI)⁻¹]_jj`,
MoDeGPT's Nyström selection) and `greedy` (forward selection by the output energy each neuron adds given
the ones already kept: a pivoted Cholesky whose pivot maximises `‖D R_:j‖² / R_jj`, R the Schur complement).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from compressor.math.whitening import symmetrized, whitening_factor
from compressor.runtime.errors import NumericalError, all_finite

ORDERS = ("greedy", "greedy-block", "energy", "leverage")


def regularized(autocorr: torch.Tensor, ridge: float) -> torch.Tensor:
    """`C + ridge·mean(diag C)·I` in fp64, symmetrised (accumulated sums are symmetric up to rounding), a new
    matrix."""
    return _add_ridge(symmetrized(autocorr), ridge, autocorr)


def _add_ridge(c: torch.Tensor, ridge: float, autocorr: torch.Tensor) -> torch.Tensor:
    """`c + ridge·mean(diag C)·I` in place, the mean read from `autocorr` (C, in its own order: symmetrizing
    leaves the diagonal as it is, so it is the same number for C, for C symmetrized and for C permuted)."""
    if ridge > 0:
        c.diagonal().add_(ridge * float(torch.diagonal(autocorr).to(torch.float64).mean()))
    return c


def energy_order(autocorr: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """Neurons by their own output energy `C_jj ‖D_:j‖²`, largest first (ties: lower index first)."""
    score = torch.diagonal(autocorr).to(torch.float64) * down.to(torch.float64).square().sum(dim=0)
    return torch.sort(-score, stable=True).indices


def leverage_order(autocorr: torch.Tensor, ridge: float) -> torch.Tensor:
    """Neurons by ridge leverage `[C (C + λ m I)⁻¹]_jj`, largest first (MoDeGPT; λ ≥ 1e-6 so the solve exists)."""
    c = regularized(autocorr, 0.0)
    damped = regularized(c, max(ridge, 1e-6))
    leverage = torch.diagonal(torch.linalg.solve(damped, c))
    return torch.sort(-leverage, stable=True).indices


def greedy_order(
    autocorr: torch.Tensor, down: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Forward selection: at every step the neuron whose addition explains the most output energy given the
    neurons already kept (`‖D R_:j‖² / R_jj`, R = C's Schur complement on the kept set), as a left-looking
    pivoted Cholesky: O(I² (I + hidden)) in matrix-vector steps. `autocorr` is used as given (regularise first).

    The selection runs in `dtype`, float32 by default: its steps are bound by memory traffic, which float32
    halves; only the order comes out of it (the errors of that order are then computed in float64 by
    `order_tail`), and near-ties it may break otherwise than float64 would cost nothing measurable.
    On the CPU the loop runs on numpy arrays: its ~I steps are matrix-vector products and a dozen small
    operations each, where numpy's BLAS and per-call cost were 2-3× cheaper than torch's on the 2-core AMD
    machine measured (0.37 s instead of 1.2 s for a width-1536 layer); on an accelerator, on torch tensors where
    they are. Same code, same order."""
    if autocorr.device.type == "cpu":
        numpy_dtype = torch.empty(0, dtype=dtype).numpy().dtype
        c = autocorr.detach().to(dtype).numpy()
        d = down.detach().to(dtype=dtype, device="cpu").numpy()
        order = _greedy_steps(c, d, lambda *shape: np.zeros(shape, dtype=numpy_dtype), torch.finfo(dtype).eps)
        return torch.tensor(order, dtype=torch.long)
    c, d = autocorr.to(dtype), down.to(dtype=dtype, device=autocorr.device)
    order = _greedy_steps(
        c, d, lambda *shape: torch.zeros(shape, dtype=dtype, device=c.device), torch.finfo(dtype).eps
    )
    return torch.tensor(order, dtype=torch.long, device=c.device)


def _greedy_steps(c, d, zeros, eps: float) -> list[int]:
    """`greedy_order`'s loop on arrays `c` (I × I) and `d` (hidden × I), numpy or torch alike (`zeros(*shape)`
    makes one of theirs): only the operators and methods the two share; `eps`: the precision of their dtype.

    The working arrays hold only the neurons not yet kept (and those kept since the last compaction): a kept
    neuron's row of the factor and column of D R no longer change any gain, so whenever a quarter of what is held
    is kept they are dropped, which takes the matrix-vector steps from 2·I²·(I/2 + hidden) multiply-adds to
    about I²·(I/3 + hidden).

    A neuron is exhausted (nothing of it left that the kept ones do not explain) once its Schur complement
    R_jj is at most I·eps·C_jj, what rounding leaves of it (LAPACK's pivoted Cholesky stops at I·eps·max C_jj):
    below that its gain is noise. The pivot is recomputed from the factor before it is used; one that rounding
    left at or below that floor marks its neuron exhausted instead of dividing by it."""
    n = c.shape[0]
    if n == 0:
        return []
    held = list(range(n))  # the neurons the working arrays hold, by position
    c_held, d_held = c, d  # C's rows and D's columns of the held neurons
    dc = d @ c  # (hidden, held): D C; D R = D C − W Vᵀ with the factor V and W = D V below
    numer = (dc * dc).sum(0)  # ‖D R_:j‖² on held
    diag = c.diagonal() * 1  # R_jj on held (a copy)
    floor = 1e-12 * float(diag.max())
    exhausted = diag * (n * eps)  # R_jj at or below this: nothing left of neuron j
    exhausted[exhausted < floor] = floor
    factor = zeros(n, n)  # [j, t]: the pivoted Cholesky factor's column t on held neuron j
    w_rows = zeros(n, d.shape[0])  # [t]: D times the factor's column t
    chosen = diag < 0  # on held: kept (all False; an array of the right kind)
    order: list[int] = []
    kept_since_compaction = t = 0  # t: the factor's columns so far, one per kept neuron
    while t < n:
        gain = numer / diag.clip(min=floor)
        gain[chosen | (diag <= exhausted)] = -1.0
        p = int(gain.argmax())
        if float(gain[p]) < 0:  # nothing left to explain (e.g. fewer calibration tokens than neurons)
            break
        column = c_held[:, held[p]] - factor[:, :t] @ factor[p, :t]  # R_:p on held (C symmetric)
        pivot = float(column[p])
        if not pivot > float(exhausted[p]):  # the tracked R_pp was rounding: p is exhausted
            diag[p] = 0
            continue
        order.append(held[p])
        chosen[p] = True
        kept_since_compaction += 1
        v = column / pivot**0.5
        w = d_held @ v  # (hidden,): D times the new column (zero on neurons no longer held)
        # D R_new_:j = D R_:j − w v_j, so ‖·‖² drops by 2 v_j (wᵀ D R_:j) − v_j² ‖w‖².
        cross = dc.T @ w - factor[:, :t] @ (w_rows[:t] @ w)  # wᵀ D R_:j for every held j
        numer -= 2 * v * cross
        numer += v * v * float(w @ w)
        numer[numer < 0] = 0
        diag -= v * v
        diag[diag < 0] = 0
        factor[:, t], w_rows[t] = v, w
        t += 1
        if kept_since_compaction > len(held) // 4 and t < n:
            stay = ~chosen
            held = [j for j, keep in zip(held, stay.tolist(), strict=True) if keep]
            c_held, d_held, dc = c[held], d[:, held], dc[:, stay]
            numer, diag, exhausted = numer[stay], diag[stay], exhausted[stay]
            compact = zeros(len(held), n)
            compact[:, :t] = factor[stay, :t]
            factor, chosen, kept_since_compaction = compact, diag < 0, 0
    # The exhausted neurons follow in their index order.
    kept = set(order)
    return order + [j for j in range(n) if j not in kept]


#: Neurons a block of `block_greedy_order` commits at once: llama.cpp's quantization block (widths of the native
#: form are multiples of it, so the order inside a block changes no native width).
GREEDY_BLOCK = 32


def block_greedy_order(
    autocorr: torch.Tensor,
    down: torch.Tensor,
    block: int = GREEDY_BLOCK,
    dtype: torch.dtype = torch.float32,
    overwrite: bool = False,
) -> torch.Tensor:
    """`greedy_order` committing `block` neurons per step: among the `2·block` largest gains
    `‖D R_:j‖² / R_jj` given the neurons kept so far (the pool), the exact greedy picks `block`, one at a time,
    every pick updating the pool's gains; then every neuron's gain is updated at once.

    It differs from the one-at-a-time greedy only where that would pick, within a block, a neuron outside the
    pool. The work is in matrix-matrix products (I/block steps) instead of I matrix-vector passes over the
    growing factor, which bound the greedy by memory traffic (the cost that made a 0.5B model's neuron selection
    take 22 minutes).

    Right-looking: the Schur complement R itself is kept (C's matrix, overwritten when `overwrite` and `autocorr`
    is already in `dtype`, else a copy) and updated by each block's rank-b product, so a pool's columns are rows
    of R (R is symmetric: contiguous to read); likewise (D R)ᵀ, whose rows are the neurons. Both hold only the
    neurons not yet kept (the kept ones are dropped whenever they are a quarter of what is held): about
    I³/3 + I²·hidden/2 multiply-adds, and no factor is stored."""
    r = autocorr.to(dtype)
    if not overwrite and r.data_ptr() == autocorr.data_ptr():
        r = r.clone()  # the caller's matrix: R is updated in place
    n = r.shape[0]
    held = torch.arange(n, device=r.device)  # the neurons R and (D R)ᵀ hold: all not kept, a few kept
    dr_t = r @ down.to(dtype=dtype, device=r.device).T  # (held, hidden): (D R)ᵀ = R Dᵀ, R = C at the start
    floor = 1e-12 * float(torch.diagonal(r).max()) if n else 0.0
    kept = torch.zeros(n, dtype=torch.bool, device=r.device)  # on held
    order: list[int] = []
    t = 0
    while t < n:
        diag = torch.diagonal(r)  # R_jj on held
        gain = _row_norms_squared(dr_t) / diag.clamp_min(floor)  # ‖D R_:j‖² / R_jj
        gain.masked_fill_(kept | (diag <= floor), -1.0)
        ranked = torch.argsort(gain, descending=True, stable=True)[: min(2 * block, n - t)]
        pool = ranked[gain[ranked] >= 0]  # positions in held
        if len(pool) == 0:  # nothing left to explain: the rest follow in their index order
            break
        pool_neurons = held[pool]
        rows = r[pool]  # R_pool,held (a copy: advanced indexing)
        d_rows = dr_t[pool]  # (D R_:pool)ᵀ (m × hidden, a copy)
        picked, w_block = [], []  # the block's factor columns and D times them
        arange = torch.arange(len(pool), device=r.device)
        for _ in range(min(block, len(pool))):
            pivots = rows[arange, pool]  # R_jj of the pool
            pool_gain = _row_norms_squared(d_rows) / pivots.clamp_min(floor)
            pool_gain.masked_fill_(kept[pool] | (pivots <= floor), -1.0)
            i = int(torch.argmax(pool_gain))
            if float(pool_gain[i]) < 0:  # the rest of the pool is explained by the block's picks
                break
            scale = pivots[i].sqrt()
            column, w = rows[i] / scale, d_rows[i] / scale
            on_pool = column[pool]
            rows.addr_(on_pool, column, alpha=-1.0)
            d_rows.addr_(on_pool, w, alpha=-1.0)
            picked.append(column)
            w_block.append(w)
            kept[int(pool[i])] = True
            order.append(int(pool_neurons[i]))
        block_factor = torch.stack(picked, dim=1)  # (held × b)
        t += len(picked)
        # R_new = R − Vb Vbᵀ and (D R_new)ᵀ = (D R)ᵀ − Vb Wbᵀ: one rank-b update each.
        r.addmm_(block_factor, block_factor.T, alpha=-1.0)
        dr_t.addmm_(block_factor, torch.stack(w_block), alpha=-1.0)
        if len(held) - (n - t) > len(held) // 4:  # a quarter of what is held is kept: drop those
            stay = ~kept
            held, dr_t, r = held[stay], dr_t[stay], r[stay][:, stay]
            kept = torch.zeros(len(held), dtype=torch.bool, device=r.device)
    chosen = torch.zeros(n, dtype=torch.bool, device=r.device)
    chosen[order] = True
    rest = torch.nonzero(~chosen).flatten().tolist()
    return torch.tensor(order + rest, dtype=torch.long, device=r.device)


def _row_norms_squared(matrix: torch.Tensor) -> torch.Tensor:
    """‖row‖² of every row: the norm along contiguous rows, squared (one pass; `(m * m).sum(1)` writes a
    temporary as large as the matrix, and took 7× the time on a 8960 × 1536 (D R)ᵀ)."""
    return torch.linalg.vector_norm(matrix, dim=1).square()


def neuron_order(rule: str, autocorr: torch.Tensor, down: torch.Tensor, ridge: float) -> torch.Tensor:
    """The order in which neurons are kept under `rule` (one of ORDERS): a permutation of range(I)."""
    if rule == "energy":
        return energy_order(autocorr, down)
    if rule == "leverage":
        return leverage_order(autocorr, ridge)
    if rule in ("greedy", "greedy-block"):
        # The greedy orders run in float32: the fp64 regularized matrix goes as soon as it is cast (the same
        # numbers as casting inside), so the order holds half an I×I fp64 matrix beside `autocorr`, not one and a half.
        c = regularized(autocorr, ridge).to(torch.float32)
        if rule == "greedy":
            return greedy_order(c, down, dtype=torch.float32)
        # The block order updates its Schur complement in `c`, this call's own copy (no second I×I matrix).
        return block_greedy_order(c, down, dtype=torch.float32, overwrite=True)
    raise ValueError(f"unknown neuron order {rule!r}: one of {', '.join(ORDERS)}")


@dataclass(frozen=True)
class NeuronTail:
    """The neurons of one MLP in the order they are kept, the output error at every width k, and the damping
    the Cholesky of `C_λ` in that order needed (0: none; every refit of this MLP uses the same)."""

    order: torch.Tensor  # (I,) permutation: the first k are the kept set at width k
    tail: torch.Tensor  # (I + 1,) fp64: tail[k] = the (regularised) output error keeping order[:k]
    damping: float
    attempts: int  # Cholesky factorizations tried (0: the input was zero at every token)

    @property
    def input_is_zero(self) -> bool:
        return self.attempts == 0

    def kept(self, width: int) -> torch.Tensor:
        """The neurons kept at `width`, in increasing index order (the order they keep in the smaller MLP)."""
        return torch.sort(self.order[:width]).values


def effective(autocorr: torch.Tensor, ridge: float, damping: float) -> torch.Tensor:
    """C_λ plus the damping its Cholesky needed: the matrix every error and refit of one MLP reads."""
    c = regularized(autocorr, ridge)
    if damping:
        c.diagonal().add_(damping)
    return c


def order_tail(autocorr: torch.Tensor, down: torch.Tensor, order: torch.Tensor, ridge: float) -> NeuronTail:
    """The output error `tail[k]` of keeping the first `k` neurons of `order` with `down_proj` refit, for every
    k = 0..I at once (one Cholesky of C_λ in that order, damped and retried like any whitening factor)."""
    n, device = autocorr.shape[0], autocorr.device
    # Two I×I fp64 matrices beside `autocorr` at most (an MLP of the 1.5B model: 0.6 GiB each): C_λ is made
    # directly in the order, and `whitening_factor` averages it with its transpose and damps it in place (the
    # ridge goes on the diagonal first, which averaging leaves as it is: the same numbers as `regularized`).
    permuted = _add_ridge(autocorr[order[:, None], order].to(torch.float64), ridge, autocorr)
    d = down.to(torch.float64)
    factor = whitening_factor(permuted, overwrite=True)
    del permuted
    if factor.input_is_zero:
        explained = torch.zeros(n, dtype=torch.float64, device=device)
    else:
        # The error keeping order[:k] is tr(D C Dᵀ) − ‖D C[:, π] S⁻ᵀ[:, :k]‖² with C[π, π] = S Sᵀ (C damped as
        # the Cholesky needed), and D C[:, π] S⁻ᵀ = D[:, π] S: no solve, no product with C; tr(D C Dᵀ) = ‖D[:, π] S‖².
        explained = lower_product(d[:, order], factor.S).square().sum(dim=0)
    # tail[k] = Σ_{i ≥ k} explained_i: summed from the end, so the small errors near full width carry no
    # cancellation from the total.
    zero = torch.zeros(1, dtype=torch.float64, device=device)
    tail = torch.cat([explained.flip(0).cumsum(0).flip(0), zero])
    if not all_finite(tail):
        raise NumericalError(f"non-finite neuron-selection error for a {tuple(d.shape)} down_proj")
    return NeuronTail(order.clone(), tail.clamp_min(0.0), factor.damping, factor.attempts)


#: Columns of `lower_product`'s result per matrix product.
_LOWER_PRODUCT_COLUMNS = 512


def lower_product(a: torch.Tensor, lower: torch.Tensor) -> torch.Tensor:
    """`a @ lower` for a lower-triangular `lower`, by column blocks that skip its zero rows: column block
    [j, j+b) of the product reads rows j: only (about half the work of the full product)."""
    n = lower.shape[0]
    product = torch.empty(a.shape[0], n, dtype=torch.promote_types(a.dtype, lower.dtype), device=a.device)
    for start in range(0, n, _LOWER_PRODUCT_COLUMNS):
        stop = min(start + _LOWER_PRODUCT_COLUMNS, n)
        torch.matmul(a[:, start:], lower[start:, start:stop], out=product[:, start:stop])
    return product


def refit_down(
    autocorr: torch.Tensor, down: torch.Tensor, neurons: NeuronTail, width: int, ridge: float
) -> torch.Tensor:
    """`D' = D C_λ[:, S] C_λ[S, S]⁻¹` (hidden × width): the least-squares down_proj on the neurons kept at
    `width` (`neurons.kept(width)`, in index order). It reads `C_λ` with the damping of the tail's Cholesky,
    whose leading block is this one's, so the built MLP's error is `neurons.tail[width]`."""
    d = down.to(torch.float64)
    if width == 0 or neurons.input_is_zero:
        return torch.zeros(d.shape[0], width, dtype=torch.float64, device=d.device)
    c = effective(autocorr, ridge, neurons.damping)
    kept = neurons.kept(width)
    # D' C[S, S] = D C[:, S]  ⇔  C[S, S] D'ᵀ = (D C[:, S])ᵀ (C[S, S] symmetric). C goes once the right-hand side
    # and the kept block are made: two I×I fp64 matrices beside `autocorr` at most, the block and its factor.
    rhs = (d @ c[:, kept]).T
    block = c[kept[:, None], kept]
    del c
    factor, info = torch.linalg.cholesky_ex(block)
    del block
    if int(info) != 0:  # a leading block of a matrix whose Cholesky succeeded: only rounding can get here
        raise NumericalError(
            f"Cholesky of the {width} kept neurons' autocorrelation failed (pivot {int(info)})"
        )
    return torch.cholesky_solve(rhs, factor, upper=False).T


def output_error(
    autocorr: torch.Tensor,
    down: torch.Tensor,
    refit: torch.Tensor,
    kept: torch.Tensor,
    ridge: float,
    damping=0.0,
) -> float:
    """The objective for an explicit `D'` on `kept`: tr(E C Eᵀ) with E = D − D' Π_S and C = C_λ + damping·I
    (a check of the tails: tests and reports)."""
    c = effective(autocorr, ridge, damping)
    full = down.to(torch.float64).clone()
    full[:, kept] -= refit.to(torch.float64)
    return float((full @ c * full).sum())
