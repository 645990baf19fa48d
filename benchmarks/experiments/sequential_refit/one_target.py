"""`--native`'s stream refit with one part targeted, the attention or the MLP, on the VALIDATION split.

`--native` takes `--refit stream` where it was chosen: at the model 20% smaller (`run.py`: the MLP and the
attention). This checks the same choice where only one part is targeted: the bundled model's attention 20%
smaller in whole query heads (`--targets attn`, `--native`'s default targets; o_proj refit) or its MLP 20% smaller
in neurons, widths in multiples of 32 (`--targets mlp`; down_proj refit), refit on the original model's statistics
(`calibration`) against refit again on the compressed model's own stream (`stream`), with the calibration windows
such a `compress --native` run reads, scored on the same windows, paired.

    python -m benchmarks.experiments.sequential_refit.one_target --targets attn --out benchmarks/results/choices/native-refit-attention-validation.json
    python -m benchmarks.experiments.sequential_refit.one_target --targets mlp --out benchmarks/results/choices/native-refit-mlp-validation.json
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.experiments.native_balance.run import scored_rows, widths_and_heads
from benchmarks.suite.common import write_json
from benchmarks.suite.quality import build_variant, prepare_quality, validation_header

#: The compression settings `--native` sets with one part targeted (the attention: its default targets).
NATIVE_ONE_TARGET = {
    "attn": {"method": "masa", "targets": "attn", "attention": "heads", "sharing": "none"},
    "mlp": {"method": "masa", "targets": "mlp", "mlp": "neurons", "width_multiple": 32, "sharing": "none"},
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--targets", choices=sorted(NATIVE_ONE_TARGET), default="attn")
    parser.add_argument("--ratio", type=float, default=0.2, help="of the targeted part's parameters")
    parser.add_argument("--max-tokens", type=int, default=0, help="0: the whole validation split")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    mlp = args.targets == "mlp"  # such a run reads the recipe's mlp_samples windows
    setup = prepare_quality("smollm2-135m", eval_max_tokens=args.max_tokens or None, progress=False,
                            split="validation", evaluate_original=False, mlp=mlp)  # fmt: skip
    variants, extra, first = {}, {}, None
    # "native" names the reference of scored_rows' paired differences: here the calibration refit
    for name, refit in (("native", "calibration"), ("stream", "stream")):
        variants[name], row = build_variant(
            setup, name, NATIVE_ONE_TARGET[args.targets] | {"refit": refit}, args.ratio, False
        )
        kept = "mlp_widths" if mlp else "heads"
        extra[name] = {"refit": refit, "compress_seconds": row["compress_seconds"],
                       kept: widths_and_heads(variants[name])[kept]}  # fmt: skip
        first = first or row
    original, rows = scored_rows(setup.loaded.model, variants, setup.eval_windows, extra)
    module = "benchmarks.experiments.sequential_refit.one_target"
    payload = validation_header(module, argv, setup, original, None, args.ratio, first) | {
        "settings": first["settings"],
        "rows": rows,
    }
    if args.out:
        write_json(args.out, payload)


if __name__ == "__main__":
    main()
