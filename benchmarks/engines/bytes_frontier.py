"""Judged in bytes: the original model quantized by llama.cpp's mixes, with and without the tool's importance
weights, and by `export --size` at each mix's bytes (every matrix's type by the loss-aware allocation), scored in
llama.cpp itself.

1. the original exported at f16 and at each `--types` mix, twice below 8 bits: `--imatrix none` and
   `--imatrix calibration` (the recipe's calibration, `--calib-samples` windows), by `masa-compress export`;
2. every file run by llama.cpp on the same capped TEST windows, in one pass against the original in transformers:
   perplexity with its interval, KL and top-1 (`evaluation.perplexity.evaluate_against`);
3. per type, the paired difference of perplexity, plain minus importance-weighted, and `--size` minus the
   importance-weighted mix of the same bytes, on those windows (95% bootstrap interval; inside it, a tie); for
   the latter also of the mean KL to the original (the verdict the tables lead with).

Writes `benchmarks/results/bytes-<model>.json` and `.md`. Speeds are not timed here (`make bench-engines` times
its files in turns on an otherwise idle machine). `python -m benchmarks.engines.bytes_frontier --model
smollm2-135m [--types q8_0,q6_k,...] [--max-tokens 16384] [--calib-samples 64]` (`make bench-bytes`).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from benchmarks.report.bytes import results_page
from benchmarks.suite.common import command_line, log, machine_info, write_json
from compressor.api.export import export
from compressor.api.model_loading import load_model, load_with_llama_cpp, resolve_model
from compressor.api.run_options import CompressOptions
from compressor.api.session import evaluation_token_windows
from compressor.api.size import compress_to_size
from compressor.calibration.sources import load_documents
from compressor.evaluation.intervals import paired_difference, paired_mean_difference
from compressor.evaluation.perplexity import evaluate_against
from compressor.quantize.byte_budget import parse_size
from compressor.quantize.ggml_quantize import K_QUANT_MIXES, NEEDS_IMATRIX
from compressor.quantize.gguf_types import BELOW_8_BITS
from compressor.recipes.schema import EvaluationSettings
from compressor.runtime.errors import UserError

RESULTS = Path("benchmarks/results")
TYPES = ("q8_0", "q6_k", "q5_k_m", "q4_k_m", "q3_k_m", "q2_k")
MAX_TOKENS = 8192


def export_ladder(
    model: str, types: tuple[str, ...], work: Path, calib_samples: int | None, below: tuple[str, ...] = (),
    structure: tuple[str, ...] | None = None, layerwise: bool = False,
) -> dict:  # fmt: skip
    """(budget, kind) → what was written: f16, each type without and (below 8 bits) with the imatrix; at each
    mix's bytes with the imatrix `export --size` (kind `size`: types only) and `compress --size` (kind
    `structure`: widths, heads and types; only at the budgets `structure` names, None: every one); at each size
    of `below` (under the ladder) those two alone."""
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
    budgets = {t: files[(t, "calibration")]["bytes"] for t in types if (t, "calibration") in files}
    budgets |= {size: parse_size(size) for size in below}
    for name, size in budgets.items():
        log(f"export {model} --size {size:,} ({name})")
        try:
            written = export(model, work / f"size-{name}.gguf", size=size, calib_samples=calib_samples,
                             overwrite=True, progress=False)  # fmt: skip
            files[(name, "size")] = written.to_dict()
        except UserError as err:  # below the smallest file of types alone: only structure reaches it
            files[(name, "size")] = {"refused": str(err), "bytes": size}
        if structure is None or name in structure:
            log(f"compress {model} --size {size:,} ({name}: structure and types)")
            options = CompressOptions(size=str(size), out=str(work / f"structure-{name}.gguf"), evaluate=False,
                                      overwrite=True, calib_samples=calib_samples, layerwise=layerwise)  # fmt: skip
            summary = compress_to_size(model, options, progress=False).summary
            files[(name, "structure")] = {
                "out": summary["out"], "bytes": summary["bytes"], "type_counts": summary["type_counts"],
                "fallbacks": {}, "predicted_loss_rise": summary["predicted_loss_rise"],
                "removed_parameters": summary["structure"].get("removed_parameters", 0),
                "structure_loss_rise": summary["structure"].get("structure_loss_rise", 0.0),
                "mlp_widths": summary["mlp_widths"], "heads": summary["heads"], "seconds": summary["seconds"],
            }  # fmt: skip
    return files


def time_ladder(model: str, files: dict, repeats: int) -> dict:
    """Decode and prefill tokens/s in llama.cpp (1 and 2 threads, the median of `repeats`) of llama.cpp's mix with
    the importance weights and the tool's `--size` file at each budget, the files of one budget timed in turns."""
    from benchmarks.engines.llama_cpp import PROMPT_TOKENS, _prompt_text, measure_speeds

    tokenizer = load_model(resolve_model(model), device="cpu", dtype="float32", progress=False).tokenizer
    prompt = tokenizer(_prompt_text(), add_special_tokens=False)["input_ids"][:PROMPT_TOKENS]
    budgets = {
        t for t, i in files if i == "calibration" and ((t, "structure") in files or (t, "size") in files)
    }
    paths = {}
    for name in budgets:
        ours = (name, "structure") if (name, "structure") in files else (name, "size")
        paths[("mix", name)] = files[(name, "calibration")]["out"]
        paths[("ours", name)] = files[ours]["out"]
    speeds = measure_speeds(paths, prompt, repeats)
    return {name: {kind: speeds[(kind, name)] for kind in ("mix", "ours")} for name in budgets}


