"""`make bench-quick`: the reduced benchmark runs end to end, writes its files and only finite numbers."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.long
def test_quick_benchmark_writes_finite_results(tmp_path):
    out = tmp_path / "bench"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.suite.run", "--quick", "--out-dir", str(out)],
        cwd=REPO,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]

    from benchmarks.suite.common import machine_signature

    results = json.loads((out / "results.json").read_text())
    for key in (
        "quality",
        "original_ppl",
        "compress_over_forward",
        "depth_memory_ratio",
        "depth_overhead_growth",
        "larger_than_memory",
        "prefill_latency_ratio",
        "decode_latency_ratio",
        "machine",
        "date",
        "command",
    ):
        assert key in results, key
    assert results["quick"] is True
    assert results["quality"] and all({"method", "ratio", "ppl"} <= set(row) for row in results["quality"])
    for key in (
        "original_ppl",
        "compress_over_forward",
        "depth_memory_ratio",
        "depth_overhead_growth",
        "prefill_latency_ratio",
    ):
        assert math.isfinite(results[key]) and results[key] > 0, key
    deep = results["larger_than_memory"]
    assert all(deep[k] > 0 for k in ("layers", "weights_bytes", "peak_rss_bytes", "ppl"))
    assert results["scaling"]["same_checkpoint"]["identical"] is True
    assert results["machine"]["torch_threads"] >= 1 and results["machine"]["cpu"]
    # Every section's machine beside its date: one run, one machine.
    assert set(results["section_machines"]) == set(results["section_dates"])
    assert set(results["section_machines"].values()) == {machine_signature(results["machine"])}

    doc = (out / "BENCHMARKS.md").read_text()
    for png in ("quality.png", "compression_stages.png", "latency.png", "scaling.png"):
        assert (out / png).stat().st_size > 0
        assert f"]({png})" in doc  # linked relative to the page
    assert "quick mode" in doc


def test_committed_page_is_the_render_of_the_committed_results():
    """BENCHMARKS.md as committed is what `python -m benchmarks.report` renders from the committed results files
    (benchmarks/results/: results.json, the engine, 1.5B and zero-shot files, choices/): no figure on the page
    that its files do not hold. The plots are not compared (matplotlib's bytes vary); their links are."""
    from benchmarks.report.page import render_markdown
    from benchmarks.report.plots import plot_paths

    results_path = REPO / "benchmarks" / "results" / "results.json"
    results = json.loads(results_path.read_text())
    doc = REPO / "BENCHMARKS.md"
    rendered = render_markdown(
        {**results, "_results_path": str(results_path)}, doc, plot_paths(results, results_path.parent)
    )
    assert rendered == doc.read_text(), (
        "BENCHMARKS.md differs from its results: re-run python -m benchmarks.report"
    )


def test_report_renders_from_results_json(tmp_path):
    """The page and plots are a pure function of results.json (re-rendering needs no measurement)."""
    from benchmarks.report.page import render

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
    assert "| ≤ 1.15x | met |" in doc  # depth_memory_ratio 1.05
    assert "(`depth_overhead_growth`) | 1.050x | ≤ 1.1x | met |" in doc
    assert "| 0.250x | < 0.5x | met |" in doc  # the deep model's peak is a quarter of its weights
    assert "byte-for-byte identical to the in-memory path's" in doc
    # The model 20% smaller beside attention only, every stage by name; the demo in minutes, against its target.
    assert "| MLP neuron orders and their errors at every width | — | 2.0 | 2.0 |" in doc
    assert "| **compression (every stage)** | **5.8** | **8.2** | **6.2** |" in doc
    assert "**With `--calib-precision bfloat16`: 3.100x** (above the 1.6x target)" in doc
    assert "multiplies bfloat16 natively" in doc
    assert "(`whole_model_compress_over_forward`) | 4.100x | ≤ 1.6x | **missed** |" in doc
    assert "(`demo_minutes`) | 5.500 min | ≤ 6 min | met |" in doc
    assert "(`calibration_over_forward`) | 1.500x | ≤ 1.15x | **missed** |" in doc
    assert "### Projected memory for larger models" in doc and "| Llama-3.1-70B | attn,mlp |" in doc
    # The narrow fake runs' overheads (~20 MiB of runtime buffers) are far from the formula's: said, not hidden.
    assert "**off by up to" in doc and "From 4 to 16 layers the formula's overhead grows" in doc


def _rendered(results: dict, tmp_path) -> str:
    """BENCHMARKS.md as `render` writes it from `results` (saved first as results.json beside it)."""
    from benchmarks.report.page import render

    path = tmp_path / "results.json"
    path.write_text(json.dumps(results))
    return render(results, path, tmp_path / "BENCHMARKS.md", tmp_path)[0].read_text()


def test_scaling_verdicts_come_from_the_numbers(tmp_path):
    """An overhead that grows 1.3x, a deep model peaking above half its weights and checkpoints that differ are
    reported as missed targets."""

    results = _fake_results()
    scaling = results["scaling"]
    scaling["overhead_growth"] = results["depth_overhead_growth"] = 1.3
    scaling["same_checkpoint"]["identical"] = False
    results["larger_than_memory"]["peak_rss_bytes"] = results["larger_than_memory"]["weights_bytes"]
    doc = _rendered(results, tmp_path)
    assert "(`depth_overhead_growth`) | 1.300x | ≤ 1.1x | **missed** |" in doc
    assert "**Overhead at 16 / 4 layers: 1.300x** (target ≤ 1.1x: **missed**)" in doc
    assert "| 1.000x | < 0.5x | **missed** |" in doc
    assert "not identical to the in-memory path's" in doc and "target identical: **missed**" in doc


def test_report_renders_scaling_results_of_the_former_schema(tmp_path):
    """results.json measured before `--layerwise` (no `mode`) still renders: the section asks for a re-run."""

    results = _fake_results()
    results["scaling"] = {"runs": [], "peak_ratio": 1.2, "time_ratio": 2.0}
    del results["larger_than_memory"], results["depth_overhead_growth"]
    doc = _rendered(results, tmp_path)
    assert "--sections scaling" in doc
    assert "(`depth_overhead_growth`)" not in doc  # a figure the results do not hold has no summary row


def test_memory_projection_terms():
    from benchmarks.report.memory_projection import (
        LLAMA,
        Shape,
        Workload,
        device_peak,
        overhead,
        phase_calibration,
        svd_bytes,
    )

    tiny = Shape(
        "tiny", hidden=4, heads=2, kv_heads=1, head_dim=2, intermediate=8, layers=4, vocab=10, tied=True
    )
    w = Workload(windows=2, seq_len=3, sensitivity=1)
    # Calibration, by hand: the stream 2·3·4·4 = 96; the fp64 autocorrelations 8·(4² + 4²) = 256; one window's
    # activations 3·4·(3·4 + 2·4 + 2·2 + 3·8) = 576; the hook's two fp64 copies of the widest input 16·3·4 = 192.
    assert phase_calibration(tiny, w) == 96 + 256 + 576 + 192
    assert svd_bytes(6, 4) == 8 * (4 * 24 + 6 * 16)
    # Wider models and more calibration tokens need more; depth adds only the block-output means (4·L·N·H).
    wider = Shape("wider", 8, 2, 1, 4, 16, 4, 10, True)
    assert overhead(wider, w) > overhead(tiny, w)
    deeper = Shape("deeper", 4, 2, 1, 2, 8, 8, 10, True)  # the same runs of 4 layers sharing a basis
    assert overhead(deeper, w) - overhead(tiny, w) == 4 * 4 * 2 * 4
    assert overhead(tiny, Workload(4, 3, 1)) > overhead(tiny, w)
    # The Llama projection grows with the model, and attn,mlp needs at least what attention alone does.
    peaks = [
        device_peak(shape, Workload(128, 2048, 16, mlp=True, dtype_bytes=2, gpu=True)) for shape, _ in LLAMA
    ]
    assert peaks == sorted(peaks)
    for shape, _ in LLAMA:
        attn = Workload(128, 2048, 16, dtype_bytes=2, gpu=True)
        assert device_peak(shape, attn) <= device_peak(shape, Workload(128, 2048, 16, True, 2, True))


def test_memory_projection_validation_against_a_measured_run():
    """The formula next to a measured run: R0 is the run's loaded RSS, so the predicted peak is R0 + overhead."""
    from benchmarks.report.memory_projection import GIB, Shape, measured_workload, overhead, validation_rows

    run = _fake_results()["scaling"]["runs"][0]
    (row,) = validation_rows([run], runtime=run["rss_loaded_gib"] * GIB)
    predicted = overhead(Shape.from_width(run["width"], run["layers"]), measured_workload(run))
    assert row["predicted_overhead"] == predicted
    assert row["predicted_peak"] == run["rss_loaded_gib"] * GIB + predicted
    assert row["measured_overhead"] == run["overhead_gib"] * GIB


def test_non_finite_paths():
    from benchmarks.suite.common import non_finite

    assert non_finite({"a": [1.0, float("nan")], "b": {"c": float("inf")}, "d": "x", "e": None}) == [
        "a[1]",
        "b.c",
    ]


def test_a_results_file_is_replaced_whole_or_kept(tmp_path, monkeypatch):
    from benchmarks.suite import common

    out = tmp_path / "sub" / "results.json"
    common.write_json(out, {"a": 1})
    assert json.loads(out.read_text()) == {"a": 1} and out.read_text().endswith("\n")

    def failing_dump(*args, **kwargs):
        raise RuntimeError("interrupted")

    # A payload that cannot be written leaves the previous file as it was, and no temporary file beside it.
    monkeypatch.setattr(common.json, "dumps", failing_dump)
    with pytest.raises(RuntimeError):
        common.write_json(out, {"a": 2})
    assert json.loads(out.read_text()) == {"a": 1}
    assert [p.name for p in out.parent.iterdir()] == ["results.json"]


def test_a_results_file_names_the_command_that_made_it(monkeypatch):
    from benchmarks.suite.common import command_line

    monkeypatch.setattr(sys, "argv", ["x", "--from-the-process"])
    assert (
        command_line("benchmarks.engines.large", ["--runs", "whole"])
        == "python -m benchmarks.engines.large --runs whole"
    )
    # An empty list is the arguments given (none), not the process's.
    assert command_line("benchmarks.engines.large", []) == "python -m benchmarks.engines.large"
    # Quoted as a shell reads it back: an argument with spaces stays one, an empty one stays.
    assert (
        command_line("m", ["--args", "--ratio 0.2", "--kinds", ""])
        == "python -m m --args '--ratio 0.2' --kinds ''"
    )
    assert (
        command_line("benchmarks.engines.large", None)
        == "python -m benchmarks.engines.large --from-the-process"
    )


def _scaling_run(layers: int, overhead: float, **extra) -> dict:
    """One depth of `benchmarks.suite.scaling.run_scaling` (the narrow width, tiny numbers)."""
    loaded = 0.38
    return {
        "layers": layers,
        "width": {
            "hidden_size": 64,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "intermediate_size": 128,
            "vocab_size": 256,
        },
        "calibration": {"samples": 4, "seq_len": 64, "tokens": 256},
        "sensitivity_windows": 2,
        "compression_settings": {"method": "masa", "targets": "attn", "sharing": "basis", "basis_layers": 4},
        "ratio": 0.2,
        "achieved_ratio": 0.2,
        "model_params": 40_000 * layers,
        "spilled_stats_bytes": 65_000 * layers,
        "seconds": {
            "load": 3.9,
            "calibration": 0.4 * layers,
            "sensitivity": 0.2,
            "compress": 0.1 * layers,
            "save": 0.1,
        },
        "compress_seconds": 0.5 * layers + 0.3,
        "stage_seconds": {"sensitivity": 0.2, "residual_svd": 0.1 * layers},
        "rss_gib": {
            "start": 0.23,
            "load": loaded,
            "calibration": 0.39,
            "sensitivity": 0.395,
            "compress": 0.4,
            "save": 0.4,
        },
        "rss_loaded_gib": loaded,
        "peak_rss_gib": loaded + overhead,
        "overhead_gib": overhead,
        "checkpoint_sha256": "ab" * 32,
        "checkpoint_bytes": 150_000 * layers,
        "weights_bytes": 160_000 * layers,
        **extra,
    }


def _fake_scaling() -> dict:
    in_memory = {"checkpoint_sha256": "ab" * 32, "rss_loaded_gib": 0.38, "peak_rss_gib": 0.41, "overhead_gib": 0.03,
                 "seconds": 7.0}  # fmt: skip
    runs = [_scaling_run(4, 0.020, in_memory=in_memory), _scaling_run(8, 0.020), _scaling_run(16, 0.021)]
    scaling = {
        "mode": "layerwise",
        "runs": runs,
        "depths": [4, 8, 16],
        "peak_ratio": 1.05,
        "peak_ratio_depths": [4, 8],
        "overhead_growth": 1.05,
        "overhead_growth_depths": [4, 16],
        "time_ratio": 3.5,
        "same_checkpoint": {"layers": 4, "identical": True},
    }
    deep_run = _scaling_run(32, 0.02, weights_bytes=8 * 2**30)
    deep = {
        "layers": 32,
        "weights_bytes": 8 * 2**30,
        "peak_rss_bytes": 2 * 2**30,
        "peak_over_weights": 0.25,
        "ppl": 262.7,
        "evaluation": {"ppl": 262.7, "tokens": 126, "load_seconds": 2.5, "eval_seconds": 0.7},
        "run": deep_run,
    }
    return {"scaling": scaling, "larger_than_memory": deep}


def _fake_results() -> dict:
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
        "command": "python -m benchmarks.suite.run",
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
        "whole_model_compression": {
            "command": "masa-compress m --targets attn,mlp --ratio 0.2 --ratio-of model",
            "calibration": {"samples": 2, "seq_len": 8},
            "stage_seconds": {"calibration": 5.0, "sensitivity": 1.0, "neuron_selection": 2.0, "other": 0.2},
            "compress_seconds": 8.2,
            "load_seconds": 1.0,
            "peak_rss_gib": 1.5,
            "dominant_stage": "calibration",
        },
        "whole_model_compress_over_forward": 4.1,
        "whole_model_bfloat16_compression": {
            "command": "masa-compress m --targets attn,mlp --ratio 0.2 --ratio-of model --calib-precision bfloat16",
            "calibration": {"samples": 2, "seq_len": 8},
            "stage_seconds": {"calibration": 3.0, "sensitivity": 1.0, "neuron_selection": 2.0, "other": 0.2},
            "compress_seconds": 6.2,
            "load_seconds": 1.0,
            "peak_rss_gib": 1.4,
            "dominant_stage": "calibration",
            "native_bfloat16_cpu": True,
        },
        "whole_model_bfloat16_compress_over_forward": 3.1,
        "calibration_over_forward": 1.5,
        "demo": {"command": "masa-compress m --ratio 0.2 --eval-max-tokens 32768", "eval_seconds": 120.0},
        "demo_minutes": 5.5,
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
        **_fake_scaling(),
        "depth_memory_ratio": 1.05,
        "depth_overhead_growth": 1.05,
        "depth_memory_overhead_ratio": 1.0,
        "depth_time_ratio": 3.5,
    }


