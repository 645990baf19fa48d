"""`--help` teaches at 80 columns: every command's help (and the top level's) in at most 80 lines, none wider
than 80 characters, each option named in docs/options.md, and the defaults that are the recipe's named from the
schema."""

from __future__ import annotations

from pathlib import Path

import pytest

from compressor.cli import app, main
from compressor.cli.commands import register
from compressor.recipes.schema import CompressionSettings

DOC = Path(__file__).resolve().parent.parent / "docs" / "options.md"
COMMANDS = ["", "compress", "plan", "eval", "inspect", "show", "export-dense", "recipes"]


def _printed(argv: list[str], capsys, monkeypatch, columns: int = 80) -> str:
    monkeypatch.setenv("COLUMNS", str(columns))
    capsys.readouterr()
    try:
        main(argv)
    except SystemExit as exit_info:
        assert exit_info.code in (0, None)
    return capsys.readouterr().out


def _help(command: str, capsys, monkeypatch) -> str:
    return _printed([command, "--help"] if command else ["--help"], capsys, monkeypatch)


@pytest.mark.parametrize("command", COMMANDS, ids=[c or "top-level" for c in COMMANDS])
def test_help_fits_80_columns(command, capsys, monkeypatch):
    lines = _help(command, capsys, monkeypatch).splitlines()
    assert len(lines) <= 80, f"{command} --help: {len(lines)} lines"
    widest = max(lines, key=len)
    assert len(widest) <= 80, f"{command} --help: a line of {len(widest)} characters: {widest!r}"


def _options(command: str) -> list[str]:
    import typer

    register(app)
    cmd = typer.main.get_command(app)
    target = cmd.commands[command] if command else cmd
    return [
        o for p in target.params for o in (*p.opts, *getattr(p, "secondary_opts", ())) if o.startswith("--")
    ]


@pytest.mark.parametrize("command", COMMANDS, ids=[c or "top-level" for c in COMMANDS])
def test_every_option_shown_and_explained(command, capsys, monkeypatch):
    shown, doc = _help(command, capsys, monkeypatch), DOC.read_text()
    for option in _options(command):
        short = "--[no-]" + option.removeprefix("--no-").removeprefix("--")
        assert option in shown or short in shown, f"{command} --help does not show {option}"
        if option != "--version":
            assert f"`{option}" in doc or option in doc, f"docs/options.md does not explain {option}"


def test_recipe_defaults_named_from_the_schema(capsys, monkeypatch):
    lines = _help("compress", capsys, monkeypatch).splitlines()
    defaults = CompressionSettings()
    for option, field in (
        ("--sharing", "sharing"),
        ("--allocation", "allocation"),
        ("--basis-layers", "basis_layers"),
        ("--groups", "groups"),
        ("--mlp", "mlp"),
    ):
        line = next(line for line in lines if f" {option}" in line)
        assert f"default: {getattr(defaults, field)}" in line, line
    method = next(line for line in lines if "--method" in line)
    assert f"{defaults.method} (default)" in method and "atoms" not in method


def test_recipes_table_keeps_aliases_whole_at_80_columns(capsys, monkeypatch):
    from compressor.recipes.schema import builtin_recipe, builtin_recipe_names

    out = _printed(["recipes"], capsys, monkeypatch)
    assert max(len(line) for line in out.splitlines()) <= 80
    assert "…" not in out
    for name in builtin_recipe_names():
        assert name in out and builtin_recipe(name).model in out


def test_main_registers_each_command_once(capsys, monkeypatch):
    """`main` registers the commands of their own modules on every call: many calls in one process (a library
    caller, this test suite) must leave each command registered once, or every later call builds them all."""
    for _ in range(3):
        _help("recipes", capsys, monkeypatch)
    names = [c.name for c in app.registered_commands]
    assert len(names) == len(set(names)), names
