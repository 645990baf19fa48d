"""`make bench-bytes`'s bookkeeping (benchmarks/engines/bytes_frontier.py) on made-up results: a run of some budgets
merged into an earlier one on the same windows, and the README's line on what `--size` files did. The runs
themselves take hours on the 1.5B model and are never part of the tests."""

import json

import pytest

from benchmarks.engines.bytes_frontier import check_rebuilt, merged
from benchmarks.report.bytes import commands
from benchmarks.report.readme import _size_decode, _size_instead

PROTOCOL = {"text": "wikipedia:test", "split": "test", "windows": 8, "seq_len": 512, "tokens": 4088}


def _results(command: str, budgets: dict[str, float], protocol=PROTOCOL) -> dict:
    """A results file measuring each budget (name → baseline bytes) with a mix, its importance weights and ours."""
    rows = [{"type": "f16", "imatrix": "none", "bytes": 10_000, "ppl": 18.0, "command": command}]
    rows += [{"type": name, "imatrix": kind, "bytes": size, "ppl": 20.0, "command": command}
             for name, size in budgets.items() for kind in ("none", "calibration", "size")]  # fmt: skip
    return {
        "command": command, "model": "m", "protocol": dict(protocol),
        "imatrix_gain": {name: {"plain_minus_imatrix": 0.1, "ci95": [0.0, 0.2], "command": command} for name in budgets},
        "rows": rows,
        "frontier": [{"type": name, "baseline_bytes": size, "ours_bytes": size - 1, "command": command}
                     for name, size in budgets.items()],
        "below_ladder": [],
    }  # fmt: skip


def test_a_merged_run_keeps_the_earlier_budgets_and_takes_the_new_measurements():
    earlier = _results("first", {"q4_k_m": 900, "q2_k": 500})
    latest = _results("second", {"q6_k": 1200, "q2_k": 500})
    out = merged(earlier, latest)
    assert [row["type"] for row in out["frontier"]] == ["q6_k", "q4_k_m", "q2_k"]  # by the baseline's bytes
    by_type = {row["type"]: row["command"] for row in out["frontier"]}
    assert by_type == {"q6_k": "second", "q4_k_m": "first", "q2_k": "second"}
    assert len(out["rows"]) == 1 + 3 * 3 and {r["command"] for r in out["rows"] if r["type"] == "f16"} == {
        "second"
    }
    assert {name: gain["command"] for name, gain in out["imatrix_gain"].items()} == by_type
    assert commands(out) == "`first`, then `second`"
    assert commands(merged(out, _results("third", {}))) == "`first`, then `second`, then `third`"


def test_a_retimed_run_names_its_timing_command_and_keeps_it_through_a_merge():
    timed = _results("first", {"q2_k": 500}) | {"retimed": ["again"]}
    assert commands(timed) == "`first`; speeds timed again by `again`"
    assert (
        commands(merged(timed, _results("second", {})))
        == "`first`, then `second`; speeds timed again by `again`"
    )


@pytest.mark.parametrize(
    "rebuilt", [{"bytes": 501, "type_counts": {"Q2_K": 3}}, {"bytes": 500, "type_counts": {"Q3_K": 3}}]
)
def test_a_file_rebuilt_for_timing_must_be_the_runs_own(rebuilt):
    row = {"bytes": 500, "type_counts": {"Q2_K": 3}}
    check_rebuilt(dict(row), row, "q2_k")  # the same file: timed
    with pytest.raises(SystemExit, match="q2_k: rebuilt"):
        check_rebuilt(rebuilt, row, "q2_k")


def test_runs_on_other_windows_do_not_merge():
    with pytest.raises(SystemExit, match="--max-tokens"):
        merged(_results("first", {"q2_k": 500}), _results("second", {}, PROTOCOL | {"tokens": 8184}))


def test_the_readme_counts_the_size_files_better_worse_and_tied():
    rows = [
        {"diff_lo": -2.0, "diff_hi": -1.0},
        {"diff_lo": -0.5, "diff_hi": 0.1},
        {"diff_lo": 0.1, "diff_hi": 0.3},
    ]
    line = _size_instead({"bytes_frontier_bundled": rows[:2], "bytes_frontier_1p5b": rows[2:]})
    assert "better at 1 of the 3 budgets" in line and "worse at 1," in line
    assert "worse at none" in _size_instead({"bytes_frontier_bundled": rows[:2]})


