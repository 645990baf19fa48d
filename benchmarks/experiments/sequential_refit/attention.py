"""`--native`'s stream refit on the attention alone (`--native` at its default targets), on the VALIDATION split.

`--native` takes `--refit stream` where it can run; it was chosen at the model 20% smaller (`run.py`: the MLP and
the attention). This checks the same choice where only the attention is targeted: the bundled model's attention
20% smaller in whole query heads, o_proj refit on the original model's statistics (`calibration`) against refit
again on the compressed model's own stream (`stream`), with the calibration a `compress --native` run of the
attention reads, scored on the same windows, paired.

    python -m benchmarks.experiments.sequential_refit.attention --out benchmarks/results/choices/native-refit-attention-validation.json
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.experiments.native_balance.run import scored_rows, widths_and_heads
from benchmarks.suite.common import write_json
from benchmarks.suite.quality import build_variant, prepare_quality, validation_header

#: The compression settings `--native` sets with the attention alone targeted (its default targets).
ATTENTION_NATIVE = {"method": "masa", "targets": "attn", "attention": "heads", "sharing": "none"}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ratio", type=float, default=0.2, help="of the attention's parameters")
    parser.add_argument("--max-tokens", type=int, default=0, help="0: the whole validation split")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    setup = prepare_quality("smollm2-135m", eval_max_tokens=args.max_tokens or None, progress=False,
                            split="validation", evaluate_original=False)  # fmt: skip
    variants, extra, first = {}, {}, None
    # "native" names the reference of scored_rows' paired differences: here the calibration refit
    for name, refit in (("native", "calibration"), ("stream", "stream")):
        variants[name], row = build_variant(
            setup, name, ATTENTION_NATIVE | {"refit": refit}, args.ratio, False
        )
        extra[name] = {"refit": refit, "compress_seconds": row["compress_seconds"],
                       "heads": widths_and_heads(variants[name])["heads"]}  # fmt: skip
        first = first or row
    original, rows = scored_rows(setup.loaded.model, variants, setup.eval_windows, extra)
    module = "benchmarks.experiments.sequential_refit.attention"
    payload = validation_header(module, argv, setup, original, None, args.ratio, first) | {
        "settings": first["settings"],
        "rows": rows,
    }
    if args.out:
        write_json(args.out, payload)


if __name__ == "__main__":
    main()
