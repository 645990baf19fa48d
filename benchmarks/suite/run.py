"""`make bench`: the project's benchmark, in one run so that its ratios compare like with like.

Sections (all on the bundled SmolLM2-135M unless said otherwise):
1. quality: attention only, perplexity on the TEST split at ratios 0.1-0.4 for masa and svd-llm (and at 0.2 the
   paper's configuration, the other form of sharing and Basis Sharing), with ONE calibration and ONE evaluation
   pass that scores every model with the original on the same windows (`benchmarks.suite.quality.run_quality`): 95%
   bootstrap intervals, paired differences, KL from the original and top-1 agreement;
1b. headline: the 0.2 pair (masa, svd-llm) again with 2048-token windows and on a second text domain;
2. whole_model: `--targets attn,mlp --ratio-of model` at 10-40% of the model (the default, the low-rank MLP,
   uniform MLP widths, FLAP, SVD-LLM; `benchmarks.suite.whole_model`), the 20% model also on a second text domain;
3. compression: real `masa-compress smollm2-135m --ratio 0.2` and `... --targets attn,mlp --ratio-of model`
   runs in fresh processes (time per stage, peak RSS, the checkpoint), each between two plain forward passes
   over its own calibration tokens in other fresh processes, their mean its reference (the ratios:
   `compress_over_forward`, `whole_model_compress_over_forward`, `calibration_over_forward`), the model 20% smaller again with
   `--calib-precision bfloat16` where the CPU multiplies bfloat16 natively (elsewhere it says why not), and
   `make demo`'s command timed whole (`demo_minutes`);
4. latency: the checkpoint of (3) reloaded with `load_compressed` vs the original, prefill and decode, and
   each model's memory in a fresh process; then the model 20% smaller (and its `--uniform-mlp` export) the
   same way: `whole_model_decode_speedup`, `whole_model_prefill_speedup`;
5. scaling: the layer-sequential compression (`--layerwise`) of random models of the bundled width with 15, 30
   and 60 layers (peak RSS, overhead over the loaded state, the checkpoint compared byte for byte with the
   in-memory path's), then of one 256-layer model whose weights are larger than its run's peak RSS, reloaded and
   evaluated.

Each section's date and machine (CPU, vector extension, cores, threads) are recorded, so that a page merged from
runs on different machines says which timings came from which. Writes `results.json` and the PNG plots to --out-dir
(default `benchmarks/results/`) and the page --doc (default `BENCHMARKS.md`). `--quick` (CI) runs tiny settings
into a temporary directory (never the committed files) and exits non-zero unless every number is finite and every
file was written; the full run does the same checks.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from benchmarks.report.page import MIN_TARGETS, REPO, TARGETS, render
from benchmarks.suite.common import (
    BUNDLED_WIDTH,
    NARROW_WIDTH,
    log,
    machine_info,
    machine_signature,
    non_finite,
    write_json,
)
from benchmarks.suite.measurements import (
    MODEL,
    section_compression,
    section_headline,
    section_latency,
    section_quality,
    section_scaling,
    section_whole_model,
)

SECTIONS = ("quality", "headline", "whole_model", "compression", "latency", "scaling")

FULL = {
    "methods": ["masa", "svd-llm"],
    "ratios": [0.1, 0.2, 0.3, 0.4],
    # Measured once, at the headline ratio: the paper's configuration, the other form of sharing, and Basis Sharing.
    "extra_variants": {0.2: ["masa-paper", "sharing-basis", "basis-sharing"]},
    "calib_samples": None,  # the recipe's: 64 windows, its mlp_samples (256) where the MLP is targeted
    "seq_len": None,  # the recipe's: 512 tokens
    "eval_split": "test",
    "eval_seq_len": 512,
    "eval_max_tokens": None,  # every test token
    # The headline pair (masa and svd-llm at 0.2) scored again: the literature's 2048-token windows, and a
    # second text domain.
    "headline_ratio": 0.2,
    "extra_evaluations": [{"seq_len": 2048}, {"text": "shakespeare"}],
    # The whole model (`--targets attn,mlp --ratio-of model`): the curve at these fractions of the model, the
    # headline fraction also on a second text and timed (section latency).
    "whole_model": {
        "variants": [
            "masa-attn-mlp",
            "masa-attn-mlp-lowrank",
            "flap-attn-mlp",
            "modegpt-attn-mlp",
            "svd-llm-attn-mlp",
        ],
        "model_ratios": [0.1, 0.2, 0.3, 0.4],
        # One MLP width in every layer (the standard architecture of export-dense), at the headline fraction.
        "headline_variants": ["masa-attn-mlp-uniform"],
        "headline": 0.2,
        "texts": ["shakespeare"],
    },
    "stage_ratio": 0.2,
    "prefill_tokens": 512,
    "decode_tokens": 64,
    "latency_repeats": 7,
    "scaling_width": BUNDLED_WIDTH,
    # Layer-sequential (`--layerwise`) compression at half, once and twice the bundled model's 30 layers...
    "scaling_layers": [15, 30, 60],
    "scaling_samples": 32,
    "scaling_seq_len": 512,
    "scaling_sensitivity": 16,
    # ...and one model of 256 layers (3.5 GiB of fp32 weights), its checkpoint loaded and evaluated.
    "deep": {"layers": 256, "samples": 16, "seq_len": 256, "sensitivity": 4, "eval_samples": 4},
}
QUICK = {
    "methods": ["masa", "svd"],
    "ratios": [0.2],
    "extra_variants": {},
    "calib_samples": 4,
    "seq_len": 128,
    "eval_split": "test",
    "eval_seq_len": 512,
    "eval_max_tokens": 1024,
    "headline_ratio": 0.2,
    "extra_evaluations": [{"seq_len": 1024, "max_tokens": 2048}],
    "whole_model": {
        "variants": ["masa-attn-mlp", "svd-llm-attn-mlp"],
        "model_ratios": [0.2],
        "headline": 0.2,
        "texts": [],
    },
    "stage_ratio": 0.2,
    "prefill_tokens": 64,
    "decode_tokens": 8,
    "latency_repeats": 3,
    "scaling_width": NARROW_WIDTH,
    "scaling_layers": [4, 8, 16],
    "scaling_samples": 4,
    "scaling_seq_len": 64,
    "scaling_sensitivity": 2,
    "deep": {"layers": 32, "samples": 2, "seq_len": 64, "sensitivity": 1, "eval_samples": 2},
}
REQUIRED_KEYS = (
    "quality",
    "original_ppl",
    "compress_over_forward",
    "whole_model_compress_over_forward",
    "calibration_over_forward",
    "demo_minutes",
    "depth_memory_ratio",
    "depth_overhead_growth",
    "larger_than_memory",
    "prefill_latency_ratio",
    "decode_latency_ratio",
    "whole_model",
    "whole_model_ppl_ratio",
    "whole_model_decode_speedup",
    "whole_model_prefill_speedup",
    "machine",
    "date",
    "command",
)
#: What the issue's checks read of the deep model's run.
LARGER_THAN_MEMORY_KEYS = ("layers", "weights_bytes", "peak_rss_bytes", "ppl")


# ------------------------------------------------------------------------------------------------------
# Checks


def check(results: dict, files: list[Path]) -> list[str]:
    """Everything wrong with a run: missing keys, non-finite numbers, missing or empty files."""
    problems = [f"results.json has no '{k}'" for k in REQUIRED_KEYS if k not in results]
    bfloat16 = results.get("whole_model_bfloat16_compression") or {}
    if not bfloat16.get("skipped") and results.get("whole_model_bfloat16_compress_over_forward") is None:
        problems.append("results.json has no 'whole_model_bfloat16_compress_over_forward' and no reason why")
    problems += [f"not finite: {p}" for p in non_finite(results)]
    quality = results.get("quality") or []
    if not quality:
        problems.append("the quality table is empty")
    for row in quality:
        missing = {"method", "ratio", "ppl"} - set(row)
        if missing:
            problems.append(f"quality row without {sorted(missing)}: {row}")
    for key in (*TARGETS, *MIN_TARGETS):
        if not isinstance(results.get(key), (int, float)) or results.get(key, 0) <= 0:
            problems.append(f"{key} is not a positive number: {results.get(key)!r}")
    deep = results.get("larger_than_memory")
    for key in LARGER_THAN_MEMORY_KEYS if isinstance(deep, dict) else ():
        if not isinstance(deep.get(key), (int, float)) or deep.get(key, 0) <= 0:
            problems.append(f"larger_than_memory.{key} is not a positive number: {deep.get(key)!r}")
    problems += [f"file missing or empty: {f}" for f in files if not f.is_file() or f.stat().st_size == 0]
    return problems


# ------------------------------------------------------------------------------------------------------
# Entry point


def notes(results: dict) -> list[str]:
    """Caveats the reader needs, derived from the run itself."""
    found = [
        "Peak memory is each fresh process's own high-water mark (`VmHWM` in /proc/self/status), not "
        "`ru_maxrss`: on Linux a child started from a large parent inherits the parent's peak in its "
        "`ru_maxrss`."
    ]
    compression = results.get("compression", {})
    if "cli_reported_peak_rss_gb" in compression:
        found[0] += (
            f" (The compression run's own summary, which reads `ru_maxrss`, said "
            f"{compression['cli_reported_peak_rss_gb']:.2f} GiB; its `VmHWM` was "
            f"{compression['peak_rss_gib']:.2f} GiB.)"
        )
    machine = results["machine"]
    load = max((machine.get("load_average_start") or [0])[0], (machine.get("load_average_end") or [0])[0])
    if load > 0.25 * (machine.get("usable_cores") or 1):
        found.append(
            f"The machine was not idle (1-minute load average up to {load:.2f} on {machine['usable_cores']} "
            "cores): times are inflated and noisy. With torch's default threads on a shared CPU, small "
            "LAPACK calls (the SVDs and Cholesky factorizations) can slow down by orders of magnitude (measured "
            "once on this project's 2-core machine: one 576×576 fp64 SVD took 16 s with 2 threads under load "
            "vs 0.12 s with 1). Run alone for numbers to quote."
        )
    if machine.get("device", "cpu") != "cpu":
        found.append(
            f"Device `{machine['device']}`: the quality section, the compression run and the plain forward "
            "pass ran there; the latency and inference-memory measurements ran on the CPU."
        )
    return found


def _command(argv: list[str]) -> str:
    return " ".join(["python -m benchmarks.suite.run", *argv])


def _load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--quick", action="store_true", help="tiny settings for CI, into a temporary directory"
    )
    parser.add_argument(
        "--out-dir", help="results.json and plots (default: benchmarks/results/, or a temp dir with --quick)"
    )
    parser.add_argument(
        "--doc", help="the markdown page (default: BENCHMARKS.md, or OUT_DIR/BENCHMARKS.md with --quick)"
    )
    parser.add_argument(
        "--sections",
        default=",".join(SECTIONS),
        help="comma-separated subset of " + ",".join(SECTIONS) + " (latency needs compression); a subset is "
        "merged into the existing OUT_DIR/results.json",
    )
    parser.add_argument(
        "--eval-max-tokens", type=int, help="override the evaluation size of the quality section"
    )
    parser.add_argument(
        "--threads",
        type=int,
        help="torch threads for every process (default: torch's default, recorded; 1 with --quick, where "
        "a busy CI machine would otherwise stall the small LAPACK calls of 2 threads)",
    )
    return parser


def _configure(args, parser) -> tuple[dict, list[str], Path, Path]:
    """The settings, the sections, the output folder and the page, from the command line (threads set)."""
    if args.quick and not args.threads:
        args.threads = 1
    settings = dict(QUICK if args.quick else FULL)
    if args.eval_max_tokens:
        settings["eval_max_tokens"] = args.eval_max_tokens
    sections = [x.strip() for x in args.sections.split(",") if x.strip()]
    unknown = set(sections) - set(SECTIONS)
    if unknown or ("latency" in sections and "compression" not in sections):
        parser.error(f"--sections: choose among {', '.join(SECTIONS)}; latency needs compression")
    if args.threads:
        os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(args.threads)
        import torch

        torch.set_num_threads(args.threads)
    if args.out_dir:
        out_dir = Path(args.out_dir)
    elif args.quick:
        out_dir = Path(tempfile.mkdtemp(prefix="masa-bench-quick-"))
    else:
        out_dir = REPO / "benchmarks" / "results"
    doc = (
        Path(args.doc) if args.doc else (out_dir / "BENCHMARKS.md" if args.quick else REPO / "BENCHMARKS.md")
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    return settings, sections, out_dir, doc


def _run_sections(
    sections: list[str], settings: dict, results: dict, results_path: Path
) -> tuple[dict, dict]:
    """Run the sections into `results`; on failure keep what was measured in results.partial.json."""
    durations = dict(results.get("durations_seconds", {}))
    section_dates = dict(results.get("section_dates", {}))
    work = Path(tempfile.mkdtemp(prefix="masa-bench-"))
    checkpoint = work / "smollm2-135m-masa"
    runners = {
        "quality": lambda: section_quality(settings),
        "headline": lambda: section_headline(settings),
        "whole_model": lambda: section_whole_model(settings),
        "compression": lambda: section_compression(settings, checkpoint),
        "latency": lambda: section_latency(settings, checkpoint),
        "scaling": lambda: section_scaling(settings),
    }
    try:
        for name in sections:
            t = time.perf_counter()
            log(f"== section {name}")
            results.update(runners[name]())
            durations[name] = time.perf_counter() - t
            section_dates[name] = datetime.now(timezone.utc).isoformat(timespec="seconds")
            log(f"== section {name} done in {durations[name] / 60:.1f} min")
    except BaseException:
        partial = results_path.with_name("results.partial.json")
        write_json(partial, {**results, "durations_seconds": durations})
        log(f"a section failed: what was measured so far is in {partial}")
        raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return durations, section_dates


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    args = parser.parse_args(argv)
    settings, sections, out_dir, doc = _configure(args, parser)
    results_path = out_dir / "results.json"

    from compressor.api.model_loading import _quiet_transformers

    _quiet_transformers()
    results: dict = {}
    if set(sections) != set(SECTIONS):
        if not results_path.is_file():
            parser.error(f"--sections {args.sections}: no earlier {results_path} to merge into")
        results = json.loads(results_path.read_text())
    start = time.perf_counter()
    machine = machine_info()
    machine["load_average_start"] = _load_average()
    if args.threads:
        machine["threads_requested"] = args.threads
    log(f"benchmark ({'quick' if args.quick else 'full'}) into {out_dir}, page {doc}; machine {machine}")
    durations, section_dates = _run_sections(sections, settings, results, results_path)
    # Every section of this run ran here: each's machine beside its date, earlier runs' merged ones kept.
    section_machines = results.get("section_machines", {}) | dict.fromkeys(
        sections, machine_signature(machine)
    )
    machine["load_average_end"] = _load_average()
    results.update(
        {
            "command": _command(argv),
            "make_target": {(): "make bench", ("--quick",): "make bench-quick"}.get(tuple(argv)),
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "machine": machine,
            "quick": args.quick,
            "settings": {**settings, "model": MODEL, "sections": sections},
            "durations_seconds": durations,
            "section_dates": section_dates,
            "section_machines": section_machines,
            "merged": bool(results.get("merged")) or set(sections) != set(SECTIONS),
            "wall_minutes": sum(durations.values()) / 60,
            "this_run_minutes": (time.perf_counter() - start) / 60,
        }
    )
    results["notes"] = notes(results)
    write_json(results_path, results)
    files = [results_path, *render(results, results_path, doc, out_dir)]
    problems = check(results, files)
    log(f"wrote {', '.join(str(f) for f in files)}")
    summary = {
        k: results.get(k)
        for k in (
            "original_ppl",
            *TARGETS,
            *MIN_TARGETS,
            "whole_model_ppl_ratio",
            "depth_memory_overhead_ratio",
            "decode_latency_ratio",
        )
    }
    deep = results.get("larger_than_memory") or {}
    summary["larger_than_memory_peak_over_weights"] = deep.get("peak_over_weights")
    log(f"key numbers: {json.dumps(summary)}")
    if problems:
        for problem in problems:
            log(f"CHECK FAILED: {problem}")
        return 1
    log(f"all numbers finite and all files written ({(time.perf_counter() - start) / 60:.1f} min)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
