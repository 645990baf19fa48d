"""`--speed mix` against `--speed any` and llama.cpp's mix of the same bytes (`benchmarks/experiments/speed_limit`):
BENCHMARKS.md section 7's table and the README's line, from `benchmarks/results/choices/speed-limit-*.json`."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.report.markdown import paired_reading
from benchmarks.report.plots import REPO

CHOICES = REPO / "benchmarks" / "results" / "choices"


def _runs(choices: Path) -> list[dict]:
    return [json.loads(path.read_text()) for path in sorted(choices.glob("speed-limit-*-validation.json"))]


def _decode(row: dict) -> str:
    """Measured decode over the mix's: 1 thread with its interval over the paired turns, then 2 threads."""
    low, high = row["decode_ratio_ci95"]
    return f"{row['decode_ratio']:.2f}x [{low:.2f}, {high:.2f}] · {row['decode_vs_mix_2t']:.2f}x"


def _predicted(row: dict) -> str:
    speed = row.get("speed")
    if not speed or not speed.get("mix_tokens_per_second"):
        return ""
    return f"{speed['predicted_tokens_per_second'] / speed['mix_tokens_per_second']:.2f}x (to {speed['mix']})"


def speed_limit_lines(choices: Path = CHOICES) -> list[str]:
    lines = []
    for data in _runs(choices):
        held = [r for r in data["rows"] if r["kind"] == "speed mix"]
        lines += [
            f"**`--speed mix`** (`{data['command']}`, {data['model']}, validation split, {data['tokens']:,} tokens, "
            f"llama.cpp; the original {data['original_ppl']:.2f} in transformers): at the bytes of llama.cpp's mix "
            "with the importance weights, `export --size` for loss alone (`--speed any`, the default) and held to the "
            "mix's decode time as predicted from the costs measured in llama.cpp on this CPU; paired on the same "
            f"windows; measured decode over the mix's, 1 thread with its 95% interval over {data['repeats']} paired "
            f"turns, then 2 threads. Held, the file's interval reached 1 or above at {data['held_not_slower']} "
            f"budgets ({sum(r['decode_ratio_ci95'][0] >= 1 for r in held)} entirely at or above 1).",
            "",
            "| budget | file | MiB | perplexity | − the mix [95%] | − any [95%] | decode / the mix, measured | "
            "predicted (held to) | matrices by type |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for row in data["rows"]:
            if row["kind"] == "mix":
                continue
            counts = ", ".join(
                f"{n} {t}" for t, n in sorted(row["type_counts"].items(), key=lambda kv: -kv[1])
            )
            against_any = paired_reading(row, "minus_any") if "minus_any" in row else ""
            lines.append(
                f"| {row['type']} | {row['kind']} | {row['bytes'] / 2**20:.2f} | {row['ppl']:.3f} | "
                f"{paired_reading(row, 'minus_mix')} | {against_any} | {_decode(row)} | {_predicted(row)} | {counts} |"
            )
        lines.append("")
    return lines


def speed_limit_sentence(choices: Path = CHOICES) -> str:
    """The README's line on `--speed mix` where the run exists: per budget, measured decode over the mix's and
    perplexity against `any` and the mix, paired (validation split)."""
    parts = []
    for data in _runs(choices):
        rows = [
            f"{r['type']} {r['decode_ratio']:.2f}x [{r['decode_ratio_ci95'][0]:.2f}, {r['decode_ratio_ci95'][1]:.2f}], "
            f"perplexity {paired_reading(r, 'minus_any')} against `any` and {paired_reading(r, 'minus_mix')} against "
            "the mix"
            for r in data["rows"]
            if r["kind"] == "speed mix"
        ]
        parts.append(f" On {data['model']}: {'; '.join(rows)}.")
    if not parts:
        return ""
    return (
        " `--speed mix` holds the allocation to the mix's decode time as predicted from costs measured in llama.cpp "
        "on this CPU (validation split; ours / the mix's measured decode, 1 thread, 95% interval over paired turns, "
        f"and paired differences; the default stays `any`).{''.join(parts)}"
    )