def test_a_cpu_that_emulates_bfloat16_skips_that_run_and_says_so(tmp_path, monkeypatch):
    """Where bfloat16 is only emulated, section 3 does not time `--calib-precision bfloat16` (a figure of the
    emulation, not of the option): no run, a reason the page prints, no column, and the check accepts it; a
    missing ratio without a reason is still a problem."""
    import benchmarks.suite.measurements as measurements
    from benchmarks.suite.run import check

    monkeypatch.setattr(measurements, "native_bfloat16_cpu", lambda: False)
    monkeypatch.setattr(
        measurements, "_timed_compression", lambda *a: pytest.fail("an emulated run was timed")
    )
    skipped = measurements._bfloat16_compression("0.2", [], tmp_path / "out")
    assert skipped == {"skipped": measurements.EMULATED_BFLOAT16, "native_bfloat16_cpu": False}

    results = _fake_results()
    results["whole_model_bfloat16_compression"] = skipped
    results["whole_model_bfloat16_compress_over_forward"] = None
    doc = _rendered(results, tmp_path)
    assert f"- `--calib-precision bfloat16`: {measurements.EMULATED_BFLOAT16}." in doc
    assert "| **compression (every stage)** | **5.8** | **8.2** |\n" in doc  # two columns, not three
    assert not [p for p in check(results, []) if "bfloat16" in p]
    del results["whole_model_bfloat16_compression"]["skipped"]
    assert "results.json has no 'whole_model_bfloat16_compress_over_forward' and no reason why" in check(
        results, []
    )


