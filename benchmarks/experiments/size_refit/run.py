"""Which refit should the structure of `compress --size` take: `calibration` (each kept matrix refit on the
original's statistics, the default under a byte budget) or `stream` (`--native`'s default at a fixed ratio: each
layer refit again on the compressed model's own inputs)? On the bundled model and the VALIDATION split.

At each of `--sizes`, `compress --size` with each refit writes a GGUF of at most that many bytes (the allocation
is the same up to the refit: it is made before either runs); llama.cpp scores every file on the first
`--max-tokens` validation tokens against the original in transformers. Per size: stream − calibration, paired on
the same windows (95% interval; inside it, a tie), and each file's predicted against measured rise of the loss.

    python -m benchmarks.experiments.size_refit.run --out benchmarks/results/choices/size-refit-validation.json
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from benchmarks.engines.bytes_frontier import score_files
from benchmarks.suite.common import command_line, log, machine_info, write_json
from compressor.api.run_options import CompressOptions
from compressor.api.size import compress_to_size
from compressor.evaluation.intervals import paired_difference

MODEL = "smollm2-135m"
REFITS = ("calibration", "stream")


def write_files(sizes: list[str], work: Path) -> dict:
    """(size, refit) → what `compress --size` wrote: its file, bytes, structure and predicted rise."""
    files = {}
    for size in sizes:
        for refit in REFITS:
            log(f"compress {MODEL} --size {size} --refit {refit}")
            options = CompressOptions(size=size, out=str(work / f"{size}-{refit}.gguf"), evaluate=False,
                                      overwrite=True, refit=refit)  # fmt: skip
            summary = compress_to_size(MODEL, options, progress=False).summary
            structure = summary["structure"]
            files[(size, refit)] = {
                "out": summary["out"], "bytes": summary["bytes"], "removed": structure.get("removed_parameters", 0),
                "predicted_rise": structure.get("predicted_loss_rise"), "mlp_widths": summary["mlp_widths"],
                "heads": summary["heads"], "type_counts": summary["type_counts"],
            }  # fmt: skip
    return files


def compare(files: dict, reference, scored: dict) -> list[dict]:
    """One row per file; the stream's rows carry stream − calibration at the same size, paired."""
    rows = []
    for (size, refit), written in files.items():
        result, faith = scored[f"{size}|{refit}"]
        row = {"size": size, "refit": refit, **{k: v for k, v in written.items() if k != "out"},
               "ppl": result.ppl, "ppl_ci95": result.ppl_ci95, "kl": faith.kl_to_original,
               "top1": faith.top1_agreement, "measured_rise": result.nll - reference.nll}  # fmt: skip
        if refit == "stream":
            base, _ = scored[f"{size}|calibration"]
            difference = paired_difference(result.window_nll, base.window_nll, result.window_tokens)
            row |= {"minus_calibration": difference.value, "ci95": list(difference.ci95)}
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="90MiB,84MiB,78MiB")
    parser.add_argument("--max-tokens", type=int, default=16384)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    with tempfile.TemporaryDirectory(prefix="masa-size-refit-") as work:
        files = write_files(sizes, Path(work))
        paths = {f"{s}|{r}": f["out"] for (s, r), f in files.items()}
        reference, scored = score_files(MODEL, paths, args.max_tokens, split="validation")
    write_json(args.out, {
        "command": command_line("benchmarks.experiments.size_refit.run", argv), "model": MODEL,
        "machine": machine_info(), "split": "validation", "tokens": reference.tokens,
        "original_ppl": reference.ppl, "rows": compare(files, reference, scored),
    })  # fmt: skip
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
