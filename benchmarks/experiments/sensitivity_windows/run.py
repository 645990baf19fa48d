"""How many calibration windows does the loss sensitivity need? (issue 32: its backward passes are the run's
second-largest cost, 23 s of 103 s for attention 0.2 on the bundled model with 16 windows.)

`--allocation global-loss` weighs each matrix's whitened error by one number per matrix, the mean over tokens of
‖∂L/∂y‖² at its output, measured on the first `sensitivity_samples` calibration windows. Each target (`attention`:
`--ratio 0.2`; `whole`: the model 20% smaller) is compressed with each window count, every checkpoint scored on
the same validation windows; per count, its perplexity minus the reference count's (paired bootstrap: a
difference whose interval holds 0 is a tie). Each run's stage times are kept, but they compare only between
runs that read the calibration alike (section 3 of BENCHMARKS.md times the default).

`python -m benchmarks.experiments.sensitivity_windows.run [--windows 4,8,16] [--reference 16] [--targets attention,whole]
[--split validation] [--max-tokens 32768] --out F`; `--split test --max-tokens 0` reports the chosen count on
every test token.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from benchmarks.experiments.calibration_size.run import MODEL, compress_and_score
from benchmarks.suite.common import command_line, log, machine_info, write_json
from compressor.api import EvalSettings
from compressor.evaluation.intervals import paired_difference

TARGETS = {
    "attention": {"ratio": 0.2},
    "whole": {"ratio": 0.2, "ratio_of": "model", "targets": "attn,mlp"},
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", default="4,8,16")
    parser.add_argument("--reference", type=int, default=16, help="the count the others are compared with")
    parser.add_argument("--targets", default="attention,whole")
    parser.add_argument(
        "--split", default="validation", help="validation to choose; test to report the choice"
    )
    parser.add_argument("--max-tokens", type=int, default=32768, help="0: every token of the split")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    counts = [int(x) for x in args.windows.split(",")]
    if args.reference not in counts:
        parser.error(f"--reference {args.reference} must be one of --windows {args.windows}")
    # The checkpoints alone: the paired differences read their per-window losses, not the original's.
    eval_settings = EvalSettings(split=args.split, max_tokens=args.max_tokens or None, compare=False)
    results = {
        "command": command_line("benchmarks.experiments.sensitivity_windows.run", argv),
        "model": MODEL,
        "split": args.split,
        "max_tokens": args.max_tokens,
        "reference_windows": args.reference,
        "machine": machine_info(),
        "targets": {},
    }
    with tempfile.TemporaryDirectory(prefix="masa-sensitivity-windows-") as work:
        for target in args.targets.split(","):
            runs = {
                n: compress_and_score(
                    f"{target}-{n}", TARGETS[target] | {"sensitivity_samples": n}, eval_settings, Path(work)
                )
                for n in counts
            }
            reference = runs[args.reference]
            differences = {}
            for n, run in runs.items():
                if n == args.reference:
                    continue
                d = paired_difference(run["window_nll"], reference["window_nll"], run["window_tokens"])
                differences[str(n)] = d.to_dict()
                log(
                    f"{target}: {n} − {args.reference} windows = {d.value:+.3f} [{d.ci95[0]:+.3f}, {d.ci95[1]:+.3f}]"
                )
            results["targets"][target] = {
                "options": TARGETS[target],
                "runs": {
                    str(n): {k: v for k, v in r.items() if not k.startswith("window_")}
                    for n, r in runs.items()
                },
                "minus_reference": differences,
            }
    write_json(args.out, results)


if __name__ == "__main__":
    main()