def test_merged_sections_from_different_machines_are_named_by_machine(tmp_path):
    """A timing ratio belongs to its machine: when merged sections were measured on different machines (or some
    on one not recorded), the page says which came from which; one machine throughout adds nothing."""
    from benchmarks.suite.common import machine_signature

    results = _fake_results() | {"merged": True}
    results["section_dates"] = {"quality": "2026-01-01", "compression": "2026-01-02", "latency": "2026-01-03"}
    fast = machine_signature(results["machine"] | {"vector_extension": "AVX-512"})
    slow = machine_signature(results["machine"] | {"vector_extension": "AVX2"})
    assert fast == "cpu (AVX-512), 2 usable cores, 2 threads" and fast != slow
    results["section_machines"] = {"quality": fast, "compression": slow, "latency": fast}
    doc = _rendered(results, tmp_path)
    assert f"**Not all on one machine**: quality, latency on {fast}; compression on {slow}." in doc
    results["section_machines"] = {"compression": slow}
    assert f"quality, latency on a machine not recorded; compression on {slow}" in _rendered(
        results, tmp_path
    )
    results["section_machines"] = {name: fast for name in results["section_dates"]}
    assert "Not all on one machine" not in _rendered(results, tmp_path)


def test_the_machine_line_names_the_vector_extension_and_bfloat16(tmp_path):
    results = _fake_results()
    results["machine"] |= {"vector_extension": "AVX2", "native_bfloat16": False}
    assert "**Machine:** cpu (AVX2, bfloat16 emulated), 2 cores" in _rendered(results, tmp_path)


def test_the_model_20pc_smaller_is_timed_against_a_forward_over_its_own_windows(tmp_path):
    """With the MLP targeted the run calibrates on the recipe's `mlp_samples`: its ratio's reference is a forward
    over those windows, shown beside the attention run's; results from before (no forward of its own) keep the
    attention run's, which then ran the same windows."""
    results = _fake_results()
    whole = results["whole_model_compression"]
    whole |= {
        "calibration": {"samples": 8, "seq_len": 8},
        "forward": {"windows": 8, "seq_len": 8},
        "forward_seconds": 4.0,
    }
    doc = _rendered(results, tmp_path)
    assert "attention 0.2 2×8, model 20% smaller 8×8" in doc
    assert "fresh process) | 2.0 (2×8) | 4.0 (8×8) |" in doc
    assert "1.25x one forward pass by itself" in doc  # its capture, 5.0 s, over its own forward's 4.0 s
    del whole["forward"], whole["forward_seconds"]
    assert "2.50x one forward pass by itself" in _rendered(results, tmp_path)


