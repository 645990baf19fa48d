"""`plan --size`'s time (`api/size_time.py`, `quantize/rounding_rates.py`): each stage a byte budget adds scales as
its work does, ggml's rates are measured once per machine, and `plan --size` and the run's summary carry the
estimate."""

from __future__ import annotations

import dataclasses
import json

import pytest

from compressor.api import size_time
from compressor.api.size_time import (
    SizeWork,
    matrices,
    nearest_type,
    rounding_error_seconds,
    size_stage_seconds,
)
from compressor.api.time_estimate import Rates
from compressor.quantize import rounding_rates as rates_module
from compressor.quantize.byte_budget import CANDIDATE_TYPES, LOOKUP_ROWS, SAMPLE_ROWS
from compressor.quantize.rounding_rates import RoundingRates
from compressor.runtime.memory import Shape

#: Widths of whole 256-blocks: every candidate type fills their rows.
SHAPE = Shape("llama", hidden=512, heads=8, kv_heads=2, head_dim=64, intermediate=1536, layers=4, vocab=8192,
              tied=True)  # fmt: skip
RATES = Rates(gemm=5e10, gram=2e10, factor=1e10, device="cpu")
ROUNDING = RoundingRates({t: 1e7 for t in CANDIDATE_TYPES}, {t: 2e7 for t in CANDIDATE_TYPES})
WORK = SizeWork(importance_windows=32, seq_len=2048, file_type="Q4_K", structure=False, eval_tokens=8192,
                eval_seq_len=2048)  # fmt: skip


def test_the_matrices_are_every_weight_but_the_norms():
    norms = SHAPE.layers * 2 * SHAPE.hidden + SHAPE.hidden
    assert sum(rows * length for rows, length in matrices(SHAPE)) == SHAPE.params() - norms
    untied = dataclasses.replace(SHAPE, tied=False)
    assert len(matrices(untied)) == len(matrices(SHAPE)) + 1 == 7 * SHAPE.layers + 2


def test_rounding_errors_are_priced_on_the_sampled_and_looked_up_rows_at_each_types_rate():
    """Each matrix's sampled rows (at most SAMPLE_ROWS) in every type its rows fill, and the embedding's
    looked-up rows; a type twice as slow costs its share twice."""
    seconds = rounding_error_seconds(SHAPE, ROUNDING)
    per_type = len(CANDIDATE_TYPES) / 1e7
    layer = 512 * 512 * 4 + 128 * 512 * 2 + 512 * 1536  # q, o, gate, up; k, v; down: at most 512 rows each
    lookup = (LOOKUP_ROWS + SAMPLE_ROWS) * 512
    assert seconds == pytest.approx(per_type * (4 * layer + SAMPLE_ROWS * 512 + lookup))
    slow = dataclasses.replace(ROUNDING, errors=ROUNDING.errors | {"Q2_K": 5e6})
    assert rounding_error_seconds(SHAPE, slow) - seconds == pytest.approx(seconds / len(CANDIDATE_TYPES))


def test_the_file_is_priced_in_the_type_nearest_the_budgets_bits():
    assert nearest_type(4.5, 512) == "Q4_K"
    assert nearest_type(6.6, 512) == "Q6_K"
    assert nearest_type(2.7, 512) == "Q2_K"
    assert nearest_type(15.0, 512) == "F16"
    assert nearest_type(4.5, 576) == "Q4_0"  # rows of 576 take no 256-wide blocks


def test_each_stage_grows_with_its_own_work_only():
    base = size_stage_seconds(SHAPE, WORK, RATES, ROUNDING)
    assert set(base) == {"importance", "export", "eval"}
    more = size_stage_seconds(SHAPE, dataclasses.replace(WORK, importance_windows=64), RATES, ROUNDING)
    assert more["importance"] > 1.5 * base["importance"]
    assert more["export"] == base["export"] and more["eval"] == base["eval"]
    longer = size_stage_seconds(SHAPE, dataclasses.replace(WORK, eval_tokens=16384), RATES, ROUNDING)
    assert longer["eval"] == pytest.approx(2 * base["eval"])
    # A narrowed model has new matrices: the export measures their importance again (a pass, not the load).
    built = size_stage_seconds(SHAPE, dataclasses.replace(WORK, structure=True), RATES, ROUNDING)
    assert base["export"] < built["export"] < base["export"] + base["importance"]
    assert built["importance"] == base["importance"]
    coarser = size_stage_seconds(SHAPE, dataclasses.replace(WORK, file_type="Q8_0"), RATES, ROUNDING)
    assert coarser == base  # every type quantizes at the same rate here
    slower = dataclasses.replace(ROUNDING, quantize=ROUNDING.quantize | {"Q8_0": 1e6})
    assert (
        size_stage_seconds(SHAPE, dataclasses.replace(WORK, file_type="Q8_0"), RATES, slower)["export"]
        > (base["export"])
    )
    assert "eval" not in size_stage_seconds(SHAPE, dataclasses.replace(WORK, eval_tokens=0), RATES, ROUNDING)


