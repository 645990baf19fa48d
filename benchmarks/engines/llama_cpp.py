"""The smaller model in llama.cpp: the model 20% smaller in the forms an engine runs, exported to GGUF, scored and
timed in llama.cpp itself beside the original exported by the same code.

1. the width granularity, chosen on the VALIDATION split: `--targets mlp --ratio-of model` with every width free
   (`--width-multiple 1`) and in multiples of 32 (q8_0's blocks), one calibration (the statistics cache), both
   scored with the original on the same windows: paired difference; the `--native` whole model
   (`--targets attn,mlp`: whole query heads and MLP neurons) on the same split;
2. the original, `--native` per layer (f16, q8_0, q4_k_m, q4_0, f32), `--native --uniform-mlp` (f16, q8_0, q4_k_m)
   and the MLP-only model (f16) exported to GGUF (`masa-compress export`);
3. every file scored through llama.cpp on the TEST split (capped, stated) against the original in transformers:
   perplexity with its interval, KL, top-1; the `--native` checkpoint also in transformers, on the same windows;
   the original's and both native forms' f16 files again on the WHOLE test split (the protocol's default, the
   tokens of the README's other figures);
4. decode and prefill speed in llama.cpp, 1 and 2 threads, after all scoring: the files of one type timed in turns,
   the median of repeats of a 128-token prompt and 64 generated tokens.

Writes `benchmarks/results/engines.json` and `engines.md`, and the summary figures (`SUMMARY_KEYS`) into
`benchmarks/results/results.json`. `python -m benchmarks.engines.llama_cpp [--ratio 0.2] [--max-tokens 16384]`
(`make bench-engines`; about 45 minutes alone on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.report.markdown import interval, number
from benchmarks.report.plots import engines_plot
from benchmarks.suite.common import command_line, log, machine_info, write_json
from compressor.api import CompressOptions, EvalSettings, compress, evaluate
from compressor.api.export import export
from compressor.evaluation.intervals import paired_difference

MODEL = "smollm2-135m"
MULTIPLES = (1, 32)
FIGURE = "engines.png"
PROMPT_TOKENS, NEW_TOKENS, REPEATS = 128, 64, 11
THREADS = (1, 2)


def compress_engine_form(ratio: float, out: Path, **forms) -> dict:
    """The model `ratio` smaller (of the whole model) in an engine form; no evaluation (scored apart)."""
    options = CompressOptions(
        ratio=ratio, ratio_of="model", evaluate=False, out=str(out), overwrite=True, **forms
    )  # fmt: skip
    start = time.perf_counter()
    summary = compress(MODEL, options, device="cpu", dtype="float32", progress=False).summary
    return {
        **forms,
        "seconds": time.perf_counter() - start,
        "calibration_windows": summary["settings"]["calibration"]["samples"],
        "model_params_before": summary["model_params_before"],
        "model_params_after": summary["model_params_after"],
    }


def scored(evaluation) -> dict:
    result = evaluation.result
    row = {"ppl": result.ppl, "ppl_ci95": result.ppl_ci95, "tokens": result.tokens, "windows": result.windows}
    if evaluation.faithfulness is not None:
        row |= {
            "kl": evaluation.faithfulness.kl_to_original,
            "top1": evaluation.faithfulness.top1_agreement,
            "original_ppl": evaluation.reference.ppl,
            "original_ppl_ci95": evaluation.reference.ppl_ci95,
        }
    return row


def choose_multiple(checkpoints: dict[int, Path], max_tokens: int) -> dict:
    """Both checkpoints on the validation split's same windows; a difference inside its interval is a tie,
    which goes to the coarser granularity (every matrix then quantizes)."""
    settings = EvalSettings(split="validation", max_tokens=max_tokens)
    runs = {m: evaluate(str(path), settings, progress=False) for m, path in checkpoints.items()}
    fine, coarse = runs[MULTIPLES[0]].result, runs[MULTIPLES[1]].result
    difference = paired_difference(coarse.window_nll, fine.window_nll, coarse.window_tokens)
    lo, hi = difference.ci95
    chosen = MULTIPLES[1] if lo <= 0 or hi < 0 else MULTIPLES[0]
    return {
        "split": "validation",
        "max_tokens": max_tokens,
        "rows": {str(m): scored(run) for m, run in runs.items()},
        "coarse_minus_fine": {"value": difference.value, "ci95": list(difference.ci95)},
        "chosen": chosen,
    }


def measure_speeds(paths: dict, prompt: list[int], repeats: int = REPEATS) -> dict:
    """Median decode and prefill tokens/s of each file at each of `THREADS` (`decode_tokens_per_second` etc.: 1
    thread; `..._2t`: 2 threads). The files of one type are timed in turns (original, smaller, ..., then again),
    so that a slow spell of the machine falls on all of them alike, not on one file's repeats."""
    from compressor.evaluation.llama_cpp import LlamaCppServer

    speeds: dict = {key: {"repeats": repeats} for key in paths}
    for tensor_type in sorted({t for _, t in paths}):
        group = [key for key in paths if key[1] == tensor_type]
        for threads in THREADS:
            log(f"speed: {tensor_type}, {threads} thread(s), {len(group)} files in turns")
            context = PROMPT_TOKENS + NEW_TOKENS
            servers = {
                key: LlamaCppServer(paths[key], context, threads=threads, embedding=False) for key in group
            }
            for server in servers.values():
                server.complete(prompt, 8)  # warm-up: the first call pages the weights in
            timings: dict = {key: [] for key in group}
            for _ in range(repeats):
                for key in group:
                    timings[key].append(servers[key].complete(prompt, NEW_TOKENS)["timings"])
            for server in servers.values():
                server.close()
            suffix = "" if threads == 1 else f"_{threads}t"
            for key in group:
                decode = statistics.median(t["predicted_per_second"] for t in timings[key])
                prefill = statistics.median(t["prompt_per_second"] for t in timings[key])
                speeds[key] |= {
                    f"decode_tokens_per_second{suffix}": decode,
                    f"prefill_tokens_per_second{suffix}": prefill,
                    # each turn's, in order: the files of one type paired turn by turn (`decode_ratio`)
                    f"decode_turns{suffix}": [t["predicted_per_second"] for t in timings[key]],
                }
    return speeds


