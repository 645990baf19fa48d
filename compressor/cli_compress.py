"""`masa-compress compress` (also the bare `masa-compress MODEL ...`): the main job."""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from compressor.cli import DeviceOpt, DtypeOpt, JsonOpt, ModelArg, QuietOpt
from compressor.errors import UserError
from compressor.pipeline import METHODS

console = Console()


def compress_command(
    model: ModelArg,
    ratio: Annotated[
        float,
        typer.Option(
            "--ratio",
            "-r",
            help="Fraction of the targeted parameters (attention by default) to remove, in (0, 1).",
        ),
    ] = 0.2,
    method: Annotated[
        str | None,
        typer.Option("--method", "-m", help=f"One of: {', '.join(METHODS)} (default: the recipe's, masa)."),
    ] = None,
    groups: Annotated[
        int | None, typer.Option("--groups", "-g", min=1, help="Groups of consecutive layers G (recipe: 3).")
    ] = None,
    bases: Annotated[
        int | None,
        typer.Option(
            "--bases",
            "-b",
            min=0,
            help="Shared atoms per group and projection B (recipe: 1; 0 = no sharing).",
        ),
    ] = None,
    largest_group_bases: Annotated[
        int | None,
        typer.Option("--largest-group-bases", min=0, help="Atoms for the largest group (paper's best: 2)."),
    ] = None,
    end_boundaries: Annotated[
        bool | None,
        typer.Option(
            "--end-boundaries/--no-end-boundaries",
            help="May the first/last KL transitions be group boundaries (making the first/last layers "
            "singletons kept whole)? Recipe default: yes (paper).",
        ),
    ] = None,
    logit_lens: Annotated[
        str | None,
        typer.Option("--logit-lens", help="final_norm (standard logit lens, default) or raw (paper)."),
    ] = None,
    allocation: Annotated[
        str | None,
        typer.Option(
            "--allocation",
            help="paper (Algorithm 1 per (Q,K)/(V,O) pair), global, or global-relative (ranks across all "
            "matrices by energy per parameter). Default: the recipe's.",
        ),
    ] = None,
    atoms: Annotated[
        str | None,
        typer.Option(
            "--atoms",
            help="plain (Matrix PCA of the weights, paper) or whitened (atoms minimizing the group's output "
            "error, coefficients refit per layer). Default: the recipe's.",
        ),
    ] = None,
    singletons: Annotated[
        str | None,
        typer.Option(
            "--singletons", help="keep (singleton groups kept whole, paper) or compress (whitened SVD)."
        ),
    ] = None,
    statistics: Annotated[
        str | None,
        typer.Option(
            "--statistics",
            help="original (whitening statistics of the original model, paper) or sequential (layer l's "
            "statistics on the model whose earlier layers are already compressed; ~1 extra forward pass).",
        ),
    ] = None,
    targets: Annotated[
        str | None,
        typer.Option(
            "--targets",
            help="Projections compressed and counted by --ratio: attn (q/k/v/o, default), mlp (gate/up/down), "
            "or attn,mlp (every linear projection of the layers, as Basis Sharing does).",
        ),
    ] = None,
    auto_groups: Annotated[
        bool | None,
        typer.Option(
            "--auto-groups/--fixed-groups",
            help="Choose G (1-8) and B (0-2) by a proxy computed before building anything (the relative "
            "whitened error left under the budget) instead of --groups/--bases; adds ~1-3 min. Default: the recipe's.",
        ),
    ] = None,
    dry_run: Annotated[
        bool,
        typer.Option("--dry-run", help="Only print the plan (same as `masa-compress plan`), no calibration."),
    ] = False,
    calib: Annotated[
        str | None,
        typer.Option(
            "--calib", help="Calibration text: wikipedia (default), a file/dir, or a datasets name."
        ),
    ] = None,
    calib_samples: Annotated[
        int | None,
        typer.Option(
            "--calib-samples", "-n", min=1, help="Calibration windows N (recipe: 64 for smollm2-135m)."
        ),
    ] = None,
    seq_len: Annotated[
        int | None, typer.Option("--seq-len", min=8, help="Tokens per calibration window T (recipe: 512).")
    ] = None,
    seed: Annotated[
        int | None, typer.Option("--seed", help="Seed for calibration window sampling (recipe: 0).")
    ] = None,
    eval_text: Annotated[
        str | None,
        typer.Option(
            "--eval-text",
            help="Evaluation text: wikipedia (default, held out), shakespeare, a file or folder, or a datasets name.",
        ),
    ] = None,
    eval_split: Annotated[
        str | None,
        typer.Option(
            "--eval-split",
            help="Held-out part the perplexity is measured on: test (default, for reporting) or validation "
            "(for choices).",
        ),
    ] = None,
    eval_seq_len: Annotated[
        int | None, typer.Option("--eval-seq-len", min=8, help="Evaluation window length (recipe: 512).")
    ] = None,
    eval_max_tokens: Annotated[
        int | None,
        typer.Option("--eval-max-tokens", min=0, help="Cap on evaluated tokens (default: all; 0 = all)."),
    ] = None,
    no_eval: Annotated[bool, typer.Option("--no-eval", help="Skip the perplexity before/after.")] = False,
    allow_overlap: Annotated[
        bool,
        typer.Option(
            "--allow-overlap",
            help="Evaluate even when the evaluation text is the calibration text (refused by default: a leak).",
        ),
    ] = False,
    compare: Annotated[
        bool,
        typer.Option(
            "--compare/--no-compare",
            help="Score the compressed model against the original in one pass (KL from the original, top-1 "
            "agreement; reloads the original, so both are in memory at the end). --no-compare: perplexity only.",
        ),
    ] = True,
    out: Annotated[
        str | None,
        typer.Option("--out", "-o", help="Checkpoint directory (default: out/<model>-<method>-r<ratio>)."),
    ] = None,
    overwrite: Annotated[
        bool, typer.Option("--overwrite", help="Replace an existing output directory.")
    ] = False,
    no_save: Annotated[
        bool, typer.Option("--no-save", help="Do not write a checkpoint (measure only).")
    ] = False,
    recipe: Annotated[
        str | None, typer.Option("--recipe", help="A recipe YAML file of your own (see recipes/).")
    ] = None,
    batch_size: Annotated[int, typer.Option("--batch-size", min=1, help="Windows per forward pass.")] = 1,
    stats_cache: Annotated[
        bool,
        typer.Option(
            "--stats-cache/--no-stats-cache",
            help="Reuse calibration statistics cached for the same model, text and windows (validated; "
            "in $MASA_CACHE/stats), so another ratio or method skips calibration.",
        ),
    ] = True,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
    as_json: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Compress MODEL's attention by RATIO, write a checkpoint, report perplexity before and after.

    Example: `masa-compress smollm2-135m --ratio 0.2` (offline, ~5 min on 2 CPU cores).
    """
    from compressor.api import CompressOptions, compress

    if dry_run:
        from compressor.cli_inspect import plan_command

        if targets not in (None, "attn"):
            raise UserError(
                f"--dry-run plans attention only: drop --targets {targets} to see the plan, or run without --dry-run"
            )
        if auto_groups:
            raise UserError(
                "--dry-run cannot plan with --auto-groups: G and B are chosen from calibration statistics; "
                "drop --auto-groups (or pass --groups/--bases) to see a plan"
            )

        plan_command(
            model, ratio=ratio, method=method, groups=groups, bases=bases,
            largest_group_bases=largest_group_bases, end_boundaries=end_boundaries, allocation=allocation,
            singletons=singletons, layout=None, recipe=recipe, as_json=as_json,
        )  # fmt: skip
        return
    options = CompressOptions(
        ratio=ratio,
        method=method,
        groups=groups,
        bases=bases,
        largest_group_bases=largest_group_bases,
        end_boundaries=end_boundaries,
        logit_lens=logit_lens,
        allocation=allocation,
        atoms=atoms,
        singletons=singletons,
        statistics=statistics,
        targets=targets,
        auto_groups=auto_groups,
        calib=calib,
        calib_samples=calib_samples,
        seq_len=seq_len,
        seed=seed,
        eval_text=eval_text,
        eval_seq_len=eval_seq_len,
        eval_max_tokens=eval_max_tokens,
        eval_split=eval_split,
        evaluate=not no_eval,
        compare=compare,
        allow_overlap=allow_overlap,
        out=out,
        overwrite=overwrite,
        save=not no_save,
        recipe_file=recipe,
        batch_size=batch_size,
        stats_cache=stats_cache,
    )
    run = compress(model, options, device=device, dtype=dtype, progress=not (quiet or as_json))
    summary = run.summary
    if as_json:
        print(json.dumps({k: v for k, v in summary.items() if k != "plan"}))
        return
    print_summary(summary)


def _fmt_ppl(value: float | None) -> str:
    return "—" if value is None else f"{value:.3f}"


def _fmt_interval(ci: list[float] | None) -> str:
    return "" if not ci else f" [{ci[0]:.3f}, {ci[1]:.3f}]"


def print_summary(summary: dict) -> None:
    grouping = summary["report"].get("grouping")
    if grouping:
        console.print(
            f"[bold]Groups[/] ({grouping['rule']}): "
            + "  ".join(f"[{g[0]}]" if len(g) == 1 else f"[{g[0]}–{g[-1]}]" for g in grouping["groups"])
        )
    search = summary["report"].get("shape_search")
    if search:
        chosen = search["chosen"]
        console.print(
            f"[bold]G and B chosen by the proxy[/]: G={chosen['groups']}, B={chosen['bases']} "
            f"(lowest relative whitened error of {len(search['candidates'])} feasible candidates)"
        )
    table = Table(title=f"masa-compress · {summary['model']} · method {summary['method']}")
    table.add_column("")
    table.add_column("before", justify="right")
    table.add_column("after", justify="right")
    targets = summary.get("targets", "attn")
    table.add_row(
        "attention parameters" if targets == "attn" else f"targeted parameters ({targets})",
        f"{summary['attention_params_before']:,}",
        f"{summary['attention_params_after']:,}",
    )
    table.add_row(
        "model parameters", f"{summary['model_params_before']:,}", f"{summary['model_params_after']:,}"
    )
    table.add_row(
        "ratio removed" + (" of attention" if targets == "attn" else f" of {targets}"),
        f"requested {summary['ratio_requested']:.3f}",
        f"achieved {summary['achieved_ratio']:.4f}",
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
        console.print(
            f"[dim]{quality['tokens']:,} predicted tokens of {quality['evaluation_text']}; brackets: 95% bootstrap "
            "intervals over windows; KL: mean KL divergence from the original, nats/token[/]"
        )
    times = Table(title="time per stage (s)")
    for stage in summary["seconds"]:
        times.add_column(stage, justify="right")
    times.add_row(*(f"{v:.1f}" for v in summary["seconds"].values()))
    console.print(times)
    console.print(
        f"peak memory {summary['peak_rss_gb']:.2f} GB · checkpoint: {summary['out'] or '(not saved)'}"
    )


def register(app: typer.Typer) -> None:
    app.command("compress")(compress_command)
