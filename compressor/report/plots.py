"""PNG figures (matplotlib object API, Agg canvas: no pyplot, no display).

Plot geometry (fixed, so that tests can check the files they open): `DPI` dots per inch; the run report's
`grouping.png`, `energy.png` and `ranks.png` are `RUN_FIGSIZE` inches; `inspect`'s `grouping.png` adds
`MAP_ROW_INCHES` per group count, and its `energy.png` is `INSPECT_ENERGY_FIGSIZE`; the run report's
`allocation.png` is `RUN_FIGSIZE[0]` wide and `ALLOCATION_EXTRA_INCHES` + `ALLOCATION_ROW_INCHES` per projection
type high.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from compressor.math.accounting import NEURON_READER
from compressor.modeling.adapters import MLP_PROJECTIONS, PROJECTIONS
from compressor.report.records import kept_fractions, pooled_energy, present_projections

DPI = 100
RUN_FIGSIZE = (10.0, 4.5)
KL_PANEL_INCHES = 4.0
MAP_ROW_INCHES = 0.32
MAP_EXTRA_INCHES = 0.9
INSPECT_ENERGY_FIGSIZE = (13.0, 4.5)
ALLOCATION_ROW_INCHES = 0.45
ALLOCATION_EXTRA_INCHES = 1.2

PROJECTION_COLORS = {
    "q_proj": "#4C72B0", "k_proj": "#DD8452", "v_proj": "#55A868", "o_proj": "#C44E52",
    "gate_proj": "#8172B3", "up_proj": "#937860", "down_proj": "#DA8BC3",
}  # fmt: skip


GROUP_COLORS = ("#9ecae1", "#c7e9c0")  # alternate shared groups
SINGLETON_COLOR = "#fcbba1"  # layers kept whole


def _figure(width: float, height: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _save(fig, path: Path) -> Path:
    path = Path(path)
    fig.savefig(path, dpi=DPI, facecolor="white")  # no bbox_inches="tight": the size stays as documented
    return path


def _draw_kl(ax, kl: Sequence[float], boundaries: Sequence[int], groups: Sequence[Sequence[int]]) -> None:
    """KL of each transition drawn between its two layers; groups shaded; boundaries dashed and marked."""
    n_layers = len(kl) + 1
    x = [t + 0.5 for t in range(len(kl))]
    for g, layers in enumerate(groups):
        color = SINGLETON_COLOR if len(layers) == 1 else GROUP_COLORS[g % 2]
        ax.axvspan(layers[0] - 0.5, layers[-1] + 0.5, color=color, alpha=0.5, lw=0)
        ax.text(
            (layers[0] + layers[-1]) / 2,
            0.97,
            f"{layers[0]}" if len(layers) == 1 else f"layers {layers[0]}–{layers[-1]}",
            transform=ax.get_xaxis_transform(),
            ha="center",
            va="top",
            fontsize=8,
        )
    ax.plot(x, kl, "-o", color="#333333", ms=3.5, lw=1.2, label="KL(p_l ‖ p_{l+1})")
    for i, t in enumerate(boundaries):
        ax.axvline(t + 0.5, color="#d62728", ls="--", lw=1.2, label="boundary" if i == 0 else None)
    if boundaries:
        ax.plot([t + 0.5 for t in boundaries], [kl[t] for t in boundaries], "o", color="#d62728", ms=7)
    positive = [v for v in kl if v > 0]
    if positive and max(positive) / min(positive) > 50:
        ax.set_yscale("log")
    ax.set_xlim(-0.5, n_layers - 0.5)
    step = max(1, math.ceil(n_layers / 30))
    ax.set_xticks(range(0, n_layers, step))
    ax.set_ylabel("KL between consecutive layers")
    ax.grid(axis="y", alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    from matplotlib.patches import Patch

    handles.append(Patch(color=SINGLETON_COLOR, alpha=0.5, label="singleton group (no atoms)"))
    ax.legend(
        handles=handles, loc="upper center", bbox_to_anchor=(0.5, 0.88), fontsize=8, ncol=3, framealpha=0.9
    )


def plot_grouping(
    path: Path,
    kl: Sequence[float],
    boundaries: Sequence[int],
    groups: Sequence[Sequence[int]],
    title: str,
    group_maps: Sequence[tuple[int, Sequence[Sequence[int]]]] | None = None,
    highlight: int | None = None,
) -> Path:
    """KL per transition with the chosen boundaries; with `group_maps` [(G, groups)], a second panel shows
    the groups chosen for every G (one row each, the `highlight` G in bold)."""
    n_layers = len(kl) + 1
    if not group_maps:
        fig = _figure(*RUN_FIGSIZE)
        ax = fig.add_subplot()
    else:
        map_height = MAP_EXTRA_INCHES + MAP_ROW_INCHES * len(group_maps)
        fig = _figure(RUN_FIGSIZE[0], KL_PANEL_INCHES + map_height)
        ax, ax_map = fig.subplots(2, 1, sharex=True, height_ratios=[KL_PANEL_INCHES, map_height])
    _draw_kl(ax, kl, boundaries, groups)
    ax.set_title(title, fontsize=10)
    if not group_maps:
        ax.set_xlabel("layer (each KL point sits between the two layers it compares)")
        return _save(fig, path)
    for row, (_, row_groups) in enumerate(group_maps):
        for g, layers in enumerate(row_groups):
            color = SINGLETON_COLOR if len(layers) == 1 else GROUP_COLORS[g % 2]
            ax_map.broken_barh(
                [(layers[0] - 0.5, len(layers))], (row - 0.4, 0.8), facecolors=color, edgecolor="white"
            )
            if len(layers) >= max(2, n_layers // 15):
                ax_map.text(
                    (layers[0] + layers[-1]) / 2, row, str(len(layers)), ha="center", va="center", fontsize=7
                )
    ax_map.set_yticks(range(len(group_maps)), [f"G={n}" for n, _ in group_maps], fontsize=8)
    for label, (n, _) in zip(ax_map.get_yticklabels(), group_maps, strict=True):
        if n == highlight:
            label.set_fontweight("bold")
    ax_map.set_ylim(len(group_maps) - 0.5, -0.5)
    ax_map.set_xlabel("layer (numbers: group sizes; red: singleton groups)")
    ax_map.set_title("groups for each G", fontsize=9)
    return _save(fig, path)


def _draw_energy_bars(ax, energy: Sequence[dict], groups: Sequence[Sequence[int]] | None) -> None:
    shared = sorted({e["group"] for e in energy if e["atoms"] > 0})
    names = present_projections(energy) or list(PROJECTIONS)
    width = 0.8 / len(names)
    for k, p in enumerate(names):
        values = []
        for g in shared:
            row = next((e for e in energy if e["group"] == g and e["projection"] == p), None)
            values.append(100 * row["energy_captured"] if row else 0.0)
        xs = [i + (k - (len(names) - 1) / 2) * width for i in range(len(shared))]
        bars = ax.bar(xs, values, width, color=PROJECTION_COLORS[p], label=p)
        ax.bar_label(bars, fmt="%.1f", fontsize=7, padding=1)
    labels = []
    for g in shared:
        row = next(e for e in energy if e["group"] == g)
        first, last = (
            (groups[g][0], groups[g][-1]) if groups else (row.get("first_layer"), row.get("last_layer"))
        )
        span = f"layers {first}–{last}" if first is not None else f"{row['layers']} layers"
        labels.append(f"group {g}: {span}\n({row['layers']} layers, B={row['atoms']})")
    ax.set_xticks(range(len(shared)), labels, fontsize=8)
    pad = max(0.0, (3 - len(shared)) / 2)  # a single group's bars stay as narrow as three groups' would
    ax.set_xlim(-0.6 - pad, len(shared) - 0.4 + pad)
    top = max((100 * e["energy_captured"] for e in energy if e["atoms"] > 0), default=1.0)
    ax.set_ylim(0, min(105.0, top * 1.25 + 1))
    ax.set_ylabel("weight energy captured by the atoms (%)")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8, ncol=4, loc="upper right")


def plot_energy(
    path: Path, energy: Sequence[dict], title: str, groups: Sequence[Sequence[int]] | None = None
) -> Path:
    """Bars: per shared group and projection type, the fraction of `Σ_l ‖W_l‖_F²` its B atoms capture."""
    fig = _figure(*RUN_FIGSIZE)
    ax = fig.add_subplot()
    _draw_energy_bars(ax, energy, groups)
    ax.set_title(title, fontsize=10)
    return _save(fig, path)


def plot_inspect_energy(path: Path, inspection: dict, title: str) -> Path:
    """Left: the highlighted G's groups as bars; right: the energy captured over all shared groups vs G."""
    fig = _figure(*INSPECT_ENERGY_FIGSIZE)
    ax_bars, ax_g = fig.subplots(1, 2, width_ratios=[3, 2])
    chosen = next(g for g in inspection["groupings"] if g["n_groups"] == inspection["highlight"])
    _draw_energy_bars(ax_bars, chosen["energy"], chosen["groups"])
    ax_bars.set_title(f"{title} · G={chosen['n_groups']}", fontsize=10)
    ns = [g["n_groups"] for g in inspection["groupings"]]
    for p in PROJECTIONS:
        pooled = [pooled_energy(g["energy"])[p] for g in inspection["groupings"]]
        ax_g.plot(
            ns,
            [100 * v if v is not None else float("nan") for v in pooled],
            "-o",
            color=PROJECTION_COLORS[p],
            label=p,
            ms=4,
        )
    ax_g.set_xticks(ns)
    ax_g.set_xlabel("number of groups G")
    ax_g.set_ylabel("energy captured, all shared layers (%)")
    ax_g.set_title("pooled over the shared groups", fontsize=10)
    ax_g.grid(alpha=0.3)
    ax_g.legend(fontsize=8)
    return _save(fig, path)


