"""The sections of `make bench` (see `benchmarks/suite/run.py`): each takes the run's settings and returns its keys of
results.json."""

from __future__ import annotations

import shlex
import subprocess
import tempfile
from pathlib import Path

from benchmarks.report.plots import REPO
from benchmarks.suite.common import log, run_json_child, run_module_measured
from benchmarks.suite.scaling import run_larger_than_memory, run_scaling
from compressor.runtime.device import native_bfloat16_cpu

MODEL = "smollm2-135m"


def section_quality(s: dict) -> dict:
    from benchmarks.suite.quality import VARIANTS, compare, run_quality
    from benchmarks.suite.quality import variant_key as key

    result = run_quality(
        MODEL,
        {name: VARIANTS[name] for name in s["methods"]},
        s["ratios"],
        calib_samples=s["calib_samples"],
        seq_len=s["seq_len"],
        eval_seq_len=s["eval_seq_len"],
        eval_max_tokens=s["eval_max_tokens"],
        progress=False,
        log=log,
        split=s["eval_split"],
        extra_variants=s["extra_variants"],
    )
    scores = result["_scores"]
    default, baseline = s["methods"][0], s["methods"][1]
    rows = []
    for r in result["quality"]:
        row = {k: r[k] for k in ("method", "ratio", "ppl", "ppl_ci95", "kl_to_original", "top1_agreement",
                                 "achieved_ratio", "target_params_after", "compress_seconds", "groups")}  # fmt: skip
        row["rise_ci95"] = compare(scores, key(r["method"], r["ratio"]), "original")["ci95"]
        if r["method"] != default:
            # Paired: the default minus this row's method at the same ratio, on the same windows.
            row["default_minus_this"] = compare(
                scores, key(default, r["ratio"]), key(r["method"], r["ratio"])
            )
        rows.append(row)
    first = rows[0]
    details = {k: result[k] for k in ("model", "calibration", "evaluation", "calibration_seconds")}
    details["target_params_before"] = round(first["target_params_after"] / (1 - first["achieved_ratio"]))
    details["peak_rss_gib"] = result["peak_rss_gb"]
    details["default"], details["baseline"] = default, baseline
    return {
        "quality": rows,
        "original_ppl": result["original_ppl"],
        "original_ppl_ci95": result["original_ppl_ci95"],
        "quality_details": details,
    }


def section_headline(s: dict) -> dict:
    """The headline pair (default and baseline at the headline ratio) on other windows and text.

    Its own section, with its own calibration and compression (the same settings, so the same models), so
    that a new text or window length does not re-measure the whole quality table.
    """
    from benchmarks.suite.quality import (
        VARIANTS,
        build_variant,
        compare,
        evaluation_settings,
        prepare_quality,
        score,
        strip_windows,
    )

    setup = prepare_quality(
        MODEL, s["calib_samples"], s["seq_len"], progress=False, log=log, evaluate_original=False
    )
    default, baseline = s["methods"][0], s["methods"][1]
    pair = {
        name: build_variant(setup, name, VARIANTS[name], s["headline_ratio"], progress=False)[0]
        for name in (default, baseline)
    }
    headline = {}
    for spec in s["extra_evaluations"]:
        evaluation = evaluation_settings(
            setup.recipe, s["eval_split"], spec.get("seq_len", s["eval_seq_len"]),
            spec.get("max_tokens", s["eval_max_tokens"]), spec.get("text"),
        )  # fmt: skip
        log(f"headline pair on {evaluation.source} {evaluation.split}, {evaluation.seq_len}-token windows")
        extra = score(setup, pair, evaluation, progress=False)
        extra["default_minus_baseline"] = compare(extra, default, baseline)
        headline[f"{evaluation.source}@{evaluation.seq_len}"] = strip_windows(extra)
        log(
            f"  original {extra['original']['ppl']:.3f}, {default} {extra['models'][default]['ppl']:.3f}, "
            f"{baseline} {extra['models'][baseline]['ppl']:.3f} ({extra['evaluation']['tokens']} tokens)"
        )
    return {
        "headline_evaluations": headline,
        "headline_details": {"default": default, "baseline": baseline, "ratio": s["headline_ratio"]},
    }


#: Seconds of a run's summary that are not compression: loading the model, evaluating it, and the sum.
NOT_COMPRESSION = ("load", "eval_before", "eval", "total")


