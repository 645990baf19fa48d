"""Whole-model compression (`--targets attn,mlp --ratio-of model`): at each fraction of the whole model removed,
the default (the MLP by neuron selection), the MLP by low-rank factors (the former default), one MLP width in
every layer (`--uniform-mlp`: a standard architecture) and SVD-LLM's uniform ranks, from ONE calibration scored
with the original in ONE pass over the same windows (paired differences).

`python -m benchmarks.whole_model [--model-ratios 0.1,0.2,0.3,0.4] [--variants ...] [--split test] [--out F]`
"""

from __future__ import annotations

import argparse
import json
import sys

from benchmarks.quality import VARIANTS, compare, run_quality, variant_key
from compressor.adapters import target_projections
from compressor.config import CompressOptions
from compressor.methods import ModelShape
from compressor.plan import targets_ratio
from compressor.planning import model_parameter_count, read_model_config
from compressor.session import resolve_run

MODEL = "smollm2-135m"
#: The default (the MLP by neuron selection, widths per layer), the MLP by low-rank factors (the former default),
#: one MLP width in every layer (a standard architecture: export-dense), and SVD-LLM's uniform ranks.
DEFAULT, LOWRANK, UNIFORM, BASELINE = (
    "masa-attn-mlp",
    "masa-attn-mlp-lowrank",
    "masa-attn-mlp-uniform",
    "svd-llm-attn-mlp",
)
CURVE = (DEFAULT, LOWRANK, UNIFORM, BASELINE)
#: Paired differences reported per row: this variant minus each partner, on the same windows.
PARTNERS = {DEFAULT: (LOWRANK, BASELINE), UNIFORM: (DEFAULT,)}


def model_ratio_as_targets(model: str, ratio: float) -> float:
    """The attn+mlp ratio that removes `ratio` of the whole model's parameters (as `--ratio-of model` does)."""
    run = resolve_run(model, CompressOptions())
    config, _ = read_model_config(run.source)
    targets = ModelShape.from_config(config, target_projections("attn,mlp")).params_before
    return targets_ratio(ratio, "model", model_parameter_count(config), targets, "attn,mlp")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--model-ratios", default="0.1,0.2,0.3,0.4", help="fractions of the whole model removed"
    )
    parser.add_argument("--variants", default=",".join(CURVE))
    parser.add_argument("--split", default="test")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    model_ratios = [float(r) for r in args.model_ratios.split(",")]
    as_targets = {r: model_ratio_as_targets(MODEL, r) for r in model_ratios}
    variants = {name: VARIANTS[name] for name in args.variants.split(",")}
    result = run_quality(MODEL, variants, list(as_targets.values()), progress=False, split=args.split)
    scores = result["_scores"]
    by_target = {round(t, 12): r for r, t in as_targets.items()}
    for row in result["quality"]:
        this = variant_key(row["method"], row["ratio"])
        row["model_ratio"] = by_target[round(row["ratio"], 12)]
        row["model_mib"] = row["model_params_after"] * 4 / 2**20  # float32 weights
        row["rise"] = compare(scores, this, "original")
        for partner in PARTNERS.get(row["method"], ()):
            if partner in variants:
                row[f"minus_{partner}"] = compare(scores, this, variant_key(partner, row["ratio"]))
    rows = {(r["method"], r["ratio"]): r for r in result["quality"]}
    for (method, ratio), row in rows.items():
        if method == DEFAULT and (BASELINE, ratio) in rows:
            row["rise_ratio_vs_svd_llm"] = row["rise"]["value"] / rows[(BASELINE, ratio)]["rise"]["value"]
    payload = {k: v for k, v in result.items() if not k.startswith("_")}
    payload["command"] = "python -m benchmarks.whole_model " + " ".join(
        sys.argv[1:] if argv is None else argv
    )
    payload["model_ratios"] = as_targets
    text = json.dumps(payload, indent=2)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    for row in result["quality"]:
        print(row["method"], f"model {row['model_ratio']:.2f}", f"{row['ppl']:.3f}", row["ppl_ci95"],
              {k: v["value"] for k, v in row.items() if k.startswith("minus_")})  # fmt: skip


if __name__ == "__main__":
    main()
