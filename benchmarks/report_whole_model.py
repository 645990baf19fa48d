"""The whole-model section of BENCHMARKS.md (`--targets attn,mlp`, `--ratio-of model`, the loss-aware allocation),
rendered from the committed runs in `benchmarks/whole-model/`, with its curve (perplexity vs model size in MiB)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from benchmarks.markdown import _ci, _difference, _link
from benchmarks.plots import REPO, _pyplot

FOLDER = "whole-model"
TEST_FILE = (
    "test.json"  # python -m benchmarks.whole_model --split test --out benchmarks/whole-model/test.json
)
VALIDATION_FILES = (
    "validation-relative-0.2.json",
    "validation-loss-0.2.json",
    "validation-attention-0.2.json",
)
DEFAULT, BASELINE = "masa-attn-mlp", "svd-llm-attn-mlp"
BYTES_PER_NUMBER = 4  # the bundled model's weights are float32


def _mib(params: int) -> float:
    return params * BYTES_PER_NUMBER / 2**20


def plot_curve(result: dict, path: Path) -> Path:
    """Perplexity against the model's size (MiB of float32 weights) for the default and SVD-LLM on attn+mlp."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for method, label, style in (
        (DEFAULT, "masa (default), attn+mlp", "o-"),
        (BASELINE, "svd-llm, attn+mlp", "s-"),
    ):
        rows = sorted(
            (r for r in result["quality"] if r["method"] == method), key=lambda r: r["model_params_after"]
        )
        ax.plot([_mib(r["model_params_after"]) for r in rows], [r["ppl"] for r in rows], style, label=label)
    ax.axhline(result["original_ppl"], color="black", linestyle="--", linewidth=1, label="original")
    ax.axvline(_mib(result["model_params_before"]), color="grey", linestyle=":", linewidth=1)
    ax.set_yscale("log")
    ax.set_xlabel("model size (MiB of float32 weights, embeddings included)")
    ax.set_ylabel("perplexity (log scale)")
    ax.set_title(f"Whole-model compression ({result['evaluation']['tokens']:,} tokens of the test split)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def whole_model_section(doc: Path) -> list[str]:
    folder = REPO / "benchmarks" / FOLDER
    test = folder / TEST_FILE
    if not test.is_file():
        return []
    result = json.loads(test.read_text())
    curve = plot_curve(result, folder / "curve.png")
    rows = {(r["method"], round(r["ratio"], 4)): r for r in result["quality"]}
    before = result["model_params_before"]
    model_ratio = round(result["model_ratio"]["as_targets_ratio"], 4)
    ratios = sorted({ratio for method, ratio in rows if method == DEFAULT})
    lines = [
        "## Whole-model compression: attention and MLP (`--targets attn,mlp`, `--ratio-of model`)",
        "",
        f"From `{result['command']}` ({_link(test, doc)}): one calibration ({result['calibration']['samples']}×"
        f"{result['calibration']['seq_len']} tokens, MLP inputs included; the loss sensitivity on its first 16 "
        f"windows), every model scored with the original in one pass over the {result['evaluation']['tokens']:,} "
        f"tokens of the **test** split (original {result['original_ppl']:.3f}{_ci(result['original_ppl_ci95'])}). "
        "The default allocation is `global-loss` (chosen on validation, below). Rise ratio: the default's "
        "perplexity rise over the original divided by SVD-LLM's at the same ratio. Difference: the default minus "
        f"SVD-LLM, paired over the same windows. Size: the whole model's float32 weights ({_mib(before):.1f} MiB "
        f"before). The row at {model_ratio:g} is `--ratio 0.2 --ratio-of model`: 20% of all the model's "
        "parameters, taken from the projections. Last column: the closed-loop check of the allocation's "
        "objective, `½ Σ s·‖(W − Ŵ)S‖²` per calibration token (a second-order, one-matrix-at-a-time estimate), "
        "against the measured `ln(ppl / original)`. The quality, headline, compression and latency sections "
        "above were measured before `global-loss` became the default (with `global-relative`).",
        "",
        f"![perplexity vs model size]({_rel(curve, doc)})",
        "",
        "| attn+mlp ratio | default: model MiB | default: perplexity | SVD-LLM: model MiB | SVD-LLM: perplexity | "
        "rise ratio | default − SVD-LLM | default's loss rise, predicted / measured (nats/token) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for ratio in ratios:
        mine, theirs = rows[(DEFAULT, ratio)], rows[(BASELINE, ratio)]
        label = f"{ratio:g}" + (" (= 0.2 of the model)" if ratio == model_ratio else "")
        lines.append(
            f"| {label} | {_mib(mine['model_params_after']):.1f} "
            f"({1 - mine['model_params_after'] / before:.1%} smaller) | {mine['ppl']:.3f}{_ci(mine['ppl_ci95'])} | "
            f"{_mib(theirs['model_params_after']):.1f} | {theirs['ppl']:.3f}{_ci(theirs['ppl_ci95'])} | "
            f"{mine['rise_ratio_vs_svd_llm']:.3f} | {_difference(mine.get(f'minus_{BASELINE}'))} | "
            f"{_loss_rise(mine, result)} |"
        )
    attention = [r for r in result["quality"] if r["method"] in ("masa", "masa-relative", "sharing-none")]
    if attention:
        default = next(r for r in attention if r["method"] == "masa")
        lines += [
            "",
            f"Attention only at {default['ratio']:g} (the headline), same calibration and windows:",
            "",
            "| variant | perplexity | the default minus this |",
            "|---|---|---|",
            *[
                f"| {_ATTENTION_LABELS[r['method']]} | {r['ppl']:.3f}{_ci(r['ppl_ci95'])} | "
                f"{_difference(default.get('minus_' + r['method']))} |"
                for r in attention
            ],
        ]
    lines += ["", *_validation_lines(folder, doc), ""]
    return lines


_ATTENTION_LABELS = {
    "masa": "default (`--sharing basis`, `global-loss`)",
    "masa-relative": "former default allocation (`global-relative`)",
    "sharing-none": "`--sharing none` (`global-loss`)",
}


def _loss_rise(row: dict, result: dict) -> str:
    """The allocation's second-order prediction of the loss rise, ½ Σ s·‖(W − Ŵ)S‖² over the calibration tokens
    (its objective, in the row's report), beside the measured ln(ppl / original ppl)."""
    objective = (row.get("report", {}).get("sharing") or {}).get("objective")
    if objective is None:
        return "—"
    tokens = result["calibration"]["samples"] * result["calibration"]["seq_len"]
    return f"{0.5 * objective / tokens:.3f} / {math.log(row['ppl'] / result['original_ppl']):.3f}"


def _validation_lines(folder: Path, doc: Path) -> list[str]:
    """The choice of the allocation, made on the validation split (ad-hoc variants, settings in each row)."""
    lines = [
        "### The allocation chosen on the validation split (ratio 0.2)",
        "",
        "Each file is one calibration and one scoring pass over the validation split; the variants' full "
        "settings are in their rows. Difference: the file's first row minus this one, paired.",
        "",
        "| file | variant | targets | sharing | allocation | perplexity | first row minus this |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in VALIDATION_FILES:
        path = folder / name
        if not path.is_file():
            continue
        result = json.loads(path.read_text())
        first = result["quality"][0]["method"]
        for r in result["quality"]:
            s = r["settings"]
            sharing = s["sharing"] if s["method"] == "masa" else "—"
            allocation = s["allocation"] if s["method"] == "masa" else "uniform"
            lines.append(
                f"| {_link(path, doc)} | `{r['method']}` ({s['method']}) | {s['targets']} | {sharing} | {allocation} | "
                f"{r['ppl']:.3f}{_ci(r['ppl_ci95'])} | {_difference(r.get(f'{first}_minus_this'))} |"
            )
    return lines


def _rel(path: Path, doc: Path) -> str:
    import os

    return Path(os.path.relpath(path, doc.parent)).as_posix()
