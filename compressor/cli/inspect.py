"""`masa-compress inspect` (the grouping after a short calibration) and `plan` / `compress --dry-run` (the exact
accounting from the config alone)."""

from __future__ import annotations

import json
import sys
from typing import Annotated

import typer
from rich.console import Console

import compressor.cli.option_sets as sets
import compressor.cli.options as o
from compressor.api.inspection import (
    INSPECT_CALIB_SAMPLES,
    InspectOptions,
    inspect_model,
    parse_group_counts,
    write_inspect_outputs,
)
from compressor.api.preview import plan_compression
from compressor.api.run_options import CompressOptions
from compressor.cli.help import ATOMS, HelpCommand
from compressor.cli.size import refuse_without_budget, show_size_plan
from compressor.report import energy_table, groupings_table, input_bases_table, kl_table, plan_tables
from compressor.runtime.errors import UserError

console = Console()


# ------------------------------------------------------------------------------------------------------
# inspect


@sets.with_option_sets
def inspect_command(
    model: o.Model,
    groups: Annotated[
        str,
        typer.Option(
            "--groups",
            "-g",
            metavar="GS",
            rich_help_panel=ATOMS,
            help="Group counts G to show: 2-8 or 3,4,6.",
        ),
    ] = "2-8",
    bases: sets.COMPRESSION_SETTINGS.annotation("bases") = None,
    largest_group_bases: sets.COMPRESSION_SETTINGS.annotation("largest_group_bases") = None,
    end_boundaries: sets.COMPRESSION_SETTINGS.annotation("end_boundaries") = None,
    logit_lens: sets.COMPRESSION_SETTINGS.annotation("logit_lens") = None,
    calib: o.Calib = None,
    calib_samples: o.calib_samples(int, "Calibration windows (a run uses more)") = INSPECT_CALIB_SAMPLES,
    seq_len: o.SeqLen = None,
    seed: o.Seed = None,
    recipe_file: o.RecipeFile = None,
    out: o.out_dir("Write inspect.json, grouping.png and energy.png here.") = None,
    as_json: o.Json = False,
    quiet: o.Quiet = False,
    compute: sets.OptionSet = sets.COMPUTE,
    **given,
) -> None:
    """Calibrate briefly and show how layers would share.

    Nothing is compressed. The logit-lens KL between consecutive layers, the groups for each G, the weight
    energy B atoms capture, and how well one input basis serves a run of layers. Example: `masa-compress inspect smollm2-135m --out out/insp`.
    """
    options = InspectOptions(
        group_counts=parse_group_counts(groups),
        bases=bases,
        largest_group_bases=largest_group_bases,
        end_boundaries=end_boundaries,
        logit_lens=logit_lens,
        calib=calib,
        calib_samples=calib_samples,
        seq_len=seq_len,
        seed=seed,
        recipe_file=recipe_file,
        batch_size=given["batch_size"],
    )
    progress = not (quiet or as_json)
    result = inspect_model(model, options, device=given["device"], dtype=given["dtype"], progress=progress)
    if out:
        result["files"] = [str(p) for p in write_inspect_outputs(out, result)]
    if as_json:
        print(json.dumps(result))
        return
    print_inspection(result)


def print_inspection(result: dict) -> None:
    cal = result["calibration"]
    console.print(
        f"[bold]Inspect[/] {result['model']} · calibration {cal['samples']} × {cal['seq_len']} tokens of {cal['text']} "
        f"(seed {cal['seed']}) · {result['device']} / {result['dtype']} · {result['seconds']['total']:.1f} s"
    )
    console.print(kl_table(result))
    console.print(groupings_table(result))
    console.print(energy_table(result))
    console.print(input_bases_table(result))
    console.print(
        f"[dim]* the recipe's G. Atoms: B={result['bases']}"
        + (
            f", largest group {result['largest_group_bases']}"
            if result["largest_group_bases"] is not None
            else ""
        )
        + f"; end boundaries {'allowed' if result['end_boundaries'] else 'excluded'}.[/]"
    )
    if result["atoms_method"] != "plain":
        console.print(
            f"[yellow]note[/]: the recipe's atoms are '{result['atoms_method']}'; the energies above are those of "
            "plain Matrix PCA of the weights"
        )
    for skip in result["skipped"]:
        console.print(f"[yellow]skipped G={skip['n_groups']}[/]: {skip['reason']}")
    if result.get("files"):
        console.print("Wrote " + ", ".join(result["files"]))


# ------------------------------------------------------------------------------------------------------
# plan


def _parse_layout(text: str | None) -> list[int] | None:
    if not text:
        return None
    try:
        return [int(v) for v in text.replace(" ", "").split(",") if v]
    except ValueError:
        raise UserError(f"--layout '{text}' is not a list of group sizes: write e.g. 1,28,1") from None


@sets.with_option_sets
def plan_command(
    model: o.Model,
    the_run: sets.OptionSet = sets.THE_RUN,
    settings: sets.OptionSet = sets.COMPRESSION_SETTINGS,
    layout: o.Layout = None,
    budget: sets.OptionSet = sets.BYTE_BUDGET,
    as_json: o.Json = False,
    **given,
) -> None:
    """What a run would store, counted exactly, its memory and its time: no weights needed.

    Each number is marked final, exact for assumed groups, or a bound the calibration decides. It reads only the
    model's config (a hub model's from its recipe: offline); the time, this machine's rates, measured once. Exits
    with status 1 when the request does not fit.
    """
    options = CompressOptions.from_values(given)
    if given["size"] is not None or given["bits_per_weight"] is not None:
        show_size_plan(model, options, given["ratio"] is not None, as_json)
        return
    refuse_without_budget(given)
    show_plan(model, options, _parse_layout(layout), as_json)


def show_plan(model: str, options: CompressOptions, layout: list[int] | None, as_json: bool) -> None:
    """Print the plan that `compress` with these options would follow (`plan` and `compress --dry-run`)."""
    result = plan_compression(model, options, layout)
    if as_json:
        print(json.dumps(result))
    else:
        for renderable in plan_tables(result):
            console.print(renderable)
    if not result["feasible"]:
        sys.exit(1)  # not typer.Exit: `cli.main` runs click with standalone_mode=False, which drops its code


def register(app: typer.Typer) -> None:
    app.command("inspect", cls=HelpCommand)(inspect_command)
    app.command("plan", cls=HelpCommand)(plan_command)