def _native_run(weight_ci: tuple[float, float]) -> dict:
    """A made-up native_balance run: the native model, its parts put back, two MLP weights, 16 windows."""

    def row(name, ratio, ci=None):
        diff = None if ci is None else {"value": sum(ci) / 2, "ci95": list(ci), "tie": ci[0] <= 0 <= ci[1]}
        return {"variant": name, "ppl": 30.0 * ratio / 1.5, "ppl_ratio": ratio, "minus_native": diff}

    return {
        "tokens": 1000,
        "sensitivity_windows": 4,
        "rows": [
            row("native", 1.5), row("attention-restored", 1.4, (-2.0, -1.0)), row("mlp-restored", 1.1, (-9.0, -8.0)),
            row("mlp-weight-0.5", 1.6, (1.0, 2.0)), row("mlp-weight-2", 1.55, weight_ci),
            row("sensitivity-16", 1.5, (-0.1, 0.1)),
        ],
    }  # fmt: skip


@pytest.mark.parametrize(
    ("weight_ci", "claim"), [((0.5, 1.5), "every one worse"), ((-0.2, 0.4), "not every one")]
)
def test_the_native_levers_say_every_weight_worse_only_when_every_interval_is_above_zero(
    tmp_path, monkeypatch, weight_ci, claim
):
    from benchmarks.report import bytes as report

    (tmp_path / "native-balance-validation.json").write_text(json.dumps(_native_run(weight_ci)))
    monkeypatch.setattr(report, "CHOICES", tmp_path)
    text = report._native_levers()[0]
    assert claim in text
    assert "with every MLP put back 1.100x" in text
    assert "16 windows instead of 4: +0.000 [-0.100, +0.100] (tie)" in text
    assert "without attention" not in text  # no attention-free run: nothing said about it


def test_a_structure_file_worse_than_types_alone_is_said_and_a_better_one_is_not(tmp_path):
    import json

    from benchmarks.report.readme import RESULTS_DIR, _structure_overrated

    measured = RESULTS_DIR / "size-structure-qwen2.5-coder-1.5b.json"
    run = json.loads(measured.read_text())
    types_alone = {row["baseline_bytes"]: row for row in json.loads((RESULTS_DIR / "bytes-qwen2.5-coder-1.5b.json").read_text())["frontier"]}[run["compress"]["budget"]]  # fmt: skip
    said = _structure_overrated(measured)
    assert (run["llama_cpp"]["ppl"] > types_alone["ours_ppl"]) == bool(said)
    if said:
        assert f"{run['llama_cpp']['ppl']:.2f}" in said
        if "guarded" in run:  # the same command since, with its figures
            assert f"same command writes types alone: {run['guarded']['llama_cpp']['ppl']:.2f}" in said
            unguarded = {k: v for k, v in run.items() if k != "guarded"}
            before = tmp_path / "before.json"
            before.write_text(json.dumps(unguarded))
            assert _structure_overrated(before).endswith("use `export --size` there.")
        else:
            assert "use `export --size` there" in said
    run["llama_cpp"]["ppl"] = (
        types_alone["ours_ppl"] - 0.5
    )  # a structure file that did better: nothing to warn of
    better = tmp_path / "better.json"
    better.write_text(json.dumps(run))
    assert _structure_overrated(better) == ""


def test_an_eval_speed_run_replaces_its_own_builds_rows_and_keeps_the_others():
    """`benchmarks.engines.eval_speed --build NAME`: one file holds every build's rows; a file in the format before
    builds (rows at the top) is not merged into."""
    from benchmarks.engines.eval_speed import merged

    machine = {"cpu": "x"}
    first = merged(None, "prebuilt", {"rows": {"f16": 1}}, machine)
    both = merged(first, "native", {"rows": {"f16": 2}}, machine)
    again = merged(both, "prebuilt", {"rows": {"f16": 3}}, machine)
    assert {name: build["rows"]["f16"] for name, build in again["builds"].items()} == {
        "prebuilt": 3,
        "native": 2,
    }
    assert again["builds"]["native"]["machine"] == machine
    assert set(merged({"rows": {"tf": {}}}, "native", {"rows": {}}, machine)) == {"what", "builds"}


