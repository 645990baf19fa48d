"""BENCHMARKS.md's zero-shot tables: each model's accuracy per task, the mean, and the paired differences."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.report.plots import REPO, label
from compressor.evaluation.zero_shot import suite_mean

ZERO_SHOT_FILE = "benchmarks/results/zero-shot-peers.json"
ZERO_SHOT_COLUMNS = {"arc_easy": "ARC-e", "arc_challenge": "ARC-c", "hellaswag": "HellaSwag", "piqa": "PIQA",
                     "winogrande": "WinoGr.", "boolq": "BoolQ", "lambada_openai": "LAMBADA"}  # fmt: skip


def zero_shot_lines(path: Path | None = None) -> list[str]:
    """The model 20% smaller on the zero-shot suite (`python -m benchmarks.engines.zero_shot_peers`, one file per
    ratio): the 20% file (`path`) with how it was measured, then the other ratios' files beside it."""
    main = path or REPO / ZERO_SHOT_FILE
    if not main.is_file():
        return []
    z = json.loads(main.read_text())
    lines = [
        f"Zero-shot accuracy of the model 20% smaller ({ZERO_SHOT_FILE}, {z['date']}: each model compressed by "
        "`masa-compress compress`, its checkpoint scored by `masa-compress eval CHECKPOINT --tasks zero-shot`, "
        f"lm-evaluation-harness's tasks, the first {z['limit_per_task']} items of each; `acc_norm` where the "
        "task has it, else `acc`; ARC and the others on their validation splits, LAMBADA on its test set). "
        "Intervals: 95% Wilson per task, and for the mean from the tasks' binomial variances. The differences "
        "are paired on the same items (each model's per-item scores, `eval --items`; ±1.96 standard errors of the "
        "mean per-item difference per task, over the tasks' mean): a difference whose interval holds 0 is a tie. "
        "At this model's scale BoolQ measures a yes/no bias more than reading (its validation split is 62% yes: a "
        "model answering one way throughout scores that share or the rest), and compression moves that bias, so "
        "the mean and the differences are also given without it." + _zero_shot_provenance(z),
        "",
        *_zero_shot_table(z),
    ]
    for other in sorted(main.parent.glob("zero-shot-peers-*.json")):
        z = json.loads(other.read_text())
        lines += [
            f"The model {z['model_ratio']:.0%} smaller, measured the same way (benchmarks/results/{other.name}, "
            f"{z['date']}, the first {z['limit_per_task']} items of each task)." + _zero_shot_provenance(z),
            "",
            *_zero_shot_table(z),
        ]
    return lines


def _zero_shot_provenance(z: dict) -> str:
    """What a zero-shot file's rows were built from: the compressed models' calibration windows, where the file
    records them, and where the original's row came from."""
    counts = sorted(
        {row["calibration_windows"] for row in z["rows"].values() if row.get("calibration_windows")}
    )
    parts = [f"every compressed model calibrated on {' or '.join(map(str, counts))} windows of 512 tokens"]
    parts = parts if counts else []
    original = z["rows"]["original"]
    if original.get("reused_from"):
        when = f"those scored on {original['scored_on']}" if original.get("scored_on") else "the 20% run's"
        parts.append(f"the original's row and items are {when}: the same model on the same items")
    text = "; ".join(parts)
    return f" {text[:1].upper()}{text[1:]}." if text else ""


def _zero_shot_table(z: dict) -> list[str]:
    """One zero-shot results file as a table: per model the tasks, the mean and the paired differences."""
    lines = [
        "| variant | "
        + " | ".join(ZERO_SHOT_COLUMNS.values())
        + " | mean [95% CI] | − original's, paired | default − this, paired | mean without BoolQ | "
        "without BoolQ: − original's | without BoolQ: default − this |",
        "|---|" + "---|" * (len(ZERO_SHOT_COLUMNS) + 6),
    ]

    def paired(row: dict, key: str) -> str:
        found = row.get(key)
        if not found:
            return "—"
        low, high = found["ci95"]
        return f"{100 * found['value']:+.1f} pt [{100 * low:+.1f}, {100 * high:+.1f}]" + (
            " tie" if found["tie"] else ""
        )

    for name, row in z["rows"].items():
        cells = [row["tasks"][t].get("acc_norm", row["tasks"][t]["acc"]) for t in ZERO_SHOT_COLUMNS]
        lines.append(
            f"| {'original' if name == 'original' else label(name)} | "
            + " | ".join(f"{c:.1%}" for c in cells)
            + f" | {row['mean']:.1%} [{row['mean_ci95'][0]:.1%}, {row['mean_ci95'][1]:.1%}] | "
            + f"{paired(row, 'paired_minus_original')} | {paired(row, 'default_minus_this')} | "
            + f"{suite_mean({t: m for t, m in row['tasks'].items() if t != 'boolq'}):.1%} | "
            + f"{paired(row, 'paired_minus_original_without_boolq')} | "
            + f"{paired(row, 'default_minus_this_without_boolq')} |"
        )
    return [*lines, ""]
