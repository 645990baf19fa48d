"""Registry of subcommands defined outside `cli/__init__.py` (each in its own module, to keep it thin)."""

from __future__ import annotations

from importlib import import_module

import typer

# Each module exposes `register(app: typer.Typer)`.
COMMAND_MODULES: tuple[str, ...] = (
    "compressor.cli.compress",
    "compressor.cli.checkpoint",
    "compressor.cli.inspect",
    "compressor.cli.recipes",
)


def register(app: typer.Typer) -> None:
    for name in COMMAND_MODULES:
        import_module(name).register(app)