EXPORTS = [("original", "f16"), ("original", "q8_0"), ("original", "q5_0"), ("original", "q4_k_m"),
           ("original", "q4_0"), ("native", "f16"), ("native", "q8_0"), ("native", "q4_k_m"),
           ("native", "q4_0"), ("native", "f32"), ("native uniform", "f16"), ("native uniform", "q8_0"),
           ("native uniform", "q4_k_m"), ("mlp only", "f16")]  # fmt: skip


def gguf_name(kind: str, tensor_type: str) -> str:
    """The file name a run gives the GGUF of `kind` (a row's model) at `tensor_type`."""
    return f"{kind.replace(' ', '-')}-{tensor_type}.gguf"


def export_files(sources: dict, work: Path, only_timed: bool = False) -> dict:
    files = {}
    for kind, tensor_type in EXPORTS:
        if only_timed and tensor_type == "f32":
            continue
        out = work / gguf_name(kind, tensor_type)
        log(f"export {sources[kind]} {out.name}")
        files[(kind, tensor_type)] = export(
            sources[kind], out, tensor_type=tensor_type, progress=False
        ).to_dict()
    return files


def speed_ratios(results: dict) -> dict:
    row = {(r["model"], r["type"]): r for r in results["llama_cpp"]}
    for tensor_type in ("f16", "q8_0"):
        smaller, original = row[("native", tensor_type)], row[("original", tensor_type)]
        results[f"gguf_decode_speedup_{tensor_type}"] = (
            smaller["decode_tokens_per_second"] / original["decode_tokens_per_second"]
        )
        results[f"gguf_prefill_speedup_{tensor_type}"] = (
            smaller["prefill_tokens_per_second"] / original["prefill_tokens_per_second"]
        )
    return results


def _prompt_ids() -> list[int]:
    from compressor.api.model_loading import load_model, resolve_model

    tokenizer = load_model(resolve_model(MODEL), device="cpu", dtype="float32", progress=False).tokenizer
    return tokenizer(_prompt_text(), add_special_tokens=False)["input_ids"][:PROMPT_TOKENS]


