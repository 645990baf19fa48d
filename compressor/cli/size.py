"""`compress --size` / `--bits-per-weight` and `plan --size`: a GGUF within a byte budget (`api/size.py`)."""

from __future__ import annotations

import json

from rich.console import Console
from rich.table import Table

from compressor.api.run_options import CompressOptions
from compressor.report import stage_times_table, time_line
from compressor.runtime.errors import UserError

console = Console()


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def compress_to_size_command(model, options, ratio_given, dry_run, as_json, device, dtype, quiet) -> None:
    """`--size` / `--bits-per-weight`: a GGUF within the bytes (`api.size`), or its plan with `--dry-run`."""
    from compressor.api.size import check_size_options, compress_to_size

    check_size_options(options, ratio_given)
    if dry_run:
        show_size_plan(model, options, ratio_given, as_json)
        return
    run = compress_to_size(model, options, device=device, dtype=dtype, progress=not (quiet or as_json))
    if as_json:
        print(json.dumps(run.summary))
        return
    print_size_summary(run.summary)


def _only_types(value: str) -> None:
    from compressor.quantize.byte_budget import parse_only_types

    parse_only_types(value, budget_given=False)


def _speed(value: str) -> None:
    from compressor.quantize.speed import parse_speed

    parse_speed(value, budget_given=False)


def _refuse(message: str):
    def refuse(value: str) -> None:
        raise UserError(message.format(value))

    return refuse


#: The options that mean something only under a byte budget (`--size` / `--bits-per-weight`), each with what
#: refuses it, in one line, given without one: a new such option is one entry here.
NEEDS_BUDGET = {
    "only_types": _only_types,
    "speed": _speed,
    "rounding": _refuse("--rounding {} rounds a GGUF's types: add --size (or use export --rounding)"),
    "imatrix": _refuse("--imatrix {} weighs a GGUF's rounding: add --size (or use export --imatrix)"),
}


def refuse_without_budget(given: dict) -> None:
    """The options of a byte budget `given` (name → value) without one, refused in one line."""
    for name, refuse in NEEDS_BUDGET.items():
        if given.get(name) is not None:
            refuse(given[name])


def show_size_plan(model: str, options: CompressOptions, ratio_given: bool, as_json: bool) -> None:
    """`plan --size` / `compress --size --dry-run`: the budget and what the allocation chooses from."""
    from compressor.api.size import plan_size, runs_layerwise

    plan = plan_size(model, options, ratio_given)
    if as_json:
        print(json.dumps(plan))
        return
    console.print(
        f"[bold]{plan['model']}[/]: {plan['parameters']:,} parameters; {plan['budget_flag']} → a GGUF of at most "
        f"{plan['budget']:,} bytes ({_mib(plan['budget'])}, {plan['bits_per_weight']:.2f} bits per weight; "
        f"f16: {_mib(plan['f16_bytes'])})"
    )
    console.print(f"[bold]Structure[/]: {plan['structure']}")
    console.print(
        f"  every matrix in its smallest type, each unit at its narrowest: {_mib(plan['smallest_matrices'])} "
        "(the file adds its metadata and tokenizer)"
    )
    if plan["only_types"]:
        console.print(
            f"  the types a matrix may take (--only-types): {', '.join(plan['only_types']).lower()}"
        )
    if plan.get("speed", "any") != "any":
        console.print(
            f"  decode held to (--speed): {plan['speed']}, as predicted from llama.cpp's decode cost per type on "
            "this CPU: " + (f"about {plan['time']['decode_cost']:.0f} s to measure the ones not yet measured (in "
                            "the export's time)" if plan["time"].get("decode_cost") else "all measured before")
        )  # fmt: skip
    for name, values in plan["candidates"].items():
        if values:
            console.print(f"  {name.replace('_', ' ')} offered per layer: {', '.join(map(str, values))}")
    memory = plan.get("memory")
    if memory:
        free = memory["available_bytes"]
        console.print(
            f"[bold]Memory[/] at the peak: {memory['in_memory_bytes'] / 2**30:.2f} GiB in memory, "
            f"{memory['layerwise_bytes'] / 2**30:.2f} GiB with --layerwise"
            + (f"; {free / 2**30:.1f} GiB available now" if free else "")
            + ("; the run compresses layer by layer (--layerwise)" if runs_layerwise(memory) else "")
        )
    console.print(f"[dim]Chosen after calibration: {plan['after_calibration']}.[/]")
    console.print(time_line(plan["time"]))


def print_size_summary(summary: dict) -> None:
    """What `compress --size` wrote: bytes against the budget, the structure, the types, the quality."""
    structure = summary["structure"]
    table = Table(title=f"masa-compress · {summary['model']} · {summary['budget_flag']}")
    table.add_column("")
    table.add_column("value", justify="right")
    table.add_row("file", summary["out"])
    table.add_row("bytes (budget)", f"{summary['bytes']:,} ({summary['budget']:,}): {_mib(summary['bytes'])}")
    table.add_row("bits per weight", f"{summary['bits_per_weight']:.3f} ({summary['architecture']})")
    table.add_row("matrices by type", ", ".join(f"{n} {t}" for t, n in summary["type_counts"].items()))
    table.add_row("structure", structure["note"])
    if structure.get("targets"):
        widths = summary["mlp_widths"]
        table.add_row("parameters removed", f"{structure.get('removed_parameters', 0):,}")
        table.add_row("MLP widths", f"{min(widths)}–{max(widths)}" if widths else "—")
        table.add_row("query heads", f"{min(summary['heads'])}–{max(summary['heads'])}")
    quality = summary.get("quality")
    if quality:
        table.add_row("perplexity: original → file", f"{quality['ppl_original']:.3f} → {quality['ppl']:.3f}")
        table.add_row(
            "KL from the original · top-1",
            f"{quality['kl_to_original']:.4f} · {quality['top1_agreement']:.2%}",
        )
    console.print(table)
    if quality:
        console.print(
            f"[dim]{quality['tokens']:,} predicted tokens ({quality['split']} split), the file run by llama.cpp[/]"
        )
    if summary.get("speed"):
        from compressor.cli.gguf_report import speed_line

        console.print(speed_line(summary["speed"]))
    console.print(stage_times_table(summary))
