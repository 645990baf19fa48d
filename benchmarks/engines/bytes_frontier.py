"""Judged in bytes: the original model quantized by llama.cpp's mixes, with and without the tool's importance
weights, and by `export --size` at each mix's bytes (every matrix's type by the loss-aware allocation), scored in
llama.cpp itself.

1. the original exported at f16 and at each `--types` mix, twice below 8 bits: `--imatrix none` and
   `--imatrix calibration` (the recipe's calibration, `--calib-samples` windows), by `masa-compress export`;
2. every file run by llama.cpp on the same capped TEST windows, in one pass against the original in transformers:
   perplexity with its interval, KL and top-1 (`evaluation.perplexity.evaluate_against`);
3. per type, the paired difference of perplexity, plain minus importance-weighted, and `--size` minus the
   importance-weighted mix of the same bytes, on those windows (95% bootstrap interval; inside it, a tie).

Writes `benchmarks/results/bytes-<model>.json` and `.md`. Speeds are not timed here (`make bench-engines` times
its files in turns on an otherwise idle machine). `python -m benchmarks.engines.bytes_frontier --model
smollm2-135m [--types q8_0,q6_k,...] [--max-tokens 16384] [--calib-samples 64]` (`make bench-bytes`).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from benchmarks.report.bytes import frontier_table, gain_table
from benchmarks.report.markdown import interval, number
from benchmarks.suite.common import command_line, log, machine_info, write_json
from compressor.api.export import export
from compressor.api.model_loading import load_model, load_with_llama_cpp, resolve_model
from compressor.api.session import evaluation_token_windows
from compressor.calibration.sources import load_documents
from compressor.checkpoint.ggml_quantize import K_QUANT_MIXES, NEEDS_IMATRIX
from compressor.checkpoint.gguf_types import BELOW_8_BITS
from compressor.evaluation.intervals import paired_difference
from compressor.evaluation.perplexity import evaluate_against
from compressor.recipes.schema import EvaluationSettings

RESULTS = Path("benchmarks/results")
TYPES = ("q8_0", "q6_k", "q5_k_m", "q4_k_m", "q3_k_m", "q2_k")
MAX_TOKENS = 8192


def export_ladder(model: str, types: tuple[str, ...], work: Path, calib_samples: int | None) -> dict:
    """(type, imatrix) → what `export` wrote: f16, and each type without and (below 8 bits) with the imatrix."""
    files = {}
    for tensor_type in ("f16", *types):
        choices = ("none", "calibration") if tensor_type in BELOW_8_BITS else (None,)
        if tensor_type in K_QUANT_MIXES and K_QUANT_MIXES[tensor_type].base in NEEDS_IMATRIX:
            choices = ("calibration",)  # llama.cpp writes it only with importance weights
        for imatrix in choices:
            log(f"export {model} {tensor_type} imatrix {imatrix or 'n/a'}")
            written = export(
                model, work / f"{tensor_type}-{imatrix or 'plain'}.gguf", tensor_type=tensor_type, imatrix=imatrix,
                calib_samples=calib_samples if imatrix == "calibration" else None, overwrite=True, progress=False,
            )  # fmt: skip
            files[(tensor_type, imatrix or "none")] = written.to_dict()
    for tensor_type in types:
        if (tensor_type, "calibration") not in files:
            continue
        size = files[(tensor_type, "calibration")]["bytes"]
        log(f"export {model} --size {size:,} (the size of its {tensor_type} with the importance weights)")
        written = export(
            model, work / f"size-{tensor_type}.gguf", size=size, calib_samples=calib_samples, overwrite=True,
            progress=False,
        )  # fmt: skip
        files[(tensor_type, "size")] = written.to_dict()
    return files


def score_files(
    model: str, paths: dict[str, str], max_tokens: int, per_pass: int = 0, split: str = "test"
) -> tuple[object, dict]:
    """Every GGUF of `paths` (name → file) in llama.cpp on the first `max_tokens` of `split`, against the original
    in transformers: (the original's result, name → (result, faithfulness)). `per_pass` files at a time (0: all in
    one pass), the original run again in each pass (deterministic: the same windows' scores), so that a large
    model's files need not all be held at once."""
    source = resolve_model(model)
    evaluation = EvaluationSettings(
        **{
            **(source.recipe.evaluation.model_dump() if source.recipe else {}),
            "split": split,
            "max_tokens": max_tokens,
        }
    )
    original = load_model(source, device="cpu", dtype="float32", progress=False)
    documents = load_documents(evaluation.source, split=split)
    windows, text_name = evaluation_token_windows(original.tokenizer, evaluation, documents)
    keys = list(paths)
    per_pass = per_pass or len(keys)
    scored = {}
    for first in range(0, len(keys), per_pass):
        engines = {key: load_with_llama_cpp(resolve_model(paths[key]), evaluation.seq_len, False)
                   for key in keys[first : first + per_pass]}  # fmt: skip
        log(f"scoring {len(engines)} of {len(keys)} files on {windows.shape[0]} windows of {windows.shape[1]} "
            f"tokens ({text_name})")  # fmt: skip
        reference, part = evaluate_against(
            original.model, {key: e.model for key, e in engines.items()}, windows, progress=True,
            description="llama.cpp files vs the original",
        )  # fmt: skip
        scored |= part
        for engine in engines.values():
            engine.model.server.close()
        del engines
    reference.text = text_name
    return reference, scored


def score_ladder(model: str, files: dict, max_tokens: int, per_pass: int = 0) -> tuple[dict, list[dict]]:
    """Every file of the ladder on the capped test windows (`score_files`), with the paired differences."""
    paths = {f"{t}|{i}": written["out"] for (t, i), written in files.items()}
    reference, scored = score_files(model, paths, max_tokens, per_pass)
    text_name = reference.text
    rows, per_window = [], {}
    for (tensor_type, imatrix), written in files.items():
        result, faith = scored[f"{tensor_type}|{imatrix}"]
        per_window[(tensor_type, imatrix)] = result
        rows.append({
            "type": tensor_type, "imatrix": imatrix, "bytes": written["bytes"], "ppl": result.ppl,
            "ppl_ci95": result.ppl_ci95, "kl": faith.kl_to_original, "top1": faith.top1_agreement,
            "type_counts": written["type_counts"], "fallbacks": len(written["fallbacks"]),
        })  # fmt: skip
    gains, frontier = {}, {}
    for tensor_type in {t for t, i in files if i == "calibration" and (t, "none") in files}:
        plain, weighted = per_window[(tensor_type, "none")], per_window[(tensor_type, "calibration")]
        difference = paired_difference(plain.window_nll, weighted.window_nll, plain.window_tokens)
        gains[tensor_type] = {"plain_minus_imatrix": difference.value, "ci95": list(difference.ci95)}
    for tensor_type in {t for t, i in files if i == "size"}:
        baseline, ours = per_window[(tensor_type, "calibration")], per_window[(tensor_type, "size")]
        difference = paired_difference(ours.window_nll, baseline.window_nll, ours.window_tokens)
        frontier[tensor_type] = {
            "type": tensor_type, "baseline_bytes": files[(tensor_type, "calibration")]["bytes"],
            "baseline_ppl": baseline.ppl, "ours_bytes": files[(tensor_type, "size")]["bytes"], "ours_ppl": ours.ppl,
            "diff": difference.value, "diff_lo": difference.ci95[0], "diff_hi": difference.ci95[1],
            "predicted_loss_rise": files[(tensor_type, "size")].get("predicted_loss_rise"),
        }  # fmt: skip
    protocol = {
        "text": text_name, "split": "test", "windows": reference.windows, "seq_len": reference.seq_len,
        "tokens": reference.tokens, "original_transformers_ppl": reference.ppl,
        "original_transformers_ppl_ci95": reference.ppl_ci95,
    }  # fmt: skip
    ladder = sorted(frontier.values(), key=lambda row: -row["baseline_bytes"])
    return {"protocol": protocol, "imatrix_gain": gains, "frontier": ladder}, rows


def render(results: dict) -> str:
    p = results["protocol"]
    lines = [
        f"# {results['model']} in bytes: llama.cpp's mixes with and without importance weights",
        "",
        f"`{results['command']}`. llama.cpp scores every file on the first {p['tokens']:,} predicted tokens of "
        f"the test split ({p['windows']} windows of {p['seq_len']}; {p['text']}); KL and top-1 against the "
        f"original in transformers (perplexity {number(p['original_transformers_ppl'])}). Importance weights: "
        f"{results['imatrix']}.",
        "",
        "| type | imatrix | MiB | perplexity [95%] | KL | top-1 | matrices by type |",
        "|---|---|---:|---|---:|---:|---|",
    ]
    for row in sorted(results["rows"], key=lambda r: (-r["bytes"], r["imatrix"])):
        mix = ", ".join(f"{n} {t}" for t, n in row["type_counts"].items())
        lines.append(
            f"| {row['type']} | {row['imatrix']} | {row['bytes'] / 2**20:.1f} | {number(row['ppl'])}"
            f"{interval(row['ppl_ci95'])} | {row['kl']:.4f} | {row['top1']:.3f} | {mix} |"
        )
    if results.get("frontier"):
        lines += [
            "",
            "`--size` at each file's bytes (the importance-weighted mix's) against that mix, paired on the same "
            "windows (ours − llama.cpp's mix; inside the interval, a tie):",
            "",
            *frontier_table(results),
        ]
    lines += [
        "",
        "Paired on the same windows, perplexity without the importance weights minus with them:",
        "",
    ]
    lines += gain_table(results)
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--types", default=",".join(TYPES))
    parser.add_argument("--max-tokens", type=int, default=MAX_TOKENS)
    parser.add_argument("--calib-samples", type=int, default=None)
    parser.add_argument(
        "--files-per-pass", type=int, default=0, help="llama.cpp files held at once while scoring (0: all)"
    )
    parser.add_argument(
        "--summarize", type=Path, default=None, help="only copy this results file's figures into results.json"
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="results file (default: results/bytes-MODEL.json)"
    )
    args = parser.parse_args(argv)
    if args.summarize:
        summarize(json.loads(args.summarize.read_text()), RESULTS / "results.json")
        return
    types = tuple(t.strip() for t in args.types.split(",") if t.strip())
    with tempfile.TemporaryDirectory(prefix="masa-bytes-") as work:
        files = export_ladder(args.model, types, Path(work), args.calib_samples)
        scored, rows = score_ladder(args.model, files, args.max_tokens, args.files_per_pass)
    imatrix = next((row["imatrix"] for row in files.values() if row["imatrix"] != "none"), "none")
    results = {
        "command": command_line("benchmarks.engines.bytes_frontier", argv),
        "model": args.model,
        "machine": machine_info(),
        "imatrix": imatrix,
        **scored,
        "rows": rows,
    }
    out = args.out or RESULTS / f"bytes-{args.model}.json"
    write_json(out, results)
    out.with_suffix(".md").write_text(render(results))
    summarize(results, RESULTS / "results.json")
    log(f"wrote {out} and {out.with_suffix('.md')}")


#: results.json's name for each model's figures.
SUMMARY_NAMES = {"smollm2-135m": "bundled", "qwen2.5-coder-1.5b": "1p5b"}
FRONTIER_FIELDS = ("type", "baseline_bytes", "baseline_ppl", "ours_bytes", "ours_ppl", "diff_lo", "diff_hi")


def summarize(results: dict, summary: Path) -> None:
    """Copy a run's frontier and importance-matrix gains into results.json, beside the other benchmarks' figures:
    `bytes_frontier_<model>` (rows of FRONTIER_FIELDS; diff = ours − the importance-weighted mix, its 95%
    interval) and `imatrix_gain_<type>_<model>` (plain − importance-weighted, paired, with its interval)."""
    name = SUMMARY_NAMES.get(results["model"])
    if name is None or not summary.is_file():
        return
    figures = {
        f"bytes_frontier_{name}": [{k: row[k] for k in FRONTIER_FIELDS} for row in results["frontier"]]
    }
    for tensor_type, gain in results["imatrix_gain"].items():
        figures[f"imatrix_gain_{tensor_type}_{name}"] = gain
    write_json(summary, json.loads(summary.read_text()) | figures)
    log(f"copied {', '.join(figures)} into {summary}")


if __name__ == "__main__":
    main()