def run(ratio: float, max_tokens: int, work: Path) -> dict:
    results: dict = {"model": MODEL, "ratio_of_model": ratio, "machine": machine_info()}
    checkpoints = {m: work / f"mlp-w{m}" for m in MULTIPLES}
    results["compression"] = {}
    for multiple, path in checkpoints.items():
        log(f"compress --targets mlp --ratio {ratio} --ratio-of model --width-multiple {multiple}")
        results["compression"][f"mlp-w{multiple}"] = compress_engine_form(
            ratio, path, targets="mlp", width_multiple=multiple
        )
    log("validation: the two granularities on the same windows")
    results["choice"] = choose_multiple(checkpoints, max_tokens)
    native = work / "native"
    log(f"compress --targets attn,mlp --ratio {ratio} --ratio-of model --native")
    results["compression"]["native"] = compress_engine_form(ratio, native, targets="attn,mlp", native=True)
    results["choice"]["rows"]["native"] = scored(
        evaluate(str(native), EvalSettings(split="validation", max_tokens=max_tokens), progress=False)
    )
    uniform = work / "uniform"
    log(f"compress --targets attn,mlp --ratio {ratio} --ratio-of model --native --uniform-mlp")
    results["compression"]["native uniform"] = compress_engine_form(
        ratio, uniform, targets="attn,mlp", native=True, uniform_mlp=True
    )
    sources = {
        "original": MODEL,
        "native": str(native),
        "native uniform": str(uniform),
        "mlp only": str(checkpoints[results["choice"]["chosen"]]),
    }
    files = export_files(sources, work)
    test = EvalSettings(split="test", max_tokens=max_tokens)
    results["llama_cpp"] = score_files(files, test)
    log("transformers: the native checkpoint on the same test windows")
    results["transformers"] = scored(evaluate(str(native), test, progress=False))
    results["whole_test"] = score_whole_test(files)
    results["gguf_ppl_ratio_f16_whole_test"] = (
        results["whole_test"]["native"]["ppl"] / results["whole_test"]["native"]["original_ppl"]
    )
    row = {(r["model"], r["type"]): r for r in results["llama_cpp"]}
    speed_ratios(results)
    for tensor_type in ("f16", "q8_0"):
        smaller = row[("native", tensor_type)]
        # against the original in transformers (fp32) on the same windows: the quantization's own cost counts
        results[f"gguf_ppl_ratio_{tensor_type}"] = smaller["ppl"] / smaller["original_ppl"]
    results["gguf_f32_ppl_over_transformers"] = row[("native", "f32")]["ppl"] / results["transformers"]["ppl"]
    results["gguf_q8_0_ppl_over_f16"] = row[("native", "q8_0")]["ppl"] / row[("native", "f16")]["ppl"]
    results["test"] = {
        "split": "test",
        "max_tokens": max_tokens,
        "windows": results["llama_cpp"][0]["windows"],
    }
    results["native_mlp_widths"] = files[("native", "f16")]["mlp_widths"]
    results["native_heads"] = files[("native", "f16")]["heads"]
    return results


def score_files(files: dict, test: EvalSettings) -> list[dict]:
    """Every GGUF through llama.cpp on the capped test windows (KL/top-1 against the original in transformers),
    and its speed."""
    rows, prompt = [], None
    for (kind, tensor_type), written in files.items():
        log(f"llama.cpp: {kind} {tensor_type}")
        against = {"against": MODEL} if kind == "original" else {}
        evaluation = evaluate(
            written["out"], EvalSettings(**vars(test) | {"engine": "llama.cpp"} | against), progress=False
        )
        if prompt is None:
            prompt = evaluation.loaded.tokenizer(_prompt_text(), add_special_tokens=False)["input_ids"]
            prompt = prompt[:PROMPT_TOKENS]
        rows.append({
            "model": kind, "type": tensor_type, "bytes": written["bytes"], "parameters": written["parameters"],
            "architecture": written["architecture"], "fallbacks": len(written["fallbacks"]),
            **scored(evaluation),
        })  # fmt: skip
    timed = {key: Path(written["out"]) for key, written in files.items() if key[1] != "f32"}
    speeds = measure_speeds(timed, prompt)
    for row in rows:
        row.update(speeds.get((row["model"], row["type"]), {}))
    return rows


def score_whole_test(files: dict) -> dict:
    """The f16 files of the original and both native forms on the whole test split (the protocol's default)."""
    whole_test = {}
    for kind in ("original", "native", "native uniform"):
        log(f"llama.cpp: {kind} f16 on the whole test split")
        against = {"against": MODEL} if kind == "original" else {}
        whole = EvalSettings(split="test", engine="llama.cpp", **against)
        whole_test[kind] = scored(evaluate(files[(kind, "f16")]["out"], whole, progress=False))
    return whole_test


