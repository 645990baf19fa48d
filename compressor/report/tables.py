"""Rich tables for the terminal: `inspect`'s KL, groupings and energies, and `plan`'s accounting."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text

from compressor.modeling.adapters import PROJECTIONS
from compressor.report.records import format_groups, group_label
from compressor.runtime.memory import GIB


def _pct(value: float | None) -> str:
    return "—" if value is None else f"{100 * value:.2f}%"


def kl_table(inspection: dict) -> Table:
    """One row per transition: its KL and the group counts G for which it is a boundary."""
    table = Table(title=f"Logit-lens KL between consecutive layers (lens: {inspection['logit_lens']})")
    table.add_column("transition", justify="right")
    table.add_column("KL", justify="right")
    table.add_column("boundary for G =")
    for t, value in enumerate(inspection["kl"]):
        used = [str(g["n_groups"]) for g in inspection["groupings"] if t in g["boundaries"]]
        table.add_row(f"{t}→{t + 1}", f"{value:.4g}", ", ".join(used))
    return table


def groupings_table(inspection: dict) -> Table:
    table = Table(
        title="Groups for each G (" + inspection["groupings"][0]["rule"].split(";")[0] + ")"
        if inspection["groupings"]
        else "Groups"
    )
    table.add_column("G", justify="right")
    table.add_column("boundaries (transitions)")
    table.add_column("groups")
    table.add_column("sizes")
    for g in inspection["groupings"]:
        mark = "*" if g["n_groups"] == inspection["highlight"] else ""
        table.add_row(
            f"{g['n_groups']}{mark}",
            ", ".join(f"{t}→{t + 1}" for t in g["boundaries"]) or "—",
            format_groups(g["groups"]),
            ", ".join(map(str, g["sizes"])),
        )
    return table


def energy_table(inspection: dict) -> Table:
    table = Table(
        title="Weight energy captured by the atoms (plain Matrix PCA), per group and projection type"
    )
    singleton = "kept whole" if inspection.get("singletons", "keep") == "keep" else "low rank"
    table.add_column("G", justify="right")
    table.add_column("group")
    table.add_column("layers", justify="right")
    table.add_column("atoms", justify="right")
    for p in PROJECTIONS:
        table.add_column(p, justify="right")
    for g in inspection["groupings"]:
        for index, layers in enumerate(g["groups"]):
            rows = {e["projection"]: e for e in g["energy"] if e["group"] == index}
            if not rows:
                table.add_row(
                    str(g["n_groups"]), group_label(layers), "1", "—", *(singleton,) * len(PROJECTIONS)
                )
                continue
            atoms = next(iter(rows.values()))["atoms"]
            table.add_row(
                str(g["n_groups"]),
                group_label(layers),
                str(len(layers)),
                str(atoms),
                *(_pct(rows[p]["energy_captured"]) for p in PROJECTIONS),
            )
        table.add_section()
    return table


def input_bases_table(inspection: dict) -> Table:
    """Per run of layers and projection type: weight energy of one shared input basis vs each matrix's own."""
    bases = inspection["input_bases"]
    table = Table(
        title=f"Weight energy of one input basis shared by {bases['run_layers']} consecutive layers "
        "(half a matrix's rank) vs each matrix's own basis of that size: shared / own"
    )
    table.add_column("run")
    for p in PROJECTIONS:
        table.add_column(p, justify="right")
    for run in sorted({r["run"] for r in bases["rows"]}):
        rows = {r["projection"]: r for r in bases["rows"] if r["run"] == run}
        first = next(iter(rows.values()))
        table.add_row(
            group_label(first["layers"]),
            *(f"{_pct(rows[p]['shared'])} / {_pct(rows[p]['own'])}" for p in PROJECTIONS),
        )
    return table


PLAN_ROWS = (
    ("target_params_before", "{t} parameters before (P)"),
    ("budget", "budget ⌊(1-ρ)·P⌋"),
    ("atoms", "shared atoms"),
    ("coefficients", "coefficients"),
    ("dense_kept", "singleton weights kept whole"),
    ("biases", "biases of compressed projections"),
    ("residual_budget", "residual budget"),
    ("residual_params", "residual factors"),
    ("target_params_after", "{t} parameters after"),
    ("target_params_after_max", "{t} parameters after, at most"),
    ("model_params_before", "model parameters before (embeddings included)"),
    ("model_params_after", "model parameters after"),
)
#: Rows of what only some forms store: left out when zero (the input-basis forms store no atoms).
ZERO_HIDDEN = ("atoms", "coefficients", "dense_kept")


#: The calibration settings `plan` shows, by the option that sets each (the calibration `samples` are the run's:
#: `mlp_samples` where an MLP is targeted).
PLAN_CALIBRATION = {"source": "calib", "samples": "calib_samples", "seq_len": "seq_len", "seed": "seed",
                    "precision": "calib_precision"}  # fmt: skip
#: The order of the settings' sources in `plan`'s lines.
SOURCE_ORDER = ("option", "recipe", "model shapes", "method", "default")


