"""`make bench-quick`: the reduced benchmark runs end to end, writes its files and only finite numbers."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_quick_benchmark_writes_finite_results(tmp_path):
    out = tmp_path / "bench"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.run", "--quick", "--out-dir", str(out)],
        cwd=REPO,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]

    results = json.loads((out / "results.json").read_text())
    for key in (
        "quality",
        "original_ppl",
        "compress_over_forward",
        "depth_memory_ratio",
        "prefill_latency_ratio",
        "decode_latency_ratio",
        "machine",
        "date",
        "command",
    ):
        assert key in results, key
    assert results["quick"] is True
    assert results["quality"] and all({"method", "ratio", "ppl"} <= set(row) for row in results["quality"])
    for key in ("original_ppl", "compress_over_forward", "depth_memory_ratio", "prefill_latency_ratio"):
        assert math.isfinite(results[key]) and results[key] > 0, key
    assert results["machine"]["torch_threads"] >= 1 and results["machine"]["cpu"]

    doc = (out / "BENCHMARKS.md").read_text()
    for png in ("quality.png", "compression_stages.png", "latency.png", "scaling.png"):
        assert (out / png).stat().st_size > 0
        assert f"]({png})" in doc  # linked relative to the page
    assert "quick mode" in doc


def test_report_renders_from_results_json(tmp_path):
    """The page and plots are a pure function of results.json (re-rendering needs no measurement)."""
    from benchmarks.report import render

    results = _fake_results()
    results_path = tmp_path / "results.json"
    results_path.write_text(json.dumps(results))
    written = render(results, results_path, tmp_path / "doc" / "BENCHMARKS.md", tmp_path / "plots")
    assert all(path.is_file() and path.stat().st_size > 0 for path in written)
    doc = written[0].read_text()
    assert "](../plots/quality.png)" in doc and "](../results.json)" in doc
    assert "| `masa` | 0.2 | 0.2000 | 25.000 [24.00, 26.00] |" in doc
    assert "| `svd` | 0.2 | 0.2000 | 90.000 | — | — | -65.000 [-70.000, -60.000] |" in doc
    assert "+0.100 [-0.100, +0.300] (tie)" in doc  # a difference whose interval holds 0 is called a tie
    assert "**missed**" in doc  # the fake prefill ratio 1.3 is over the 1.15 target


def test_non_finite_paths():
    from benchmarks.common import non_finite

    assert non_finite({"a": [1.0, float("nan")], "b": {"c": float("inf")}, "d": "x", "e": None}) == [
        "a[1]",
        "b.c",
    ]


def _fake_results() -> dict:
    run = {
        "layers": 2,
        "width": {
            "hidden_size": 8,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "intermediate_size": 16,
            "vocab_size": 32,
        },
        "calibration": {"samples": 2, "seq_len": 8, "tokens": 16},
        "ratio": 0.2,
        "model_params": 1000,
        "model_gib": 1e-5,
        "stats_gib": 1e-6,
        "seconds": {"build": 0.1, "calibration": 1.0, "compress": 2.0, "save": 0.1},
        "compress_seconds": 3.1,
        "rss_after_model_gib": 0.3,
        "peak_rss_gib": 0.32,
        "overhead_gib": 0.02,
        "peak_gib_after": {"start": 0.2, "build": 0.3, "calibration": 0.31, "compress": 0.32, "save": 0.32},
    }
    side = {
        "prefill_ms": 100.0,
        "prefill_projection_ms": 30.0,
        "decode_ms": 640.0,
        "decode_projection_ms": 200.0,
        "decode_ms_per_token": 10.0,
        "params": 1e6,
        "param_gib": 0.004,
    }
    return {
        "command": "python -m benchmarks.run",
        "date": "2026-01-01T00:00:00+00:00",
        "wall_minutes": 1.0,
        "machine": {
            "cpu": "cpu",
            "cores": 2,
            "usable_cores": 2,
            "ram_gib": 8,
            "os": "Linux",
            "python": "3.11",
            "torch": "2",
            "torch_threads": 2,
            "transformers": "5",
            "device": "cpu",
        },
        "quality": [
            {"method": "masa", "ratio": 0.2, "ppl": 25.0, "achieved_ratio": 0.2, "ppl_ci95": [24.0, 26.0]},
            {
                "method": "svd",
                "ratio": 0.2,
                "ppl": 90.0,
                "achieved_ratio": 0.2,
                "default_minus_this": {"value": -65.0, "ci95": [-70.0, -60.0], "tie": False},
            },
            {"method": "masa", "ratio": 0.4, "ppl": 40.0, "achieved_ratio": 0.4},
            {
                "method": "svd",
                "ratio": 0.4,
                "ppl": 40.1,
                "achieved_ratio": 0.4,
                "default_minus_this": {"value": 0.1, "ci95": [-0.1, 0.3], "tie": True},
            },
        ],
        "original_ppl": 20.0,
        "quality_details": {"model": "m", "calibration": {}, "evaluation": {"tokens": 100, "split": "test"}},
        "compression": {
            "command": "masa-compress m",
            "ratio": 0.2,
            "achieved_ratio": 0.2,
            "calibration": {"samples": 2, "seq_len": 8},
            "stage_seconds": {
                "calibration": 3.0,
                "grouping": 0.1,
                "pca": 0.2,
                "residual_svd": 2.0,
                "save": 0.5,
            },
            "compress_seconds": 5.8,
            "load_seconds": 1.0,
            "other_seconds": 0.5,
            "peak_rss_gib": 1.0,
            "checkpoint_mib": 10.0,
            "forward": {"windows": 2, "seq_len": 8, "batch_size": 1},
            "forward_seconds": 2.0,
            "compress_over_forward_wall": 3.1,
            "dominant_stage": "calibration",
        },
        "compress_over_forward": 2.9,
        "latency": {
            "prefill_tokens": 8,
            "decode_tokens": 64,
            "repeats": 3,
            "torch_threads": 2,
            "original": side,
            "compressed": {**side, "prefill_ms": 130.0, "prefill_projection_ms": 55.0},
            "decoded_tokens_equal_to_original": 10,
        },
        "prefill_latency_ratio": 1.3,
        "decode_latency_ratio": 1.0,
        "scaling": {
            "runs": [run, {**run, "layers": 4, "peak_rss_gib": 0.36, "rss_after_model_gib": 0.33}],
            "depth_factor": 2.0,
            "time_ratio": 2.0,
            "peak_ratio": 1.125,
            "overhead_ratio": 1.5,
            "model_ratio": 1.6,
        },
        "depth_memory_ratio": 1.125,
        "depth_memory_overhead_ratio": 1.5,
    }
