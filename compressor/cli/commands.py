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
    """Add the commands of COMMAND_MODULES to `app`, once: `main()` calls this on every run (a library caller or
    a test may call `main` many times in one process), and typer keeps every registration, so a second one
    would duplicate each command (and every later call would build them all again)."""
    if getattr(app, "_masa_extensions_registered", False):
        return
    for name in COMMAND_MODULES:
        import_module(name).register(app)
    app._masa_extensions_registered = True