#: The figures `benchmarks/results/results.json` carries from this benchmark (beside `make bench`'s own).
SUMMARY_KEYS = (
    "gguf_decode_speedup_f16",
    "gguf_decode_speedup_q8_0",
    "gguf_prefill_speedup_f16",
    "gguf_prefill_speedup_q8_0",
    "gguf_ppl_ratio_f16",
    "gguf_ppl_ratio_q8_0",
    "gguf_f32_ppl_over_transformers",
    "gguf_q8_0_ppl_over_f16",
    "gguf_ppl_ratio_f16_whole_test",
)


def _prompt_text() -> str:
    from compressor.calibration.sources import load_documents

    return "\n\n".join(load_documents("wikipedia", split="test").documents[:3])


def render(results: dict) -> str:
    choice = results["choice"]
    fine, coarse = (choice["rows"][str(m)] for m in MULTIPLES)
    native = choice["rows"]["native"]
    diff = choice["coarse_minus_fine"]
    ratio = f"{results['ratio_of_model']:.0%}"
    lines = [
        "# The smaller model in llama.cpp",
        "",
        f"Written by `python -m benchmarks.engines.llama_cpp` (`make bench-engines`) on {results['machine'].get('cpu', '?')}, "
        f"{results['machine'].get('cores', '?')} cores. The model {ratio} smaller in the forms engines run, "
        "exported with `masa-compress export`; the original exported by the same code. `native`: `--targets "
        f"attn,mlp --ratio {results['ratio_of_model']} --ratio-of model --native` (whole query heads and MLP "
        f"neurons, in multiples of 32, one loss-aware allocation; {_windows(results)}); `mlp only`: `--targets mlp "
        "--ratio-of model "
        f"--width-multiple {choice['chosen']}` (the attention whole).",
        "",
        f"## Validation split (first {choice['max_tokens']:,} tokens; original {number(native['original_ppl'])}"
        f"{interval(native['original_ppl_ci95'])})",
        "",
        f"- `mlp only`, every width free (`--width-multiple 1`): {number(fine['ppl'])}{interval(fine['ppl_ci95'])}",
        f"- `mlp only`, multiples of 32: {number(coarse['ppl'])}{interval(coarse['ppl_ci95'])}; 32 minus 1 (paired): "
        f"{diff['value']:+.3f} [{diff['ci95'][0]:+.3f}, {diff['ci95'][1]:+.3f}] → `--width-multiple "
        f"{choice['chosen']}`"
        + (" (a tie goes to 32: every matrix then fills q8_0's blocks)" if choice["chosen"] == 32 else ""),
        f"- `native`: {number(native['ppl'])}{interval(native['ppl_ci95'])}",
        "",
        f"## In llama.cpp (test split, first {results['test']['max_tokens']:,} tokens; speed: 1 and 2 threads, "
        f"{PROMPT_TOKENS}-token prompt, {NEW_TOKENS} new tokens, median of {REPEATS}, the files of a type in turns)",
        "",
        *(
            [
                f"Speeds timed again on {results['speed_retimed']} (`benchmarks.engines.retime`: the files "
                f"{results.get('speed_retimed_files', 'rebuilt')}, byte for byte the scored ones, and timed on a "
                "quiet machine).",
                "",
            ]
            if "speed_retimed" in results
            else []
        ),  # fmt: skip
        "| model | type | arch | MiB | fallbacks | perplexity | KL | top-1 | decode tok/s (1 / 2 threads) "
        "| prefill tok/s (1 / 2) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results["llama_cpp"]:
        speed = (
            f"{r['decode_tokens_per_second']:.1f} / {r['decode_tokens_per_second_2t']:.1f} | "
            f"{r['prefill_tokens_per_second']:.1f} / {r['prefill_tokens_per_second_2t']:.1f}"
            if "decode_tokens_per_second" in r
            else "— | —"
        )
        lines.append(
            f"| {r['model']} | {r['type']} | {r['architecture']} | {r['bytes'] / 2**20:.1f} | {r['fallbacks']} | "
            f"{number(r['ppl'])}{interval(r['ppl_ci95'])} | {r['kl']:.4f} | {r['top1']:.1%} | {speed} |"
        )
    return "\n".join(lines + render_notes(results))


def render_notes(results: dict) -> list[str]:
    """The paragraphs under the llama.cpp table: equal bytes, the whole test split, the f32 check, the ratios."""
    row = {(r["model"], r["type"]): r for r in results["llama_cpp"]}
    smaller, lower = row[("native", "q8_0")], row[("original", "q5_0")]
    verdict = "better" if smaller["ppl_ci95"][1] < lower["ppl_ci95"][0] else (
        "worse" if smaller["ppl_ci95"][0] > lower["ppl_ci95"][1] else "a tie (intervals overlap)"
    )  # fmt: skip
    lines = [
        "",
        f"At about equal bytes ([figure]({FIGURE})): `native` at q8_0 ({smaller['bytes'] / 2**20:.1f} MiB, "
        f"{number(smaller['ppl'])}) against the original one quantization down, q5_0 ({lower['bytes'] / 2**20:.1f} "
        f"MiB, {number(lower['ppl'])}): {verdict}. q4_k_m is quantized by llama.cpp's own code with "
        "`llama-quantize`'s choice per tensor; SmolLM2's hidden size (576) is not a multiple of 256, so most of its "
        "matrices take llama.cpp's fallback (Q5_0; the embedding Q8_0), as they would with `llama-quantize`.",
    ]
    whole = results["whole_test"]
    lines += [
        "",
        f"On the whole test split ({whole['original']['tokens']:,} tokens, llama.cpp, f16): original "
        f"{number(whole['original']['ppl'])}{interval(whole['original']['ppl_ci95'])}, `native` "
        f"{number(whole['native']['ppl'])}{interval(whole['native']['ppl_ci95'])}, `native uniform` "
        f"{number(whole['native uniform']['ppl'])}{interval(whole['native uniform']['ppl_ci95'])}; `native` over "
        f"the original in transformers on the same windows ({number(whole['native']['original_ppl'])}): "
        f"{results['gguf_ppl_ratio_f16_whole_test']:.3f}×.",
    ]
    t = results["transformers"]
    original = results["llama_cpp"][0]
    lines += [
        "",
        f"KL and top-1 are against the original in transformers (fp32) on the same windows: "
        f"{number(original['original_ppl'])}{interval(original['original_ppl_ci95'])}. The `native` checkpoint "
        f"in transformers: {number(t['ppl'])}{interval(t['ppl_ci95'])}; its f32 GGUF in llama.cpp is "
        f"{results['gguf_f32_ppl_over_transformers']:.4f}× that, its q8_0 {results['gguf_q8_0_ppl_over_f16']:.4f}× "
        "its f16. llama.cpp tokenizes the text itself, and its tokenizer differs from transformers' on a few inputs "
        "(a blank line before a digit is one token to it, two to transformers: one token in about 10,000 here), so "
        "its windows are not exactly the tool's; on one window of the same tokens the f32 file and the checkpoint "
        "agree to 1e-5 per token.",
        "",
        f"`native` over the original: perplexity {results['gguf_ppl_ratio_f16']:.3f}× at f16, "
        f"{results['gguf_ppl_ratio_q8_0']:.3f}× at q8_0 (each against the fp32 original); decode "
        f"{results['gguf_decode_speedup_f16']:.2f}× at f16, {results['gguf_decode_speedup_q8_0']:.2f}× at q8_0; "
        f"prefill {results['gguf_prefill_speedup_f16']:.2f}× and {results['gguf_prefill_speedup_q8_0']:.2f}×.",
        "",
    ]
    return lines


def _windows(results: dict) -> str:
    """How the native model was calibrated, as its run recorded it (files written before the record: unknown)."""
    windows = results["compression"]["native"].get("calibration_windows")
    return (
        f"calibrated on {windows} windows of 512 tokens"
        if windows
        else "its calibration windows not recorded"
    )


def write_outputs(results: dict, out: str, doc: str) -> None:
    """engines.json, engines.md and its figure, and the summary figures into results.json beside them."""
    write_json(out, results)
    Path(doc).write_text(render(results))
    engines_plot(results, Path(doc).with_name(FIGURE))
    summary = Path(out).with_name("results.json")
    if summary.is_file():  # the summary figures beside `make bench`'s, where BENCHMARKS.md's targets are read
        merged = json.loads(summary.read_text()) | {key: results[key] for key in SUMMARY_KEYS}
        write_json(summary, merged)
    log(f"wrote {out} and {doc}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ratio", type=float, default=0.2)
    parser.add_argument("--max-tokens", type=int, default=16384)
    parser.add_argument("--out", default="benchmarks/results/engines.json")
    parser.add_argument("--doc", default="benchmarks/results/engines.md")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="masa-engines-") as work:
        results = run(args.ratio, args.max_tokens, Path(work))
    results["command"] = command_line("benchmarks.engines.llama_cpp", argv)
    write_outputs(results, args.out, args.doc)


if __name__ == "__main__":
    main()
