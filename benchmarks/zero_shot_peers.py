"""Zero-shot accuracy of the model 20% smaller, the default beside its peers, as a user would run it: each model
compressed by `masa-compress compress` (no evaluation), written as a checkpoint, then scored by `masa-compress eval
CHECKPOINT --tasks zero-shot` (lm-evaluation-harness loading the checkpoint with its remote code), with the
original scored the same way. An item cap per task keeps it to minutes on 2 cores (stated in the file).

`python -m benchmarks.zero_shot_peers [--limit 100] [--batch-size 16] [--out benchmarks/results/zero-shot-peers.json]`

Intervals: each accuracy's 95% Wilson interval over its items; every model's per-item scores (`eval --items`,
kept under `benchmarks/results/zero-shot-items/`) give the differences of suite means paired on the same items
(`zero_shot.paired_suite_difference`): each model minus the original, and the default minus each other model,
with and without BoolQ.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import log
from compressor.evaluation.zero_shot import paired_suite_difference, read_items, suite_mean

MODEL = "smollm2-135m"
DEFAULT = "masa-attn-mlp"
ITEMS = Path("benchmarks/results/zero-shot-items")
CLI = [sys.executable, "-m", "compressor"]
WHOLE_MODEL = ["--targets", "attn,mlp", "--ratio", "0.2", "--ratio-of", "model"]
#: name -> the compress options after the model's (None: the original, not compressed)
MODELS = {
    "original": None,
    "masa-attn-mlp": [],
    "masa-attn-mlp-uniform": ["--uniform-mlp"],
    "flap-attn-mlp": ["--method", "flap"],
    "modegpt-attn-mlp": ["--method", "modegpt"],
    "svd-llm-attn-mlp": ["--method", "svd-llm"],
}


def _run_json(args: list[str]) -> dict:
    done = subprocess.run(args, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(args[2:])} failed: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout)


def suite_mean_interval(tasks: dict) -> tuple[float, list[float]]:
    """The suite mean (`zero_shot.suite_mean`: `acc_norm` where a task has it, else `acc`) and its 95% interval
    from the tasks' binomial variances (the tasks are independent item sets: the variance of a mean of k shares
    is the sum of theirs over k²)."""
    mean = suite_mean(tasks)
    shares = [(metrics.get("acc_norm", metrics["acc"]), metrics["items"]) for metrics in tasks.values()]
    half = 1.96 * math.sqrt(sum(p * (1 - p) / n for p, n in shares)) / len(shares)
    return mean, [mean - half, mean + half]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--out", default="benchmarks/results/zero-shot-peers.json")
    args = parser.parse_args(argv)
    rows = {}
    ITEMS.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="zero-shot-peers-") as folder:
        for name, options in MODELS.items():
            path, compress_seconds = MODEL, None
            if options is not None:
                path = str(Path(folder) / name)
                start = time.perf_counter()
                compressed = _run_json(
                    [*CLI, "compress", MODEL, *WHOLE_MODEL, *options, "--no-eval", "--out", path, "--json"]
                )
                compress_seconds = time.perf_counter() - start
                log(f"{name}: compressed, achieved {compressed.get('achieved_ratio')}")
            start = time.perf_counter()
            scored = _run_json(
                [*CLI, "eval", path, "--tasks", "zero-shot", "--limit", str(args.limit),
                 "--batch-size", str(args.batch_size), "--items", str(ITEMS / f"{name}.jsonl"), "--json"]
            )  # fmt: skip
            mean, ci95 = suite_mean_interval(scored["tasks"])
            rows[name] = {
                "options": options,
                "tasks": scored["tasks"],
                "mean": mean,
                "mean_ci95": ci95,
                "eval_seconds": time.perf_counter() - start,
                "compress_seconds": compress_seconds,
            }
            log(f"{name}: mean {mean:.4f} [{ci95[0]:.4f}, {ci95[1]:.4f}]")
    items = {name: read_items(ITEMS / f"{name}.jsonl") for name in rows}
    without_boolq = {name: {t: v for t, v in found.items() if t != "boolq"} for name, found in items.items()}
    for name, row in rows.items():
        row["mean_drop"] = rows["original"]["mean"] - row["mean"]
        if name == "original":
            continue
        row["paired_minus_original"] = paired_suite_difference(items[name], items["original"])
        row["paired_minus_original_without_boolq"] = paired_suite_difference(
            without_boolq[name], without_boolq["original"]
        )
        if name != DEFAULT:
            row["default_minus_this"] = paired_suite_difference(items[DEFAULT], items[name])
            row["default_minus_this_without_boolq"] = paired_suite_difference(
                without_boolq[DEFAULT], without_boolq[name]
            )
    payload = {
        "what": "zero-shot accuracy of the model 20% smaller (--targets attn,mlp --ratio 0.2 --ratio-of model)",
        "command": "python -m benchmarks.zero_shot_peers " + " ".join(argv or sys.argv[1:]),
        "model": MODEL,
        "limit_per_task": args.limit,
        "batch_size": args.batch_size,
        "date": time.strftime("%Y-%m-%d"),
        "rows": rows,
    }
    Path(args.out).write_text(json.dumps(payload, indent=2) + "\n")
    print(json.dumps({n: [r["mean"], r["mean_ci95"]] for n, r in rows.items()}))


if __name__ == "__main__":
    main()