def test_a_run_timed_between_two_forwards_shows_both_and_the_ratio_against_each(tmp_path):
    results = _fake_results()
    c = results["compression"]
    c |= {
        "forward": {**c["forward"], "seconds": 1.0},
        "forward_after": {**c["forward"], "seconds": 3.0},
        "forward_seconds": 2.0,
    }
    results["compress_over_forward"] = c["compress_seconds"] / 2.0
    doc = _rendered(results, tmp_path)
    assert "; the mean of one before and one after the run) | 2.0 (2×8; 1.0 before, 3.0 after) |" in doc
    low, high = c["compress_seconds"] / 3.0, c["compress_seconds"] / 1.0
    assert f"; {low:.2f}x to {high:.2f}x against the forward before or after it alone" in doc
    # A machine that held its speed: one ratio, not a range from a number to itself.
    c |= {"forward": {**c["forward"], "seconds": 2.0}, "forward_after": {**c["forward"], "seconds": 2.0}}
    doc = _rendered(results, tmp_path)
    assert f"; {c['compress_seconds'] / 2.0:.2f}x against either forward alone" in doc
    assert "to " + f"{c['compress_seconds'] / 2.0:.2f}x against the forward before" not in doc


def test_section_3_times_each_run_between_two_forwards_over_its_own_windows(tmp_path, monkeypatch):
    """Each run's reference is the mean of a plain forward over its own calibration windows timed just before it
    and one just after (the machine's speed drifts): the model 20% smaller, which calibrates on the recipe's
    `mlp_samples`, against forwards over those; the rendered section shows both forwards and the ratio against
    each alone."""
    import benchmarks.suite.measurements as measurements

    events = []

    def timed(args, checkpoint, what):
        events.append(what)
        windows = 8 if "attn,mlp" in args else 2
        return {"calibration": {"samples": windows, "seq_len": 4}, "compress_seconds": 10.0 * windows,
                "stage_seconds": {"calibration": 5.0 * windows}, "process_seconds": 60.0}  # fmt: skip

    slowdown = iter([1.0, 1.5, 1.0, 3.0])  # the machine slows down after each run

    def forward(args, what):
        events.append("forward" + (" mlp" if "--targets" in args else ""))
        windows = 8 if "--targets" in args else 2
        return {"windows": windows, "seq_len": 4, "seconds": 4.0 * windows * next(slowdown), "batch_size": 1}

    monkeypatch.setattr(measurements, "_timed_compression", timed)
    monkeypatch.setattr(measurements, "run_json_child", forward)
    monkeypatch.setattr(measurements, "_bfloat16_compression", lambda *a: {"skipped": "emulated"})
    monkeypatch.setattr(measurements, "demo_arguments", lambda: ["m", "--ratio", "0.2"])
    s = {"calib_samples": None, "seq_len": None, "stage_ratio": 0.2, "eval_max_tokens": None}
    out = measurements.section_compression(s, tmp_path / "ckpt")
    assert events == [
        "forward", "attention only", "forward",
        "forward mlp", "the model 20% smaller", "forward mlp",
        "demo",
    ]  # fmt: skip
    assert out["compression"]["forward_seconds"] == (8.0 + 12.0) / 2
    assert out["compress_over_forward"] == 20.0 / 10.0
    assert out["whole_model_compression"]["forward_seconds"] == (32.0 + 96.0) / 2
    assert out["whole_model_compress_over_forward"] == 80.0 / 64.0
    assert out["calibration_over_forward"] == 10.0 / 10.0
    # A forward over other windows than the run's is refused, not divided by.
    monkeypatch.setattr(
        measurements, "run_json_child", lambda args, what: {"windows": 3, "seq_len": 4, "seconds": 1}
    )
    with pytest.raises(RuntimeError, match="other windows"):
        measurements.section_compression(s, tmp_path / "ckpt")


def test_report_renders_the_whole_model_and_its_targets(tmp_path):
    """The whole-model section (curve, second text, the speed of the model 20% smaller) renders from results.json
    where `make bench` measured it, and its targets are judged from the numbers: a perplexity ratio above the
    1.30x aim and a decode speed-up below 1.15 are misses, a prefill speed-up of 1.0 meets 'not slower'."""
    from benchmarks.report.page import render

    results = _fake_results()
    diff = {"value": -3.0, "ci95": [-4.0, -2.0], "tie": False}

    def row(method, ppl):
        return {"method": method, "ratio": 0.25, "model_ratio": 0.2, "model_mib": 410.5, "ppl": ppl,
                "ppl_ci95": [ppl - 1, ppl + 1], "kl_to_original": 0.4, "top1_agreement": 0.65,
                **({"minus_svd-llm-attn-mlp": diff} if method == "masa-attn-mlp" else {})}  # fmt: skip

    scored = {"ppl": 31.0, "ppl_ci95": [30.0, 32.0], "kl_to_original": 0.5, "top1_agreement": 0.6}
    results["whole_model"] = {
        "calibration": {"samples": 2, "seq_len": 8, "text": "t"},
        "evaluation": {"tokens": 100, "split": "test"},
        "original_ppl": 20.0, "original_ppl_ci95": [19.0, 21.0], "model_mib_before": 513.1,
        "quality": [row("masa-attn-mlp", 31.0), row("svd-llm-attn-mlp", 34.0)],
        "other_texts": {"shakespeare": {
            "evaluation": {"tokens": 50, "split": "test"}, "original": {"ppl": 40.0, "ppl_ci95": [39.0, 41.0]},
            "models": {"masa-attn-mlp": scored}, "differences": {"masa-attn-mlp_minus_svd-llm-attn-mlp": diff},
            "targets_ratio": 0.25,
        }},
    }  # fmt: skip
    lat = {
        "original": {"prefill_ms": 100.0, "decode_ms": 640.0},
        "compressed": {"prefill_ms": 100.0, "decode_ms": 600.0},
        "prefill_ratio": 1.0,
        "decode_ratio": 0.9375,
    }
    results["whole_model_latency"] = {"default": lat, "commands": {"default": "masa-compress m"}, "mib": {"default": 410.5}}  # fmt: skip
    results |= {
        "whole_model_ppl_ratio": 1.55,
        "whole_model_decode_speedup": 640 / 600,
        "whole_model_prefill_speedup": 1.0,
    }
    results["inference_memory"] = {"original_file_mib": 513.1}
    path = tmp_path / "results.json"
    path.write_text(json.dumps(results))
    written = render(results, path, tmp_path / "BENCHMARKS.md", tmp_path)
    doc = written[0].read_text()
    assert (tmp_path / "whole_model.png").stat().st_size > 0 and "](whole_model.png)" in doc
    assert (
        "smaller / the original's (test split, section 2) (`whole_model_ppl_ratio`) | 1.550x | ≤ 1.30x | **missed** |"
        in doc
    )
    assert "model 30% smaller / the original's" not in doc  # measured at 20% only: no row for the 30% aim
    assert "(`whole_model_decode_speedup`) | 1.067x | ≥ 1.15x | **missed** |" in doc
    assert "(`whole_model_prefill_speedup`) | 1.000x | ≥ 1x | met |" in doc
    assert "| 20% | masa (default)" in doc and "− svd-llm-attn-mlp: -3.000 [-4.000, -2.000]" in doc
    assert "on **shakespeare**" in doc and "| 1.000x | 1.067x |" in doc


