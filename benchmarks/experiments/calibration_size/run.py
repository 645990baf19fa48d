"""How many calibration windows does the model 20% smaller need? (issue 31: the engine-native form refits o_proj
and down_proj by least squares, on inputs up to 2.7x wider than the attention's.)

Each form (`native`: `--native`; `default`: the recipe's forms) is compressed from the first N calibration windows
for each N (the same seed, so the smaller set is the start of the larger), every checkpoint scored on the same
validation windows; per form, each larger calibration minus the smallest (paired bootstrap: a difference whose
interval holds 0 is a tie).

`python -m benchmarks.experiments.calibration_size.run [--windows 64,128] [--forms native,default] [--max-tokens 32768] --out F`
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from benchmarks.suite.common import command_line, log, machine_info, write_json
from compressor.api import CompressOptions, EvalSettings, compress, evaluate
from compressor.evaluation.intervals import paired_difference

MODEL = "smollm2-135m"
FORMS = {"native": {"native": True}, "default": {}}


def compress_and_score(label: str, options: dict, eval_settings: EvalSettings, work: Path) -> dict:
    """Compress the bundled model with `options` (`CompressOptions` fields), score the checkpoint on
    `eval_settings`' windows, and keep what a choice compares: stage times, size, perplexity and the per-window
    losses a paired difference needs. Other choice benchmarks (`benchmarks.experiments.sensitivity_windows.run`) use it too."""
    out = work / label
    options = CompressOptions(evaluate=False, out=str(out), overwrite=True, **options)
    start = time.perf_counter()
    summary = compress(MODEL, options, device="cpu", dtype="float32", progress=False).summary
    seconds = time.perf_counter() - start
    result = evaluate(str(out), eval_settings, progress=False).result
    log(f"{label}: ppl {result.ppl:.3f} {result.ppl_ci95} ({seconds:.0f} s to compress)")
    return {
        "compress_seconds": seconds,
        "stage_seconds": summary["seconds"],
        "model_params_after": summary["model_params_after"],
        "ppl": result.ppl,
        "ppl_ci95": list(result.ppl_ci95),
        "tokens": result.tokens,
        "window_nll": list(result.window_nll),
        "window_tokens": list(result.window_tokens),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", default="64,128")
    parser.add_argument("--forms", default="native,default")
    parser.add_argument("--ratio", type=float, default=0.2)
    parser.add_argument("--max-tokens", type=int, default=32768)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    counts = [int(x) for x in args.windows.split(",")]
    eval_settings = EvalSettings(split="validation", max_tokens=args.max_tokens)
    results = {
        "command": command_line("benchmarks.experiments.calibration_size.run", argv),
        "model": MODEL,
        "ratio_of_model": args.ratio,
        "split": "validation",
        "max_tokens": args.max_tokens,
        "machine": machine_info(),
        "forms": {},
    }
    with tempfile.TemporaryDirectory(prefix="masa-calibration-size-") as work:
        for form in args.forms.split(","):
            runs = {
                n: {"windows": n}
                | compress_and_score(
                    f"{form}-{n}",
                    {"ratio": args.ratio, "ratio_of": "model", "targets": "attn,mlp", "calib_samples": n}
                    | FORMS[form],
                    eval_settings,
                    Path(work),
                )
                for n in counts
            }
            small = runs[counts[0]]
            # Each larger calibration minus the smallest, paired on the same windows.
            differences = {
                n: paired_difference(runs[n]["window_nll"], small["window_nll"], runs[n]["window_tokens"])
                for n in counts[1:]
            }
            for n, difference in differences.items():
                lo, hi = difference.ci95
                log(f"{form}: {n} − {counts[0]} windows = {difference.value:+.3f} [{lo:+.3f}, {hi:+.3f}]")
            results["forms"][form] = {
                "runs": {
                    str(n): {k: v for k, v in r.items() if not k.startswith("window_")}
                    for n, r in runs.items()
                },
                "larger_minus_smaller": differences[counts[-1]].to_dict(),
                "minus_smallest": {str(n): d.to_dict() for n, d in differences.items()},
            }
    write_json(args.out, results)


if __name__ == "__main__":
    main()