def test_ggml_rates_are_measured_once_and_not_kept_when_measured_on_a_busy_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("MASA_CACHE", str(tmp_path))
    measured = []
    monkeypatch.setattr(rates_module, "measure_rounding_rates", lambda: measured.append(1) or ROUNDING)
    assert rates_module.rounding_rates() == ROUNDING == rates_module.rounding_rates() and len(measured) == 1
    for path in (tmp_path / "rates").iterdir():
        path.unlink()
    busy = dataclasses.replace(ROUNDING, cpu_share=0.3)
    monkeypatch.setattr(rates_module, "measure_rounding_rates", lambda: measured.append(1) or busy)
    assert rates_module.rounding_rates() == busy == rates_module.rounding_rates() and len(measured) == 3


def test_measured_ggml_rates_cover_every_candidate_type_and_are_finite():
    import math

    rates = rates_module.measure_rounding_rates(rows=16, row_length=512)
    assert set(rates.errors) == set(rates.quantize) == set(CANDIDATE_TYPES)
    assert all(math.isfinite(r) and r > 1e4 for r in (*rates.errors.values(), *rates.quantize.values()))
    assert 0 < rates.cpu_share <= 1


def test_plan_size_prints_the_time_of_each_stage_a_byte_budget_runs(tmp_path, monkeypatch, capsys):
    """On a tiny folder (its config alone): `plan --size` prices the importance pass, the structure's run, the
    export and the evaluation. That the run carries this estimate beside its own times: `test_byte_structure`."""
    pytest.importorskip("xllamacpp")
    from conftest import tiny_model
    from test_gguf_tokenizer import bundled_tokenizer_files

    from compressor.cli import main

    monkeypatch.setattr(size_time, "rounding_rates", lambda: ROUNDING)  # its measurement: the test above
    folder = tmp_path / "tiny"
    tiny_model("llama", vocab_size=49152).save_pretrained(folder)
    bundled_tokenizer_files(folder)
    main(["plan", str(folder), "--size", "5800KiB", "--json"])
    planned = json.loads(capsys.readouterr().out)["time"]
    stages = planned["stages"]
    assert {"importance", "structure_calibration", "structure_residual_svd", "export", "eval"} <= set(stages)
    assert all(seconds >= 0 for seconds in stages.values())
    assert planned["total"] == pytest.approx(sum(stages.values()), abs=0.1 * len(stages))
    main(["plan", str(folder), "--size", "5800KiB"])
    assert "time: about" in capsys.readouterr().out


def test_plan_size_with_speed_prices_the_decode_costs_not_yet_measured_into_the_export(
    tmp_path, monkeypatch, capsys
):
    """`--speed mix`: the export's time grows by `decode_cost.measurement_seconds` of every candidate type of the
    model's row lengths and every type of the mix nearest the budget (here faked; its arithmetic:
    test_decode_cost), and `plan` says so; `any` adds nothing."""
    pytest.importorskip("xllamacpp")
    from conftest import tiny_model
    from test_gguf_tokenizer import bundled_tokenizer_files

    from compressor.cli import main

    monkeypatch.setattr(size_time, "rounding_rates", lambda: ROUNDING)
    asked = []
    monkeypatch.setattr(
        size_time, "measurement_seconds", lambda types, *a, **k: asked.append(set(types)) or 123.0
    )
    folder = tmp_path / "tiny"
    model = tiny_model("llama", vocab_size=49152)
    model.save_pretrained(folder)
    bundled_tokenizer_files(folder)
    plans = {}
    for speed in ("any", "mix"):
        main(["plan", str(folder), "--size", "5800KiB", "--speed", speed, "--json"])
        plans[speed] = json.loads(capsys.readouterr().out)["time"]
    assert plans["any"]["decode_cost"] == 0 and plans["mix"]["decode_cost"] == 123.0
    assert plans["mix"]["stages"]["export"] == pytest.approx(
        plans["any"]["stages"]["export"] + 123.0, abs=0.2
    )
    assert (
        len(asked) == 1 and {"F16", "Q8_0", "Q4_0"} <= asked[0]
    )  # the tiny model's 64-wide rows: no k-quant
    c = model.config
    layer, types = size_time.speed_types(c, 5800 << 10, mix=True)
    assert types == asked[0] and layer.hidden == c.hidden_size and layer.intermediate == c.intermediate_size
    mix = size_time._mix_types(c, layer, 5800 << 10)
    assert set(mix.values()) <= types and size_time.speed_types(c, 5800 << 10, False)[1] <= types
    assert len(mix) == 7 * c.num_hidden_layers + 1 + (not c.tie_word_embeddings)  # each matrix, the embedding
    main(["plan", str(folder), "--size", "5800KiB", "--speed", "mix"])
    assert "about 123 s to measure the ones not yet measured" in capsys.readouterr().out.replace("\n", " ")
    main(["plan", str(folder), "--size", "5800KiB", "--speed", "30", "--only-types", "q8_0,q4_0", "--json"])
    assert asked[-1] == {"Q8_0", "Q4_0"}  # a tokens/s limit: the candidates --only-types keeps, no mix's
