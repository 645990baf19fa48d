"""Cached calibration statistics: reused only for the same model/text/windows, validated on load."""

from __future__ import annotations

import pytest
import torch
from conftest import random_windows, tiny_model
from test_capture import assert_within_gram_bound, projection_input

from compressor.modeling.adapters import get_adapter
from compressor.statistics.cache import load_stats, model_fingerprint, save_stats, stats_key, stats_path
from compressor.statistics.capture import collect_statistics


def _setup(monkeypatch, tmp_path):
    monkeypatch.setenv("MASA_CACHE", str(tmp_path))
    model = tiny_model("llama")
    adapter = get_adapter(model)
    windows = random_windows()
    stats = collect_statistics(model, adapter, windows, progress=False)
    key = stats_key(model_fingerprint(model), "text-sha", windows, torch.float32)
    return model, adapter, windows, stats, key


def test_round_trip_returns_identical_statistics(monkeypatch, tmp_path):
    _, adapter, _, stats, key = _setup(monkeypatch, tmp_path)
    save_stats(stats, key)
    loaded, why = load_stats(key, adapter)
    assert loaded is not None, why
    for a, b in zip(
        stats.attn_autocorr + stats.o_autocorr, loaded.attn_autocorr + loaded.o_autocorr, strict=True
    ):
        assert torch.equal(a, b)
    assert torch.equal(stats.block_output_means, loaded.block_output_means)


def test_key_changes_with_model_text_and_windows(monkeypatch, tmp_path):
    model, _, windows, _, key = _setup(monkeypatch, tmp_path)
    other_model = tiny_model("llama", seed=1)
    assert stats_key(model_fingerprint(other_model), "text-sha", windows, torch.float32) != key
    assert stats_key(model_fingerprint(model), "other-text", windows, torch.float32) != key
    assert stats_key(model_fingerprint(model), "text-sha", random_windows(seed=1), torch.float32) != key
    # forward passes in bfloat16 give other numbers: another key (the model's own dtype keeps its key)
    bf16 = stats_key(model_fingerprint(model), "text-sha", windows, torch.float32, autocast=torch.bfloat16)
    assert bf16 != key
    assert stats_key(model_fingerprint(model), "text-sha", windows, torch.float32, autocast=None) == key


def test_damaged_or_foreign_cache_files_are_not_trusted(monkeypatch, tmp_path):
    _, adapter, _, stats, key = _setup(monkeypatch, tmp_path)
    path = save_stats(stats, key)
    path.write_bytes(path.read_bytes()[:100])  # truncated
    loaded, why = load_stats(key, adapter)
    assert loaded is None and "unreadable" in why
    stats.attn_autocorr[0][0, 0] = float("nan")
    save_stats(stats, key)
    loaded, why = load_stats(key, adapter)
    assert loaded is None and "non-finite" in why
    assert stats_path(key).is_file()


def test_mlp_statistics_round_trip_under_their_own_key(monkeypatch, tmp_path):
    model, adapter, windows, _, attn_key = _setup(monkeypatch, tmp_path)
    stats = collect_statistics(model, adapter, windows, progress=False, mlp=True)
    key = stats_key(model_fingerprint(model), "text-sha", windows, torch.float32, mlp=True)
    assert key != attn_key  # attention-only statistics never stand in for these
    save_stats(stats, key)
    loaded, why = load_stats(key, adapter)
    assert loaded is not None and loaded.has_mlp, why
    for kind in ("attn", "o", "mlp", "down"):
        for layer in range(adapter.num_layers):
            assert torch.equal(stats.autocorr(kind, layer), loaded.autocorr(kind, layer))
            assert torch.equal(stats.input_mean(kind, layer), loaded.input_mean(kind, layer))


def test_statistics_without_the_gate_input_round_trip_under_their_own_key(monkeypatch, tmp_path):
    """What a neuron-selecting method collects (no gate/up input) is cached apart from the full set: a method that
    factors gate/up never reads a file without it, and the file says which inputs it holds."""
    model, adapter, windows, _, _ = _setup(monkeypatch, tmp_path)
    stats = collect_statistics(model, adapter, windows, progress=False, mlp=True, gate_input=False)
    assert stats.inputs == ("attn", "o", "down") and stats.has_mlp
    key = stats_key(model_fingerprint(model), "text-sha", windows, torch.float32, mlp=True, gate_input=False)
    assert key != stats_key(model_fingerprint(model), "text-sha", windows, torch.float32, mlp=True)
    save_stats(stats, key)
    loaded, why = load_stats(key, adapter)
    assert loaded is not None and loaded.inputs == ("attn", "o", "down"), why
    for layer in range(adapter.num_layers):
        assert torch.equal(stats.autocorr("down", layer), loaded.autocorr("down", layer))
    with pytest.raises(
        ValueError, match="mlp input autocorrelations were not collected: pass mlp=True, gate_input"
    ):
        loaded.autocorr("mlp", 0)


def test_statistics_of_another_format_are_never_reused(monkeypatch, tmp_path):
    """Format 1 held the summed autocorrelations Σ xᵀx, format 2 their token means, format 3 adds the inputs' means:
    a format-1 file, read as a later one, would scale every statistic by the token count, so the format is part of
    the key."""
    import compressor.statistics.cache as stats_cache

    model, adapter, windows, stats, key = _setup(monkeypatch, tmp_path)
    assert stats_cache.STATS_FORMAT == 7
    monkeypatch.setattr(stats_cache, "STATS_FORMAT", 1)
    stale = stats_key(model_fingerprint(model), "text-sha", windows, torch.float32)
    assert stale != key
    save_stats(stats, stale)
    assert load_stats(key, adapter)[0] is None