def attach_speeds(frontier: list[dict], speeds: dict) -> None:
    """Each timed budget's speeds onto its frontier row, with ours / the mix's decode tokens/s (1 and 2 threads)."""
    for row in frontier:
        if row["type"] in speeds:
            row["speeds"] = speeds[row["type"]]
            mix, ours = speeds[row["type"]]["mix"], speeds[row["type"]]["ours"]
            row["decode_ratio"] = ours["decode_tokens_per_second"] / mix["decode_tokens_per_second"]
            row["decode_ratio_2t"] = ours["decode_tokens_per_second_2t"] / mix["decode_tokens_per_second_2t"]


def check_rebuilt(written: dict, row: dict, label: str) -> None:
    """A file built again for timing must be the run's own: the same bytes and the same matrices by type."""
    if (written["bytes"], written["type_counts"]) != (row["bytes"], row["type_counts"]):
        raise SystemExit(
            f"{label}: rebuilt {written['bytes']:,} bytes, {written['type_counts']}; "
            f"the run's file {row['bytes']:,} bytes, {row['type_counts']}"
        )


def retime(
    results: dict, types: tuple[str, ...], work: Path, calib_samples: int | None, repeats: int, command: str
) -> dict:
    """Time budgets a recorded run left untimed: each budget's importance-weighted mix and `export --size` file
    built again (deterministic), their bytes and types checked against the run's rows, then timed in turns."""
    recorded = {(row["type"], row["imatrix"]): row for row in results["rows"]}
    files = {}
    for tensor_type in types:
        log(f"--retime {tensor_type}: its mix and export --size built again")
        if (tensor_type, "structure") in recorded:
            raise SystemExit(
                f"--retime {tensor_type}: the run chose structure there; time it with a full run"
            )
        mix = export(results["model"], work / f"{tensor_type}-calibration.gguf", tensor_type=tensor_type,
                     imatrix="calibration", calib_samples=calib_samples, overwrite=True, progress=False)  # fmt: skip
        size = export(results["model"], work / f"size-{tensor_type}.gguf", size=mix.details["bytes"], calib_samples=calib_samples,
                      overwrite=True, progress=False)  # fmt: skip
        for kind, written in (("calibration", mix.to_dict()), ("size", size.to_dict())):
            check_rebuilt(written, recorded[(tensor_type, kind)], f"--retime {tensor_type} ({kind})")
            files[(tensor_type, kind)] = written
    attach_speeds(results["frontier"], time_ladder(results["model"], files, repeats))
    results["retimed"] = [*results.get("retimed", []), command]
    return results


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
    paths = {f"{t}|{i}": written["out"] for (t, i), written in files.items() if "out" in written}
    reference, scored = score_files(model, paths, max_tokens, per_pass)
    rows, per_window, window_kl = [], {}, {}
    for (tensor_type, imatrix), written in files.items():
        if "out" not in written:
            rows.append(
                {
                    "type": tensor_type,
                    "imatrix": imatrix,
                    "bytes": written["bytes"],
                    "refused": written["refused"],
                }
            )
            continue
        result, faith = scored[f"{tensor_type}|{imatrix}"]
        per_window[(tensor_type, imatrix)] = result
        window_kl[(tensor_type, imatrix)] = faith.window_kl
        rows.append({
            "type": tensor_type, "imatrix": imatrix, "bytes": written["bytes"], "ppl": result.ppl,
            "ppl_ci95": result.ppl_ci95, "kl": faith.kl_to_original, "top1": faith.top1_agreement,
            **{f"kl_{k.replace('.', '')}": v for k, v in faith.kl_percentiles.items()},  # kl_p99, kl_p999
            "type_counts": written["type_counts"], "fallbacks": len(written["fallbacks"]),
            **{k: written[k] for k in ("removed_parameters", "mlp_widths", "heads") if k in written},
        })  # fmt: skip

    def paired(a, b) -> tuple[float, float, float]:
        difference = paired_difference(
            per_window[a].window_nll, per_window[b].window_nll, per_window[a].window_tokens
        )
        return difference.value, *difference.ci95

    def paired_kl(a, b) -> dict:
        """The mean KL to the original of a minus b, paired over the windows (the verdict llama.cpp users read)."""
        difference = paired_mean_difference(window_kl[a], window_kl[b], per_window[a].window_tokens)
        return {
            "kl_diff": difference.value,
            "kl_diff_lo": difference.ci95[0],
            "kl_diff_hi": difference.ci95[1],
        }

    gains, frontier, below = {}, {}, []
    for tensor_type in {t for t, i in files if i == "calibration" and (t, "none") in files}:
        value, lo, hi = paired((tensor_type, "none"), (tensor_type, "calibration"))
        gains[tensor_type] = {"plain_minus_imatrix": value, "ci95": [lo, hi]}
    for name in {t for t, i in files if i in ("size", "structure")}:
        ours = (name, "structure") if (name, "structure") in per_window else (name, "size")
        row = {"type": name, "ours": ours[1], "ours_bytes": files[ours]["bytes"], "ours_ppl": per_window[ours].ppl,
               "removed_parameters": files[ours].get("removed_parameters", 0),
               "predicted_loss_rise": files[ours].get("predicted_loss_rise")}  # fmt: skip
        if (name, "size") in per_window and ours != (name, "size"):
            row["types_only_ppl"] = per_window[(name, "size")].ppl
            value, lo, hi = paired(ours, (name, "size"))
            row |= {"minus_types_only": value, "minus_types_only_ci95": [lo, hi]}
        if (name, "calibration") not in per_window:  # under the ladder: no mix of these bytes
            below.append(
                row | {"budget": files[(name, "size")]["bytes"] if (name, "size") in files else None}
            )
            continue
        value, lo, hi = paired(ours, (name, "calibration"))
        frontier[name] = row | {
            "baseline_bytes": files[(name, "calibration")]["bytes"], "baseline_ppl": per_window[(name, "calibration")].ppl,
            "diff": value, "diff_lo": lo, "diff_hi": hi, **paired_kl(ours, (name, "calibration")),
        }  # fmt: skip
    protocol = {
        "text": reference.text, "split": "test", "windows": reference.windows, "seq_len": reference.seq_len,
        "tokens": reference.tokens, "original_transformers_ppl": reference.ppl,
        "original_transformers_ppl_ci95": reference.ppl_ci95,
    }  # fmt: skip
    ladder = sorted(frontier.values(), key=lambda row: -row["baseline_bytes"])
    below = sorted(below, key=lambda row: -row["ours_bytes"])
    return {"protocol": protocol, "imatrix_gain": gains, "frontier": ladder, "below_ladder": below}, rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--types", default=",".join(TYPES))
    parser.add_argument("--max-tokens", type=int, default=MAX_TOKENS)
    parser.add_argument("--calib-samples", type=int, default=None)
    parser.add_argument(
        "--below", default="", help="budgets under the ladder (e.g. 78MiB,72MiB): --size files only"
    )
    parser.add_argument(
        "--structure-at",
        default=None,
        help="the budgets (type or size names) compress --size runs at (default: all)",
    )
    parser.add_argument("--repeats", type=int, default=5, help="timed generations per file (0: no timing)")
    parser.add_argument(
        "--layerwise", action="store_true", help="compress --size with --layerwise (large models)"
    )
    parser.add_argument(
        "--files-per-pass", type=int, default=0, help="llama.cpp files held at once while scoring (0: all)"
    )
    parser.add_argument(
        "--summarize", type=Path, default=None, help="only copy this results file's figures into results.json"
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="results file (default: results/bytes-MODEL.json)"
    )
    parser.add_argument(
        "--merge", action="store_true",
        help="keep the results file's budgets not measured this time (the same windows: refused otherwise)",
    )  # fmt: skip
    parser.add_argument(
        "--retime", action="store_true",
        help="only time --types' budgets of the results file (their files rebuilt and checked), then write it again",
    )  # fmt: skip
    args = parser.parse_args(argv)
    types = tuple(t.strip() for t in args.types.split(",") if t.strip())
    if args.retime:
        out = args.out or RESULTS / f"bytes-{args.model}.json"
        with tempfile.TemporaryDirectory(prefix="masa-bytes-") as work:
            results = retime(
                json.loads(out.read_text()), types, Path(work), args.calib_samples, args.repeats,
                command_line("benchmarks.engines.bytes_frontier", argv),
            )  # fmt: skip
        write_json(out, results)
        out.with_suffix(".md").write_text(results_page(results))
        return
    if args.summarize:
        summarize(json.loads(args.summarize.read_text()), RESULTS / "results.json")
        return
    with tempfile.TemporaryDirectory(prefix="masa-bytes-") as work:
        below = tuple(b.strip() for b in args.below.split(",") if b.strip())
        structure_at = None if args.structure_at is None else tuple(args.structure_at.split(","))
        files = export_ladder(
            args.model, types, Path(work), args.calib_samples, below, structure_at, args.layerwise
        )
        scored, rows = score_ladder(args.model, files, args.max_tokens, args.files_per_pass)
        speeds = time_ladder(args.model, files, args.repeats) if args.repeats else {}
    attach_speeds(scored["frontier"], speeds)
    imatrix = next((r.get("imatrix") for r in files.values() if r.get("imatrix", "none") != "none"), "none")
    results = {
        "command": command_line("benchmarks.engines.bytes_frontier", argv),
        "model": args.model,
        "machine": machine_info(),
        "imatrix": imatrix,
        **scored,
        "rows": rows,
    }
    out = args.out or RESULTS / f"bytes-{args.model}.json"
    if args.merge and out.is_file():
        results = merged(json.loads(out.read_text()), results)
    write_json(out, results)
    out.with_suffix(".md").write_text(results_page(results))
    summarize(results, RESULTS / "results.json")
    log(f"wrote {out} and {out.with_suffix('.md')}")


