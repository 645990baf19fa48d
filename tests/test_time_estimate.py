"""`plan`'s time (`api/time_estimate.py`): each stage's arithmetic scales as the work does, a stage a run does not
have is not priced, the machine's rates are measured once, and `plan` and the run's summary carry the estimate."""

from __future__ import annotations

import json

import pytest

from compressor.api import time_estimate
from compressor.api.time_estimate import Rates, RunWork, stage_seconds
from compressor.runtime.memory import Shape, Workload

SHAPE = Shape("llama", hidden=576, heads=9, kv_heads=3, head_dim=64, intermediate=1536, layers=30, vocab=49152,
              tied=True)  # fmt: skip
RATES = Rates(gemm=5e10, gram=2e10, factor=1e10, device="cpu")
RUN = RunWork(neurons=True, neuron_order="greedy", attention_factors=False, mlp_factors=False, stream_windows=64, eval_tokens=8192,
              eval_passes=2, weights_bytes=540_000_000, saved_bytes=0)  # fmt: skip


def work(**changes) -> Workload:
    return Workload(**{"windows": 256, "seq_len": 512, "sensitivity": 4, "mlp": True, "eval_seq_len": 512,
                       **changes})  # fmt: skip


def test_each_stage_grows_with_its_own_work_only():
    base = stage_seconds(SHAPE, work(), RUN, RATES)
    doubled = stage_seconds(SHAPE, work(windows=512), RUN, RATES)
    assert doubled["calibration"] == pytest.approx(2 * base["calibration"])
    for stage in ("sensitivity", "neuron_selection", "residual_svd", "stream_refit", "eval", "load"):
        assert doubled[stage] == pytest.approx(base[stage]), stage  # the stream refit reads its own windows
    more_stream = stage_seconds(
        SHAPE, work(), RUN.__class__(**{**RUN.__dict__, "stream_windows": 128}), RATES
    )
    assert more_stream["stream_refit"] == pytest.approx(2 * base["stream_refit"])
    wider = Shape(**{**SHAPE.__dict__, "intermediate": 2 * SHAPE.intermediate})
    ratio = stage_seconds(wider, work(), RUN, RATES)["neuron_selection"] / base["neuron_selection"]
    assert 4 < ratio <= 8  # I³/3 + I²·H/2: between the square and the cube
    faster = stage_seconds(SHAPE, work(), RUN, Rates(gemm=1e11, gram=4e10, factor=2e10, device="cpu"))
    assert all(
        faster[stage] == pytest.approx(base[stage] / 2) for stage in base if stage not in ("load", "save")
    )


def test_a_stage_the_run_does_not_have_is_not_priced():
    none = RunWork(neurons=False, neuron_order="greedy", attention_factors=False, mlp_factors=False, stream_windows=0, eval_tokens=0,
                   eval_passes=2, weights_bytes=1, saved_bytes=0)  # fmt: skip
    stages = stage_seconds(SHAPE, work(sensitivity=0, mlp=False), none, RATES)
    assert set(stages) == {"load", "calibration", "residual_svd"}


def test_the_machine_rates_are_measured_once_and_then_read(tmp_path, monkeypatch):
    import torch

    monkeypatch.setenv("MASA_CACHE", str(tmp_path))
    measured = []
    monkeypatch.setattr(time_estimate, "measure_rates", lambda device: measured.append(device) or RATES)
    assert time_estimate.machine_rates(torch.device("cpu")) == RATES
    assert time_estimate.machine_rates(torch.device("cpu")) == RATES and len(measured) == 1
    (path,) = (tmp_path / "rates").iterdir()
    path.write_text("{damaged")  # measured again, never trusted
    assert time_estimate.machine_rates(torch.device("cpu")) == RATES and len(measured) == 2


def test_rates_measured_while_other_work_held_the_cpu_price_one_plan_and_are_not_kept(tmp_path, monkeypatch):
    """A measurement with a third of the CPU (another job on the cores) would price every later plan three times
    too long: it prices this estimate, the next one measures again, and the time line says why."""
    import dataclasses

    import torch

    from compressor.report.tables import time_line

    monkeypatch.setenv("MASA_CACHE", str(tmp_path))
    busy = dataclasses.replace(RATES, cpu_share=0.34)
    measured = []
    monkeypatch.setattr(time_estimate, "measure_rates", lambda device: measured.append(device) or busy)
    assert time_estimate.machine_rates(torch.device("cpu")) == busy
    assert time_estimate.machine_rates(torch.device("cpu")) == busy and len(measured) == 2
    assert not (tmp_path / "rates").exists() or not any((tmp_path / "rates").iterdir())
    estimate = {
        "stages": {"calibration": 60.0},
        "total": 60.0,
        "rates": dataclasses.asdict(busy),
        "busy": True,
    }
    assert "other work held the CPU (34% of it ours)" in time_line(estimate).plain
    assert "other work" not in time_line(estimate | {"busy": False}).plain


