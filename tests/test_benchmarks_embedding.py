"""The low-rank token embedding weighted on both sides (`benchmarks.experiments.embedding_target.embedding`): exact at full rank, its tail is
its error, and no other rank-r matrix does better in its norm."""

from __future__ import annotations

import pytest
import torch

from benchmarks.experiments.embedding_target.embedding import (
    factored_params,
    token_row_weights,
    weighted_low_rank,
)


def _problem(vocab: int = 40, width: int = 6, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(vocab, width, generator=gen, dtype=torch.float64)
    counts = torch.randint(0, 20, (vocab,), generator=gen).double()  # some tokens never seen
    hidden = torch.randn(200, width, generator=gen, dtype=torch.float64) * torch.linspace(0.2, 4.0, width)
    metric = hidden.T @ hidden / 200 + 0.3 * torch.eye(width, dtype=torch.float64)
    return weight, token_row_weights(counts, 1.0), metric


def _error(weight, approx, row_weights, metric) -> float:
    delta = weight - approx
    return float((row_weights.unsqueeze(1) * (delta @ metric) * delta).sum())


def test_full_rank_is_exact():
    weight, w, metric = _problem()
    a, b, tail = weighted_low_rank(weight, w, metric, weight.shape[1])
    torch.testing.assert_close(a @ b, weight, rtol=1e-10, atol=1e-10)
    assert float(tail[-1]) == 0.0


@pytest.mark.parametrize("rank", [1, 3, 5])
def test_tail_is_the_weighted_error(rank):
    weight, w, metric = _problem()
    a, b, tail = weighted_low_rank(weight, w, metric, rank)
    assert a.shape == (weight.shape[0], rank) and b.shape == (rank, weight.shape[1])
    assert _error(weight, a @ b, w, metric) == pytest.approx(float(tail[rank]), rel=1e-9)
    assert bool((tail[:-1] >= tail[1:]).all())  # more rank, never more error


def test_no_rank_r_matrix_does_better():
    """Eckart–Young in the weighted norm: the plain SVD's truncation and perturbations of the optimum all lose."""
    weight, w, metric = _problem(seed=1)
    rank = 3
    a, b, tail = weighted_low_rank(weight, w, metric, rank)
    best = _error(weight, a @ b, w, metric)
    u, s, vh = torch.linalg.svd(weight, full_matrices=False)
    assert _error(weight, (u[:, :rank] * s[:rank]) @ vh[:rank], w, metric) > best
    gen = torch.Generator().manual_seed(2)
    for _ in range(10):
        a2 = a + 1e-2 * torch.randn(a.shape, generator=gen, dtype=torch.float64)
        b2 = b + 1e-2 * torch.randn(b.shape, generator=gen, dtype=torch.float64)
        assert _error(weight, a2 @ b2, w, metric) > best


def test_heavier_rows_are_kept_better():
    """A token seen far more often than the rest is reproduced almost exactly at rank 1."""
    weight, _, metric = _problem(seed=3)
    counts = torch.zeros(weight.shape[0], dtype=torch.float64)
    counts[7] = 1e6
    a, b, _ = weighted_low_rank(weight, token_row_weights(counts, 1.0), metric, 1)
    row_error = ((weight - a @ b) ** 2).sum(1)
    assert float(row_error[7]) < 1e-4 * float(row_error.mean())


def test_row_weights_and_counting():
    w = token_row_weights(torch.tensor([0.0, 3.0, 1.0]), 1.0)
    torch.testing.assert_close(w, torch.tensor([1.0, 4.0, 2.0], dtype=torch.float64) / 7)
    with pytest.raises(ValueError, match="pseudo_count must be positive"):
        token_row_weights(torch.zeros(3), 0.0)
    weight, w, metric = _problem()
    with pytest.raises(ValueError, match="every row weight must be positive"):
        weighted_low_rank(weight, torch.zeros_like(w), metric, 2)
    assert factored_params(49152, 576, 512) == 512 * (49152 + 576)


def test_a_singular_metric_is_damped_and_said(capsys):
    """A metric that is not positive definite (a hidden direction never used) is damped, and the damping is printed."""
    weight, w, _ = _problem()
    metric = torch.diag(torch.tensor([1.0, 2.0, 0.0, 1.0, 3.0, 1.0], dtype=torch.float64))
    a, b, _ = weighted_low_rank(weight, w, metric, 3)
    assert torch.isfinite(a @ b).all()
    assert "the embedding's metric M was damped by" in capsys.readouterr().err