def _timed_compression(args: list[str], checkpoint: Path, what: str) -> dict:
    """One CLI run in a fresh process (`--json --no-stats-cache`: the capture is timed, never read from a
    cache): its command as a user types it, every stage's seconds, the rest of the process except loading and
    evaluating as `other`, and the process's own peak RSS and wall time."""
    args = [*args, "--json", "--no-stats-cache", "--out", str(checkpoint), "--overwrite"]
    command = "masa-compress " + " ".join(args).replace(str(checkpoint), "<tmp>")
    log(f"{what}: {command}")
    summary = run_module_measured("compressor", args, what)
    seconds = summary["seconds"]
    stages = {k: v for k, v in seconds.items() if k not in NOT_COMPRESSION}
    compressing = seconds["total"] - sum(seconds.get(k, 0.0) for k in NOT_COMPRESSION[:-1])
    stages["other"] = compressing - sum(stages.values())  # reading and tokenizing the text, planning, setup
    log(f"  {compressing:.1f} s compressing {stages}; peak RSS {summary['process']['peak_rss_gib']:.2f} GiB")
    from benchmarks.suite.speed import checkpoint_bytes

    return {
        "command": command,
        "achieved_ratio": summary["achieved_ratio"],
        "calibration": {
            k: summary["settings"]["calibration"][k] for k in ("samples", "seq_len", "seed", "text")
        },
        "stage_seconds": stages,
        "compress_seconds": compressing,
        "load_seconds": seconds.get("load", 0.0),
        "eval_seconds": seconds.get("eval", 0.0) + seconds.get("eval_before", 0.0),
        "total_seconds": seconds["total"],
        "process_seconds": summary["process"]["wall_seconds"],
        "peak_rss_gib": summary["process"]["peak_rss_gib"],
        "checkpoint_mib": checkpoint_bytes(checkpoint) / 1024**2,
        "dominant_stage": max(stages, key=stages.get),
        "summary_seconds": seconds,
        "quality": summary.get("quality"),  # with evaluation: perplexities, intervals, KL, top-1, tokens
    }


