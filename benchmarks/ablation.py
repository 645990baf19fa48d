"""Issue 8's ablation: each candidate improvement over the paper-faithful MASA alone, and combinations,
at one ratio on the bundled model, with ONE calibration and ONE evaluation shared by every row.

    python -m benchmarks.ablation --out benchmarks/ablation.json
"""

from __future__ import annotations

import argparse
import json

from benchmarks.quality import compare, run_quality, strip_windows, variant_key

# The paper-faithful settings spelled out under method `masa`, so that each row can change one of them
# (`--method masa-paper` pins them all).
PAPER = {"method": "masa", "sharing": "atoms", "groups": 3, "bases": 1, "atoms": "plain", "allocation": "paper",
         "singletons": "keep", "end_boundaries": True, "statistics": "original",
         "dense_when_cheaper": False}  # fmt: skip

ABLATIONS: dict[str, dict] = {
    "svd-llm": {"method": "svd-llm"},
    "masa-paper": {**PAPER, "method": "masa-paper"},
    "masa-paper, zero atoms": {**PAPER, "bases": 0},
    "+ whitened atoms": {**PAPER, "atoms": "whitened"},
    "+ global allocation": {**PAPER, "allocation": "global"},
    "+ global-relative allocation": {**PAPER, "allocation": "global-relative"},
    "+ singletons compressed": {**PAPER, "singletons": "compress"},
    "+ no end boundaries": {**PAPER, "end_boundaries": False},
    "+ one group (G=1)": {**PAPER, "groups": 1},
    "+ sequential statistics": {**PAPER, "statistics": "sequential"},
    "whitened atoms + global + singletons compressed": {
        **PAPER,
        "atoms": "whitened",
        "allocation": "global",
        "singletons": "compress",
    },
    "whitened atoms + global + singletons compressed + G=1": {
        **PAPER,
        "atoms": "whitened",
        "allocation": "global",
        "singletons": "compress",
        "groups": 1,
    },
    "global-relative, zero atoms": {**PAPER, "allocation": "global-relative", "bases": 0},
    "global-relative + whitened atoms": {**PAPER, "allocation": "global-relative", "atoms": "whitened"},
    "global-relative + singletons compressed": {
        **PAPER,
        "allocation": "global-relative",
        "singletons": "compress",
    },
    "global-relative + sequential": {**PAPER, "allocation": "global-relative", "statistics": "sequential"},
    "global-relative + whitened + sequential": {
        **PAPER,
        "allocation": "global-relative",
        "atoms": "whitened",
        "statistics": "sequential",
    },
    # The default recipe (`masa`: global-relative allocation) and the baseline, for calibration-size sweeps.
    "global-relative + dense when cheaper": {
        **PAPER,
        "allocation": "global-relative",
        "dense_when_cheaper": True,
    },
    "global-relative + dense when cheaper, zero atoms": {
        **PAPER,
        "allocation": "global-relative",
        "dense_when_cheaper": True,
        "bases": 0,
    },
    # The default this ablation was run for (`--sharing atoms`, before `basis` became the default):
    # global-relative + dense when cheaper + singletons compressed (the rest as the paper).
    "masa (default)": {"method": "masa", "sharing": "atoms"},
    "masa (default), zero atoms": {"method": "masa", "sharing": "atoms", "bases": 0},
    "auto G and B (proxy)": {"method": "masa", "sharing": "atoms", "auto_groups": True},
    # `--targets attn,mlp`: the ratio then counts every linear projection of the layers; the reference is
    # SVD-LLM on the same targets.
    "svd-llm, attn+mlp": {"method": "svd-llm", "targets": "attn,mlp"},
    "masa (default), attn+mlp": {"method": "masa", "sharing": "atoms", "targets": "attn,mlp"},
    "masa (default), attn+mlp, zero atoms": {
        "method": "masa",
        "sharing": "atoms",
        "targets": "attn,mlp",
        "bases": 0,
    },
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ratios", default="0.2")
    parser.add_argument("--only", help="semicolon-separated row names")
    parser.add_argument(
        "--split", default="validation", help="evaluation split: validation (default: choices) or test"
    )
    parser.add_argument("--eval-max-tokens", type=int, help="cap on evaluated tokens (default: all)")
    parser.add_argument("--calib-samples", type=int, help="calibration windows (recipe: 64)")
    parser.add_argument("--seq-len", type=int, help="calibration window length (recipe: 512)")
    parser.add_argument("--out", default="benchmarks/ablation.json")
    parser.add_argument(
        "--render", nargs="+", metavar="JSON", help="only print the markdown table of these files"
    )
    args = parser.parse_args()
    if args.render:
        print(render([json.loads(open(path).read()) for path in args.render]), end="")
        return
    variants = ABLATIONS if not args.only else {k: ABLATIONS[k] for k in args.only.split(";")}
    result = run_quality(
        "smollm2-135m",
        variants,
        [float(r) for r in args.ratios.split(",")],
        calib_samples=args.calib_samples,
        seq_len=args.seq_len,
        eval_max_tokens=args.eval_max_tokens,
        progress=False,
        split=args.split,
    )
    add_differences(result)
    result["scores"] = strip_windows(result["_scores"])
    with open(args.out, "w") as f:
        json.dump({k: v for k, v in result.items() if not k.startswith("_")}, f, indent=2)


def add_differences(result: dict) -> None:
    """Per row, the paired-bootstrap difference to the default and to SVD-LLM at the same ratio and targets."""
    scores, rows = result["_scores"], result["quality"]

    def reference(row: dict, method: str, targets: str) -> dict | None:
        return next(
            (
                r
                for r in rows
                if r["ratio"] == row["ratio"] and r["method"] == method and _targets(r) == targets
            ),
            None,
        )

    for row in rows:
        key = variant_key(row["method"], row["ratio"])
        svd_llm = next(
            (r for r in rows if r["ratio"] == row["ratio"] and r["settings"].get("method") == "svd-llm"
             and _targets(r) == _targets(row)),
            None,
        )  # fmt: skip
        for label, ref in (("vs_default", reference(row, "masa (default)", "attn")), ("vs_svd_llm", svd_llm)):
            if ref is not None and ref is not row:
                row[label] = compare(scores, key, variant_key(ref["method"], ref["ratio"]))


def render(results: list[dict]) -> str:
    """Markdown table of one or more ablation result files that share calibration and evaluation."""
    base = results[0]
    for other in results[1:]:
        same = (other["calibration"], other["evaluation"]["tokens"], other["original_ppl"])
        if same != (base["calibration"], base["evaluation"]["tokens"], base["original_ppl"]):
            raise ValueError("ablation files with different calibration or evaluation cannot share a table")
    rows = [row for result in results for row in result["quality"]]
    original = base["original_ppl"]
    # The reference of a row: SVD-LLM at the same ratio on the same targets (attention unless stated).
    svd_llm = {(r["ratio"], _targets(r)): r["ppl"] for r in rows if r["settings"].get("method") == "svd-llm"}
    split = base["evaluation"].get(
        "split", "validation (its first 20,440 tokens, measured before the split existed)"
    )
    lines = [
        f"Evaluation split: **{split}**. "
        f"Bundled SmolLM2-135M, calibration {base['calibration']['samples']}×{base['calibration']['seq_len']} "
        f"tokens of {base['calibration']['text']}, evaluation {base['evaluation']['tokens']:,} tokens of "
        f"{base['evaluation']['text']} in {base['evaluation']['seq_len']}-token windows; original perplexity "
        f"{original:.3f}. Rise ratio = (ppl − original) / (SVD-LLM's ppl − original) at the same ratio.",
        "",
        "| configuration | ratio | achieved | perplexity [95% CI] | rise ratio vs SVD-LLM | "
        "Δ ppl vs default [95% CI] | KL from original | compression time (s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        reference = svd_llm.get((r["ratio"], _targets(r)))
        rise = "—" if reference is None else f"{(r['ppl'] - original) / (reference - original):.3f}"
        ci = r.get("ppl_ci95")
        ppl = f"{r['ppl']:.3f}" + (f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else "")
        lines.append(
            f"| {r['method']} | {r['ratio']:.2f} | {r['achieved_ratio']:.4f} | {ppl} | {rise} | "
            f"{format_difference(r.get('vs_default'))} | "
            + ("—" if r.get("kl_to_original") is None else f"{r['kl_to_original']:.4f}")
            + " | "
            + ("— |" if r.get("compress_seconds") is None else f"{r['compress_seconds']:.0f} |")
        )
    return "\n".join(lines) + "\n"


def format_difference(diff: dict | None) -> str:
    """`+0.123 [0.05, 0.20]`, with "tie" where the interval contains 0; "—" where there is none."""
    if diff is None:
        return "—"
    lo, hi = diff["ci95"]
    return f"{diff['value']:+.3f} [{lo:+.3f}, {hi:+.3f}]" + (" tie" if diff["tie"] else "")


def _targets(row: dict) -> str:
    return row["settings"].get("targets", "attn")


if __name__ == "__main__":
    main()
