"""`masa-compress compress` (also the bare `masa-compress MODEL ...`): the main job."""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

import compressor.cli.option_sets as sets
import compressor.cli.options as o
from compressor.api import compress
from compressor.api.run_options import CompressOptions
from compressor.cli.help import CALIBRATION, HARDWARE, OUTPUT, RUN, HelpCommand
from compressor.cli.inspect import show_plan
from compressor.cli.size import compress_to_size_command, refuse_without_budget
from compressor.math.accounting import NEURON_READER
from compressor.report import basis_label, group_label, kept_by_type, stage_times_table

console = Console()


@sets.with_option_sets
def compress_command(
    model: o.Model,
    the_run: sets.OptionSet = sets.THE_RUN,
    dry_run: Annotated[
        bool,
        typer.Option(
            "--dry-run", rich_help_panel=RUN, help="Only print the plan: no weights, no calibration."
        ),
    ] = False,
    settings: sets.OptionSet = sets.COMPRESSION_SETTINGS,
    choosing_groups: sets.OptionSet = sets.AUTO_GROUPS,
    calib: o.Calib = None,
    calib_samples: o.CalibSamples = None,
    seq_len: o.SeqLen = None,
    seed: o.Seed = None,
    calib_precision: o.CalibPrecision = None,
    stats_cache: Annotated[
        bool,
        typer.Option(
            "--stats-cache/--no-stats-cache",
            rich_help_panel=CALIBRATION,
            help="Reuse cached calibration statistics.",
        ),
    ] = True,
    eval_text: Annotated[
        o.Opt[str],
        typer.Option(
            "--eval-text",
            metavar="TEXT",
            rich_help_panel=CALIBRATION,
            help="Evaluation text (default: the recipe's).",
        ),
    ] = None,
    eval_split: o.EvalSplit = None,
    eval_seq_len: o.EvalSeqLen = None,
    eval_max_tokens: o.EvalMaxTokens = None,
    no_eval: Annotated[
        bool,
        typer.Option("--no-eval", rich_help_panel=CALIBRATION, help="Skip the perplexity before and after."),
    ] = False,
    compare: o.CompareInRun = True,
    allow_overlap: Annotated[
        bool,
        typer.Option(
            "--allow-overlap", rich_help_panel=CALIBRATION, help="Evaluate on the calibration text (a leak)."
        ),
    ] = False,
    out: o.out_dir("Checkpoint directory (default: out/MODEL-METHOD-rRATIO).") = None,
    overwrite: o.Overwrite = False,
    no_save: Annotated[
        bool, typer.Option("--no-save", rich_help_panel=OUTPUT, help="Write no checkpoint (measure only).")
    ] = False,
    as_json: o.Json = False,
    quiet: o.Quiet = False,
    compute: sets.OptionSet = sets.COMPUTE,
    budget: sets.OptionSet = sets.BYTE_BUDGET,
    rounding: o.Rounding = None,
    imatrix: o.ImatrixFile = None,
    layerwise: Annotated[
        bool,
        typer.Option(
            "--layerwise",
            rich_help_panel=HARDWARE,
            help="Layers on disk, one at a time: models beyond memory.",
        ),
    ] = False,
    offload_dir: Annotated[
        o.Opt[str],
        typer.Option(
            "--offload-dir",
            metavar="DIR",
            rich_help_panel=HARDWARE,
            help="--layerwise's temporary files (default: beside --out).",
        ),
    ] = None,
    **given,
) -> None:
    """Compress MODEL: remove --ratio or fit --size, score it (its time: `plan`)."""
    options = CompressOptions.from_values({**locals(), **given, "evaluate": not no_eval, "save": not no_save})
    ratio_given, device, dtype = given["ratio"] is not None, given["device"], given["dtype"]
    if given["size"] is not None or given["bits_per_weight"] is not None:
        compress_to_size_command(model, options, ratio_given, dry_run, as_json, device, dtype, quiet)
        return
    refuse_without_budget({**given, "rounding": rounding, "imatrix": imatrix})
    if dry_run:
        show_plan(model, options, layout=None, as_json=as_json)
        return
    run = compress(model, options, device=device, dtype=dtype, progress=not (quiet or as_json))
    if as_json:
        print(json.dumps({k: v for k, v in run.summary.items() if k != "plan"}))
        return
    print_summary(run.summary)


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def _fmt_ppl(value: float | None) -> str:
    return "—" if value is None else f"{value:.3f}"


def _fmt_interval(ci: list[float] | None) -> str:
    return "" if not ci else f" [{ci[0]:.3f}, {ci[1]:.3f}]"


