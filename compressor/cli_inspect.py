"""`masa-compress inspect | plan | show | recipes`: look before paying, and look at what was made.

Thin: each command parses its options, calls `compressor.inspection` and prints with `compressor.report`.
"""

from __future__ import annotations

import json
import sys
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from compressor.cli import DeviceOpt, DtypeOpt, JsonOpt, ModelArg, QuietOpt
from compressor.inspection import INSPECT_CALIB_SAMPLES

console = Console()
err_console = Console(stderr=True)

Opt = Optional  # typer needs Optional[...] (not X | None) on Python 3.10

RecipeOpt = Annotated[
    Opt[str], typer.Option("--recipe", help="A recipe YAML file of your own (see `masa-compress recipes`).")
]
BasesOpt = Annotated[
    Opt[int],
    typer.Option("--bases", "-b", min=0, help="Shared atoms per group and projection B (recipe: 1)."),
]
LargestOpt = Annotated[
    Opt[int],
    typer.Option(
        "--largest-group-bases", min=0, help="Atoms for the largest group (recipe: same as --bases)."
    ),
]
EndsOpt = Annotated[
    Opt[bool],
    typer.Option(
        "--end-boundaries/--no-end-boundaries",
        help="May the first/last KL transitions be group boundaries (first/last layers singletons kept whole)? "
        "Recipe default: yes (paper).",
    ),
]


# ------------------------------------------------------------------------------------------------------
# inspect