def test_the_eval_speed_line_says_where_a_windows_time_goes_and_names_a_blas_build(tmp_path, monkeypatch):
    """BENCHMARKS.md's line on `eval --engine llama.cpp`: each build's widest vectors, AMX and its BLAS library
    where it has them, a file's `--flash-attention` row beside its exact one (time and perplexity change), and
    the f16 window's hidden states against its prefill alone, beside transformers' time a window; a build timed
    before the breakdown existed still renders, without it."""
    from benchmarks.report.eval_speed import eval_speed_lines

    system_info = "CPU : AVX2 = 1 | AVX512 = 1 | OPENMP = 1 | "
    machine = {"cpu": "Some CPU", "vector_extension": "AVX512", "usable_cores": 2, "torch_threads": 2}
    rows = {"transformers": {"seconds": 8.0, "windows": 16, "seconds_over_transformers": 1.0},
            "f16": {"seconds": 20.0, "windows": 16, "seconds_over_transformers": 2.5}}  # fmt: skip
    builds = {
        "native": {
            "llama_cpp": {"system_info": system_info},
            "rows": rows,
            "max_tokens": 8192,
            "machine": machine,
        },
        "amx": {
            "llama_cpp": {"system_info": system_info + "AMX_INT8 = 1 | "},
            "rows": rows
            | {
                "f16 flash": {"seconds": 12.0, "ppl": 20.5, "seconds_over_transformers": 1.5},
                "f16": rows["f16"] | {"ppl": 20.0},
            },  # fmt: skip
            "max_tokens": 8192,
            "machine": machine,
        },
        "openblas": {
            "llama_cpp": {"system_info": system_info, "devices": ["BLAS (OpenBLAS)", "CPU (Some CPU)"]},
            "rows": rows,
            "window": {"tokens": 512, "hidden_states_seconds": 1.3, "prefill_seconds": 0.95},
            "max_tokens": 8192,
            "machine": machine,
        },
    }
    (tmp_path / "eval-speed-smollm2-135m.json").write_text(json.dumps({"builds": builds}))
    text = " ".join(eval_speed_lines(tmp_path))
    assert "native (AVX512; transformers 8.0 s): f16 2.50x the transformers time;" in text
    flash = "(1.50x with `--flash-attention`, perplexity +0.5000)"
    assert f"amx (AVX512, AMX; transformers 8.0 s): f16 2.50x {flash}" in text
    assert "f16 flash" not in text
    assert (
        "openblas (AVX512, matrix products through BLAS (OpenBLAS); transformers 8.0 s): f16 2.50x the transformers "
        "time; one 512-token window of the f16 file: its hidden states 1.30 s, its prefill alone 0.95 s "
        "(transformers 0.50 s a window, head included)" in text
    )


def test_a_retime_on_kept_files_takes_each_timed_file_and_names_a_missing_one(tmp_path):
    """`benchmarks.engines.retime --files DIR`: the run's own files, by their names in the run, with
    their sizes (checked against the recorded rows); the f32 file is never timed; a missing file is named."""
    from benchmarks.engines.llama_cpp import EXPORTS, gguf_name
    from benchmarks.engines.retime import _kept_files

    timed = [(kind, t) for kind, t in EXPORTS if t != "f32"]
    for index, (kind, tensor_type) in enumerate(timed):
        (tmp_path / gguf_name(kind, tensor_type)).write_bytes(b"x" * (index + 1))
    files = _kept_files(tmp_path)
    assert list(files) == timed
    assert files[("native uniform", "q8_0")]["bytes"] == timed.index(("native uniform", "q8_0")) + 1
    (tmp_path / "mlp-only-f16.gguf").unlink()
    with pytest.raises(SystemExit, match="mlp-only-f16.gguf is missing"):
        _kept_files(tmp_path)


