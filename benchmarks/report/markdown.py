"""Small formatting helpers shared by the sections of BENCHMARKS.md."""

from __future__ import annotations

import os
from pathlib import Path


def number(value, digits: int = 2) -> str:
    return "—" if value is None else f"{value:,.{digits}f}"


def interval(values, digits: int = 2) -> str:
    return "" if not values else f" [{values[0]:.{digits}f}, {values[1]:.{digits}f}]"


def difference(diff: dict | None) -> str:
    """`−5.31 [−5.62, −5.01]`, or `tie` where the paired interval contains 0."""
    if not diff:
        return "—"
    lo, hi = diff["ci95"]
    return f"{diff['value']:+.3f} [{lo:+.3f}, {hi:+.3f}]" + (" (tie)" if diff["tie"] else "")


def mib(d: dict, key: str):
    return None if key not in d else d[key] * 1024


def link(path: Path, doc: Path) -> str:
    rel = Path(os.path.relpath(path, doc.parent)).as_posix()
    return f"[`{rel}`]({rel})"


def sources(paths: list[Path], doc: Path) -> str:
    return ", ".join(
        f"[`{Path(os.path.relpath(p, doc.parent)).as_posix()}`]({Path(os.path.relpath(p, doc.parent)).as_posix()})"
        for p in paths
    )


def paired_verdict(diff: dict) -> str:
    """'better (x)', 'worse (x)' or 'a tie (x)' for a paired difference of perplexity (negative: better)."""
    value = f"{diff['value']:+.3f} [{diff['ci95'][0]:+.3f}, {diff['ci95'][1]:+.3f}]"
    if diff["tie"]:
        return f"a tie ({value})"
    return f"{'better' if diff['value'] < 0 else 'worse'} ({value})"


def reading(lo: float, hi: float, better: str, worse: str) -> str:
    """What a paired interval of ours − theirs says: `better` below 0, `worse` above, else a tie."""
    return better if hi < 0 else worse if lo > 0 else "tie"


def paired_reading(row: dict, key: str, better: str = "better", worse: str = "worse") -> str:
    """`+0.123 [+0.010, +0.240] worse` for a row's paired difference `key` (its interval at `key`_ci95, else at
    ci95), `reading`'s word after it; empty where the row has none."""
    if key not in row:
        return ""
    lo, hi = row.get(f"{key}_ci95") or row["ci95"]
    return f"{row[key]:+.3f} [{lo:+.3f}, {hi:+.3f}] {reading(lo, hi, better, worse)}"