def plan_tables(plan: dict) -> list:
    """The plan as rich renderables: counts with their status, ranks, and the notes."""
    out = _plan_header(plan)
    out.append(_budget_table(plan))
    if plan["ranks"]["rows"]:
        out.append(_plan_ranks_table(plan))
    return out + _plan_footer(plan)


def _targets(plan: dict) -> list[str]:
    return plan.get("targets") or list(PROJECTIONS)


def _targets_name(plan: dict) -> str:
    targets = _targets(plan)
    return "attention" if targets == list(PROJECTIONS) else "/".join(p.removesuffix("_proj") for p in targets)


def _plan_header(plan: dict) -> list:
    geo = plan["geometry"]
    out: list = [
        Text.assemble(
            ("Plan ", "bold"),
            f"{plan['model']} · method {plan['method']}"
            + (f" (allocation {plan['allocation']})" if plan.get("allocation") else "")
            + (
                f" · remove {plan['ratio_requested']:g} of the model's parameters: {plan['targets_ratio']:.4f} of "
                f"the {_targets_name(plan)} parameters"
                if plan.get("ratio_of") == "model"
                else f" · remove {plan['ratio_requested']:g} of the {_targets_name(plan)} parameters"
            ),
        ),
        Text(
            f"config: {plan['config_source']} · {plan['num_layers']} layers · hidden {geo['hidden_size']} · "
            f"{geo['num_heads']} heads / {geo['num_kv_heads']} kv heads × {geo['head_dim']} · "
            f"biases: {', '.join(plan['bias_projections']) or 'none'}"
        ),
    ]
    out += _settings_lines(plan)
    for key in ("warning", "refit_warning"):
        if plan.get(key):
            out.append(Text(f"warning: {plan[key]}", style="yellow"))
    groups = plan["groups"]
    if groups["layers"]:
        out.append(
            Text.assemble(
                ("Groups ", "bold"),
                (f"({groups['source']}) ", "yellow" if groups["source"] == "assumed" else "green"),
                f"{format_groups(groups['layers'])} · sizes {', '.join(map(str, groups['sizes']))}"
                + (
                    f" · atoms per group {', '.join(map(str, groups['atoms']))}"
                    if any(groups["atoms"])
                    else ""
                ),
            )
        )
        out.append(Text(f"  {groups['rule']}", style="dim"))
    return out


def _settings_lines(plan: dict) -> list:
    """The run's settings (the compression settings its method reads, and the calibration's), one line per source
    (`option`, `recipe NAME`, `model shapes` with each one's reason, `method NAME`, `default`)."""
    sources = plan.get("settings_source")
    if not sources:
        return []
    read = plan.get("settings_read") or list(plan["settings"])
    items = [(k, v, sources["compression"][k]) for k, v in plan["settings"].items() if k in read]
    calibration = plan["calibration"]
    items += [(option, calibration[k], sources["calibration"][k]) for k, option in PLAN_CALIBRATION.items()]
    lines: dict[str, list[str]] = {}
    for name, value, source in items:
        shown = ("yes" if value else "no") if isinstance(value, bool) else "none" if value is None else value
        reason = source.removeprefix("model shapes ")
        if reason != source:  # one line for the model's shapes, each setting with its reason
            lines.setdefault("model shapes", []).append(f"{name} {shown} {reason}")
        else:
            lines.setdefault(source, []).append(f"{name} {shown}")
    order = sorted(lines, key=lambda s: next(i for i, p in enumerate(SOURCE_ORDER) if s.startswith(p)))
    return [Text("Settings, by where each comes from", style="bold")] + [
        Text.assemble((f"  {source}: ", "bold"), ", ".join(lines[source])) for source in order
    ]


def _budget_table(plan: dict) -> Table:
    table = Table(title="Parameter budget (exact counts)")
    table.add_column("quantity")
    table.add_column("numbers", justify="right")
    table.add_column("status")
    for key, label in _plan_rows(plan):
        table.add_row(label.format(t=_targets_name(plan)), f"{plan[key]:,}", plan["status"].get(key, ""))
    if plan.get("achieved_ratio") is not None:
        table.add_row(
            f"{_targets_name(plan)} ratio removed",
            f"{plan['achieved_ratio']:.4f}",
            plan["status"].get("achieved_ratio", ""),
        )
    table.add_row(
        "largest feasible ratio with these groups/atoms",
        f"{plan['max_ratio']:.4f}",
        plan["status"].get("max_ratio", ""),
    )
    return table


def _plan_rows(plan: dict) -> list[tuple[str, str]]:
    """The budget rows shown: none unset, none of `ZERO_HIDDEN` at zero, and one "after" row when the count and
    its bound agree (the global allocations: the bound is what the run spends)."""
    rows = [
        (key, label)
        for key, label in PLAN_ROWS
        if plan.get(key) is not None and not (key in ZERO_HIDDEN and plan[key] == 0)
    ]
    if plan.get("target_params_after") == plan.get("target_params_after_max"):
        rows = [(k, label) for k, label in rows if k != "target_params_after"]
    return rows