def merged(earlier: dict, latest: dict) -> dict:
    """`latest` with the budgets of `earlier` it did not measure: rows by (budget, kind), the frontier, the rows
    under the ladder and the importance-matrix gains by budget. Only runs on the same windows merge (each paired
    difference is within one run; the original's scores are deterministic)."""
    if earlier["protocol"] != latest["protocol"] or earlier["model"] != latest["model"]:
        raise SystemExit(
            f"--merge: {earlier['model']} on {earlier['protocol']['tokens']:,} tokens in the results file, "
            f"{latest['model']} on {latest['protocol']['tokens']:,} now: the same --model and --max-tokens, or no --merge"
        )  # fmt: skip

    def union(key: str, name) -> list:
        rows = {name(row): row for row in earlier.get(key, [])} | {
            name(row): row for row in latest.get(key, [])
        }
        return list(rows.values())

    return latest | {
        "earlier_commands": [*earlier.get("earlier_commands", []), earlier["command"]],
        "retimed": earlier.get("retimed", []),
        "imatrix_gain": earlier["imatrix_gain"] | latest["imatrix_gain"],
        "rows": union("rows", lambda row: (row["type"], row["imatrix"])),
        "frontier": sorted(
            union("frontier", lambda row: row["type"]), key=lambda row: -row["baseline_bytes"]
        ),
        "below_ladder": sorted(
            union("below_ladder", lambda row: row["type"]), key=lambda row: -row["ours_bytes"]
        ),
    }