def plot_ranks(
    path: Path, projections: Sequence[dict], title: str, initial: dict[str, int] | None = None
) -> Path:
    """Residual (or low-rank) rank per layer and projection type; layers kept whole shaded, single projections
    kept whole (factors would have cost more) marked × at their full rank, readers of a shared input basis
    marked □ at its size; with `initial` (projection →
    Algorithm 1's starting rank) dotted lines show where the balancing started."""
    fig = _figure(*RUN_FIGSIZE)
    ax = fig.add_subplot()
    n_layers = 1 + max(pp["layer"] for pp in projections)
    modes: dict[int, set[str]] = {}
    for pp in projections:
        modes.setdefault(pp["layer"], set()).add(pp["mode"])
    whole_layers = sorted(layer for layer, m in modes.items() if m == {"dense"})
    for i, layer in enumerate(whole_layers):
        label = "layer kept whole" if i == 0 else None
        ax.axvspan(layer - 0.5, layer + 0.5, color=SINGLETON_COLOR, alpha=0.5, lw=0, label=label)
    marked = shared = False
    for p in present_projections(projections):
        mine = [pp for pp in projections if pp["projection"] == p and pp["layer"] not in whole_layers]
        rows = sorted((pp["layer"], pp["rank"]) for pp in mine if pp["mode"] != "dense")
        whole = sorted(
            (pp["layer"], min(pp["out_features"], pp["in_features"])) for pp in mine if pp["mode"] == "dense"
        )
        if rows:
            xs, ys = [r[0] for r in rows], [r[1] or 0 for r in rows]
            # NaN where the projection is not factored, so that the line breaks instead of bridging the gap.
            line = [float("nan")] * n_layers
            for x, y in zip(xs, ys, strict=True):
                line[x] = y
            ax.plot(range(n_layers), line, "-o", ms=3, color=PROJECTION_COLORS[p], label=p)
            readers = sorted((pp["layer"], pp["rank"]) for pp in mine if pp["mode"] == "basis")
            if readers:  # the size of the shared input basis they read
                ax.plot(*zip(*readers, strict=True), "s", ms=6, mfc="none", color=PROJECTION_COLORS[p])
                shared = True
            if initial and p in initial:
                ax.plot(xs, [initial[p]] * len(xs), ":", lw=1.2, color=PROJECTION_COLORS[p])
        if whole:
            ax.plot(
                *zip(*whole, strict=True), "x", ms=5, color=PROJECTION_COLORS[p], label=None if rows else p
            )
            marked = True
    if marked:
        ax.plot([], [], "x", color="#555555", label="kept whole (factors dearer)")
    if shared:
        ax.plot([], [], "s", mfc="none", color="#555555", label="reads a shared input basis (its size)")
    if initial:
        ax.plot([], [], ":", color="#555555", label="initial (Algorithm 1)")
    ax.set_xlim(-0.5, n_layers - 0.5)
    ax.set_xlabel("layer")
    ax.set_ylabel("rank of the residual factors / basis size")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    fig.legend(loc="outside right upper", fontsize=8)
    return _save(fig, path)


