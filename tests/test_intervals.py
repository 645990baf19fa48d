"""Bootstrap intervals over windows: reproducible for a seed, paired differences, ties."""

from __future__ import annotations

import math

import numpy as np
import pytest

from compressor.evaluation.intervals import paired_difference, perplexity_interval, resample_indices


def _windows(n: int = 40, seed: int = 1, shift: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    tokens = np.full(n, 100)
    nll = tokens * (3.0 + shift + rng.normal(0.0, 0.3, n))  # per-window summed NLL
    return nll, tokens


def test_same_seed_same_interval_other_seed_other_interval():
    nll, tokens = _windows()
    first = perplexity_interval(nll, tokens, seed=7)
    assert perplexity_interval(nll, tokens, seed=7) == first
    assert perplexity_interval(nll, tokens, seed=8) != first
    assert np.array_equal(resample_indices(40, 5, seed=3), resample_indices(40, 5, seed=3))


def test_interval_brackets_the_perplexity_and_shrinks_with_more_windows():
    nll, tokens = _windows(n=40)
    ppl = math.exp(nll.sum() / tokens.sum())
    lo, hi = perplexity_interval(nll, tokens)
    assert lo < ppl < hi
    many_nll, many_tokens = _windows(n=640)
    lo_many, hi_many = perplexity_interval(many_nll, many_tokens)
    assert hi_many - lo_many < (hi - lo) / 2  # ~1/sqrt(16) of the width


def test_paired_difference_separates_a_constant_shift_and_calls_identical_models_a_tie():
    nll, tokens = _windows()
    worse = nll + 0.02 * tokens  # +0.02 nats/token on every window: small, but the same everywhere
    diff = paired_difference(worse, nll, tokens)
    assert diff.value == pytest.approx(math.exp(worse.sum() / 4000) - math.exp(nll.sum() / 4000))
    assert diff.ci95[0] > 0 and not diff.tie  # pairing removes the windows' shared difficulty
    # Unpaired, the two perplexity intervals overlap: only the paired comparison can rank them.
    assert perplexity_interval(worse, tokens)[0] < perplexity_interval(nll, tokens)[1]
    # Differences of ±1 nat per window that cancel in total: no model is better.
    noise = nll + np.where(np.arange(len(nll)) % 2 == 0, 1.0, -1.0)
    assert paired_difference(noise, nll, tokens).tie
    assert paired_difference(nll, nll, tokens).to_dict() == {"value": 0.0, "ci95": [0.0, 0.0], "tie": True}


def test_shapes_are_checked():
    with pytest.raises(ValueError, match="equal 1-D"):
        perplexity_interval([1.0, 2.0], [10])