#: results.json's name for each model's figures.
SUMMARY_NAMES = {"smollm2-135m": "bundled", "qwen2.5-coder-1.5b": "1p5b"}
FRONTIER_FIELDS = ("type", "baseline_bytes", "baseline_ppl", "ours_bytes", "ours_ppl", "diff_lo", "diff_hi")
#: The paired mean-KL difference, where the run kept the per-window KL.
KL_FIELDS = ("kl_diff", "kl_diff_lo", "kl_diff_hi")


def summarize(results: dict, summary: Path) -> None:
    """Copy a run's frontier and importance-matrix gains into results.json, beside the other benchmarks' figures:
    `bytes_frontier_<model>` (rows of FRONTIER_FIELDS; diff = ours − the importance-weighted mix, its 95%
    interval; `KL_FIELDS` too where kept) and `imatrix_gain_<type>_<model>` (plain − importance-weighted, paired, with its interval)."""
    name = SUMMARY_NAMES.get(results["model"])
    if name is None or not summary.is_file():
        return
    figures = {
        f"bytes_frontier_{name}": [
            {k: row[k] for k in (*FRONTIER_FIELDS, *KL_FIELDS) if k in row} for row in results["frontier"]
        ]
    }
    for tensor_type, gain in results["imatrix_gain"].items():
        figures[f"imatrix_gain_{tensor_type}_{name}"] = gain
    write_json(summary, json.loads(summary.read_text()) | figures)
    log(f"copied {', '.join(figures)} into {summary}")


if __name__ == "__main__":
    main()
