"""`plan`'s time against the runs' (`benchmarks/results/choices/plan-time.json`, written by
`benchmarks/experiments/plan_time/run.py`): per model, each stage's estimate beside what the run took."""

from __future__ import annotations

import json

from benchmarks.report.plots import REPO

PLAN_TIME = REPO / "benchmarks" / "results" / "choices" / "plan-time.json"
#: How close `plan`'s total must come to the run's (issue "What a run costs": within 1.5x either way).
WITHIN = 1.5


def plan_time_section() -> list[str]:
    if not PLAN_TIME.is_file():
        return []
    data = json.loads(PLAN_TIME.read_text())
    lines = [
        "## How long `plan` says a run takes, against the run",
        "",
        "`plan` prices each stage from the model's shapes, the run's settings and three rates measured once on this "
        "machine (matrix products, autocorrelations, fp64 factorizations), times a factor per stage "
        "(`compressor/api/time_estimate.py`), fitted on the bundled model's run below (its plan is the one made "
        "before the fit, every factor 1) and, for the neuron orders, on one MLP of the 1.5B model's widths timed "
        "alone; each run alone on the machine, its statistics measured afresh (a cache of its own). The total is "
        f"the run's whole time, the stages `plan` does not price included; held to within {WITHIN:g}x either way. "
        "A `--size` run's rows (`plan --size`, `compressor/api/size_time.py`) price its importance pass, its "
        "structure's `compress` run, the export (ggml's rounding at its rate per type, measured once here too) and "
        "the file's scoring in llama.cpp, with factors of their own fitted on the first such row.",
        "",
        "| model, run | stage: measured / planned (s) | total measured / planned | verdict |",
        "|---|---|---|---|",
    ]
    for run in data["runs"]:
        stages = ", ".join(f"{stage.replace('_', ' ')} {v['measured']:.0f} / {v['planned']:.0f}"
                           for stage, v in run["stages"].items())  # fmt: skip
        unpriced = sum(run.get("unpriced", {}).values())
        stages += f"; not priced {unpriced:.0f}" if unpriced >= 0.5 else ""
        ratio = run["total_ratio"]
        verdict = "met" if 1 / WITHIN <= ratio <= WITHIN else "**missed**"
        fitted = " (the factors' fit, planned before it)" if run.get("fitted_factors") else ""
        ratios = {
            stage: v["ratio"] for stage, v in run["stages"].items() if v["ratio"] and v["measured"] >= 30
        }
        if ratios and not fitted:  # the stage of most seconds whose estimate is the furthest off (either way)
            stage = max(ratios, key=lambda k: max(ratios[k], 1 / ratios[k]))
            verdict += f"; furthest stage of 30 s or more: {stage.replace('_', ' ')}, {ratios[stage]:.2f}x"
        verdict = "the fit (not a check)" if fitted else verdict
        lines.append(
            f"| {run['model']} `{run['args']}`{fitted} | {stages} | {run['measured_total']:.0f} / "
            f"{run['planned_total']:.0f} s ({ratio:.2f}x) | {verdict} |"
        )
    orders = data.get("neuron_orders")
    if orders:
        lines += [
            "",
            f"One MLP {orders['width']} wide ({orders['hidden']} hidden) timed alone: the block greedy's order "
            f"{orders['order_s']:.1f} s ({orders['greedy-block']:.2f}x its arithmetic), its errors' Cholesky "
            f"{orders['tail_s']:.1f} s ({orders['tail']:.2f}x).",
        ]
    decode = data.get("decode_cost")
    if decode:
        ratio = decode["ratio"]
        verdict = "within" if 1 / WITHIN <= ratio <= WITHIN else "**not within**"
        lines += [
            "",
            f"`--speed mix`'s first measurement of llama.cpp's decode costs ({decode['model']}, `--size "
            f"{decode['size']}`: {len(decode['types'])} types on a cache of its own) took {decode['measured_s']:.0f} s; "
            f"`plan` priced it at {decode['planned_s']:.0f} s ({ratio:.2f}x, {verdict} {WITHIN:g}x), from one probe "
            "it times once on this CPU (a few seconds).",
        ]
    return [*lines, ""]
