"""Issue 8: the automatic choice of G and B (`--auto-groups`) validated against measured perplexity.

One calibration and one evaluation; the proxy of every feasible (G, B) comes from one `auto_groups` run, then
every candidate is built with fixed G and B and evaluated. Reports the rank correlation between proxy and
perplexity, and where the proxy's choice lands among the measured candidates.

    python -m benchmarks.shape_search --out benchmarks/shape-search.json     (~30 min alone on 2 cores)
    python -m benchmarks.shape_search --render benchmarks/shape-search.json
"""

from __future__ import annotations

import argparse
import json

from scipy.stats import spearmanr

from benchmarks.quality import measure_variant, prepare_quality, quality_header
from compressor.session import peak_rss_gb


def run(
    ratio: float, eval_max_tokens: int | None, calib_samples: int | None, seq_len: int | None, split: str
) -> dict:
    setup = prepare_quality(
        "smollm2-135m", calib_samples, seq_len, eval_max_tokens=eval_max_tokens, progress=False, split=split
    )
    auto = measure_variant(setup, "auto (proxy)", {"auto_groups": True}, ratio, progress=False)
    search = auto["report"]["shape_search"]
    print(f"auto: chose {search['chosen']} ppl {auto['ppl']:.3f}", flush=True)
    rows = []
    for candidate in search["candidates"]:
        fixed = {"groups": candidate["groups"], "bases": candidate["bases"], "largest_group_bases": None}
        row = measure_variant(setup, f"G={fixed['groups']}, B={fixed['bases']}", fixed, ratio, progress=False)
        row.pop("report")
        rows.append({**row, "proxy": candidate["proxy"], "G": fixed["groups"], "B": fixed["bases"]})
        print(f"{row['method']}: proxy {candidate['proxy']:.4f} ppl {row['ppl']:.3f}", flush=True)
    rho, p_value = spearmanr([r["proxy"] for r in rows], [r["ppl"] for r in rows])
    return {
        **quality_header(setup),
        "ratio": ratio,
        "auto": {k: v for k, v in auto.items() if k != "report"},
        "chosen": search["chosen"],
        "candidates": rows,
        "spearman": {"rho": float(rho), "p_value": float(p_value)},
        "peak_rss_gb": peak_rss_gb(),
    }


def render(result: dict) -> str:
    rows = sorted(result["candidates"], key=lambda r: r["proxy"])
    by_ppl = sorted(rows, key=lambda r: r["ppl"])
    chosen = result["chosen"]
    best = by_ppl[0]
    chosen_row = next(r for r in rows if (r["G"], r["B"]) == (chosen["groups"], chosen["bases"]))
    default = next((r for r in rows if (r["G"], r["B"]) == (3, 1)), None)
    lines = [
        f"Evaluation split: **{result['evaluation'].get('split', 'validation (its first 20,440 tokens, measured before the split existed)')}**. "
        f"Bundled SmolLM2-135M at ratio {result['ratio']}, calibration {result['calibration']['samples']}×"
        f"{result['calibration']['seq_len']} tokens, evaluation {result['evaluation']['tokens']:,} tokens; "
        f"original perplexity {result['original_ppl']:.3f}. Every feasible (G, B) with G ≤ 8 and B ≤ 2 "
        "(layouts that are the same once: with B = 0 only the singletons matter), sorted by the proxy.",
        "",
        "| G | B | groups | proxy (relative whitened error) | perplexity | rank by perplexity |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        groups = " ".join(f"[{g[0]}]" if len(g) == 1 else f"[{g[0]}–{g[-1]}]" for g in r["groups"])
        mark = " **(chosen)**" if r is chosen_row else ""
        lines.append(
            f"| {r['G']} | {r['B']} | {groups} | {r['proxy']:.4f}{mark} | {r['ppl']:.3f} | {by_ppl.index(r) + 1} |"
        )
    lines += [
        "",
        f"- Spearman rank correlation between proxy and perplexity: ρ = {result['spearman']['rho']:.3f} "
        f"(p = {result['spearman']['p_value']:.2g}, {len(rows)} candidates).",
        f"- The proxy chose G={chosen['groups']}, B={chosen['bases']}: perplexity {chosen_row['ppl']:.3f}, "
        f"rank {by_ppl.index(chosen_row) + 1} of {len(rows)}; the best measured is G={best['G']}, B={best['B']} "
        f"({best['ppl']:.3f})"
        + (f"; the recipe's fixed G=3, B=1 gives {default['ppl']:.3f}." if default else "."),
        f"- The search itself (the proxy of every candidate, inside the `--auto-groups` run) took "
        f"{result['auto']['stage_seconds']['shape_search']:.0f} s; the whole run "
        f"{result['auto']['compress_seconds']:.0f} s including {result['calibration_seconds']:.0f} s of "
        "calibration.",
    ]
    if result.get("note"):
        lines.append(f"- Note: {result['note']}")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ratio", type=float, default=0.2)
    parser.add_argument("--split", default="validation", help="evaluation split (choices: validation)")
    parser.add_argument("--eval-max-tokens", type=int, help="cap on evaluated tokens (default: all)")
    parser.add_argument("--calib-samples", type=int)
    parser.add_argument("--seq-len", type=int)
    parser.add_argument("--out", default="benchmarks/shape-search.json")
    parser.add_argument("--render", metavar="JSON", help="only print the markdown of this result file")
    args = parser.parse_args()
    if args.render:
        print(render(json.loads(open(args.render).read())), end="")
        return
    result = run(args.ratio, args.eval_max_tokens, args.calib_samples, args.seq_len, args.split)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(render(result), end="")


if __name__ == "__main__":
    main()
