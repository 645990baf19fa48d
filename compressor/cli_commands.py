"""Registry of subcommands defined outside cli.py (each in its own module, to keep cli.py thin)."""

from __future__ import annotations

from importlib import import_module

import typer

# Each module exposes `register(app: typer.Typer)`.
COMMAND_MODULES: tuple[str, ...] = (
    "compressor.cli_compress",
    "compressor.cli_checkpoint",
    "compressor.cli_inspect",
    "compressor.cli_recipes",
)


def register(app: typer.Typer) -> None:
    for name in COMMAND_MODULES:
        import_module(name).register(app)
