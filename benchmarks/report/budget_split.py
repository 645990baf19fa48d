"""BENCHMARKS.md section 6's budget split: where the whole model loses, and the levers on the budget between
attention and MLP measured against the default (`benchmarks.experiments.budget_split.run`; none adopted)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from benchmarks.report.markdown import difference, interval, link, paired_verdict

#: The budget-split runs, by the fraction of the model removed.
BUDGET_SPLIT = {0.2: "budget-split-validation-20.json", 0.3: "budget-split-validation-30.json"}
#: What each of its variants is, in a few words.
BUDGET_VARIANTS = {
    "attention-restored": "only the MLP compressed (every attention put back)",
    "mlp-restored": "only the attention compressed (every MLP put back)",
    "mlp-weight-0.7": "MLP units' loss sensitivity × 0.7 (more cut from the MLP)",
    "mlp-weight-1.5": "MLP units' loss sensitivity × 1.5 (more cut from the attention)",
    "mlp-weight-2.5": "MLP units' loss sensitivity × 2.5",
    "endpoint-0.5": "sensitivity blended half-way to the compressed model's",
    "endpoint-1": "sensitivity of the compressed model",
}


def budget_split_section(doc: Path, load: Callable[[str], tuple[Path, dict | None]]) -> list[str]:
    """Where the model 20% / 30% smaller loses, and the levers on the attention/MLP budget measured against it;
    `load(name)`: a choices file's path and contents (None where it is absent), as section 6 reads them."""
    runs = {ratio: load(name) for ratio, name in BUDGET_SPLIT.items()}
    runs = {ratio: found for ratio, found in runs.items() if found[1] is not None}
    if not runs:
        return []
    ratios = sorted(runs)
    links = ", ".join(link(path, doc) for path, _ in (runs[r] for r in ratios))
    rows_by = {r: {row["variant"]: row for row in runs[r][1]["rows"]} for r in ratios}
    first = runs[ratios[0]][1]
    lines = [
        "### Where the whole model loses, and the budget between attention and MLP (no lever adopted)",
        "",
        f"From {links}: the default's model {' and '.join(f'{r:.0%}' for r in ratios)} smaller, validation split "
        f"(first {first['tokens']:,} tokens), every model on the same windows, differences paired to the default. "
        "`mlp-weight-w` multiplies the loss sensitivity of every MLP unit by w before the one allocation (w > 1 "
        "moves the cut towards the attention); `endpoint-a` re-measures the loss sensitivity on the default's "
        "compressed model and uses `s · (s_compressed / s)^a`, then allocates and builds again.",
        "",
        "| variant | "
        + " | ".join(f"{r:.0%} smaller: perplexity | minus the default" for r in ratios)
        + " |",
        "|---|" + "---|---|" * len(ratios),
    ]
    lines.append(
        "| original | "
        + " | ".join(
            f"{runs[r][1]['original']['ppl']:.3f}{interval(runs[r][1]['original']['ppl_ci95'])} | —"
            for r in ratios
        )
        + " |"
    )
    for name in rows_by[ratios[0]]:
        cells = []
        for r in ratios:
            row = rows_by[r].get(name)
            cells.append(
                "— | —"
                if row is None
                else f"{row['ppl']:.3f}{interval(row['ppl_ci95'])} | {difference(row['minus_default'])}"
            )
        what = "the default" if name == "default" else f"`{name}`: {BUDGET_VARIANTS.get(name, name)}"
        lines.append(f"| {what} | " + " | ".join(cells) + " |")
    lines.append("")
    for r in ratios:
        data, rows = runs[r][1], rows_by[r]
        base = data["original"]["nll"]
        rise = rows["default"]["nll"] - base
        mlp_only = rows["attention-restored"]["nll"] - base
        attention_only = rows["mlp-restored"]["nll"] - base
        levers = {
            n: row["minus_default"] for n, row in rows.items() if n.startswith(("mlp-weight", "endpoint"))
        }
        best = min(levers, key=lambda n: levers[n]["value"])
        gain = -levers[best]["value"] / (rows["default"]["ppl"] - data["original"]["ppl"])
        lines.append(
            f"At {r:.0%} the default's loss rises by {rise:.3f} nats per token: {mlp_only:.3f} with only its MLP "
            f"compressed, {attention_only:.3f} with only its attention. The best lever, `{best}`, is "
            f"{paired_verdict(levers[best])}: {gain:.0%} of the default's perplexity rise."
        )
        lines.append("")
    files = [runs[r][1] for r in ratios]
    return [*lines, *_attention_drop_lines(files), *_bypass_lines(files)]


def _attention_drop_lines(files: list[dict]) -> list[str]:
    """The scan of one layer's attention replaced by its mean output, from the first file that has it."""
    found = next((f for f in files if "attention_drop" in f), None)
    if not found:
        return []
    drop, (first, end) = found["attention_drop"], found["drop_windows"]
    lines: list[str] = []
    order = sorted(range(len(drop["rise"])), key=lambda i: drop["rise"][i])
    cheapest = ", ".join(f"layer {i} +{drop['rise'][i]:.4f}" for i in order[:5])
    lines += [
        "One layer's attention replaced by its mean output (the original model otherwise, calibration windows "
        f"{first} to {end - 1}, which the sensitivity did not read; loss {drop['loss']:.3f}): the rise per layer ranges from "
        f"{min(drop['rise']):.4f} to {max(drop['rise']):.4f} nats; the cheapest: {cheapest} "
        f"(each of {drop['attention_params'][order[0]]:,} numbers).",
        "",
    ]
    return lines


def _bypass_lines(files: list[dict]) -> list[str]:
    """The linear path beside a narrowed MLP against more neurons, from the first file that has it."""
    found = next((f for f in files if "bypass" in f), None)
    if not found:
        return []
    bypass = found["bypass"]
    lines: list[str] = []
    ranks = [entry["rank"] for entry in bypass[0]["ranks"]]
    lines += [
        "A linear path beside a narrowed MLP (the closed-form part of refitting more than down_proj): the relative "
        "output error of the greedy neurons with down_proj refit, and with a rank-r map of the MLP's input fitted "
        "to what they leave, against as many more neurons as the same numbers keep (first "
        f"{found['bypass_windows']} calibration windows, in-sample for both).",
        "",
        "| layer | kept | neurons | " + " | ".join(f"rank {k}: path / more neurons" for k in ranks) + " |",
        "|---|---|---|" + "---|" * len(ranks),
    ]
    for row in bypass:
        cells = " | ".join(
            f"{e['with_linear_path']:.4f} / {e['with_more_neurons']:.4f} (+{e['same_numbers_as_neurons']})"
            for e in row["ranks"]
        )
        lines.append(f"| {row['layer']} | {row['keep']:.0%} | {row['neurons']:.4f} | {cells} |")
    lines.append("")
    return lines