def print_layout(summary: dict) -> None:
    """What the run built, before the numbers: groups, shared bases, kept fractions, MLP widths, G and B."""
    grouping = summary["report"].get("grouping")
    if grouping:
        console.print(
            f"[bold]Groups[/] ({grouping['rule']}): " + "  ".join(group_label(g) for g in grouping["groups"])
        )
    print_sharing(summary["report"])
    projections = (summary.get("plan") or {}).get("projections")
    if projections and all(pp["mode"] == "dense" or pp.get("rank") is not None for pp in projections):
        console.print(
            "[bold]Kept fraction of the dense numbers[/] (per layer: allocation.png beside the checkpoint): "
            + "  ".join(
                f"{r['projection'].removesuffix('_proj')} {r['kept']:.0%}" for r in kept_by_type(projections)
            )
        )
    widths = mlp_widths(projections or [])
    if widths:
        (low, at_low), (high, at_high) = min(widths), max(widths)
        full = next(pp["in_features"] for pp in projections if pp["projection"] == NEURON_READER)
        console.print(
            f"[bold]MLP neurons kept[/] (of {full} per layer): {sum(w for w, _ in widths) / len(widths):.0f} on "
            f"average, {low} (layer {at_low}) to {high} (layer {at_high})"
        )
    search = summary["report"].get("shape_search")
    if search:
        chosen = search["chosen"]
        console.print(
            f"[bold]G and B chosen by the proxy[/]: G={chosen['groups']}, B={chosen['bases']} "
            f"(lowest weighted whitened error of {len(search['candidates'])} feasible candidates)"
        )


def print_summary(summary: dict) -> None:
    print_layout(summary)
    table = Table(title=f"masa-compress · {summary['model']} · method {summary['method']}")
    table.add_column("")
    table.add_column("before", justify="right")
    table.add_column("after", justify="right")
    targets = summary.get("targets", "attn")
    table.add_row(
        "attention parameters" if targets == "attn" else f"targeted parameters ({targets})",
        f"{summary['target_params_before']:,}",
        f"{summary['target_params_after']:,}",
    )
    before, after = summary["model_params_before"], summary["model_params_after"]
    table.add_row("model parameters", f"{before:,}", f"{after:,}")
    if "weights_bytes_before" in summary:
        written = summary.get("checkpoint_bytes")
        table.add_row(
            "model size (weights; written checkpoint)",
            _mib(summary["weights_bytes_before"]),
            _mib(summary["weights_bytes_after"]) + (f"; {_mib(written)}" if written else ""),
        )
    by_model = summary.get("ratio_of") == "model"
    table.add_row(
        "ratio removed" + (" of attention" if targets == "attn" else f" of {targets}"),
        "" if by_model else f"requested {summary['ratio_requested']:.3f}",
        f"achieved {summary['achieved_ratio']:.4f}",
    )
    if by_model:
        table.add_row(
            "ratio removed of the model",
            f"requested {summary['ratio_requested']:.3f}",
            f"achieved {1 - after / before:.4f}",
        )
    quality = summary.get("quality") or {}
    table.add_row(
        f"perplexity ({summary.get('split')} split)" if quality else "perplexity",
        _fmt_ppl(summary["ppl_before"]) + _fmt_interval(quality.get("ppl_before_ci95")),
        _fmt_ppl(summary["ppl_after"]) + _fmt_interval(quality.get("ppl_after_ci95")),
    )
    if summary.get("kl_to_original") is not None:
        table.add_row("KL from the original", "", f"{summary['kl_to_original']:.4f}")
        table.add_row("top-1 agreement", "", f"{summary['top1_agreement']:.2%}")
    console.print(table)
    if quality:
        cap = ((summary.get("settings") or {}).get("evaluation") or {}).get("max_tokens")
        capped = f" (capped by --eval-max-tokens {cap}: leave it out to score the whole split)" if cap else ""
        console.print(
            f"[dim]{quality['tokens']:,} predicted tokens of {quality['evaluation_text']}{capped}; brackets: 95% "
            "bootstrap intervals over windows; KL: mean KL divergence from the original, nats/token[/]"
        )
    console.print(stage_times_table(summary))
    console.print(
        f"peak memory {summary['peak_rss_gb']:.2f} GiB · checkpoint: {summary['out'] or '(not saved)'}"
    )


def mlp_widths(projections: list[dict]) -> list[tuple[int, int]]:
    """(neurons kept, layer) of every MLP in `neurons` mode of a plan's projections (whole: all its neurons)."""
    if not any(pp["mode"] == "neurons" for pp in projections):
        return []
    return [
        (pp["in_features"] if pp["mode"] == "dense" else pp["rank"], pp["layer"])
        for pp in projections
        if pp["projection"] == NEURON_READER
    ]


def print_sharing(report: dict) -> None:
    """The input-basis forms: each shared basis (run, readers, size, their mean relative whitened error), what
    `--sharing auto` weighed, and the proxy the allocation minimised."""
    sharing = report.get("sharing")
    if not sharing:
        return
    if report.get("sharing_note"):
        console.print(f"[bold]Sharing[/]: {report['sharing_note']}")
    bases = sharing["bases"]
    console.print(
        f"[bold]Shared input bases[/] ({len(bases)}; run: readers size (mean relative whitened error)): "
        + ("  ".join(f"{basis_label(r)} ({r['relative_error']:.3f})" for r in bases) or "none")
    )
    choice = report.get("sharing_choice")
    if choice:
        shared = [c for c in choice["candidates"] if c["chosen"] == "basis"]
        console.print(
            f"[bold]--sharing auto[/]: {len(shared)} of {len(choice['candidates'])} (run, projection type) "
            f"candidates share a basis, in {len(choice['rounds'])} rounds ({choice['rule']})"
        )
    console.print(
        f"[dim]proxy (Σ relative whitened error over matrices): {sharing['proxy_error']:.4f}, "
        f"mean {sharing['proxy_error_mean']:.5f} per matrix; the allocation's objective {sharing['objective']:.4g}[/]"
    )


def register(app: typer.Typer) -> None:
    app.command("compress", cls=HelpCommand)(compress_command)
