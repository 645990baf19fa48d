"""`masa-compress export-dense`: a standard dense checkpoint for runtimes that only take dense models."""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.console import Console

from compressor.cli import JsonOpt

console = Console()


def export_dense_command(
    path: Annotated[str, typer.Argument(help="A checkpoint directory written by masa-compress.")],
    out: Annotated[str, typer.Argument(help="Where to write the dense Hugging Face checkpoint.")],
    overwrite: Annotated[
        bool, typer.Option("--overwrite", help="Replace an existing output directory.")
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """Write each projection's effective dense weight as a plain Hugging Face checkpoint (vLLM, llama.cpp
    converters, any tool that takes a model directory). It loads without trust_remote_code and gives the same
    logits, but it is NOT smaller: the savings exist only in the compressed format."""
    from compressor.checkpoint import export_dense

    result = export_dense(path, out, overwrite=overwrite)
    payload = {
        "out": str(result.path),
        "compressed_bytes": result.compressed_bytes,
        "dense_bytes": result.dense_bytes,
        "compressed_params": result.compressed_params,
        "dense_params": result.dense_params,
    }
    if as_json:
        print(json.dumps(payload))
        return
    console.print(
        f"Wrote a dense checkpoint to {result.path}: {result.dense_params:,} parameters, "
        f"{result.dense_bytes / 2**20:.1f} MiB on disk, vs {result.compressed_params:,} parameters and "
        f"{result.compressed_bytes / 2**20:.1f} MiB compressed. [bold]It is not smaller[/]: use it only for "
        "runtimes that need dense weights."
    )


def register(app: typer.Typer) -> None:
    app.command("export-dense")(export_dense_command)