def test_the_cpu_share_of_a_measurement_is_its_process_time_over_its_wall_time_and_threads(monkeypatch):
    """Process time ticks once a second per busy thread: with half of it (the other half another job's) the
    share reads a half."""
    import torch

    clock = iter([0.0, 10.0])  # wall: start, end
    cpu = iter([0.0, 10.0 * torch.get_num_threads() / 2])  # process time: start, end
    monkeypatch.setattr(time_estimate.time, "perf_counter", lambda: next(clock, 10.0))
    monkeypatch.setattr(
        time_estimate.time, "process_time", lambda: next(cpu, 10.0 * torch.get_num_threads() / 2)
    )
    monkeypatch.setattr(time_estimate, "_best_rate", lambda work, run, repeats=3: 1e10)
    assert time_estimate.measure_rates(torch.device("cpu")).cpu_share == 0.5


def test_measured_rates_are_positive_and_finite():
    import math

    import torch

    rates = time_estimate.measure_rates(torch.device("cpu"))
    assert all(math.isfinite(r) and r > 1e8 for r in (rates.gemm, rates.gram, rates.factor))
    assert 0 < rates.cpu_share <= 1


def test_plan_prints_the_time_per_stage_and_the_run_sets_it_beside_what_it_took(
    tmp_path, capsys, monkeypatch
):
    from conftest import tiny_model_dir

    from compressor.cli import main

    monkeypatch.setattr(time_estimate, "machine_rates", lambda device: RATES)
    folder = str(tiny_model_dir(tmp_path / "tiny"))
    args = [
        "--targets",
        "attn,mlp",
        "--calib-samples",
        "4",
        "--seq-len",
        "64",
        "--eval-seq-len",
        "64",
        "--eval-max-tokens",
        "256",
    ]
    main([folder, *args, "--dry-run", "--json"])  # `plan` with every option of the run (`plan` takes fewer)
    planned = json.loads(capsys.readouterr().out)["time"]
    assert planned["total"] == pytest.approx(
        sum(planned["stages"].values()), abs=0.1 * len(planned["stages"])
    )
    assert {"calibration", "neuron_selection", "eval"} <= set(planned["stages"])
    main(["plan", folder, "--targets", "attn,mlp"])
    assert "time: about" in capsys.readouterr().out
    main([folder, *args, "--out", str(tmp_path / "ckpt"), "--json"])
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["seconds_planned"] == planned["stages"] | {"total": planned["total"]}
    assert set(summary["seconds_planned"]) - {"total"} <= set(summary["seconds"])


def test_a_hub_evaluation_text_is_not_read_and_left_unpriced_unless_capped(tmp_path):
    from types import SimpleNamespace

    def evaluation(source, max_tokens=None):  # as `EvaluationSettings` holds them
        return SimpleNamespace(source=source, split="test", max_tokens=max_tokens)

    # No network here: a hub source read would raise; it is neither read nor guessed.
    assert time_estimate.evaluation_tokens(evaluation("wikitext2")) is None
    assert time_estimate.evaluation_tokens(evaluation("hf:some/set", max_tokens=4096)) == 4096
    text = tmp_path / "eval.txt"
    text.write_text("word " * 840)  # 4,200 characters: 1,000 tokens at 4.2 a token
    assert time_estimate.evaluation_tokens(evaluation(str(text))) == 1000
    assert time_estimate.evaluation_tokens(evaluation(str(text), max_tokens=100)) == 100
    whole = time_estimate.evaluation_tokens(evaluation("wikipedia"))
    assert 50_000 < whole < 200_000  # the test split: about 60k-130k tokens (calibration/sources.py)


def test_plan_prices_the_layerwise_run_where_only_it_fits(tmp_path, monkeypatch):
    """A run that fits in memory only layer by layer is priced as `compress --layerwise` runs it, and the estimate
    says so; both run the same stages, the stream refit included."""
    from conftest import tiny_model_dir

    import compressor.api.preview as preview
    from compressor.api.run_options import CompressOptions

    monkeypatch.setattr(time_estimate, "machine_rates", lambda device: RATES)
    folder = str(tiny_model_dir(tmp_path / "tiny"))
    options = CompressOptions(
        targets="attn,mlp", ratio=0.2, ratio_of="model", native=True, eval_max_tokens=256
    )
    fits = preview.plan_compression(folder, options)["time"]
    assert not fits["layerwise"] and "stream_refit" in fits["stages"]
    estimate_of = preview.memory_estimate

    def little_memory(*args, **kwargs):
        estimate = estimate_of(*args, **kwargs)
        return estimate | {"available_bytes": estimate["in_memory_bytes"] - 1}

    monkeypatch.setattr(preview, "memory_estimate", little_memory)
    layerwise = preview.plan_compression(folder, options)["time"]
    assert layerwise["layerwise"] and layerwise["stages"] == fits["stages"]