def test_the_readme_names_the_budgets_where_a_size_file_decodes_slower(tmp_path):
    def timed(budget: str, ratio: float, structure: bool) -> tuple[dict, list[dict]]:
        ours = "structure" if structure else "size"
        rows = [{"type": budget, "imatrix": "calibration", "type_counts": {"Q3_K": 100, "Q4_K": 50, "Q6_K": 1}},
                {"type": budget, "imatrix": "size", "type_counts": {"Q4_K": 90, "IQ3_S": 60}}]  # fmt: skip
        if structure:
            rows.append({"type": budget, "imatrix": "structure", "type_counts": {"Q4_1": 200}})
        return {"type": budget, "ours": ours, "decode_ratio": ratio, "decode_ratio_2t": ratio}, rows

    for model, budgets in {"qwen2.5-coder-1.5b": [("q4_k_m", 1.1, False), ("q2_k", 0.7, False)],
                           "smollm2-135m": [("q3_k_m", 0.9, True), ("q6_k", 1.3, True)]}.items():  # fmt: skip
        pairs = [timed(*budget) for budget in budgets]
        data = {"frontier": [p[0] for p in pairs], "rows": [r for p in pairs for r in p[1]]}
        (tmp_path / f"bytes-{model}.json").write_text(json.dumps(data))
    line = _size_decode(tmp_path)
    assert "Qwen2.5-Coder-1.5B at q2_k 0.70x (ours 90 Q4_K, 60 IQ3_S; the mix 100 Q3_K, 50 Q4_K)" in line
    assert (
        "SmolLM2-135M at q3_k_m 0.90x (ours 200 Q4_1; the mix" in line
    )  # compress --size's file where it ran
    assert "at the other timed budgets 1.10-1.30x" in line and "q4_k_m" not in line
    for path in tmp_path.iterdir():  # every budget at least as fast: no line
        data = json.loads(path.read_text())
        path.write_text(
            json.dumps(data | {"frontier": [r | {"decode_ratio": 1.0} for r in data["frontier"]]})
        )
    assert _size_decode(tmp_path) == ""


def _speeds(decode: float) -> dict:
    return {"decode_tokens_per_second": decode, "decode_tokens_per_second_2t": 2 * decode}


def test_the_byte_choices_render_each_paired_reading_and_the_decode_ratio(tmp_path, monkeypatch):
    """The size-refit and --only-types runs (`benchmarks/report/byte_choices`): each stream row's paired reading
    against calibration, each --size file's against the mix and (k-quants alone) against every type, its decode
    over the mix's; a choice not run renders nothing."""
    from benchmarks.report import byte_choices

    monkeypatch.setattr(byte_choices, "CHOICES", tmp_path)
    assert byte_choices._size_refit() == [] and byte_choices._only_types() == []
    common = {"command": "python -m x", "tokens": 16352, "original_ppl": 17.5}
    refit = {"size": "84MiB", "bytes": 84 * 2**20, "removed": 1000, "ppl": 21.0, "predicted_rise": 0.05,
             "measured_rise": 0.07}  # fmt: skip
    (tmp_path / "size-refit-validation.json").write_text(json.dumps({**common, "rows": [
        {**refit, "refit": "calibration"},
        {**refit, "refit": "stream", "ppl": 20.5, "minus_calibration": -0.5, "ci95": [-0.8, -0.2]},
        {**refit, "size": "90MiB", "refit": "stream", "minus_calibration": 0.0, "ci95": [0.0, 0.0]},
    ]}))  # fmt: skip
    lines = byte_choices._size_refit()
    assert "| 84MiB | calibration | 84.00 | 1,000 | 21.000 |  | 0.0500 · 0.0700 |" in lines
    assert (
        "| 84MiB | stream | 84.00 | 1,000 | 20.500 | -0.500 [-0.800, -0.200] better | 0.0500 · 0.0700 |"
        in lines
    )
    assert "| 90MiB | stream | 84.00 | 1,000 | 21.000 | 0 (the same scores) | 0.0500 · 0.0700 |" in lines
    file = {"type": "q2_k", "bytes": 700 * 2**20, "type_counts": {"Q4_K": 70, "IQ3_S": 65}}
    (tmp_path / "only-types-m-validation.json").write_text(json.dumps({**common, "model": "m", "only_types": "q4_k",
        "rows": [
            {**file, "kind": "mix", "ppl": 23.0, "decode_vs_mix": 1.0, "decode_vs_mix_2t": 1.0},
            {**file, "kind": "every type", "ppl": 20.7, "minus_mix": -2.3, "minus_mix_ci95": [-3.0, -1.5],
             "decode_vs_mix": 0.67, "decode_vs_mix_2t": 0.75},
            {**file, "kind": "only types", "ppl": 21.0, "minus_mix": -2.0, "minus_mix_ci95": [-2.6, -1.4],
             "minus_every_type": 0.3, "minus_every_type_ci95": [-0.1, 0.6], "decode_vs_mix": 0.98,
             "decode_vs_mix_2t": 1.01},
        ]}))  # fmt: skip
    lines = byte_choices._only_types()
    assert lines[0].startswith("**`--only-types q4_k`** (`python -m x`, m, validation split, 16,352 tokens")
    assert (
        "| q2_k | every type | 700.00 | 20.700 | -2.300 [-3.000, -1.500] better |  | 0.67x · 0.75x | "
        in "".join(lines)
    )
    assert (
        "| q2_k | only types | 700.00 | 21.000 | -2.000 [-2.600, -1.400] better | +0.300 [-0.100, +0.600] tie | "
        "0.98x · 1.01x | 70 Q4_K, 65 IQ3_S |"
    ) in lines
    assert byte_choices.only_types_sentence(tmp_path) == (
        " `--only-types` restricts the allocation to the types named (validation split; ours / the mix's decode, "
        "1 thread, and paired differences). On m with q4_k: q2_k 0.98x, perplexity +0.300 [-0.100, +0.600] tie "
        "against every type and -2.000 [-2.600, -1.400] better against the mix."
    )


