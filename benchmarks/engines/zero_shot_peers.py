"""Zero-shot accuracy of the model 10/20/30% smaller, the default beside its peers, as a user would run it: each
model compressed by `masa-compress compress` (no evaluation), written as a checkpoint, then scored by
`masa-compress eval CHECKPOINT --tasks zero-shot` (lm-evaluation-harness loading the checkpoint with its remote
code), with the original scored the same way. An item cap per task keeps it to minutes on 2 cores (stated in the
file).

`python -m benchmarks.engines.zero_shot_peers [--model-ratio 0.2] [--limit 100] [--batch-size 16] [--out F]`

The model 20% smaller writes `benchmarks/results/zero-shot-peers.json` (items under `zero-shot-items/`); another
ratio `zero-shot-peers-30.json` (items under `zero-shot-items/30/`). Every run, the 20% one re-run included, reads
the original's row and items from the 20% run's file when that scored the same items (same `--limit` and batch
size; the row keeps the date it was scored): the original is not compressed, so it scores the same; otherwise it
scores it again. Each compressed row records the calibration windows its run took.

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

from benchmarks.suite.common import command_line, log, write_json
from compressor.evaluation.zero_shot import paired_suite_difference, read_items, suite_mean

MODEL = "smollm2-135m"
DEFAULT = "masa-attn-mlp"
ITEMS = Path("benchmarks/results/zero-shot-items")
RESULTS = Path("benchmarks/results/zero-shot-peers.json")
#: The ratio whose files have the plain names (the others carry their percent)
MAIN_RATIO = 0.2
CLI = [sys.executable, "-m", "compressor"]
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


def ratio_paths(model_ratio: float) -> tuple[Path, Path]:
    """The results file and the per-item folder of `model_ratio`."""
    if model_ratio == MAIN_RATIO:
        return RESULTS, ITEMS
    percent = f"{100 * model_ratio:g}"
    return RESULTS.with_name(f"zero-shot-peers-{percent}.json"), ITEMS / percent


def reused_original(limit: int, batch_size: int) -> dict | None:
    """The original's row from the main ratio's results when it scored `limit` items per task in batches of
    `batch_size` (and its per-item file is there): the same model on the same items. It keeps the date it was
    scored on (`scored_on`), carried over however many runs reuse it."""
    if not RESULTS.is_file() or not (ITEMS / "original.jsonl").is_file():
        return None
    found = json.loads(RESULTS.read_text())
    if found["limit_per_task"] != limit or found["batch_size"] != batch_size:
        return None
    row = found["rows"]["original"]
    return {**row, "reused_from": str(RESULTS), "scored_on": row.get("scored_on", found["date"])}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-ratio", type=float, default=MAIN_RATIO)
    parser.add_argument("--limit", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--out", help="default: zero-shot-peers.json, or with the ratio's percent")
    args = parser.parse_args(argv)
    out, items_folder = ratio_paths(args.model_ratio)
    out = Path(args.out) if args.out else out
    whole_model = ["--targets", "attn,mlp", "--ratio", f"{args.model_ratio:g}", "--ratio-of", "model"]
    rows, item_files = {}, {}
    items_folder.mkdir(parents=True, exist_ok=True)
    original = reused_original(args.limit, args.batch_size)
    if original is not None:
        rows["original"], item_files["original"] = original, ITEMS / "original.jsonl"
        log(f"original: the {original['reused_from']} row (scored {original['scored_on']}), same items")
    with tempfile.TemporaryDirectory(prefix="zero-shot-peers-") as folder:
        for name, options in MODELS.items():
            if name in rows:
                continue
            path, compress_seconds, windows = MODEL, None, None
            item_files[name] = items_folder / f"{name}.jsonl"
            if options is not None:
                path = str(Path(folder) / name)
                start = time.perf_counter()
                compressed = _run_json(
                    [*CLI, "compress", MODEL, *whole_model, *options, "--no-eval", "--out", path, "--json"]
                )
                compress_seconds = time.perf_counter() - start
                windows = compressed["settings"]["calibration"]["samples"]
                log(f"{name}: compressed on {windows} windows, achieved {compressed.get('achieved_ratio')}")
            start = time.perf_counter()
            scored = _run_json(
                [*CLI, "eval", path, "--tasks", "zero-shot", "--limit", str(args.limit),
                 "--batch-size", str(args.batch_size), "--items", str(item_files[name]), "--json"]
            )  # fmt: skip
            mean, ci95 = suite_mean_interval(scored["tasks"])
            rows[name] = {
                "options": options,
                "tasks": scored["tasks"],
                "mean": mean,
                "mean_ci95": ci95,
                "eval_seconds": time.perf_counter() - start,
                "compress_seconds": compress_seconds,
                "calibration_windows": windows,
            }
            log(f"{name}: mean {mean:.4f} [{ci95[0]:.4f}, {ci95[1]:.4f}]")
    items = {name: read_items(item_files[name]) for name in rows}
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
        "what": f"zero-shot accuracy of the model {args.model_ratio:.0%} smaller ({' '.join(whole_model)})",
        "model_ratio": args.model_ratio,
        "command": command_line("benchmarks.engines.zero_shot_peers", argv),
        "model": MODEL,
        "limit_per_task": args.limit,
        "batch_size": args.batch_size,
        "date": time.strftime("%Y-%m-%d"),
        "rows": rows,
    }
    write_json(out, payload)
    print(json.dumps({n: [r["mean"], r["mean_ci95"]] for n, r in rows.items()}))


if __name__ == "__main__":
    main()
