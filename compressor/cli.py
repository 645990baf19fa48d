"""The `masa-compress` command line: parses options and calls the library (`compressor.api`).

`masa-compress MODEL --ratio R` (no subcommand) is the main job, the same as `masa-compress compress ...`.
"""

from __future__ import annotations

import json
import sys
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from compressor import __version__
from compressor.errors import NumericalError, UserError

app = typer.Typer(
    name="masa-compress",
    help=(
        "Training-free compression of LLM attention by sharing weights across layers (MASA).\n\n"
        "Main job: `masa-compress MODEL --ratio 0.2` removes 20% of the attention parameters, writes a "
        "compressed safetensors checkpoint and reports perplexity before and after. MODEL is a recipe alias "
        "(smollm2-135m is bundled and works offline), a local Hugging Face directory, a .gguf file, or a hub id."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console()
err_console = Console(stderr=True)

ModelArg = Annotated[
    str,
    typer.Argument(
        help="Recipe alias (smollm2-135m, llama-3.2-1b, ...), local HF directory, .gguf file, hub id, "
        "or a masa-compress checkpoint directory."
    ),
]
DeviceOpt = Annotated[str, typer.Option("--device", help="auto (cuda > mps > cpu), cpu, cuda, cuda:N, mps.")]
DtypeOpt = Annotated[
    str, typer.Option("--dtype", help="auto (float32 on CPU, bfloat16 on GPU), float32, bfloat16, float16.")
]
JsonOpt = Annotated[
    bool, typer.Option("--json", help="Print one JSON object on stdout (no bars, no tables).")
]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="No progress bars.")]


def _version_callback(value: bool) -> None:
    if value:
        console.print(f"masa-compress {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool | None,
        typer.Option(
            "--version", callback=_version_callback, is_eager=True, help="Show the version and exit."
        ),
    ] = None,
) -> None:
    """Training-free compression of LLM attention by cross-layer weight sharing (MASA)."""


@app.command("eval")
def eval_command(
    model: ModelArg,
    text: Annotated[
        str | None,
        typer.Option(
            "--text",
            help="Evaluation text: a file, a directory of .txt files, a datasets name (wikitext2, c4, "
            "hf:NAME[:CONFIG][:SPLIT][:FIELD]), or the default: the held-out part of the bundled Wikipedia text.",
        ),
    ] = None,
    seq_len: Annotated[
        int | None,
        typer.Option(
            "--seq-len", min=8, help="Tokens per evaluation window (default: the recipe's, else 512)."
        ),
    ] = None,
    max_tokens: Annotated[
        int | None,
        typer.Option(
            "--max-tokens", min=8, help="Cap on evaluated tokens (default: the recipe's; 0 means all)."
        ),
    ] = None,
    batch_size: Annotated[int, typer.Option("--batch-size", min=1, help="Windows per forward pass.")] = 1,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
    as_json: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Perplexity of MODEL on held-out text (non-overlapping windows, mean NLL over predicted tokens)."""
    from compressor.api import EvalSettings, evaluate

    settings = EvalSettings(text=text, seq_len=seq_len, max_tokens=max_tokens, batch_size=batch_size)
    if max_tokens == 0:
        settings.max_tokens = None
    result, loaded = evaluate(model, settings, device=device, dtype=dtype, progress=not (quiet or as_json))
    payload = {
        "model": loaded.source.describe(),
        **result.to_dict(),
        "device": str(loaded.device),
        "dtype": str(loaded.dtype).removeprefix("torch."),
        "load_seconds": round(loaded.seconds, 3),
    }
    if as_json:
        print(json.dumps(payload))
        return
    table = Table(title=f"Perplexity of {loaded.source.describe()}", show_header=False)
    table.add_row("perplexity", f"{result.ppl:.4f}")
    table.add_row("text", result.text)
    table.add_row("windows × seq_len", f"{result.windows} × {result.seq_len}")
    table.add_row("predicted tokens", f"{result.tokens:,}")
    table.add_row("device / dtype", f"{payload['device']} / {payload['dtype']}")
    table.add_row("time", f"{result.seconds:.1f} s (+ {loaded.seconds:.1f} s load)")
    console.print(table)


def _register_extensions() -> None:
    """Commands that live in their own modules register themselves here."""
    from compressor import cli_commands

    cli_commands.register(app)


KNOWN_COMMANDS = {"eval", "compress", "inspect", "plan", "show", "export-dense", "recipes"}


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point: bare `masa-compress MODEL ...` means `masa-compress compress MODEL ...`."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and not args[0].startswith("-") and args[0] not in KNOWN_COMMANDS:
        args.insert(0, "compress")
    _register_extensions()
    try:
        code = app(args=args, prog_name="masa-compress", standalone_mode=False)
        # With standalone_mode=False click returns (not raises) the code of a `typer.Exit(code)`.
        if isinstance(code, int) and code:
            sys.exit(code)
    except UserError as err:
        err_console.print(f"[bold red]error:[/] {err}", highlight=False, soft_wrap=True)
        sys.exit(2)
    except NumericalError as err:
        err_console.print(f"[bold red]numerical error:[/] {err}", highlight=False, soft_wrap=True)
        sys.exit(3)
    except KeyboardInterrupt:
        err_console.print("[bold red]interrupted[/]: nothing was written")
        sys.exit(130)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except Exception as exc:  # click usage errors arrive here with standalone_mode=False
        import click

        if isinstance(exc, click.exceptions.ClickException):
            exc.show()
            sys.exit(exc.exit_code)
        if isinstance(exc, click.exceptions.Abort):
            err_console.print("[bold red]aborted[/]")
            sys.exit(130)
        raise


if __name__ == "__main__":
    main()