def inspect_command(
    model: ModelArg,
    groups: Annotated[
        str, typer.Option("--groups", "-g", help="Group counts G to show: a range '2-8' or a list '3,4,6'.")
    ] = "2-8",
    bases: BasesOpt = None,
    largest_group_bases: LargestOpt = None,
    end_boundaries: EndsOpt = None,
    logit_lens: Annotated[
        Opt[str],
        typer.Option("--logit-lens", help="final_norm (standard logit lens, default) or raw (paper)."),
    ] = None,
    calib: Annotated[
        Opt[str],
        typer.Option(
            "--calib", help="Calibration text: wikipedia (default), a file/dir, or a datasets name."
        ),
    ] = None,
    calib_samples: Annotated[
        int,
        typer.Option(
            "--calib-samples",
            "-n",
            min=1,
            help="Calibration windows N (fewer than a compression run: grouping and atom energy need little).",
        ),
    ] = INSPECT_CALIB_SAMPLES,
    seq_len: Annotated[
        Opt[int], typer.Option("--seq-len", min=8, help="Tokens per calibration window T (recipe: 512).")
    ] = None,
    seed: Annotated[
        Opt[int], typer.Option("--seed", help="Seed for calibration window sampling (recipe: 0).")
    ] = None,
    out: Annotated[
        Opt[str],
        typer.Option(
            "--out", "-o", help="Write inspect.json, grouping.png and energy.png into this directory."
        ),
    ] = None,
    recipe: RecipeOpt = None,
    batch_size: Annotated[int, typer.Option("--batch-size", min=1, help="Windows per forward pass.")] = 1,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
    as_json: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Calibrate briefly and show the grouping: the logit-lens KL between consecutive layers, the groups
    for each G, and the weight energy that B atoms capture per group and projection type.

    Nothing is compressed. Example: `masa-compress inspect smollm2-135m --out out/inspect`.
    """
    from compressor.inspection import InspectOptions, inspect_model, parse_group_counts, write_inspect_outputs
    from compressor.report import energy_table, groupings_table, kl_table

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
        recipe_file=recipe,
        batch_size=batch_size,
    )
    progress = not (quiet or as_json)
    result = inspect_model(model, options, device=device, dtype=dtype, progress=progress)
    if out:
        result["files"] = [str(p) for p in write_inspect_outputs(out, result)]
    if as_json:
        print(json.dumps(result))
        return
    cal = result["calibration"]
    console.print(
        f"[bold]Inspect[/] {result['model']} · calibration {cal['samples']} × {cal['seq_len']} tokens of {cal['text']} "
        f"(seed {cal['seed']}) · {result['device']} / {result['dtype']} · {result['seconds']['total']:.1f} s"
    )
    console.print(kl_table(result))
    console.print(groupings_table(result))
    console.print(energy_table(result))
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
    if out:
        console.print("Wrote " + ", ".join(result["files"]))


# ------------------------------------------------------------------------------------------------------
# plan


def _parse_layout(text: str | None) -> list[int] | None:
    from compressor.errors import UserError

    if not text:
        return None
    try:
        return [int(v) for v in text.replace(" ", "").split(",") if v]
    except ValueError:
        raise UserError(f"--layout '{text}' is not a list of group sizes: write e.g. 1,28,1") from None


def plan_command(
    model: ModelArg,
    ratio: Annotated[
        float,
        typer.Option("--ratio", "-r", help="Fraction of the attention parameters to remove, in (0, 1)."),
    ] = 0.2,
    method: Annotated[
        Opt[str],
        typer.Option("--method", "-m", help="masa (default), masa-paper, svd-llm, svd, shared-mean."),
    ] = None,
    groups: Annotated[
        Opt[int], typer.Option("--groups", "-g", min=1, help="Groups of consecutive layers G (recipe: 3).")
    ] = None,
    bases: BasesOpt = None,
    largest_group_bases: LargestOpt = None,
    end_boundaries: EndsOpt = None,
    allocation: Annotated[
        Opt[str],
        typer.Option(
            "--allocation",
            help="paper (Algorithm 1 per (Q,K)/(V,O) pair), global, or global-relative (the recipe's default); "
            "ranks are decided after calibration.",
        ),
    ] = None,
    singletons: Annotated[
        Opt[str],
        typer.Option(
            "--singletons", help="keep (singleton groups kept whole, default) or compress (whitened SVD)."
        ),
    ] = None,
    layout: Annotated[
        Opt[str],
        typer.Option(
            "--layout",
            help="Known group sizes, first to last (e.g. 1,28,1 from `inspect`): makes the counts final "
            "instead of estimated from assumed groups.",
        ),
    ] = None,
    recipe: RecipeOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """What `masa-compress MODEL --ratio R` would store, counted exactly, without loading weights or
    calibrating: the budget, atoms, coefficients, singleton weights, residual budget and per-layer ranks,
    each marked final, estimated from the assumed groups, or decided after calibration.

    The real groups need calibration statistics; without --layout the plan assumes them (the first and last layers singletons when end boundaries are allowed, the rest split evenly) and says so. Exits with status 1 when the request does not fit, listing group/atom settings that do.
    """
    from compressor.inspection import PlanOptions, plan_compression
    from compressor.report import plan_tables

    options = PlanOptions(
        method=method,
        groups=groups,
        bases=bases,
        largest_group_bases=largest_group_bases,
        end_boundaries=end_boundaries,
        allocation=allocation,
        singletons=singletons,
        layout=_parse_layout(layout),
        recipe_file=recipe,
    )
    result = plan_compression(model, ratio, options)
    if as_json:
        print(json.dumps(result))
    else:
        for renderable in plan_tables(result):
            console.print(renderable)
    if not result["feasible"]:
        sys.exit(1)  # not typer.Exit: `cli.main` runs click with standalone_mode=False, which drops its code


# ------------------------------------------------------------------------------------------------------
# show


def show_command(
    path: Annotated[str, typer.Argument(help="A checkpoint directory written by masa-compress.")],
    as_json: JsonOpt = False,
) -> None:
    """What a compressed checkpoint holds: source model, when and how it was made, groups, ranks, ratio."""
    from compressor.inspection import describe_checkpoint
    from compressor.report import group_label

    info = describe_checkpoint(path)
    if as_json:
        print(json.dumps(info))
        return
    table = Table(title=f"masa-compress checkpoint · {info['path']}", show_header=False)
    source = info["source"]
    if isinstance(source, dict):
        source = f"{source.get('spec')} ({source.get('kind')}: {source.get('location')})"
    made = [info["tool"], f"format {info['format_version']}"]
    if info["device"]:
        made.append(f"on {info['device']}")
    if info["seconds"] is not None:
        made.append(f"in {info['seconds']:.0f} s")
    rows = [
        ("source", str(source)),
        ("recipe", info["recipe"] or "—"),
        ("architecture", f"{info['base_architecture']} · stored as {info['dtype']}"),
        ("created", f"{info['created']} · " + " · ".join(made)),
        ("method", str(info["method"])),
        (
            "ratio",
            f"requested {info['ratio_requested']}, achieved {info['achieved_ratio']:.4f}"
            if info["achieved_ratio"] is not None
            else str(info["ratio_requested"]),
        ),
    ]
    if info["attention_params_before"] is not None:
        rows.append(
            (
                "attention parameters"
                if info["targets"] == ["q_proj", "k_proj", "v_proj", "o_proj"]
                else f"targeted parameters ({'/'.join(p.removesuffix('_proj') for p in info['targets'])})",
                f"{info['attention_params_before']:,} → {info['attention_params_after']:,}",
            )
        )
    if info["total_params"] is not None:
        rows.append(("model parameters", f"{info['total_params']:,}"))
    if info["ppl_before"] is not None or info["ppl_after"] is not None:
        fmt = lambda v: "—" if v is None else f"{v:.3f}"  # noqa: E731
        rows.append(("perplexity", f"{fmt(info['ppl_before'])} → {fmt(info['ppl_after'])}"))
    cal = info["calibration"]
    if cal:
        rows.append(
            (
                "calibration",
                f"{cal.get('samples')} × {cal.get('seq_len')} tokens of {cal.get('text', cal.get('source'))}, seed {cal.get('seed')}",
            )
        )
    comp = info["compression"]
    if comp:
        rows.append(("settings", ", ".join(f"{k}={v}" for k, v in comp.items())))
    if info["groups"]:
        groups = "  ".join(
            f"{group_label(g['layers'])} " + (f"B={g['n_atoms']}" if len(g["layers"]) > 1 else "alone")
            for g in info["groups"]
        )
        rows.append(("groups", groups + (f"  ({info['grouping_rule']})" if info["grouping_rule"] else "")))
    rows.append(("weights", f"{info['weights_bytes'] / 1e6:.1f} MB in {len(info['files'])} file(s)"))
    for key, value in rows:
        table.add_row(key, value)
    console.print(table)
    ranks = Table(title="per layer: mode and residual rank (atoms)")
    for col in ("layer", "mode", "group", "q_proj", "k_proj", "v_proj", "o_proj"):
        ranks.add_column(col, justify="right" if col != "mode" else "left")
    for row in info["ranks"]:
        cells = []
        for p in ("q_proj", "k_proj", "v_proj", "o_proj"):
            if row["mode"] == "dense":
                cells.append("whole")
            else:
                atoms = row.get(f"{p}_atoms", 0)
                cells.append(f"{row.get(p)}" + (f" ({atoms})" if atoms else ""))
        ranks.add_row(
            str(row["layer"]), row["mode"], "—" if row["group"] is None else str(row["group"]), *cells
        )
    console.print(ranks)


# ------------------------------------------------------------------------------------------------------
# recipes


def _schema_help() -> str:
    """Every recipe key with its default and meaning, from the pydantic schema itself."""
    from compressor.recipes.schema import CalibrationSettings, CompressionSettings, EvaluationSettings, Recipe

    lines = ["Recipe keys (YAML; unknown keys are rejected) and their defaults:", ""]
    for name, info in Recipe.model_fields.items():
        if name in ("calibration", "evaluation", "compression"):
            continue
        default = "(required)" if info.is_required() else repr(info.default)
        lines.append(f"  {name}: {default}  {info.description or ''}".rstrip())
    for section, model in (
        ("calibration", CalibrationSettings),
        ("evaluation", EvaluationSettings),
        ("compression", CompressionSettings),
    ):
        lines.append(f"  {section}:")
        for name, info in model.model_fields.items():
            lines.append(f"    {name}: {info.default!r}  {info.description or ''}".rstrip())
    return "\n\n".join(lines)  # one paragraph per key: typer's help reflows single newlines


def recipes_command(
    name: Annotated[Opt[str], typer.Argument(help="Show one recipe in full (YAML).")] = None,
    check: Annotated[
        Opt[str], typer.Option("--check", help="Validate a recipe YAML file of your own and show it.")
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    import yaml

    from compressor.errors import UserError
    from compressor.recipes.schema import builtin_recipe, builtin_recipe_names, load_recipe_file

    if check or name:
        recipe = load_recipe_file(check) if check else builtin_recipe(name)
        if recipe is None:
            raise UserError(f"unknown recipe '{name}': use one of {', '.join(builtin_recipe_names())}")
        data = recipe.model_dump()
        if as_json:
            print(json.dumps(data))
        else:
            if check:
                console.print(f"[green]valid[/] {check}")
            console.print(yaml.safe_dump(data, sort_keys=False).rstrip(), highlight=False)
        return
    recipes = [builtin_recipe(n) for n in builtin_recipe_names()]
    if as_json:
        print(json.dumps([r.model_dump() for r in recipes]))
        return
    table = Table(title="Built-in recipes (masa-compress ALIAS ...; `masa-compress recipes ALIAS` shows one)")
    for col in ("alias", "model", "calibration N×T", "method", "G", "B", "end bnd.", "lens", "alloc."):
        table.add_column(col)
    for r in recipes:
        c = r.compression
        bases = f"{c.bases}" + (
            f" ({c.largest_group_bases} largest)" if c.largest_group_bases is not None else ""
        )
        table.add_row(
            r.name,
            r.model,
            f"{r.calibration.samples}×{r.calibration.seq_len} {r.calibration.source}",
            c.method,
            str(c.groups),
            bases,
            "yes" if c.end_boundaries else "no",
            c.logit_lens,
            c.allocation,
        )
    console.print(table)


def register(app: typer.Typer) -> None:
    app.command("inspect")(inspect_command)
    app.command("plan")(plan_command)
    app.command("show")(show_command)
    app.command(
        "recipes",
        help="List the built-in recipes with their settings, show one, or validate your own (--check FILE).\n\n"
        + _schema_help(),
    )(recipes_command)