def demo_arguments() -> list[str]:
    """The arguments of `masa-compress` in `make demo`, as `make -n` expands them (`--overwrite` left out)."""
    dry_run = subprocess.run(
        ["make", "-n", "demo"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout
    line = next(line for line in dry_run.splitlines() if "masa-compress " in line)
    return [a for a in shlex.split(line.split("masa-compress ", 1)[1]) if a != "--overwrite"]


def section_compression(s: dict, checkpoint: Path) -> dict:
    """Real CLI runs in fresh processes: attention only and the model 20% smaller, the latter also with bfloat16
    forward passes in the calibration (no evaluation; every second but loading the model counted), each of the
    first two between two plain forward passes over its own calibration windows in other fresh processes (the
    reference of its ratio: their mean, `_bracketed_compression`), and `make demo`'s command itself, evaluation
    included, timed whole."""
    calibration_flags = []
    for flag, key in (("--calib-samples", "calib_samples"), ("--seq-len", "seq_len")):
        if s[key] is not None:
            calibration_flags += [flag, str(s[key])]
    ratio = str(s["stage_ratio"])
    forward_args = ["-m", "benchmarks.suite.speed", "forward", "--model", MODEL, *calibration_flags]
    attention = _bracketed_compression(
        [MODEL, "--ratio", ratio, "--no-eval", *calibration_flags], checkpoint, "attention only", forward_args
    )
    with tempfile.TemporaryDirectory(prefix="masa-bench-whole-") as work:
        # The model 20% smaller calibrates on the recipe's `mlp_samples`: its reference is a forward over those.
        whole = _bracketed_compression(
            [MODEL, "--targets", "attn,mlp", "--ratio", ratio, "--ratio-of", "model", "--no-eval",
             *calibration_flags],
            Path(work) / "whole",
            "the model 20% smaller",
            [*forward_args, "--targets", "attn,mlp"],
        )  # fmt: skip
        whole_bfloat16 = _bfloat16_compression(ratio, calibration_flags, Path(work) / "whole-bfloat16")
        # `make demo` as the Makefile runs it (a first run: no statistics cache); the quick run caps it further.
        eval_cap = ["--eval-max-tokens", str(s["eval_max_tokens"])] if s["eval_max_tokens"] else []
        demo = _timed_compression(
            [*demo_arguments(), *calibration_flags, *eval_cap], Path(work) / "demo", "demo"
        )
    attention["ratio"] = s["stage_ratio"]
    return {
        "compression": attention,
        "whole_model_compression": whole,
        "whole_model_bfloat16_compression": whole_bfloat16,
        "demo": demo,
        "compress_over_forward": attention["compress_seconds"] / attention["forward_seconds"],
        "whole_model_compress_over_forward": whole["compress_seconds"] / whole["forward_seconds"],
        # None (not left from an earlier run merged into this one) where this CPU only emulates bfloat16.
        "whole_model_bfloat16_compress_over_forward": (
            whole_bfloat16["compress_seconds"] / whole["forward_seconds"]
            if "compress_seconds" in whole_bfloat16
            else None
        ),
        "calibration_over_forward": attention["stage_seconds"]["calibration"] / attention["forward_seconds"],
        "demo_minutes": demo["process_seconds"] / 60,
    }


def _bracketed_compression(run_args: list[str], out: Path, what: str, forward_args: list[str]) -> dict:
    """A compression run between two plain forward passes over its own calibration windows, each in a fresh
    process: the run's reference is their mean (`forward_seconds`), `forward` and `forward_after` the two. A
    shared machine's speed drifts (the same forward over 64×512 tokens took 77.7 s and 119.2 s on one 2-core
    machine, hours apart), so a reference timed long before or after the run can move its ratio by a third; the
    two passes bound what the drift did during it."""
    before = run_json_child(forward_args, f"the plain forward pass before {what}")
    run = _timed_compression(run_args, out, what)
    after = run_json_child(forward_args, f"the plain forward pass after {what}")
    for forward in (before, after):
        _check_same_windows(forward, run)
    log(f"  {what}: forward {before['seconds']:.1f} s before, {after['seconds']:.1f} s after")
    return run | {
        "forward": before,
        "forward_after": after,
        "forward_seconds": (before["seconds"] + after["seconds"]) / 2,
    }


def _check_same_windows(forward: dict, run: dict) -> None:
    calibration = run["calibration"]
    if (forward["windows"], forward["seq_len"]) != (calibration["samples"], calibration["seq_len"]):
        raise RuntimeError(f"the forward pass ran other windows than the compression run: {forward}")


#: Why section 3 leaves out its bfloat16 run on a CPU without native bfloat16.
EMULATED_BFLOAT16 = (
    "not measured: this CPU has no native bfloat16 (no AVX512-BF16 or AMX), so a bfloat16 calibration is emulated "
    "and slower than float32 (the run warns so); the option is only worth timing where bfloat16 is native"
)


def _bfloat16_compression(ratio: str, calibration_flags: list[str], out: Path) -> dict:
    """The model 20% smaller with `--calib-precision bfloat16`, timed like the others, where this CPU multiplies
    bfloat16 natively; elsewhere only why it was not run (an emulated run took over 15 minutes where the float32
    one took 3: a figure of the emulation, not of the option)."""
    if not native_bfloat16_cpu():
        return {"skipped": EMULATED_BFLOAT16, "native_bfloat16_cpu": False}
    timed = _timed_compression(
        [MODEL, "--targets", "attn,mlp", "--ratio", ratio, "--ratio-of", "model", "--no-eval",
         "--calib-precision", "bfloat16", *calibration_flags],
        out,
        "the model 20% smaller, bfloat16 forward passes in the calibration",
    )  # fmt: skip
    return timed | {"native_bfloat16_cpu": True}


def section_whole_model(s: dict) -> dict:
    """The whole model (`--targets attn,mlp --ratio-of model`): the curve of `benchmarks.suite.whole_model` on the test
    split (the default, the low-rank MLP, uniform MLP widths, SVD-LLM), and the headline fraction on a second
    text domain."""
    from benchmarks.suite.whole_model import DEFAULT, measure_whole_model

    w = s["whole_model"]
    result = measure_whole_model(
        w["variants"], w["model_ratios"], s["eval_split"], headline=w["headline"], other_texts=tuple(w["texts"]),
        log=log, headline_variants=tuple(w.get("headline_variants", ())), calib_samples=s["calib_samples"], seq_len=s["seq_len"], eval_seq_len=s["eval_seq_len"],
        eval_max_tokens=s["eval_max_tokens"],
    )  # fmt: skip
    headline = next(
        r for r in result["quality"] if r["method"] == DEFAULT and r["model_ratio"] == w["headline"]
    )
    return {"whole_model": result, "whole_model_ppl_ratio": headline["ppl"] / result["original_ppl"]}


def section_latency(s: dict, checkpoint: Path) -> dict:
    """The attention-only checkpoint of section `compression` reloaded against the original (prefill, decode,
    memory); then the whole model 20% smaller (`whole_model_checkpoints`) the same way: its speed-ups."""
    from benchmarks.suite.speed import checkpoint_bytes
    from compressor.api.model_loading import bundled_model_dir, resolve_model

    log(f"latency: prefill {s['prefill_tokens']} tokens, decode {s['decode_tokens']} tokens (fresh process)")
    latency = _latency(s, checkpoint)
    log(f"  prefill ratio {latency['prefill_ratio']:.3f}, decode ratio {latency['decode_ratio']:.3f}")
    memory = {}
    for name, spec in (("original", MODEL), ("compressed", str(checkpoint))):
        log(f"inference memory of the {name} model (fresh process)")
        memory[name] = run_json_child(
            ["-m", "benchmarks.suite.speed", "memory", "--model", spec]
            + ["--prefill", str(s["prefill_tokens"]), "--decode", str(s["decode_tokens"])],
            f"the memory measurement ({name})",
        )
    memory["original_file_mib"] = checkpoint_bytes(bundled_model_dir(resolve_model(MODEL), False)) / 1024**2
    memory["compressed_file_mib"] = checkpoint_bytes(checkpoint) / 1024**2
    whole = whole_model_checkpoints(s, checkpoint.parent)
    timed = {name: _latency(s, path) for name, path in whole["paths"].items()}
    default = timed["default"]
    for name, lat in timed.items():
        log(
            f"  whole model ({name}): decode {1 / lat['decode_ratio']:.3f}x, prefill {1 / lat['prefill_ratio']:.3f}x faster"
        )
    return {
        "latency": latency,
        "inference_memory": memory,
        "prefill_latency_ratio": latency["prefill_ratio"],
        "decode_latency_ratio": latency["decode_ratio"],
        "whole_model_latency": {**timed, "commands": whole["commands"], "mib": whole["mib"]},
        # The original's time over the checkpoint's: above 1, the smaller model is faster.
        "whole_model_decode_speedup": 1 / default["decode_ratio"],
        "whole_model_prefill_speedup": 1 / default["prefill_ratio"],
    }


def _latency(s: dict, checkpoint: Path) -> dict:
    return run_json_child(
        ["-m", "benchmarks.suite.speed", "latency", "--model", MODEL, "--checkpoint", str(checkpoint)]
        + ["--prefill", str(s["prefill_tokens"]), "--decode", str(s["decode_tokens"])]
        + ["--repeats", str(s["latency_repeats"])],
        f"the latency measurement of {checkpoint.name}",
    )


def whole_model_checkpoints(s: dict, work: Path) -> dict:
    """The model 20% smaller (`--targets attn,mlp --ratio R --ratio-of model`), as the CLI writes it; and with one
    MLP width in every layer, exported by `export-dense` to the base architecture (plain transformers, no remote
    code). Paths, commands and sizes (MiB on disk)."""
    from benchmarks.suite.speed import checkpoint_bytes

    base = [
        MODEL,
        "--targets",
        "attn,mlp",
        "--ratio",
        str(s["whole_model"]["headline"]),
        "--ratio-of",
        "model",
    ]
    base += ["--json", "--no-eval", "--overwrite"]
    for flag, key in (("--calib-samples", "calib_samples"), ("--seq-len", "seq_len")):
        if s[key] is not None:
            base += [flag, str(s[key])]
    paths = {"default": work / "whole-model", "uniform": work / "whole-model-uniform"}
    commands = {}
    for name, extra in (("default", []), ("uniform", ["--uniform-mlp"])):
        args = [*base, *extra, "--out", str(paths[name])]
        commands[name] = "masa-compress " + " ".join(args).replace(str(work), "<tmp>")
        log(f"whole-model checkpoint ({name}): {commands[name]}")
        run_module_measured("compressor", args, f"the whole-model run ({name})")
    exported = work / "whole-model-uniform-dense"
    args = ["export-dense", str(paths["uniform"]), str(exported), "--overwrite", "--json"]
    commands["uniform-dense"] = "masa-compress " + " ".join(args).replace(str(work), "<tmp>")
    run_module_measured("compressor", args, "export-dense of the uniform checkpoint")
    paths["uniform-dense"] = exported
    return {
        "paths": paths,
        "commands": commands,
        "mib": {name: checkpoint_bytes(path) / 2**20 for name, path in paths.items()},
    }


def section_scaling(s: dict) -> dict:
    """The layer-sequential pipeline at several depths (memory flat with depth, the checkpoint identical to the
    in-memory one), then one deep model whose weights exceed what the run may hold (`benchmarks.suite.scaling`)."""
    scaling = run_scaling(
        s["scaling_width"], s["scaling_layers"], s["scaling_samples"], s["scaling_seq_len"], s["stage_ratio"],
        s["scaling_sensitivity"],
    )  # fmt: skip
    deep = s["deep"]
    larger = run_larger_than_memory(
        s["scaling_width"], deep["layers"], deep["samples"], deep["seq_len"], s["stage_ratio"],
        deep["sensitivity"], deep["eval_samples"],
    )  # fmt: skip
    runs = {r["layers"]: r for r in scaling["runs"]}
    first, depths = scaling["runs"][0], scaling["peak_ratio_depths"]
    return {
        "scaling": scaling,
        "depth_memory_ratio": scaling["peak_ratio"],
        "depth_overhead_growth": scaling["overhead_growth"],
        # The overhead at 2x the first depth (the older key, beside depth_memory_ratio's depths).
        "depth_memory_overhead_ratio": runs[depths[1]]["overhead_gib"] / first["overhead_gib"],
        "depth_time_ratio": scaling["time_ratio"],
        "larger_than_memory": larger,
    }