def test_section_2_renders_the_default_and_its_peers_from_the_whole_model_file(tmp_path, monkeypatch):
    """Where results.json holds no `whole_model`, section 2 is the file of `python -m benchmarks.suite.whole_model`
    (whole-model-256-test.json): the default, FLAP and MoDeGPT at each fraction with the paired differences, its
    command and link, the plot, and the summary's rows judged against the aims (1.30x at 20%, 1.6x at 30%)."""
    from benchmarks.report import plots

    def row(method, fraction, ppl, **minus):
        return {"method": method, "model_ratio": fraction, "model_mib": 513.1 * (1 - fraction), "ppl": ppl,
                "ppl_ci95": [ppl - 1, ppl + 1], "kl_to_original": 0.4, "top1_agreement": 0.65,
                "stage_seconds": {"sensitivity": 10.0, "neuron_selection": 5.0},
                **{f"minus_{k}": v for k, v in minus.items()}}  # fmt: skip

    def diff(value):
        return {"value": value, "ci95": [value - 1, value + 1], "tie": False}

    path = tmp_path / "whole-model-256-test.json"
    path.write_text(json.dumps({
        "calibration": {"samples": 256, "mlp_samples": 256, "seq_len": 512, "text": "wiki"},
        "evaluation": {"tokens": 1000, "split": "test"},
        "original_ppl": 20.0, "original_ppl_ci95": [19.0, 21.0], "model_mib_before": 513.1,
        "calibration_seconds": 500.0,
        "quality": [
            row("masa-attn-mlp", 0.2, 27.0, **{"flap-attn-mlp": diff(-14.0), "modegpt-attn-mlp": diff(-11.0)}),
            row("flap-attn-mlp", 0.2, 41.0), row("modegpt-attn-mlp", 0.2, 38.0),
            row("masa-attn-mlp", 0.3, 40.0, **{"flap-attn-mlp": diff(-65.0), "modegpt-attn-mlp": diff(-28.0)}),
            row("flap-attn-mlp", 0.3, 105.0), row("modegpt-attn-mlp", 0.3, 68.0),
        ],
        "command": "python -m benchmarks.suite.whole_model --model-ratios 0.2,0.3 --out /tmp/x/w.json",
    }))  # fmt: skip
    monkeypatch.setattr(plots, "WHOLE_MODEL_PATH", path)
    results = _fake_results()
    assert "whole_model" not in results
    doc = _rendered(results, tmp_path)
    section = doc.split("## 2. The whole model")[1].split("## 3.")[0]
    assert "`python -m benchmarks.suite.whole_model --model-ratios 0.2,0.3` ([`" in section  # --out left out
    assert "One calibration (256×512 tokens of wiki, MLP inputs included)" in section
    assert "the default (the MLP keeps a subset" in section and "FLAP (`--method flap`" in section
    assert (
        "MoDeGPT (`--method modegpt`" in section and "SVD-LLM" not in section and "rise ratio" not in section
    )
    assert (
        "| 20% | masa (default): MLP neurons, widths per layer | 410.5 | 27.000 [26.00, 28.00] | 1.35 | 0.400 | "
        "65.0% | 15 | − flap-attn-mlp: -14.000 [-15.000, -13.000]; − modegpt-attn-mlp: -11.000 [-12.000, -10.000] |"
    ) in section
    assert "| 20% | flap (FLAP, a structured peer) | 410.5 | 41.000 [40.00, 42.00] | 2.05 |" in section
    assert "| 30% | modegpt (MoDeGPT, a decomposing peer) | 359.2 | 68.000 [67.00, 69.00] | 3.40 |" in section
    assert (
        "the model 20% smaller 1.350x the original's perplexity (aim ≤ 1.30x: **missed**); the model 30% smaller "
        "2.000x the original's perplexity (aim ≤ 1.60x: **missed**)"
    ) in section
    assert "](whole_model.png)" in section and (tmp_path / "whole_model.png").stat().st_size > 0
    assert (
        "| perplexity of the model 20% smaller / the original's (test split, section 2) | 1.350x | ≤ 1.30x | **missed** |"
        in doc
    )
    assert (
        "| perplexity of the model 30% smaller / the original's (test split, section 2) | 2.000x | ≤ 1.60x | **missed** |"
        in doc
    )
    # No whole-model latency was measured with it: neither its rows in the summary nor its table in section 4.
    assert "whole_model_decode_speedup" not in doc and "**The model 20% smaller**, timed" not in doc
    # A ratio under its aim is met.
    data = json.loads(path.read_text())
    data["quality"][3]["ppl"] = 30.0
    path.write_text(json.dumps(data))
    assert "| 1.500x | ≤ 1.60x | met |" in _rendered(results, tmp_path)


def test_the_decode_ceiling_counts_only_the_time_that_reads_layer_weights():
    """With 40 of 100 ms inside the layers' projections and MLPs and a quarter of the layer parameters removed,
    at most 10 ms can go: the ceiling is 100/90, whatever the parameter ratio of the whole model."""
    from benchmarks.report.sections import _decode_ceiling_lines, decode_speedup_ceiling

    original = {"decode_ms": 100.0, "decode_projection_ms": 10.0, "decode_mlp_ms": 30.0,
                "decode_lm_head_ms": 15.0, "layer_params": 400}  # fmt: skip
    lat = {"original": original, "compressed": {"layer_params": 300}}
    assert decode_speedup_ceiling(lat) == pytest.approx(100 / 90)
    line = _decode_ceiling_lines(lat)[0]
    assert "45 ms elsewhere" in line and "1.111x" in line
    # Measured before the breakdown existed: no claim.
    assert decode_speedup_ceiling({"original": {"decode_ms": 1.0}, "compressed": {}}) is None


def test_the_sensitivity_windows_choice_says_a_tie_only_when_every_interval_holds_zero(tmp_path, monkeypatch):
    """Section 6's line on `sensitivity_samples` reads the ties from the validation file, not from the text."""
    from benchmarks.report import choices as report_choices

    def run(ppl: float) -> dict:
        return {"ppl": ppl, "ppl_ci95": [ppl - 1, ppl + 1], "stage_seconds": {}}

    def data(lo: float, hi: float) -> dict:
        minus = {"4": {"value": (lo + hi) / 2, "ci95": [lo, hi], "tie": lo <= 0 <= hi}}
        return {
            "max_tokens": 32768,
            "reference_windows": 16,
            "targets": {"attention": {"runs": {"4": run(19.0), "16": run(19.1)}, "minus_reference": minus}},
        }

    monkeypatch.setattr(report_choices, "CHOICES", tmp_path / "choices")
    (tmp_path / "choices").mkdir()
    path = tmp_path / "choices" / "sensitivity-windows-validation.json"
    path.write_text(json.dumps(data(-0.2, 0.1)))
    text = "\n".join(report_choices._sensitivity_windows(tmp_path / "BENCHMARKS.md"))
    assert "Every count ties with 16" in text and "| attention | 4 | 19.000 [18.00, 20.00] |" in text
    path.write_text(json.dumps(data(0.05, 0.3)))
    text = "\n".join(report_choices._sensitivity_windows(tmp_path / "BENCHMARKS.md"))
    assert "Not every count ties with 16" in text and "+0.175 [+0.050, +0.300] |" in text


