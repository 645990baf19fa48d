"""What do bfloat16 forward passes in the calibration cost? (issue 32: the capture is most of a run's time on a
CPU, and a CPU with native bfloat16 runs the model's matrix products in about 0.6x the time.)

`--calib-precision model` runs the calibration (capture, loss sensitivity) in the model's float32; `bfloat16`
computes the forward and backward passes' matrix products in bfloat16 (autocast), the statistics still summed in
fp64. Each target (`attention`: `--ratio 0.2`; `whole`: the model 20% smaller) is compressed both ways from
fresh statistics (no cache) for each calibration seed, every checkpoint scored on the same validation windows:
per seed, bfloat16 minus float32 (paired bootstrap: a difference whose interval holds 0 is a tie), and, as the
yardstick of what the calibration sample itself moves, float32 at each other seed minus float32 at the first.
Stage times are kept (section 3 of BENCHMARKS.md times the default alone on the machine).

`python -m benchmarks.experiments.calibration_precision.run [--targets attention,whole] [--seeds 0,1,2] [--split validation]
[--max-tokens 32768] --out F`
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
PRECISIONS = ("model", "bfloat16")


def _difference(label: str, a: dict, b: dict) -> dict:
    d = paired_difference(a["window_nll"], b["window_nll"], b["window_tokens"])
    log(f"{label} = {d.value:+.3f} [{d.ci95[0]:+.3f}, {d.ci95[1]:+.3f}]")
    return d.to_dict()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--targets", default="attention,whole")
    parser.add_argument("--seeds", default="0", help="calibration seeds (comma-separated), each target")
    parser.add_argument("--split", default="validation", help="validation to choose; test to report")
    parser.add_argument("--max-tokens", type=int, default=32768, help="0: every token of the split")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    # The checkpoints alone: the paired differences read their per-window losses, not the original's.
    eval_settings = EvalSettings(split=args.split, max_tokens=args.max_tokens or None, compare=False)
    results = {
        "command": command_line("benchmarks.experiments.calibration_precision.run", argv),
        "model": MODEL,
        "split": args.split,
        "max_tokens": args.max_tokens,
        "machine": machine_info(),
        "targets": {},
    }
    with tempfile.TemporaryDirectory(prefix="masa-calibration-precision-") as work:
        for target in args.targets.split(","):
            runs = {
                (precision, seed): compress_and_score(
                    f"{target}-{precision}-s{seed}",
                    TARGETS[target] | {"calib_precision": precision, "seed": seed, "stats_cache": False},
                    eval_settings,
                    Path(work),
                )
                for seed in seeds
                for precision in PRECISIONS
            }
            bfloat16_minus_model = {
                str(seed): _difference(
                    f"{target} seed {seed}: bfloat16 − model", runs["bfloat16", seed], runs["model", seed]
                )
                for seed in seeds
            }
            seed_minus_first = {
                str(seed): _difference(
                    f"{target} model: seed {seed} − seed {seeds[0]}",
                    runs["model", seed],
                    runs["model", seeds[0]],
                )
                for seed in seeds[1:]
            }
            results["targets"][target] = {
                "options": TARGETS[target],
                "runs": {
                    f"{precision}-s{seed}": {k: v for k, v in r.items() if not k.startswith("window_")}
                    for (precision, seed), r in runs.items()
                },
                "bfloat16_minus_model": bfloat16_minus_model,
                "model_seed_minus_first_seed": seed_minus_first,
            }
    write_json(args.out, results)


if __name__ == "__main__":
    main()
