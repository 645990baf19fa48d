"""BENCHMARKS.md section 7, in bytes: llama.cpp's mixes with and without the tool's importance weights and
`export --size` at their sizes (`benchmarks/results/bytes-*.json`, `make bench-bytes`), and the byte budget's
error model checked on the validation split (`results/choices/byte-error-model-validation.json`)."""

from __future__ import annotations

import json

from benchmarks.report.plots import REPO

RESULTS = REPO / "benchmarks" / "results"


def reading(lo: float, hi: float, better: str, worse: str) -> str:
    """What a paired interval of ours − theirs says: `better` below 0, `worse` above, else a tie."""
    return better if hi < 0 else worse if lo > 0 else "tie"


#: What each model's packaged weights do to its frontier, said beside its figures.
CAVEATS = {
    "qwen2.5-coder-1.5b": "Its packaged weights are dequantized Q4_K_M values: the q4_k_m budget is the mix's home "
    "ground, the budgets below it are the test. Structure is not in these files (types only).",
    "smollm2-135m": "**Read with care:** the packaged weights are dequantized Q4_K/Q5_0 values, which Q4_1 and Q4_K "
    "store exactly, and the allocation finds that grid (its files are almost all Q4_1), while llama.cpp's mixes, "
    "on rows 576 wide, fall back to 32-value types that do not fit it. So this says what llama.cpp's fixed mixes "
    "lose on this model, not what `--size` gains on a model trained in 16 bits.",
}


def by_budget(data: dict) -> list[dict]:
    """The frontier's rows, largest budget first."""
    return sorted(data["frontier"], key=lambda row: -row["baseline_bytes"])


def frontier_table(data: dict) -> list[str]:
    """`export --size` against llama.cpp's mix of the same bytes, one row per budget (this page and the results
    page `bytes_frontier` writes)."""
    lines = [
        "| budget | llama.cpp's mix (with the importance weights) | `export --size` | ours − mix [95%] | reading |",
        "|---|---|---|---|---|",
    ]
    for row in by_budget(data):
        lines.append(
            f"| {row['type']} | {row['baseline_bytes'] / 2**20:.2f} MiB, {row['baseline_ppl']:.2f} | "
            f"{row['ours_bytes'] / 2**20:.2f} MiB, {row['ours_ppl']:.2f} | {row['diff']:+.3f} "
            f"[{row['diff_lo']:+.3f}, {row['diff_hi']:+.3f}] | "
            f"{reading(row['diff_lo'], row['diff_hi'], 'ours better', 'ours worse')} |"
        )
    return lines


def gain_table(data: dict) -> list[str]:
    """Each mix without minus with the importance weights, paired, largest file first."""
    size = {row["type"]: row["bytes"] for row in data["rows"] if row["imatrix"] == "calibration"}
    lines = ["| mix | without − with the importance weights [95%] | reading |", "|---|---|---|"]
    for mix, gain in sorted(data["imatrix_gain"].items(), key=lambda kv: -size[kv[0]]):
        lo, hi = gain["ci95"]
        lines.append(
            f"| {mix} | {gain['plain_minus_imatrix']:+.3f} [{lo:+.3f}, {hi:+.3f}] | "
            f"{reading(-hi, -lo, 'the weights help', 'the weights hurt')} |"
        )
    return lines


def _frontier(name: str, data: dict) -> list[str]:
    p = data["protocol"]
    return [
        f"**{data['model']}** (`{data['command']}`): every file run by llama.cpp on the first {p['tokens']:,} "
        f"predicted tokens of the test split ({p['windows']} windows of {p['seq_len']}), paired on the same "
        f"windows; the original at f16 scores {next(r['ppl'] for r in data['rows'] if r['type'] == 'f16'):.2f}. "
        f"Importance weights: {data['imatrix']}. {CAVEATS[data['model']]} Every file: "
        f"[{name}.md](benchmarks/results/{name}.md).",
        "",
        *frontier_table(data),
        "",
        *gain_table(data),
        "",
    ]


def _error_model() -> list[str]:
    path = RESULTS / "choices" / "byte-error-model-validation.json"
    if not path.is_file():
        return []
    data = json.loads(path.read_text())
    plans = "; ".join(
        f"{p['budget'] / 2**20:.1f} MiB: predicted {p['predicted']:.4f}, measured {p['measured']:.4f}"
        for p in data["plans"]
    )
    miss = max(data["singles"], key=lambda s: abs(s["predicted"] - s["measured"]))
    return [
        f"**The error model** (`{data['command']}`, validation split, {data['tokens']:,} tokens, in transformers "
        f"with the decoded matrices): over {len(data['singles'])} single changes (one matrix's type) the predicted "
        f"and measured rises of the loss have a rank correlation (Spearman) of only {data['spearman_singles']:.2f}; "
        f"measured over predicted, median {data['measured_over_predicted_median']:.2f}. The largest miss: "
        f"`{miss['matrix']}` in {miss['type']}, predicted {miss['predicted']:.4f}, measured {miss['measured']:.4f} "
        "nats. Whole plans (nats per token): "
        + plans
        + ". "
        + _predictors(data)
        + "Not yet an error model to trust: its fix is open.",
        "",
    ]


def _predictors(data: dict) -> str:
    """The alternatives to the importance statistic tried on the same single changes, where the run has them."""
    tried = data.get("predictors")
    if not tried:
        return ""
    named = "; ".join(f"{name} {fit['spearman']:.2f}" for name, fit in tried.items())
    return (
        "Two fixes tried on the same points (`benchmarks/experiments/byte_error_model/predictors.py`), Spearman: "
        f"{named}: neither the first position left out of the inputs' mean squares nor each token's gradient "
        "weighing its inputs ranks the changes better. Most single changes move the loss by less than its "
        "first-order noise on these tokens. "
    )


def bytes_section() -> list[str]:
    files = sorted(RESULTS.glob("bytes-*.json"))
    if not files:
        return []
    body = [line for path in files for line in _frontier(path.stem, json.loads(path.read_text()))]
    return [
        "## 7. In bytes: llama.cpp's mixes and `export --size`",
        "",
        "The original as GGUF files: llama.cpp's own mixes (`export --type`, `llama-quantize`'s type per tensor), "
        "each without and with the tool's importance weights (the imatrix, from the recipe's calibration), and "
        "`export --size` at the bytes of each mix with them: every matrix's type chosen by the loss-aware "
        "allocation, nothing removed. Diff: ours − the mix of the same bytes; an interval holding 0 is a tie.",
        "",
        *body,
        *_error_model(),
    ]
