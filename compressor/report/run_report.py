"""The report of a compression run beside its checkpoint: `report.json` and the PNG figures."""

from __future__ import annotations

from pathlib import Path

from compressor.report.plots import _initial_ranks, plot_allocation, plot_energy, plot_grouping, plot_ranks
from compressor.report.records import format_groups, write_json


def write_run_report(out_dir: Path, summary: dict) -> list[Path]:
    """Write `report.json` (the whole summary of `api.compress`) and the plots its report supports:
    `grouping.png` (KL per transition, boundaries, groups) when it has a grouping, `energy.png` when it has
    `atom_energy`, `ranks.png` when the plan has allocated ranks, and `allocation.png` (the kept fraction per layer
    and projection type, an MLP keeping neurons as one row: its kept share of neurons) when it has ranks or MLP
    widths. Returns the paths written."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [write_json(out_dir / "report.json", summary)]
    report = summary.get("report") or {}
    title = f"{summary.get('model', '?')} · {summary.get('method', '?')} · ratio {summary.get('ratio_requested', '?')}"
    grouping = report.get("grouping")
    groups = grouping["groups"] if grouping else None
    if grouping and grouping.get("kl"):
        lens = grouping.get("logit_lens", "")
        paths.append(
            plot_grouping(
                out_dir / "grouping.png",
                grouping["kl"],
                grouping["boundaries"],
                groups,
                f"{title} · logit lens {lens} · groups {format_groups(groups)}",
            )
        )
    if any(e.get("atoms", 0) > 0 for e in report.get("atom_energy") or []):
        paths.append(
            plot_energy(
                out_dir / "energy.png", report["atom_energy"], f"{title} · energy captured per group", groups
            )
        )
    projections = (summary.get("plan") or {}).get("projections") or []
    # An MLP keeping neurons has a width, an attention keeping heads a head count, not a rank: allocation.png shows
    # them (as the kept share of its neurons or heads).
    factored = [pp for pp in projections if pp["mode"] not in ("neurons", "heads", "rows", "columns")]
    if any(pp["mode"] != "dense" and pp.get("rank") is not None for pp in factored):
        paths.append(
            plot_ranks(out_dir / "ranks.png", factored, f"{title} · residual ranks", _initial_ranks(report))
        )
    if any(pp["mode"] != "dense" and pp.get("rank") is not None for pp in projections):
        paths.append(plot_allocation(out_dir / "allocation.png", projections, f"{title} · kept fraction"))
    return paths
