"""Does the loss sensitivity earn its backward pass in the default run? `--native` 20% of the model as it runs by
default (`--allocation global-loss`: each matrix's error weighted by the loss sensitivity, one backward pass over
`sensitivity_samples` calibration windows) against the cheaper `--allocation global-relative` (no backward pass:
each error relative to its matrix's output energy), both from the same calibration, every checkpoint scored on the
same validation windows, paired with the default. The pass's own time is the run's `sensitivity` stage (plan-time
runs, BENCHMARKS.md): the runs here read it from the cache.

    python -m benchmarks.experiments.sensitivity_windows.against_none \\
        --out benchmarks/results/choices/sensitivity-against-none-validation.json
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.experiments.native_balance.run import native_overrides, scored_rows
from benchmarks.suite.common import write_json
from benchmarks.suite.quality import build_variant, validation_header, validation_setup
from benchmarks.suite.whole_model import model_ratio_as_targets

#: The default run (`--native` with the MLP targeted, in memory: the stream refit) and its cheaper choice.
DEFAULT = {"refit": "stream"}
VARIANTS = {"native": DEFAULT, "global-relative": {**DEFAULT, "allocation": "global-relative"}}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-ratio", type=float, default=0.2)
    parser.add_argument("--max-tokens", type=int, default=0, help="0: the whole validation split")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    setup = validation_setup(args.max_tokens, progress=False)
    ratio = model_ratio_as_targets("smollm2-135m", args.model_ratio)
    variants, extra, rows_built = {}, {}, {}
    for name, overrides in VARIANTS.items():
        variants[name], rows_built[name] = build_variant(
            setup, name, native_overrides() | overrides, ratio, progress=False
        )
        extra[name] = {"stage_seconds": rows_built[name]["stage_seconds"],
                       "allocation": rows_built[name]["settings"]["allocation"]}  # fmt: skip
        print(f"{name}: {rows_built[name]['stage_seconds']}", flush=True)
    original, rows = scored_rows(setup.loaded.model, variants, setup.eval_windows, extra)
    module = "benchmarks.experiments.sensitivity_windows.against_none"
    if args.out:
        header = validation_header(
            module, argv, setup, original, args.model_ratio, ratio, rows_built["native"]
        )
        write_json(args.out, header | {"settings": rows_built["native"]["settings"], "rows": rows})


if __name__ == "__main__":
    main()
