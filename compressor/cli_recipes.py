"""`masa-compress recipes`: the built-in recipes, one in full, or a recipe file of your own checked."""

from __future__ import annotations

import json
from typing import Annotated, Optional

import typer
import yaml
from rich.console import Console
from rich.table import Table

from compressor.cli import JsonOpt
from compressor.errors import UserError
from compressor.recipes.schema import (
    CalibrationSettings,
    CompressionSettings,
    EvaluationSettings,
    Recipe,
    builtin_recipe,
    builtin_recipe_names,
    load_recipe_file,
)

console = Console()
Opt = Optional  # typer needs Optional[...] (not X | None) on Python 3.10


def _schema_help() -> str:
    """Every recipe key with its default and meaning, from the pydantic schema itself."""
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
    app.command(
        "recipes",
        help="List the built-in recipes with their settings, show one, or validate your own (--check FILE).\n\n"
        + _schema_help(),
    )(recipes_command)