def test_the_embedding_choice_counts_wins_ties_and_losses_from_the_file(tmp_path, monkeypatch):
    """Section 6's verdict on the embedding as a target reads each paired interval, not a fixed sentence."""
    from benchmarks.report import choices as report_choices

    def row(rank, lo, hi):
        base = {"embedding_rank": rank, "pseudo_count": 1.0, "input_term": True, "model_ratio": 0.2,
                "ppl": 30.0, "ppl_ci95": [29.0, 31.0]}  # fmt: skip
        if rank is not None:
            base["minus_masa-attn-mlp"] = {"value": (lo + hi) / 2, "ci95": [lo, hi], "tie": lo <= 0 <= hi}
        return base

    def data(*intervals) -> dict:
        rows = {"masa-attn-mlp": row(None, 0, 0)}
        rows |= {f"embed-{i}": row(512, lo, hi) for i, (lo, hi) in enumerate(intervals)}
        return {"original_ppl": 20.6, "rows": rows}

    monkeypatch.setattr(report_choices, "CHOICES", tmp_path / "choices")
    (tmp_path / "choices").mkdir()
    path = tmp_path / "choices" / "embedding-validation.json"
    path.write_text(json.dumps(data((-0.2, 0.1), (0.3, 0.9))))
    text = "\n".join(report_choices._embedding_target(tmp_path / "BENCHMARKS.md"))
    assert "No low-rank embedding beats the default" in text and "(1 tie, 1 lose)" in text
    path.write_text(json.dumps(data((-0.9, -0.3), (0.3, 0.9))))
    text = "\n".join(report_choices._embedding_target(tmp_path / "BENCHMARKS.md"))
    assert "1 of 2 low-rank embeddings beat the default" in text and "-0.600 [-0.900, -0.300] |" in text


def test_the_neuron_refinements_verdicts_read_each_paired_interval(tmp_path, monkeypatch):
    """Section 6's line on the refinements of the neuron form says better, worse or tie from the file."""
    from benchmarks.report import choices as report_choices

    def row(variant, keep, lo=0.0, hi=0.0):
        diff = {"value": (lo + hi) / 2, "ci95": [lo, hi], "tie": lo <= 0 <= hi}
        return {"variant": variant, "keep": keep, "ppl": 30.0, "ppl_ci95": [29.0, 31.0], "kl_to_original": 0.5,
                "minus_greedy": diff}  # fmt: skip

    rows = [row("greedy", 0.75), row("centered", 0.75, -0.1, 0.05), row("fisher", 0.75, 0.03, 0.3),
            row("centered", 0.6, -0.3, -0.02)]  # fmt: skip
    monkeypatch.setattr(report_choices, "CHOICES", tmp_path / "choices")
    (tmp_path / "choices").mkdir()
    data = {"original": {"ppl": 20.6}, "fisher_windows": 16, "rows": rows}
    (tmp_path / "choices" / "neuron-refinements-validation.json").write_text(json.dumps(data))
    text = "\n".join(report_choices._neuron_refinements(tmp_path / "BENCHMARKS.md"))
    assert (
        "`centered` a tie (-0.025 [-0.100, +0.050]) at 75% kept, better (-0.160 [-0.300, -0.020]) at 60%"
        in text
    )
    assert "`fisher` worse (+0.165 [+0.030, +0.300]) at 75% kept" in text
    assert "| 75% | `greedy` | 30.000 [29.00, 31.00] | 0.500 | — |" in text
    assert "Not adopted" in text and "the default stays" not in text
    rows[3] = row("centered", 0.6, -0.3, 0.02)  # no variant better anywhere
    (tmp_path / "choices" / "neuron-refinements-validation.json").write_text(json.dumps(data))
    text = "\n".join(report_choices._neuron_refinements(tmp_path / "BENCHMARKS.md"))
    assert "Neither is better anywhere: the default stays." in text and "Not adopted" not in text


def test_the_zero_shot_suite_mean_and_its_interval_read_acc_norm_where_a_task_has_it():
    from benchmarks.engines.zero_shot_peers import suite_mean_interval

    tasks = {"arc_easy": {"acc": 0.9, "acc_norm": 0.5, "items": 100}, "boolq": {"acc": 0.8, "items": 100}}
    mean, (lo, hi) = suite_mean_interval(tasks)
    half = 1.96 * math.sqrt(0.5 * 0.5 / 100 + 0.8 * 0.2 / 100) / 2
    assert mean == pytest.approx(0.65) and (lo, hi) == pytest.approx((0.65 - half, 0.65 + half))