def test_the_autocorrelations_are_token_means(monkeypatch, tmp_path):
    model, adapter, windows, stats, _ = _setup(monkeypatch, tmp_path)
    assert stats.tokens == windows.numel()
    q_input = projection_input(model, adapter, 1, "q_proj", windows)
    assert_within_gram_bound(stats.autocorr("attn", 1), q_input, tokens=windows.numel())
    x = q_input.reshape(-1, q_input.shape[-1]).double()
    # Each window summed in fp32 (its T tokens: an error of at most T·2⁻²⁴ of Σ|x|), the windows added in fp64.
    bound = windows.shape[1] * 2.0**-24 * x.abs().mean(0)
    assert bool(((stats.input_mean("attn", 1) - x.mean(0)).abs() <= bound).all())


def test_the_loss_sensitivity_is_cached_beside_its_statistics(monkeypatch, tmp_path):
    """A first run measures the sensitivity during its capture (no pass of its own); a second run with the same
    statistics and number of sensitivity windows skips it: the cached sensitivity is the measured one, exactly;
    another window count or a damaged file is measured again, by a pass of its own (the statistics are cached)."""
    from conftest import tiny_model_dir

    import compressor.api.pipeline as pipeline
    from compressor.api import compress
    from compressor.api.run_options import CompressOptions
    from compressor.statistics.sensitivity import LossGradients

    monkeypatch.setenv("MASA_CACHE", str(tmp_path / "cache"))
    path = str(tiny_model_dir(tmp_path / "tiny"))
    text = tmp_path / "calib.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 400)
    measured, separate = [], []
    result, collect_alone = LossGradients.result, pipeline.collect_sensitivity
    monkeypatch.setattr(LossGradients, "result", lambda self, s: measured.append(1) or result(self, s))
    monkeypatch.setattr(
        pipeline, "collect_sensitivity", lambda *a, **k: separate.append(1) or collect_alone(*a, **k)
    )

    def run(**extra):
        options = CompressOptions(
            calib=str(text), calib_samples=4, seq_len=32, evaluate=False, save=False, **extra
        )
        return compress(path, options, progress=False).outcome

    first = run()
    assert (measured, separate) == ([1], [])  # measured by the capture's first windows
    second = run()
    assert measured == [1]  # the second run read it from the cache
    assert first.plan.to_dict() == second.plan.to_dict()
    run(sensitivity_samples=2)  # another window count: measured again, the statistics read from the cache
    assert (measured, separate) == ([1, 1], [1])
    for cached in (tmp_path / "cache" / "stats").glob("*.sensitivity-4.json"):
        cached.write_text("{not json")
    run()
    assert measured == [1, 1, 1]


def test_cached_statistics_collects_once_then_reads_the_same_numbers(monkeypatch, tmp_path):
    """The one lookup `compress` and the benchmark harness share: the first call collects and caches, the
    second reads identical statistics under the same key without collecting."""
    from compressor.statistics.cache import attach_cached_sensitivity, cached_statistics, save_sensitivity
    from compressor.statistics.sensitivity import Sensitivity

    model, adapter, windows, stats, _ = _setup(monkeypatch, tmp_path)
    collected, lookups = [], []

    def collect():
        collected.append(1)
        return stats

    def lookup(**kw):
        return cached_statistics(
            model, adapter, "text-sha", windows, torch.float32, False, collect, on_lookup=lookups.append
        )

    first, first_note, key = lookup()
    second, second_note, second_key = lookup()
    assert collected == [1] and key == second_key
    assert first_note.startswith("computed and cached") and second_note.startswith("reused cached")
    assert lookups[0] == "no cached statistics"
    for a, b in zip(first.attn_autocorr, second.attn_autocorr, strict=True):
        assert torch.equal(a, b)

    projections = ("q_proj", "o_proj")
    assert not attach_cached_sensitivity(second, key, 8, adapter.num_layers, projections)
    weights = {(layer, p): 1.0 + layer for layer in range(adapter.num_layers) for p in projections}
    save_sensitivity(Sensitivity(weights, 100, min(8, second.windows), 0.5), key)
    assert attach_cached_sensitivity(second, key, 8, adapter.num_layers, projections)
    assert second.sensitivity.weights == weights
    # Other projections than were measured: not attached (measured again by the run).
    assert not attach_cached_sensitivity(second, key, 8, adapter.num_layers, ("q_proj", "down_proj"))


def test_statistics_read_from_the_cache_say_how_they_were_computed(monkeypatch, tmp_path):
    """What `compress_model` reads to measure a missing loss sensitivity the same way (`stats.autocast`)."""
    from compressor.statistics.cache import cached_statistics

    model, adapter, windows, _, _ = _setup(monkeypatch, tmp_path)

    def collect():
        return collect_statistics(model, adapter, windows, progress=False, autocast=torch.bfloat16)

    cached_statistics(
        model, adapter, "text-sha", windows, torch.float32, False, collect, autocast=torch.bfloat16
    )
    again, note, _ = cached_statistics(
        model, adapter, "text-sha", windows, torch.float32, False, collect, autocast=torch.bfloat16
    )
    assert note.startswith("reused cached") and again.autocast == torch.bfloat16
    _, note, _ = cached_statistics(model, adapter, "text-sha", windows, torch.float32, False, collect)
    assert note.startswith("computed and cached")  # the float32 statistics are not the bfloat16 ones
