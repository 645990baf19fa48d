"""Issue 8's ablation: each candidate improvement over the paper-faithful MASA alone, and combinations,
at one ratio on the bundled model, with ONE calibration and ONE evaluation shared by every row.

    python -m benchmarks.ablation --out benchmarks/ablation.json
"""

from __future__ import annotations

import argparse
import json

from benchmarks.quality import run_quality

PAPER = {"method": "masa-paper", "groups": 3, "bases": 1, "atoms": "plain", "allocation": "paper",
         "singletons": "keep", "end_boundaries": True}  # fmt: skip

ABLATIONS: dict[str, dict] = {
    "svd-llm": {"method": "svd-llm"},
    "masa-paper": PAPER,
    "masa-paper, zero atoms": {**PAPER, "bases": 0},
    "+ whitened atoms": {**PAPER, "atoms": "whitened"},
    "+ global allocation": {**PAPER, "allocation": "global"},
    "+ global-relative allocation": {**PAPER, "allocation": "global-relative"},
    "+ singletons compressed": {**PAPER, "singletons": "compress"},
    "+ no end boundaries": {**PAPER, "end_boundaries": False},
    "+ one group (G=1)": {**PAPER, "groups": 1},
    "combination A": {**PAPER, "atoms": "whitened", "allocation": "global", "singletons": "compress"},
    "combination B": {
        **PAPER,
        "atoms": "whitened",
        "allocation": "global",
        "singletons": "compress",
        "groups": 1,
    },
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ratios", default="0.2")
    parser.add_argument("--only", help="comma-separated row names")
    parser.add_argument("--eval-max-tokens", type=int, default=20480)
    parser.add_argument("--out", default="benchmarks/ablation.json")
    args = parser.parse_args()
    variants = ABLATIONS if not args.only else {k: ABLATIONS[k] for k in args.only.split(";")}
    result = run_quality(
        "smollm2-135m",
        variants,
        [float(r) for r in args.ratios.split(",")],
        eval_max_tokens=args.eval_max_tokens,
        progress=False,
    )
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