def plot_allocation(path: Path, projections: Sequence[dict], title: str) -> Path:
    """Where the budget went: the fraction of its dense numbers each projection keeps (`kept_fractions`), one
    row per projection type, one column per layer, with the type's mean over layers beside its name."""
    kept = kept_fractions(projections)
    types = present_projections(projections)
    neurons = any(pp["mode"] == "neurons" for pp in projections)
    if neurons:  # gate/up/down keep the same share of the MLP's neurons: one row
        types = [p for p in types if p not in MLP_PROJECTIONS] + [NEURON_READER]
    n_layers = 1 + max(layer for layer, _ in kept)
    grid = [[kept.get((layer, p), float("nan")) for layer in range(n_layers)] for p in types]
    fig = _figure(RUN_FIGSIZE[0], ALLOCATION_EXTRA_INCHES + ALLOCATION_ROW_INCHES * len(types))
    ax = fig.add_subplot()
    image = ax.imshow(grid, aspect="auto", cmap="viridis", vmin=0.0, vmax=1.0, interpolation="nearest")
    means = [sum(v for v in row if v == v) / max(1, sum(v == v for v in row)) for row in grid]
    names = ["mlp neurons" if neurons and p == NEURON_READER else p.removesuffix("_proj") for p in types]
    ax.set_yticks(range(len(types)), [f"{n} ({m:.0%})" for n, m in zip(names, means, strict=True)])
    ax.set_xticks(range(n_layers), [str(layer) if layer % 2 == 0 else "" for layer in range(n_layers)])
    ax.set_xlabel("layer")
    ax.set_title(title, fontsize=10)
    fig.colorbar(image, ax=ax, label="kept fraction of the dense numbers", fraction=0.04)
    return _save(fig, path)


def _initial_ranks(report: dict) -> dict[str, int] | None:
    """Algorithm 1's starting rank per projection type (the same for every compressed layer)."""
    splits = report.get("algorithm1") or []
    initial: dict[str, int] = {}
    for split in splits:
        for p, r in zip(split["pair"], split["initial"], strict=True):
            initial.setdefault(p, r)
    return initial or None
