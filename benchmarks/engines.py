"""The smaller model in llama.cpp: the model 20% smaller in the form an engine runs (narrower MLPs, attention
whole), exported to GGUF, scored and timed in llama.cpp itself beside the original exported by the same code.

1. choose the width granularity on the VALIDATION split: `--targets mlp --ratio-of model` with every width free
   (`--width-multiple 1`) and in multiples of 32 (q8_0's blocks), one calibration (the statistics cache), both
   scored with the original on the same windows: paired difference;
2. export the chosen checkpoint and the original to GGUF at f16 and q8_0 (`masa-compress export`);
3. score every file through llama.cpp on the TEST split (capped, stated) against the original in transformers:
   perplexity with its interval, KL, top-1; the chosen checkpoint also in transformers, on the same windows;
4. decode and prefill speed in llama.cpp, 1 thread (the bound where a small model's weights are read per token):
   the median of repeats of a 128-token prompt and 64 generated tokens.

`python -m benchmarks.engines [--ratio 0.2] [--max-tokens 16384] [--out benchmarks/results/engines.json]
[--doc benchmarks/results/engines.md]` (`make bench-engines`; about 15 minutes alone on 2 cores).
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
TYPES = ("f16", "q8_0")
PROMPT_TOKENS, NEW_TOKENS, REPEATS = 128, 64, 5


def compress_native(ratio: float, multiple: int, out: Path) -> dict:
    options = CompressOptions(
        ratio=ratio, ratio_of="model", targets="mlp", width_multiple=multiple, evaluate=False, out=str(out),
        overwrite=True,
    )  # fmt: skip
    start = time.perf_counter()
    run = compress(MODEL, options, device="cpu", dtype="float32", progress=False)
    summary = run.summary
    return {
        "width_multiple": multiple,
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
        results["compression"][str(multiple)] = compress_native(ratio, multiple, path)
    log("validation: the two granularities on the same windows")
    results["choice"] = choose_multiple(checkpoints, max_tokens)
    chosen = checkpoints[results["choice"]["chosen"]]
    files = {}
    for kind, source in (("original", MODEL), ("compressed", str(chosen))):
        for tensor_type in TYPES:
            out = work / f"{kind}-{tensor_type}.gguf"
            log(f"export {source} {out.name}")
            files[(kind, tensor_type)] = export(
                source, out, tensor_type=tensor_type, progress=False
            ).to_dict()
    test = EvalSettings(split="test", max_tokens=max_tokens)
    rows = []
    prompt = None
    for (kind, tensor_type), written in files.items():
        log(f"llama.cpp: {kind} {tensor_type}")
        against = {} if kind == "compressed" else {"against": MODEL}
        evaluation = evaluate(
            written["out"], EvalSettings(**vars(test) | {"engine": "llama.cpp"} | against), progress=False
        )
        if prompt is None:
            prompt = evaluation.loaded.tokenizer(_prompt_text(), add_special_tokens=False)["input_ids"]
            prompt = prompt[:PROMPT_TOKENS]
        rows.append({
            "model": kind, "type": tensor_type, "bytes": written["bytes"], "parameters": written["parameters"],
            "architecture": written["architecture"], "fallbacks": len(written["fallbacks"]),
            **scored(evaluation), **decode_speed(Path(written["out"]), prompt),
        })  # fmt: skip
    results["llama_cpp"] = rows
    log("transformers: the chosen checkpoint on the same test windows")
    results["transformers"] = scored(evaluate(str(chosen), test, progress=False))
    for tensor_type in TYPES:
        by = {r["model"]: r for r in rows if r["type"] == tensor_type}
        results[f"decode_speedup_{tensor_type}"] = (
            by["compressed"]["decode_tokens_per_second"] / by["original"]["decode_tokens_per_second"]
        )
        results[f"prefill_speedup_{tensor_type}"] = (
            by["compressed"]["prefill_tokens_per_second"] / by["original"]["prefill_tokens_per_second"]
        )
    results["test"] = {"split": "test", "max_tokens": max_tokens, "windows": rows[0]["windows"]}
    results["mlp_widths"] = files[("compressed", "f16")]["mlp_widths"]
    return results


def _prompt_text() -> str:
    from compressor.calibration.sources import load_documents

    return "\n\n".join(load_documents("wikipedia", split="test").documents[:3])


def render(results: dict) -> str:
    choice = results["choice"]
    fine, coarse = (choice["rows"][str(m)] for m in MULTIPLES)
    diff = choice["coarse_minus_fine"]
    lines = [
        "# The smaller model in llama.cpp",
        "",
        f"Written by `python -m benchmarks.engines` (`make bench-engines`) on {results['machine'].get('cpu', 'this machine')}. "
        f"The model {results['ratio_of_model']:.0%} smaller in the form engines run: `--targets mlp --ratio-of model` "
        "(narrower MLPs, per-layer widths; the attention whole), exported with `masa-compress export`; the original "
        "exported by the same code.",
        "",
        f"## Width granularity (validation split, first {choice['max_tokens']:,} tokens)",
        "",
        f"- every width free (`--width-multiple 1`): {number(fine['ppl'])}{interval(fine['ppl_ci95'])}",
        f"- multiples of 32 (`--width-multiple 32`): {number(coarse['ppl'])}{interval(coarse['ppl_ci95'])}",
        f"- difference (32 minus 1, paired): {diff['value']:+.3f} [{diff['ci95'][0]:+.3f}, {diff['ci95'][1]:+.3f}]"
        f" → chosen: `--width-multiple {choice['chosen']}`"
        + (" (a tie goes to 32: every matrix then fills q8_0's blocks)" if choice["chosen"] == 32 else ""),
        "",
        f"## In llama.cpp (test split, first {results['test']['max_tokens']:,} tokens; speed: 1 thread, "
        f"{PROMPT_TOKENS}-token prompt, {NEW_TOKENS} new tokens, median of {REPEATS})",
        "",
        "| model | type | arch | MiB | f16 fallbacks | perplexity | KL | top-1 | decode tok/s | prefill tok/s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results["llama_cpp"]:
        lines.append(
            f"| {r['model']} | {r['type']} | {r['architecture']} | {r['bytes'] / 2**20:.1f} | {r['fallbacks']} | "
            f"{number(r['ppl'])}{interval(r['ppl_ci95'])} | {r['kl']:.4f} | {r['top1']:.1%} | "
            f"{r['decode_tokens_per_second']:.1f} | {r['prefill_tokens_per_second']:.1f} |"
        )
    t = results["transformers"]
    original = results["llama_cpp"][0]
    lines += [
        "",
        f"The original in transformers (fp32) on the same windows: {number(original['original_ppl'])}"
        f"{interval(original['original_ppl_ci95'])}; KL and top-1 are against it. The compressed checkpoint in "
        f"transformers: {number(t['ppl'])}{interval(t['ppl_ci95'])}.",
        "",
        f"Decode speed-up of the compressed model over the original: f16 {results['decode_speedup_f16']:.2f}×, "
        f"q8_0 {results['decode_speedup_q8_0']:.2f}×; prefill f16 {results['prefill_speedup_f16']:.2f}×, q8_0 "
        f"{results['prefill_speedup_q8_0']:.2f}×.",
        "",
    ]
    return "\n".join(lines)


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
    log(f"wrote {args.out} and {args.doc}")


if __name__ == "__main__":
    main()