def test_the_readmes_llama_cpp_eval_limitation_gives_each_builds_span_and_its_flash_attention_span(tmp_path):
    """The README's line: per build, the exact rows' span of times over transformers', and the
    `--flash-attention` rows' span beside it where the build has them (never mixed into the exact span)."""
    from benchmarks.report.eval_speed import llama_cpp_eval_limitation

    machine = {"usable_cores": 2, "vector_extension": "AVX512"}

    def build(exact: list[float], flash: list[float], system_info: str = "CPU : AVX512 = 1 | ") -> dict:
        rows = {"transformers": {"seconds_over_transformers": 1.0}}
        rows |= {f"t{i}": {"seconds_over_transformers": r} for i, r in enumerate(exact)}
        rows |= {f"t{i} flash": {"seconds_over_transformers": r} for i, r in enumerate(flash)}
        return {"rows": rows, "machine": machine, "llama_cpp": {"system_info": system_info}}

    builds = {"prebuilt": build([3.0, 3.7], [2.5, 2.9]), "native": build([1.4, 2.2], [])}
    (tmp_path / "eval-speed-smollm2-135m.json").write_text(json.dumps({"builds": builds}))
    text = llama_cpp_eval_limitation(tmp_path)
    assert "3.0-3.7x (2.5-2.9x with `--flash-attention`) the transformers time with the prebuilt" in text
    assert "1.4-2.2x with llama.cpp built for it (" in text and text.count("--flash-attention") == 1
    assert "AMX included" not in text  # said only of a build whose own system info lists AMX_INT8


def test_the_frontier_pairs_the_mean_kl_per_window_and_the_readme_leads_with_it(monkeypatch):
    """score_ladder: each budget's KL difference is the paired one over the same windows (ours − the mix, from the
    per-window KL sums), and the per-token tails reach the rows; the README's table then leads with that KL and
    its reading, where a run without per-window KL keeps the perplexity-led table and says why."""
    from types import SimpleNamespace

    import benchmarks.engines.bytes_frontier as frontier
    from benchmarks.report.readme import _bytes_rows
    from compressor.evaluation.intervals import paired_mean_difference

    tokens = [511] * 4
    kl_sums = {"mix": [60.0, 50.0, 70.0, 55.0], "ours": [20.0, 25.0, 15.0, 30.0], "f16": [0.0] * 4}

    def scored(name: str):
        result = SimpleNamespace(
            ppl=20.0 if name != "f16" else 18.0,
            ppl_ci95=[19.0, 21.0],
            window_nll=[1500.0 + 10 * i for i in range(4)],
            window_tokens=tokens,
        )
        faith = SimpleNamespace(
            kl_to_original=sum(kl_sums[name]) / sum(tokens),
            top1_agreement=0.9,
            window_kl=kl_sums[name],
            kl_percentiles={"p99": 1.0, "p99.9": 2.5},
        )
        return result, faith  # fmt: skip

    reference = SimpleNamespace(
        text="t", windows=4, seq_len=512, tokens=sum(tokens), ppl=18.0, ppl_ci95=[17, 19]
    )
    names = {"f16|none": "f16", "q2_k|calibration": "mix", "q2_k|size": "ours"}
    monkeypatch.setattr(
        frontier, "score_files", lambda *a, **k: (reference, {p: scored(n) for p, n in names.items()})
    )
    written = {"out": "x.gguf", "bytes": 1000, "type_counts": {"Q2_K": 1}, "fallbacks": []}
    files = {("f16", "none"): written, ("q2_k", "calibration"): written, ("q2_k", "size"): written}
    results, rows = frontier.score_ladder("m", files, 2048)
    (row,) = results["frontier"]
    expected = paired_mean_difference(kl_sums["ours"], kl_sums["mix"], tokens)
    assert row["kl_diff"] == pytest.approx(expected.value) and row["kl_diff"] < 0
    assert [row["kl_diff_lo"], row["kl_diff_hi"]] == pytest.approx(list(expected.ci95))
    assert all(r["kl_p999"] == 2.5 and r["kl_p99"] == 1.0 for r in rows)
    data = {**results, "rows": rows, "model": "smollm2-135m"}
    led = _bytes_rows(data, "smollm2-135m", "T").splitlines()
    assert led[0].startswith("| budget (the size of llama.cpp's mix) | mean KL to the original")
    assert "**closer**" in led[2] and "per-window KL" not in led[-1]
    for r in data["frontier"]:
        del r["kl_diff"]
    plain = _bytes_rows(data, "smollm2-135m", "T").splitlines()
    assert "perplexity" in plain[0].split("|")[2] and "runs kept no per-window KL" in plain[-1]


