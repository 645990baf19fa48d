"""`masa-compress recipes`: the built-in recipes, one in full, or a recipe file of your own checked."""

from __future__ import annotations

import json
from typing import Annotated, Optional

import typer
import yaml
from rich import box
from rich.console import Console
from rich.table import Table

import compressor.cli.options as o
from compressor.cli.help import HelpCommand
from compressor.recipes.schema import (
    CalibrationSettings,
    CompressionSettings,
    EvaluationSettings,
    ModelShapes,
    Recipe,
    builtin_recipe,
    builtin_recipe_names,
    load_recipe_file,
)
from compressor.runtime.errors import UserError


def console() -> Console:
    """A console of the terminal's width now (rich reads COLUMNS when a console is made: one made at import would
    keep the width of whoever imported the module first)."""
    return Console()


Opt = Optional  # typer needs Optional[...] (not X | None) on Python 3.10


def schema_keys() -> list[str]:
    """Every recipe key with its default and meaning, from the pydantic schema itself (`recipes --keys`)."""
    lines = ["Recipe keys (YAML; unknown keys are rejected), their defaults and meaning:"]
    for name, info in Recipe.model_fields.items():
        if name in ("calibration", "evaluation", "compression", "shapes"):
            continue
        default = "(required)" if info.is_required() else repr(info.default)
        lines.append(f"  {name}: {default}  {info.description or ''}".rstrip())
    for section, model in (
        ("shapes", ModelShapes),
        ("calibration", CalibrationSettings),
        ("evaluation", EvaluationSettings),
        ("compression", CompressionSettings),
    ):
        lines.append(
            f"  {section}:"
            + ("  (optional) the model's published config values" if section == "shapes" else "")
        )
        for name, info in model.model_fields.items():
            default = "(required)" if info.is_required() else repr(info.default)
            lines.append(f"    {name}: {default}  {info.description or ''}".rstrip())
    return lines


def _form(c: CompressionSettings) -> str:
    """The method and, for masa, its form of sharing (with G and B only for the atoms form)."""
    if c.method != "masa":
        return c.method
    if c.sharing == "atoms":
        return f"masa · atoms G={c.groups} B={c.bases}"
    return f"masa · {c.sharing}"


def recipes_command(
    name: Annotated[
        Opt[str], typer.Argument(metavar="ALIAS", help="Show this recipe in full (YAML).")
    ] = None,
    check: Annotated[
        Opt[str],
        typer.Option("--check", metavar="FILE", help="Validate a recipe YAML of your own and show it."),
    ] = None,
    keys: Annotated[bool, typer.Option("--keys", help="Every recipe key, its default and meaning.")] = False,
    as_json: o.Json = False,
) -> None:
    """The built-in recipes; one in full; or check your own."""
    if keys:
        for line in schema_keys():
            console().print(line, highlight=False, markup=False)
        return
    if check or name:
        recipe = load_recipe_file(check) if check else builtin_recipe(name)
        if recipe is None:
            raise UserError(f"unknown recipe '{name}': use one of {', '.join(builtin_recipe_names())}")
        data = recipe.model_dump()
        if as_json:
            print(json.dumps(data))
        else:
            if check:
                console().print(f"[green]valid[/] {check}")
            console().print(yaml.safe_dump(data, sort_keys=False).rstrip(), highlight=False)
        return
    recipes = [builtin_recipe(n) for n in builtin_recipe_names()]
    if as_json:
        print(json.dumps([r.model_dump() for r in recipes]))
        return
    table = Table(
        title="Built-in recipes: masa-compress ALIAS ...",
        caption="`masa-compress recipes ALIAS` shows one in full",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
    )
    for col in ("alias", "model", "calibration N×T", "method"):
        table.add_column(col, no_wrap=col in ("alias", "model"))
    for r in recipes:
        cal = r.calibration
        table.add_row(r.name, r.model, f"{cal.samples}×{cal.seq_len} {cal.source}", _form(r.compression))
    console().print(table)


def register(app: typer.Typer) -> None:
    app.command("recipes", cls=HelpCommand)(recipes_command)