def _plan_ranks_table(plan: dict) -> Table:
    ranks, targets = plan["ranks"], _targets(plan)
    atoms = any(row["mode"] == "shared" for row in ranks["rows"])
    budgets = any(row.get("pair_budgets") for row in ranks["rows"])
    table = Table(title=f"Ranks per layer: {ranks['kind']}")
    table.add_column("layers")
    table.add_column("mode")
    if atoms:
        table.add_column("B", justify="right")
    for p in targets:
        table.add_column(p.removesuffix("_proj"), justify="right")
    if budgets:
        table.add_column("pair budgets qk / ov", justify="right", no_wrap=True)
    for row in ranks["rows"]:
        dense, pair = row["mode"] == "dense", row.get("pair_budgets")
        table.add_row(
            group_label(row["layers"]),
            "kept whole" if dense else row["mode"],
            *([str(row["atoms"]) if row["mode"] == "shared" else ""] if atoms else []),
            *("" if dense else "—" if row[p] is None else str(row[p]) for p in targets),
            *([f"{pair[0]:,} / {pair[1]:,}" if pair else ""] if budgets else []),
        )
    return table


def _memory_line(memory: dict) -> Text:
    """The run's estimated peak memory in memory and with --layerwise, against what is available now."""
    where = "GPU memory" if memory["device"] == "gpu" else "memory"
    available = memory.get("available_bytes")
    chosen = memory["layerwise_bytes"] if memory["layerwise"] else memory["in_memory_bytes"]
    fits = available is None or chosen <= available
    first_use = memory.get("first_use_bytes")
    return Text.assemble(
        (f"{where}: ", "bold"),
        f"about {memory['in_memory_bytes'] / GIB:.1f} GiB at its peak in memory, "
        f"{memory['layerwise_bytes'] / GIB:.1f} GiB with --layerwise",
        "" if available is None else f" · {available / GIB:.1f} GiB available now",
        ""
        if fits
        else (" · needs --layerwise" if memory["layerwise_bytes"] <= available else " · does not fit"),
        ""
        if first_use is None
        else f" · first use: about {first_use / GIB:.1f} GiB of {'host ' if memory['device'] == 'gpu' else ''}"
        "memory, once, to convert the model's GGUF",
    )


#: What a cache saves of a `compress` run's estimate (a byte budget's says its own: `size_time`).
CACHED = "less the calibration where its statistics are cached"


def time_line(estimate: dict) -> Text:
    """The run's estimated time on this machine, its total and its longest stages."""
    stages = sorted(estimate["stages"].items(), key=lambda item: -item[1])
    shown = ", ".join(f"{stage.replace('_', ' ')} {_duration(seconds)}" for stage, seconds in stages[:4])
    unpriced = "".join(f", {why}" for why in estimate.get("unpriced", []))
    busy = (
        f"; priced while other work held the CPU ({estimate['rates']['cpu_share']:.0%} of it ours): shorter once "
        "that work is done"
        if estimate.get("busy")
        else ""
    )
    return Text.assemble(
        ("time: ", "bold"),
        f"about {_duration(estimate['total'])} on this machine{' with --layerwise' if estimate.get('layerwise') else ''} "
        f"({shown}{unpriced}; {estimate.get('cached', CACHED)}{busy})",
    )


def stage_times_table(summary: dict) -> Table:
    """A run's seconds per stage, and under them what `plan` said it would take where it prices that stage."""
    planned = summary.get("seconds_planned") or {}
    times = Table(title="time per stage (s; planned in brackets)" if planned else "time per stage (s)")
    for stage in summary["seconds"]:
        times.add_column(stage, justify="right")
    times.add_row(*(f"{v:.1f}" for v in summary["seconds"].values()))
    if planned:
        times.add_row(*(f"({planned[k]:.0f})" if k in planned else "" for k in summary["seconds"]))
    return times


def _duration(seconds: float) -> str:
    return (
        f"{seconds:.0f} s"
        if seconds < 90
        else f"{seconds / 60:.0f} min"
        if seconds < 5400
        else f"{seconds / 3600:.1f} h"
    )


def _plan_footer(plan: dict) -> list:
    out: list = [
        Text.assemble(("  " + tag, "bold"), f": {meaning}")
        for tag, meaning in (plan.get("status_legend") or {}).items()
    ]
    out.append(
        Text.assemble(
            ("feasible: ", "bold"),
            ("yes", "bold green") if plan["feasible"] else ("no", "bold red"),
            "" if plan["feasible"] else f" · {plan['reason']}",
        )
    )
    if plan.get("memory"):
        out.append(_memory_line(plan["memory"]))
    if plan.get("time"):
        out.append(time_line(plan["time"]))
    for alt in plan.get("alternatives") or []:
        out.append(
            Text(
                f"  fits: --groups {alt['groups']} --bases {alt['bases']} "
                f"{'--end-boundaries' if alt['end_boundaries'] else '--no-end-boundaries'} "
                f"(removes up to {alt['max_ratio']:.3f}; assumed groups {format_groups(alt['layers'])})"
            )
        )
    out += [Text(f"• {note}", style="dim") for note in plan.get("notes") or []]
    return out