def test_the_speed_limit_run_renders_the_measured_ratio_its_interval_and_what_speed_cost(tmp_path):
    """`--speed mix` rows (`benchmarks/report/speed_limit`): per `--size` file its paired readings against the mix
    and (held) against `any`, its measured decode over the mix's with the interval over paired turns, and (held)
    the predicted ratio; the count of budgets whose interval reaches 1; nothing where the run does not exist."""
    from benchmarks.report.speed_limit import speed_limit_lines, speed_limit_sentence

    assert speed_limit_lines(tmp_path) == [] and speed_limit_sentence(tmp_path) == ""
    file = {
        "type": "q2_k",
        "bytes": 84 * 2**20,
        "type_counts": {"Q4_1": 186, "Q4_K": 24},
        "decode_vs_mix_2t": 0.8,
    }
    held_record = {"predicted_tokens_per_second": 104.0, "mix_tokens_per_second": 100.0, "mix": "q2_k"}
    (tmp_path / "speed-limit-m-validation.json").write_text(json.dumps({
        "command": "python -m x", "model": "m", "tokens": 8192, "original_ppl": 17.5, "repeats": 7,
        "held_not_slower": "1 of 1", "rows": [
            {**file, "kind": "mix", "ppl": 23.0},
            {**file, "kind": "any", "ppl": 20.7, "minus_mix": -2.3, "minus_mix_ci95": [-3.0, -1.5],
             "decode_ratio": 0.69, "decode_ratio_ci95": [0.65, 0.73], "speed": None},
            {**file, "kind": "speed mix", "ppl": 21.5, "minus_mix": -1.5, "minus_mix_ci95": [-2.0, -1.0],
             "minus_any": 0.8, "minus_any_ci95": [0.5, 1.1], "decode_ratio": 1.02, "decode_ratio_ci95": [0.98, 1.06],
             "speed": held_record, "type_counts": {"IQ4_NL": 93, "Q4_1": 69}},
        ]}))  # fmt: skip
    lines = speed_limit_lines(tmp_path)
    assert lines[0].startswith("**`--speed mix`** (`python -m x`, m, validation split, 8,192 tokens")
    assert "reached 1 or above at 1 of 1 budgets (0 entirely at or above 1)" in lines[0]
    assert (
        "| q2_k | any | 84.00 | 20.700 | -2.300 [-3.000, -1.500] better |  | 0.69x [0.65, 0.73] · 0.80x |  | "
        in ("".join(lines))
    )
    assert (
        "| q2_k | speed mix | 84.00 | 21.500 | -1.500 [-2.000, -1.000] better | +0.800 [+0.500, +1.100] worse | "
        "1.02x [0.98, 1.06] · 0.80x | 1.04x (to q2_k) | 93 IQ4_NL, 69 Q4_1 |"
    ) in lines
    assert speed_limit_sentence(tmp_path).endswith(
        "On m: q2_k 1.02x [0.98, 1.06], perplexity +0.800 [+0.500, +1.100] worse against `any` and -1.500 "
        "[-2.000, -1.000] better against the mix."
    )
