"""`make bench-large`'s arithmetic and page (benchmarks/engines/large.py) on made-up runs: the figures, their verdicts, and
a command line per run. The runs themselves take hours on the real 1.5B model and are never part of the tests."""

from benchmarks.engines.large import RUNS, cli_args, figures, render, summary_rows


def _run(
    before: float, after: float, seconds: dict, peak: float, planned: float, reloaded: float | None = None
):
    quality = {
        "ppl_before": before, "ppl_after": after, "ppl_after_ci95": [after - 1, after + 1],
        "ppl_rise_ci95": [after - before - 0.1, after - before + 0.1], "ppl_ratio": after / before,
        "kl_to_original": 0.01, "top1_agreement": 0.9, "tokens": 16352,
    }  # fmt: skip
    run = {
        "run": {"quality": quality, "seconds": seconds, "checkpoint_bytes": 5 * 2**30,
                "process": {"peak_rss_gib": peak, "wall_seconds": 600.0}},
        "plan": {"planned_gib": planned}, "what": "a run",
    }  # fmt: skip
    if reloaded is not None:
        run["reloaded"] = {"ppl": reloaded, "tokens": 16352}
    return run


def test_figures_and_verdicts():
    runs = {
        "attention": _run(16.0, 16.2, {"calibration": 300.0}, 17.0, 17.5, reloaded=16.2),
        "attention-svd-llm": _run(16.0, 18.0, {"calibration": 300.0}, 17.0, 17.5),
        "whole": _run(16.0, 22.0, {"calibration": 600.0, "neuron_selection": 900.0}, 6.6, 6.0),
        "whole-svd-llm": _run(16.0, 88.0, {"calibration": 600.0}, 6.0, 6.0),
    }
    out = figures(runs)
    assert out["large_whole_model_ppl_over_svd_llm"] == 0.25
    assert abs(out["large_attention_rise_ratio"] - 0.2 / 2.0) < 1e-12
    assert abs(out["large_whole_model_ppl_ratio"] - 22.0 / 16.0) < 1e-12
    assert abs(out["large_peak_rss_over_planned"] - 1.1) < 1e-12
    assert out["large_neuron_selection_over_capture"] == 1.5
    runs["whole-uniform"] = _run(16.0, 23.0, {"calibration": 600.0}, 7.2, 6.0)  # further over its plan
    assert abs(figures(runs)["large_peak_rss_over_planned"] - 1.2) < 1e-12
    rows = "\n".join(summary_rows(out))
    assert "`large_attention_rise_ratio`" in rows and "0.100x | ≤ 0.15x | met" in rows
    assert "`large_neuron_selection_over_capture`" in rows and "1.500x | ≤ 1x | **missed**" in rows
    # A figure whose runs were not measured is left out, never shown as a number.
    assert (
        figures({"whole": runs["whole"]})
        .keys()
        .isdisjoint({"large_attention_rise_ratio", "large_whole_model_ppl_over_svd_llm"})
    )
    runs["attention-svd-llm"] |= {"note": "its calibration read from the cache", "date": "2026-11-27 09:52"}
    page = render({"command": "python -m benchmarks.engines.large", "machine": {"cpu": "cpu", "cores": 2},
                   "date": "2026-11-27", "runs": runs} | out)  # fmt: skip
    assert "calibration 300 (its calibration read from the cache)" in page and "| 2026-11-27 09:52 |" in page
    assert "16.2000 on 16,352 tokens (the run: 16.2000 on 16,352)" in page
    assert "16.000 → 22.000" in page


def test_every_run_has_a_command_line():
    assert cli_args({"ratio": 0.2, "ratio_of": "model", "layerwise": True, "uniform_mlp": True}) == [
        "--ratio", "0.2", "--ratio-of", "model", "--layerwise", "--uniform-mlp",
    ]  # fmt: skip
    whole = [values for values, _, _ in RUNS.values() if values.get("targets") == "attn,mlp"]
    # In memory the 1.5B model's MLP statistics do not fit 24 GB: every whole-model run is layer by layer.
    assert whole and all(values["layerwise"] for values in whole)


def test_sigterm_unwinds_the_temporary_directory(tmp_path):
    """A killed benchmark (SIGTERM) exits through its `with` blocks: the temporary checkpoints are removed."""
    import os
    import signal
    import tempfile

    import pytest

    from benchmarks.suite.common import exit_on_sigterm

    previous = signal.getsignal(signal.SIGTERM)
    try:
        exit_on_sigterm()
        with pytest.raises(SystemExit) as exited:
            with tempfile.TemporaryDirectory(dir=tmp_path) as work:
                (tmp_path / "seen").write_text(work)
                os.kill(os.getpid(), signal.SIGTERM)
        assert exited.value.code == 128 + signal.SIGTERM
        assert not os.path.exists((tmp_path / "seen").read_text())
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_the_conversion_is_measured_apart_before_the_runs(monkeypatch):
    """A cache without the converted model: the conversion runs in a child process of its own (`--convert-only`)
    before any run, its peak set beside `plan`'s first-use estimate and named on the page; a converted model: no
    child at all."""
    import benchmarks.engines.large as large
    import compressor.api.model_loading as model_loading

    children = []

    def child(module, args, what):
        children.append((module, args))
        return {"converted": "somewhere", "process": {"peak_rss_gib": 8.9, "wall_seconds": 120.0}}

    monkeypatch.setattr(large, "run_module_measured", child)
    monkeypatch.setattr(model_loading, "needs_conversion", lambda source: False)
    assert large.convert_model() is None and children == []
    monkeypatch.setattr(model_loading, "needs_conversion", lambda source: True)
    conversion = large.convert_model()
    assert children == [("benchmarks.engines.large", ["--convert-only"])]
    assert conversion["process"]["peak_rss_gib"] == 8.9 and 8.5 < conversion["planned_gib"] < 9.5
    page = render({"command": "c", "machine": {"cpu": "cpu", "cores": 2}, "date": "d", "runs": {},
                   "conversion": conversion})  # fmt: skip
    assert "peak RSS 8.90 GiB, 2.0 min; `plan` printed" in page and "No run's figures include it" in page
