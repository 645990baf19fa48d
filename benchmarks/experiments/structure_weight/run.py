"""How much should the structure's predicted rise weigh against the rounding's in `compress --size` (κ)? And does
the joint error model order whole files right? On the bundled model and the VALIDATION split.

At each of `--sizes`: `export --size` (every matrix's type, the structure kept whole) and `compress --size` with
each κ of `--weights` (each MLP's width and each attention's heads with the types) write a GGUF of at most that
many bytes; llama.cpp scores every file on the first `--max-tokens` validation tokens against the original in
transformers. Per (size, κ): the paired difference of perplexity against the types-only file of the same size
(95% interval; inside it, a tie). Per file: the predicted rise of the mean loss (the structure's, κ = 1, plus the
export's rounding) against the measured one (its mean NLL minus the original's), and their rank correlation over
the files.

    python -m benchmarks.experiments.structure_weight.run --out benchmarks/results/choices/structure-weight-validation.json
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from benchmarks.engines.bytes_frontier import score_files
from benchmarks.suite.common import command_line, log, machine_info, write_json
from compressor.api.export import export
from compressor.api.run_options import CompressOptions
from compressor.api.size import compress_to_size
from compressor.evaluation.intervals import paired_difference
from compressor.quantize.byte_budget import parse_size
from compressor.runtime.errors import UserError

MODEL = "smollm2-135m"


def write_files(model: str, sizes: list[str], weights: list[float], work: Path) -> dict:
    """(size, κ or None for types only) → what was written: bytes, structure, predicted rises."""
    files = {}
    for size in sizes:
        budget = parse_size(size)
        log(f"export {model} --size {size} (types only)")
        try:
            written = export(model, work / f"types-{size}.gguf", size=budget, overwrite=True, progress=False)
            files[(size, None)] = {"out": str(written.path), "bytes": written.details["bytes"], "removed": 0,
                                   "structure_rise": 0.0, "rounding_rise": written.details["predicted_loss_rise"]}  # fmt: skip
        except UserError as err:  # below the smallest file of types alone: only structure reaches it
            files[(size, None)] = {"refused": str(err)}
        for weight in weights:
            log(f"compress {model} --size {size}, structure weight {weight:g}")
            options = CompressOptions(size=size, out=str(work / f"joint-{size}-{weight:g}.gguf"), evaluate=False,
                                      overwrite=True)  # fmt: skip
            summary = compress_to_size(model, options, progress=False, structure_weight=weight).summary
            structure = summary["structure"]
            files[(size, weight)] = {
                "out": summary["out"], "bytes": summary["bytes"], "removed": structure.get("removed_parameters", 0),
                "structure_rise": structure.get("structure_loss_rise", 0.0) / weight,  # at κ = 1
                "rounding_rise": summary["predicted_loss_rise"], "mlp_widths": summary["mlp_widths"],
                "heads": summary["heads"], "type_counts": summary["type_counts"],
            }  # fmt: skip
    return files


def compare(files: dict, reference, scored: dict) -> list[dict]:
    rows = []
    for (size, weight), written in files.items():
        row = {"size": size, "weight": weight, **{k: v for k, v in written.items() if k != "out"}}
        if "refused" not in written:
            result, faith = scored[f"{size}|{weight}"]
            row |= {"ppl": result.ppl, "ppl_ci95": result.ppl_ci95, "kl": faith.kl_to_original,
                    "top1": faith.top1_agreement, "measured_rise": result.nll - reference.nll,
                    "predicted_rise": written["structure_rise"] + written["rounding_rise"]}  # fmt: skip
            plain = files.get((size, None), {})
            if weight is not None and "refused" not in plain:
                base, _ = scored[f"{size}|None"]
                difference = paired_difference(result.window_nll, base.window_nll, result.window_tokens)
                row |= {"minus_types_only": difference.value, "ci95": list(difference.ci95)}
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="90MiB,84MiB,78MiB")
    parser.add_argument("--weights", default="0.5,1,2,4")
    parser.add_argument("--max-tokens", type=int, default=8192)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    weights = [float(w) for w in args.weights.split(",") if w.strip()]
    with tempfile.TemporaryDirectory(prefix="masa-structure-weight-") as work:
        files = write_files(MODEL, sizes, weights, Path(work))
        paths = {f"{s}|{w}": f["out"] for (s, w), f in files.items() if "out" in f}
        reference, scored = score_files(MODEL, paths, args.max_tokens, split="validation")
    rows = compare(files, reference, scored)
    from scipy.stats import spearmanr

    measured = [r for r in rows if "measured_rise" in r]
    fit = spearmanr([r["predicted_rise"] for r in measured], [r["measured_rise"] for r in measured])
    write_json(args.out, {
        "command": command_line("benchmarks.experiments.structure_weight.run", argv), "model": MODEL,
        "machine": machine_info(), "split": "validation", "tokens": reference.tokens,
        "original_ppl": reference.ppl, "spearman_files": float(fit.statistic), "rows": rows,
    })  # fmt: skip
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