def test_the_zero_shot_table_shows_each_task_the_mean_and_the_paired_differences(tmp_path):
    from benchmarks.report.zero_shot import ZERO_SHOT_COLUMNS, zero_shot_lines

    def row(share, **paired):
        tasks = {t: {"acc": share, "items": 100} for t in ZERO_SHOT_COLUMNS}
        tasks["boolq"]["acc"] = 0.9  # left out of the mean without BoolQ
        return {"tasks": tasks, "mean": share, "mean_ci95": [share - 0.05, share + 0.05], **paired}

    def difference(value, low, high):
        return {"value": value, "ci95": [low, high], "tie": low <= 0 <= high}

    path = tmp_path / "zero-shot-peers.json"
    assert zero_shot_lines(path) == []
    rows = {
        "original": row(0.5),
        "masa-attn-mlp": row(0.45, paired_minus_original=difference(-0.05, -0.08, -0.02)),
        "svd-llm-attn-mlp": row(
            0.40,
            paired_minus_original=difference(-0.10, -0.13, -0.07),
            default_minus_this=difference(0.05, -0.01, 0.11),
        ),
    }
    path.write_text(json.dumps({"date": "2026-11-27", "limit_per_task": 100, "rows": rows}))
    text = "\n".join(zero_shot_lines(path))
    assert "the first 100 items of each" in text and "paired on the same items" in text
    assert "| 45.0% [40.0%, 50.0%] | -5.0 pt [-8.0, -2.0] | — | 45.0% |" in text
    assert "| 40.0% [35.0%, 45.0%] | -10.0 pt [-13.0, -7.0] | +5.0 pt [-1.0, +11.0] tie | 40.0% |" in text
    assert "| 50.0% [45.0%, 55.0%] | — | — | 50.0% |" in text
    assert "smaller, measured the same way" not in text
    # Another ratio's file beside it: its own table after the 20% one, saying where the original's row came from.
    rows["masa-attn-mlp"]["mean"] = 0.35
    rows["original"]["reused_from"] = str(path)
    other = {"date": "2026-11-28", "limit_per_task": 100, "model_ratio": 0.3, "rows": rows}
    (tmp_path / "zero-shot-peers-30.json").write_text(json.dumps(other))
    text = "\n".join(zero_shot_lines(path))
    assert "The model 30% smaller, measured the same way (benchmarks/results/zero-shot-peers-30.json" in text
    assert "The original's row and items are the 20% run's" in text
    # A file that does not record its windows says nothing of them.
    assert "calibrated on" not in text
    assert (
        text.index("| 45.0% [40.0%, 50.0%]")
        < text.index("30% smaller")
        < text.index("| 35.0% [40.0%, 50.0%]")
    )
    # A re-run records its windows and the date its reused original was scored on.
    rows["masa-attn-mlp"]["calibration_windows"] = rows["svd-llm-attn-mlp"]["calibration_windows"] = 256
    rows["original"]["scored_on"] = "2026-11-27"
    path.write_text(json.dumps({"date": "2026-11-29", "limit_per_task": 100, "rows": rows}))
    text = "\n".join(zero_shot_lines(path))
    assert (
        "Every compressed model calibrated on 256 windows of 512 tokens; the original's row and items are those "
        "scored on 2026-11-27" in text
    )


def test_another_ratios_zero_shot_run_has_its_own_files_and_reuses_the_original_only_on_the_same_items(
    tmp_path, monkeypatch
):
    from benchmarks.engines import zero_shot_peers

    monkeypatch.setattr(zero_shot_peers, "RESULTS", tmp_path / "zero-shot-peers.json")
    monkeypatch.setattr(zero_shot_peers, "ITEMS", tmp_path / "items")
    assert zero_shot_peers.ratio_paths(0.2) == (tmp_path / "zero-shot-peers.json", tmp_path / "items")
    assert zero_shot_peers.ratio_paths(0.3) == (
        tmp_path / "zero-shot-peers-30.json",
        tmp_path / "items" / "30",
    )
    assert zero_shot_peers.reused_original(200, 16) is None  # no 20% run yet
    original = {"tasks": {}, "mean": 0.44}
    main = {"limit_per_task": 200, "batch_size": 16, "date": "2026-11-27", "rows": {"original": original}}
    (tmp_path / "zero-shot-peers.json").write_text(json.dumps(main))
    assert zero_shot_peers.reused_original(200, 16) is None  # its per-item scores are missing
    (tmp_path / "items").mkdir()
    (tmp_path / "items" / "original.jsonl").write_text("")
    reused = zero_shot_peers.reused_original(200, 16)
    assert reused == {
        **original,
        "reused_from": str(tmp_path / "zero-shot-peers.json"),
        "scored_on": "2026-11-27",
    }
    # A later 20% run that reused it keeps the date it was scored on, not its own.
    main = {**main, "date": "2026-11-29", "rows": {"original": reused}}
    (tmp_path / "zero-shot-peers.json").write_text(json.dumps(main))
    assert zero_shot_peers.reused_original(200, 16)["scored_on"] == "2026-11-27"
    assert (
        zero_shot_peers.reused_original(100, 16) is None and zero_shot_peers.reused_original(200, 8) is None
    )


def test_the_gpu_scale_benchmark_takes_the_shapes_plan_reads_from_the_recipe():
    from benchmarks.engines import gpu_scale
    from compressor.api.model_loading import recipe_config
    from compressor.recipes.schema import builtin_recipe

    planned = recipe_config(builtin_recipe(gpu_scale.RECIPE))
    shapes = gpu_scale.model_shapes()
    for key in ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size", "tie_word_embeddings"):  # fmt: skip
        assert shapes[key] == getattr(planned, key), key
    assert (shapes["num_hidden_layers"], shapes["intermediate_size"]) == (28, 8960)
    assert gpu_scale.model_shapes(tiny=True)["intermediate_size"] == 256


def test_the_gpu_scale_benchmark_plans_runs_and_reloads_a_random_model():
    """`benchmarks.engines.gpu_scale` on its small model on the CPU (its GPU run is the same code at the 1.5B shapes):
    the plan's memory and the run's stages are recorded, and the reloaded checkpoint scores as the run did."""
    from benchmarks.engines import gpu_scale

    results = gpu_scale.run(tiny=True)
    assert results["planned_device"] == "cpu" and results["planned_gib"] > 0
    assert {"calibration", "sensitivity", "neuron_selection", "residual_svd", "save"} <= set(
        results["seconds"]
    )
    assert results["plain_forward_seconds"] > 0 and 0.2 <= results["achieved_ratio"] < 1
    assert results["reloaded_ppl"] == pytest.approx(results["ppl_after"], rel=1e-9)


def test_the_gpu_scale_step_peaks_name_the_step_that_allocated_and_restore_the_pipeline(monkeypatch):
    """`StepPeaks` on a fake peak counter: each step's peak is the counter's at its end (an inner step's apart
    from its caller's), what runs outside every step is `between steps`, and the patched functions are the
    originals again afterwards."""
    from benchmarks.engines import gpu_scale
    from compressor.methods.masa import mlp

    current = {"peak": 0.0}
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: current["peak"] * 2**30)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda: 2 * current["peak"] * 2**30)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda: current.update(peak=0.0))
    monkeypatch.setattr(gpu_scale, "STEPS", {"outer": ["compressor.methods.masa.mlp:neuron_order"],
                                             "inner": ["compressor.methods.masa.mlp:order_tail"]})  # fmt: skip

    def outer():
        current["peak"] = 3.0
        mlp.order_tail()  # the inner step: its own peak, then the outer's resumes
        current["peak"] = max(current["peak"], 2.0)

    def inner():
        current["peak"] = 5.0

    monkeypatch.setattr(mlp, "neuron_order", lambda *a: outer())
    monkeypatch.setattr(mlp, "order_tail", lambda *a: inner())
    patched_order, patched_tail = mlp.neuron_order, mlp.order_tail
    with gpu_scale.StepPeaks() as steps:
        current["peak"] = 1.0  # before any step
        mlp.neuron_order()
        current["peak"] = 0.5  # after
    assert steps.peaks == {"between steps": 1.0, "outer": 3.0, "inner": 5.0}
    assert steps.peak == 5.0 and steps.reserved == 10.0
    assert (mlp.neuron_order, mlp.order_tail) == (patched_order, patched_tail)


