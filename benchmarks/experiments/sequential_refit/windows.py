"""How many calibration windows the stream refit needs (`--native`'s default refit), on the validation split.

The stream refit advances the original and the compressed model through every layer over the calibration
windows: its time grows with them (its stage time in the run's summary), while its least-squares solves need
enough tokens per input. Here the same native run (20% of the model) refits
on all the windows (`native`, today's default), on K of them evenly spaced (`stream-K`), and by the calibration
refit (`calibration`, no stream pass); every variant scored in one pass over the same validation windows, paired
with `native`. The cheapest K whose difference to `native` is inside its interval is the default
(`partly_compressed.STREAM_REFIT_WINDOWS`).

    python -m benchmarks.experiments.sequential_refit.windows --windows 32,64,128 \\
        --out benchmarks/results/choices/stream-refit-windows-validation.json
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.experiments.native_balance.run import native_overrides, scored_rows
from benchmarks.suite.common import write_json
from benchmarks.suite.quality import build_variant, validation_header, validation_setup
from benchmarks.suite.whole_model import model_ratio_as_targets
from compressor.statistics import partly_compressed


def build(setup, name: str, overrides: dict, ratio: float, windows: int | None) -> tuple:
    """The native variant with `overrides`, its stream refit reading at most `windows` windows: (the model, its
    `build_variant` row, what its results row adds)."""
    partly_compressed.STREAM_REFIT_WINDOWS = windows
    try:
        model, row = build_variant(setup, name, native_overrides() | overrides, ratio, progress=False)
    finally:
        partly_compressed.STREAM_REFIT_WINDOWS = None
    seconds = row["stage_seconds"]
    print(f"{name}: stream refit {seconds.get('stream_refit', 0.0):.0f} s", flush=True)
    return model, row, {"stage_seconds": seconds, "refit_windows": windows or int(setup.windows.shape[0])}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-ratio", type=float, default=0.2)
    parser.add_argument("--max-tokens", type=int, default=0, help="0: the whole validation split")
    parser.add_argument("--windows", default="32,64,128", help="the window counts to try besides all of them")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    setup = validation_setup(args.max_tokens, progress=False)
    ratio = model_ratio_as_targets("smollm2-135m", args.model_ratio)
    variants, extra = {}, {}
    runs = [("native", "stream", None), *((f"stream-{int(c)}", "stream", int(c)) for c in args.windows.split(",")),
            ("calibration", "calibration", None)]  # fmt: skip
    for name, refit, windows in runs:
        variants[name], row, extra[name] = build(setup, name, {"refit": refit}, ratio, windows)
    original, rows = scored_rows(setup.loaded.model, variants, setup.eval_windows, extra)
    module = "benchmarks.experiments.sequential_refit.windows"
    if args.out:
        write_json(args.out, validation_header(module, argv, setup, original, args.model_ratio, ratio, row) | {
            "settings": row["settings"], "rows": rows,
        })  # fmt: skip


if __name__ == "__main__":
    main()
