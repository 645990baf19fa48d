"""The smaller model in llama.cpp: the model 20% smaller in the forms an engine runs, exported to GGUF, scored and
timed in llama.cpp itself beside the original exported by the same code.

1. the width granularity, chosen on the VALIDATION split: `--targets mlp --ratio-of model` with every width free
   (`--width-multiple 1`) and in multiples of 32 (q8_0's blocks), one calibration (the statistics cache), both
   scored with the original on the same windows: paired difference; the `--native` whole model
   (`--targets attn,mlp`: whole query heads and MLP neurons) on the same split;
2. the original, `--native` (f16, q8_0, f32) and the MLP-only model (f16) exported to GGUF (`masa-compress export`);
3. every file scored through llama.cpp on the TEST split (capped, stated) against the original in transformers:
   perplexity with its interval, KL, top-1; the `--native` checkpoint also in transformers, on the same windows;
4. decode and prefill speed in llama.cpp, 1 thread (the bound where a small model's weights are read per token):
   the median of repeats of a 128-token prompt and 64 generated tokens.

Writes `benchmarks/results/engines.json` and `engines.md`, and the summary figures (`SUMMARY_KEYS`) into
`benchmarks/results/results.json`. `python -m benchmarks.engines [--ratio 0.2] [--max-tokens 16384]`
(`make bench-engines`; about 25 minutes alone on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import log, machine_info
from benchmarks.markdown import interval, number
from compressor.api import CompressOptions, EvalSettings, compress, evaluate
from compressor.api.export import export
from compressor.evaluation.intervals import paired_difference

MODEL = "smollm2-135m"
MULTIPLES = (1, 32)
FIGURE = "engines.png"
PROMPT_TOKENS, NEW_TOKENS, REPEATS = 128, 64, 5


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


def decode_speed(path: Path, prompt: list[int]) -> dict:
    from compressor.evaluation.llama_cpp import LlamaCppServer

    server = LlamaCppServer(path, context=PROMPT_TOKENS + NEW_TOKENS, threads=1, embedding=False)
    server.complete(prompt, 8)  # warm-up: the first call pages the weights in
    timings = [server.complete(prompt, NEW_TOKENS)["timings"] for _ in range(REPEATS)]
    server.close()
    return {
        "decode_tokens_per_second": statistics.median(t["predicted_per_second"] for t in timings),
        "prefill_tokens_per_second": statistics.median(t["prompt_per_second"] for t in timings),
        "threads": 1,
        "repeats": REPEATS,
    }


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
    sources = {
        "original": MODEL,
        "native": str(native),
        "mlp only": str(checkpoints[results["choice"]["chosen"]]),
    }
    exports = [("original", "f16"), ("original", "q8_0"), ("original", "q5_0"), ("original", "q4_0"),
               ("native", "f16"), ("native", "q8_0"), ("native", "q4_0"), ("native", "f32"),
               ("mlp only", "f16")]  # fmt: skip
    files = {}
    for kind, tensor_type in exports:
        out = work / f"{kind.replace(' ', '-')}-{tensor_type}.gguf"
        log(f"export {sources[kind]} {out.name}")
        files[(kind, tensor_type)] = export(
            sources[kind], out, tensor_type=tensor_type, progress=False
        ).to_dict()
    test = EvalSettings(split="test", max_tokens=max_tokens)
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
        speed = decode_speed(Path(written["out"]), prompt) if tensor_type != "f32" else {}
        rows.append({
            "model": kind, "type": tensor_type, "bytes": written["bytes"], "parameters": written["parameters"],
            "architecture": written["architecture"], "fallbacks": len(written["fallbacks"]),
            **scored(evaluation), **speed,
        })  # fmt: skip
    results["llama_cpp"] = rows
    log("transformers: the native checkpoint on the same test windows")
    results["transformers"] = scored(evaluate(str(native), test, progress=False))
    row = {(r["model"], r["type"]): r for r in rows}
    for tensor_type in ("f16", "q8_0"):
        smaller, original = row[("native", tensor_type)], row[("original", tensor_type)]
        results[f"gguf_decode_speedup_{tensor_type}"] = (
            smaller["decode_tokens_per_second"] / original["decode_tokens_per_second"]
        )
        results[f"gguf_prefill_speedup_{tensor_type}"] = (
            smaller["prefill_tokens_per_second"] / original["prefill_tokens_per_second"]
        )
        # against the original in transformers (fp32) on the same windows: the quantization's own cost counts
        results[f"gguf_ppl_ratio_{tensor_type}"] = smaller["ppl"] / smaller["original_ppl"]
    results["gguf_f32_ppl_over_transformers"] = row[("native", "f32")]["ppl"] / results["transformers"]["ppl"]
    results["gguf_q8_0_ppl_over_f16"] = row[("native", "q8_0")]["ppl"] / row[("native", "f16")]["ppl"]
    results["test"] = {"split": "test", "max_tokens": max_tokens, "windows": rows[0]["windows"]}
    results["native_mlp_widths"] = files[("native", "f16")]["mlp_widths"]
    results["native_heads"] = files[("native", "f16")]["heads"]
    return results


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
        f"Written by `python -m benchmarks.engines` (`make bench-engines`) on {results['machine'].get('cpu', '?')}, "
        f"{results['machine'].get('cores', '?')} cores. The model {ratio} smaller in the forms engines run, "
        "exported with `masa-compress export`; the original exported by the same code. `native`: `--targets "
        f"attn,mlp --ratio {results['ratio_of_model']} --ratio-of model --native` (whole query heads and MLP "
        "neurons, in multiples of 32, one loss-aware allocation); `mlp only`: `--targets mlp --ratio-of model "
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
        f"## In llama.cpp (test split, first {results['test']['max_tokens']:,} tokens; speed: 1 thread, "
        f"{PROMPT_TOKENS}-token prompt, {NEW_TOKENS} new tokens, median of {REPEATS})",
        "",
        "| model | type | arch | MiB | f16 fallbacks | perplexity | KL | top-1 | decode tok/s | prefill tok/s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results["llama_cpp"]:
        speed = (
            f"{r['decode_tokens_per_second']:.1f} | {r['prefill_tokens_per_second']:.1f}"
            if "decode_tokens_per_second" in r
            else "— | —"
        )
        lines.append(
            f"| {r['model']} | {r['type']} | {r['architecture']} | {r['bytes'] / 2**20:.1f} | {r['fallbacks']} | "
            f"{number(r['ppl'])}{interval(r['ppl_ci95'])} | {r['kl']:.4f} | {r['top1']:.1%} | {speed} |"
        )
    row = {(r["model"], r["type"]): r for r in results["llama_cpp"]}
    smaller, lower = row[("native", "q8_0")], row[("original", "q5_0")]
    verdict = "better" if smaller["ppl_ci95"][1] < lower["ppl_ci95"][0] else (
        "worse" if smaller["ppl_ci95"][0] > lower["ppl_ci95"][1] else "a tie (intervals overlap)"
    )  # fmt: skip
    lines += [
        "",
        f"At about equal bytes ([figure]({FIGURE})): `native` at q8_0 ({smaller['bytes'] / 2**20:.1f} MiB, "
        f"{number(smaller['ppl'])}) against the original one quantization down, q5_0 ({lower['bytes'] / 2**20:.1f} "
        f"MiB, {number(lower['ppl'])}): {verdict}. (k-quants such as q4_k_m need llama.cpp's own quantizer, which no "
        "wheel installed here ships.)",
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
    return "\n".join(lines)


def plot(results: dict, path: Path) -> Path:
    """Perplexity against file size, one line per model over its quantized types."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0), layout="constrained")
    for model in ("original", "native"):
        rows = sorted((r for r in results["llama_cpp"] if r["model"] == model and r["type"] != "f32"),
                      key=lambda r: r["bytes"])  # fmt: skip
        sizes, ppls = [r["bytes"] / 2**20 for r in rows], [r["ppl"] for r in rows]
        errors = [
            [p - r["ppl_ci95"][0] for p, r in zip(ppls, rows, strict=True)],
            [r["ppl_ci95"][1] - p for p, r in zip(ppls, rows, strict=True)],
        ]
        ax.errorbar(sizes, ppls, yerr=errors, marker="o", capsize=3, label=model)
        for size, ppl, r in zip(sizes, ppls, rows, strict=True):
            ax.annotate(r["type"], (size, ppl), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set_xlabel("GGUF file (MiB)")
    ax.set_ylabel("perplexity in llama.cpp (test split)")
    ax.set_title("The bundled model and its --native 20% smaller form", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ratio", type=float, default=0.2)
    parser.add_argument("--max-tokens", type=int, default=16384)
    parser.add_argument("--out", default="benchmarks/results/engines.json")
    parser.add_argument("--doc", default="benchmarks/results/engines.md")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="masa-engines-") as work:
        results = run(args.ratio, args.max_tokens, Path(work))
    results["command"] = " ".join(
        ["python -m benchmarks.engines", *(argv if argv is not None else sys.argv[1:])]
    )
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    Path(args.doc).write_text(render(results))
    plot(results, Path(args.doc).with_name(FIGURE))
    summary = Path(args.out).with_name("results.json")
    if summary.is_file():  # the summary figures beside `make bench`'s, where BENCHMARKS.md's targets are read
        merged = json.loads(summary.read_text()) | {key: results[key] for key in SUMMARY_KEYS}
        summary.write_text(json.dumps(merged, indent=2) + "\n")
    log(f"wrote {args.out} and {args.doc}")


if __name__ == "__main__":
    main()