def test_the_error_models_measured_rise_is_the_paired_mean_with_an_interval_and_the_kl():
    """`byte_error_model.rise`: the mean loss rise per token over the original on the same windows, a paired
    bootstrap interval around it (a constant shift has a zero-width one), and the mean KL per token."""
    import numpy as np

    from benchmarks.experiments.byte_error_model.run import rise

    base = np.array([100.0, 120.0, 80.0, 90.0])
    shifted = rise(base + 2.0, base, tokens=400, kl=np.full(4, 1.0))
    assert shifted["measured"] == pytest.approx(0.02) and shifted["kl"] == pytest.approx(0.01)
    assert shifted["measured_ci95"] == [pytest.approx(0.02), pytest.approx(0.02)]
    noisy = rise(base + np.array([4.0, -2.0, 3.0, -1.0]), base, tokens=400)
    lo, hi = noisy["measured_ci95"]
    assert noisy["measured"] == pytest.approx(0.01) and lo < 0 < 0.01 < hi and "kl" not in noisy


def test_the_calibration_precision_choice_counts_its_losses_and_ties_from_the_file(tmp_path, monkeypatch):
    """Section 6's line on `--calib-precision` reads each seed's paired difference and the seed-to-seed yardstick
    from the validation file, not from the text."""
    from benchmarks.report import choices as report_choices

    def run(ppl: float, seconds: float) -> dict:
        return {"ppl": ppl, "ppl_ci95": [ppl - 1, ppl + 1], "compress_seconds": seconds}

    def diff(value: float, half: float) -> dict:
        return {"value": value, "ci95": [value - half, value + half], "tie": abs(value) <= half}

    data = {
        "max_tokens": 32768,
        "targets": {
            "whole": {
                "runs": {
                    "model-s0": run(27.0, 130),
                    "bfloat16-s0": run(27.1, 95),
                    "model-s1": run(26.8, 130),
                    "bfloat16-s1": run(26.8, 95),
                },  # fmt: skip
                "bfloat16_minus_model": {"0": diff(0.1, 0.05), "1": diff(0.01, 0.05)},
                "model_seed_minus_first_seed": {"1": diff(-0.2, 0.05)},
            }
        },
    }
    monkeypatch.setattr(report_choices, "CHOICES", tmp_path / "choices")
    (tmp_path / "choices").mkdir()
    (tmp_path / "choices" / "calibration-precision-validation.json").write_text(json.dumps(data))
    text = "\n".join(report_choices._calibration_precision(tmp_path / "BENCHMARKS.md"))
    assert "whole: bfloat16 worse at 1 of 2 seeds, a tie at 1, +0.055 on average" in text
    assert "another calibration seed moves float32 by up to 0.200" in text
    assert (
        "| whole | 1 | 26.800 [25.80, 27.80] | 26.800 [25.80, 27.80] | +0.010 [-0.040, +0.060] (tie) | "
        in text
    )
    assert "| 130 / 95 |" in text


def test_the_budget_split_choice_reads_the_split_and_the_best_lever_from_the_file(tmp_path, monkeypatch):
    """Section 6's budget split: the loss split and the best lever's verdict come from the validation file."""
    from benchmarks.report import budget_split as report_budget_split
    from benchmarks.report import choices as report_choices

    def row(name, nll, lo=None, hi=None):
        minus = None if lo is None else {"value": (lo + hi) / 2, "ci95": [lo, hi], "tie": lo <= 0 <= hi}
        return {"variant": name, "ppl": 20.0 + (lo or 0), "ppl_ci95": [19.0, 21.0], "nll": nll,
                "minus_default": minus}  # fmt: skip

    def data(lo, hi):
        return {
            "tokens": 16352, "original": {"ppl": 15.0, "ppl_ci95": [14.0, 16.0], "nll": 2.7},
            "rows": [row("default", 3.0), row("attention-restored", 2.95, -1.0, -0.8),
                     row("mlp-restored", 2.75, -4.2, -3.9), row("mlp-weight-1.5", 2.99, lo, hi),
                     row("endpoint-1", 3.0, -0.05, 0.02)],
            "attention_drop": {"loss": 3.1, "rise": [0.2, 0.01, 0.05], "attention_params": [10, 10, 10]},
            "drop_windows": [64, 68],
        }  # fmt: skip

    monkeypatch.setattr(report_choices, "CHOICES", tmp_path / "choices")
    (tmp_path / "choices").mkdir()
    path = tmp_path / "choices" / "budget-split-validation-20.json"
    path.write_text(json.dumps(data(-0.3, -0.1)))
    text = "\n".join(
        report_budget_split.budget_split_section(tmp_path / "BENCHMARKS.md", report_choices._load)
    )
    assert (
        "rises by 0.300 nats per token: 0.250 with only its MLP compressed, 0.050 with only its attention"
        in text
    )
    assert "`mlp-weight-1.5`, is better (-0.200 [-0.300, -0.100]): 4% of" in text
    assert "the cheapest: layer 1 +0.0100, layer 2 +0.0500, layer 0 +0.2000" in text
    path.write_text(json.dumps(data(-0.02, 0.1)))
    text = "\n".join(
        report_budget_split.budget_split_section(tmp_path / "BENCHMARKS.md", report_choices._load)
    )
    assert "`endpoint-1`, is a tie (-0.015 [-0.050, +0.020])" in text


def test_llama_quantize_port_reads_the_type_llama_quantize_writes():
    """`llama_quantize_port.TENSOR_LINE` takes from a `--dry-run` log line the tensor and the type it is written
    in: the new one when it changes, its own when it stays; metadata lines are no tensors."""
    from benchmarks.engines.llama_quantize_port import TENSOR_LINE

    changed = (
        "[  56/ 272] blk.5.ffn_up.weight                  - [   576,   1536,      1,      1], type =   q4_1, "
        "size =     0.53 MiB ->     0.58 MiB (q5_0)"
    )
    kept = "[  58/ 272] blk.6.attn_norm.weight               - [   576,      1,      1,      1], type =    f32, size =    0.002 MiB"
    metadata = (
        'llama_model_loader: - kv   8:                          general.languages arr[str,1]       = ["en"]'
    )
    assert TENSOR_LINE.search(changed).groups() == ("blk.5.ffn_up.weight", "q4_1", "q5_0")
    assert TENSOR_LINE.search(kept).groups() == ("blk.6.attn_norm.weight", "f32", None)
    assert TENSOR_LINE.search(metadata) is None
