"""Does `--speed mix` decode as fast as llama.cpp's mix of the same bytes, and what does it cost in quality? On the
VALIDATION split.

At each of `--types` (a llama.cpp mix): its importance-weighted mix, and `export --size` at its bytes with `--speed
any` (the allocation for loss alone, the default) and with `--speed mix` (held to the mix's predicted decode time,
`quantize/speed.py`). llama.cpp scores the three on the first `--max-tokens` validation tokens against the original
in transformers, paired on the same windows (95% interval; inside it, a tie), and times them in turns (1 and 2
threads, `--repeats` turns). Per `--size` file: its predicted and measured decode speed as a multiple of the mix's,
the measured ratio's 95% interval over the paired turns (1 thread), and its paired differences to the mix and (for
`mix`) to `any`: what the speed costs.

    python -m benchmarks.experiments.speed_limit.run --out benchmarks/results/choices/speed-limit-smollm2-135m-validation.json
"""

from __future__ import annotations

import argparse
import math
import tempfile
from pathlib import Path

import numpy as np
from scipy import stats

from benchmarks.engines.bytes_frontier import score_files
from benchmarks.experiments.only_types.run import compare, time_files, write_files
from benchmarks.suite.common import command_line, log, machine_info, write_json

MODEL = "smollm2-135m"
TYPES = "q8_0,q6_k,q5_k_m,q4_k_m,q3_k_m,q2_k"
#: Each `--size` file's `--speed`, and what it is compared with, paired on the same windows.
SPEEDS = {"any": {"speed": "any"}, "speed mix": {"speed": "mix"}}
PAIRED = {"any": ("mix",), "speed mix": ("mix", "any")}


def decode_ratio(ours: list[float], mix: list[float]) -> tuple[float, list[float]]:
    """Decode tokens/s of ours over the mix's: the geometric mean of the turns' ratios (each turn times both files
    back to back), with a 95% t interval over the turns."""
    logs = np.log(np.asarray(ours) / np.asarray(mix))
    half = stats.t.ppf(0.975, len(logs) - 1) * logs.std(ddof=1) / math.sqrt(len(logs))
    return float(np.exp(logs.mean())), [float(np.exp(logs.mean() - half)), float(np.exp(logs.mean() + half))]


def add_decode_ratios(rows: list[dict], speeds: dict) -> list[dict]:
    for row in rows:
        if row["kind"] != "mix":
            turns = speeds[(row["kind"], row["type"])]["decode_turns"]
            ratio, ci95 = decode_ratio(turns, speeds[("mix", row["type"])]["decode_turns"])
            row |= {"decode_ratio": ratio, "decode_ratio_ci95": ci95}
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--types", default=TYPES)
    parser.add_argument("--max-tokens", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    types = [t.strip() for t in args.types.split(",") if t.strip()]
    with tempfile.TemporaryDirectory(prefix="masa-speed-limit-") as work:
        files = write_files(args.model, types, SPEEDS, Path(work))
        paths = {f"{t}|{kind}": f["out"] for (t, kind), f in files.items()}
        reference, scored = score_files(args.model, paths, args.max_tokens, per_pass=3, split="validation")
        speeds = time_files(args.model, files, args.repeats)
    rows = add_decode_ratios(compare(files, reference, scored, speeds, PAIRED), speeds)
    held = [r for r in rows if r["kind"] == "speed mix"]
    write_json(args.out, {
        "command": command_line("benchmarks.experiments.speed_limit.run", argv), "model": args.model,
        "machine": machine_info(), "split": "validation", "tokens": reference.tokens, "repeats": args.repeats,
        "original_ppl": reference.ppl, "rows": rows,
        "held_not_slower": f"{sum(r['decode_ratio_ci95'][1] >= 1 for r in held)} of {len(held)}",
    })  # fmt: skip
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
