"""Whole-model compression (`--targets attn,mlp`, `--ratio-of model`): the default against SVD-LLM's uniform
ranks at several ratios, and the attention-only default against the former allocation, from ONE calibration
scored with the original in ONE pass over the same windows (paired differences).

`python -m benchmarks.whole_model [--ratios 0.1,0.2,0.3,0.4] [--model-ratio 0.2] [--split test] [--out F]`
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
DEFAULT, BASELINE = "masa-attn-mlp", "svd-llm-attn-mlp"
#: Attention only at the headline ratio: the default, the former default allocation, and no sharing.
ATTENTION = ("masa", "masa-relative", "sharing-none")
HEADLINE_RATIO = 0.2


def model_ratio_as_targets(model: str, ratio: float) -> float:
    """The attn+mlp ratio that removes `ratio` of the whole model's parameters (as `--ratio-of model` does)."""
    run = resolve_run(model, CompressOptions())
    config, _ = read_model_config(run.source)
    targets = ModelShape.from_config(config, target_projections("attn,mlp")).params_before
    return targets_ratio(ratio, "model", model_parameter_count(config), targets, "attn,mlp")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ratios", default="0.1,0.2,0.3,0.4")
    parser.add_argument("--model-ratio", type=float, default=0.2)
    parser.add_argument("--split", default="test")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    ratios = [float(r) for r in args.ratios.split(",")]
    as_targets = model_ratio_as_targets(MODEL, args.model_ratio)
    extra = {as_targets: [DEFAULT, BASELINE], HEADLINE_RATIO: list(ATTENTION)}
    variants = {name: VARIANTS[name] for name in (DEFAULT, BASELINE)}
    result = run_quality(MODEL, variants, ratios, progress=False, split=args.split, extra_variants=extra)
    scores = result["_scores"]
    for row in result["quality"]:
        this = variant_key(row["method"], row["ratio"])
        row["rise"] = compare(scores, this, "original")
        for partner in {DEFAULT: [BASELINE], ATTENTION[0]: ATTENTION[1:]}.get(row["method"], []):
            row[f"minus_{partner}"] = compare(scores, this, variant_key(partner, row["ratio"]))
    rows = {(r["method"], r["ratio"]): r for r in result["quality"]}
    for (method, ratio), row in rows.items():
        if method == DEFAULT:
            row["rise_ratio_vs_svd_llm"] = row["rise"]["value"] / rows[(BASELINE, ratio)]["rise"]["value"]
    payload = {k: v for k, v in result.items() if not k.startswith("_")}
    payload["command"] = "python -m benchmarks.whole_model " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    payload["model_ratio"] = {"requested": args.model_ratio, "as_targets_ratio": as_targets}
    text = json.dumps(payload, indent=2)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    for row in result["quality"]:
        print(row["method"], f"{row['ratio']:.4f}", f"{row['ppl']:.3f}", row["ppl_ci95"],
              row.get("rise_ratio_vs_svd_llm"), row.get(f"minus_{BASELINE}") or row.get(f"minus_{ATTENTION[1]}"))  # fmt: skip


if __name__ == "__main__":
    main()
