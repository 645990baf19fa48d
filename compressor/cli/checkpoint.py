"""`masa-compress show` (what a checkpoint holds) and `export` (the model in the form an engine runs: a GGUF for
llama.cpp, or a dense Hugging Face checkpoint; `export-dense` is `export --format hf` for one more release)."""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

import compressor.cli.options as o
from compressor.api.inspection import describe_checkpoint
from compressor.checkpoint import export_dense
from compressor.cli.gguf_report import print_export_summary, print_tensor_types, show_gguf
from compressor.cli.help import HelpCommand
from compressor.math.accounting import NEURON_READER
from compressor.methods import get_method
from compressor.modeling.adapters import MLP_PROJECTIONS, PROJECTIONS
from compressor.recipes.schema import CompressionSettings
from compressor.report import basis_label, group_label
from compressor.runtime.errors import UserError

console = Console()


def export_command(
    model: Annotated[
        str,
        typer.Argument(
            metavar="MODEL", help="A checkpoint, or an original (alias, folder, .gguf) as the baseline."
        ),
    ],
    out: Annotated[
        str, typer.Argument(metavar="OUT", help="Where to write: OUT.gguf, or a folder for --format hf.")
    ],
    format: Annotated[
        str,
        typer.Option(
            "--format",
            metavar="FORMAT",
            help="gguf (llama.cpp) or hf (dense attention, narrower MLP: smaller than the original only when "
            "the MLP was narrowed).",
        ),
    ] = "gguf",
    tensor_type: Annotated[
        str | None,
        typer.Option(
            "--type",
            metavar="TYPE",
            help=(
                "GGUF matrices: f32, f16, bf16, q8_0, q5_0, q4_0, or llama.cpp's mixes q6_k, q5_k_m, q5_k_s, "
                "q4_k_m, q4_k_s, q3_k_l, q3_k_m, q3_k_s, q2_k and the i-quants iq4_xs, iq4_nl, iq3_m, iq3_s, "
                "iq3_xxs, iq2_xs, iq2_xxs (by llama.cpp's quantizer, with llama-quantize's type per tensor; rows "
                "that do not fill whole blocks fall back, listed) (default: f16)."
            ),
        ),
    ] = None,
    size: Annotated[
        str | None,
        typer.Option(
            "--size",
            metavar="SIZE",
            help="The GGUF's bytes at most (e.g. 90MiB, 1.2GB): each matrix's type chosen by one loss-aware "
            "allocation over the calibration's importance weights and sensitivities, instead of a --type mix.",
        ),
    ] = None,
    bits_per_weight: Annotated[
        float | None,
        typer.Option(
            "--bits-per-weight",
            metavar="B",
            help="--size as llama.cpp's bits per weight: at most B × the model's parameters / 8 bytes "
            "(e.g. 4.5).",
        ),
    ] = None,
    only_types: Annotated[
        str | None,
        typer.Option(
            "--only-types",
            metavar="TYPES",
            help="--size: the types the matrices may take (e.g. q4_k,q3_k,q5_k,q6_k,q8_0,f16; default: every "
            "candidate, i-quants included). On a CPU llama.cpp decodes k-quants faster than IQ3_S.",
        ),
    ] = None,
    imatrix: Annotated[
        str | None,
        typer.Option(
            "--imatrix",
            metavar="SOURCE",
            help="calibration: weigh each matrix's rounding by its inputs' mean squares on the calibration text "
            "(llama.cpp's importance matrix, measured on this model; cached), none, or FILE: llama.cpp's importance "
            "file (imatrix.gguf or .dat; of the original for a checkpoint) (default: calibration below 8 bits).",
        ),
    ] = None,
    calib_samples: Annotated[
        int | None,
        typer.Option(
            "--calib-samples",
            metavar="N",
            help="Calibration windows the importance weights are measured on (default: the checkpoint's or "
            "the recipe's samples).",
        ),
    ] = None,
    imatrix_out: Annotated[
        str | None,
        typer.Option(
            "--imatrix-out",
            metavar="FILE.gguf",
            help="Also write the importance weights (measured on the calibration text, as --imatrix calibration "
            "measures them) as llama.cpp's imatrix file, for `llama-quantize --imatrix FILE.gguf` "
            "(e.g. with --type f16).",
        ),
    ] = None,
    rounding: o.Rounding = None,
    speed: o.Speed = None,
    tensor_types_out: Annotated[
        str | None,
        typer.Option(
            "--tensor-types-out",
            metavar="FILE",
            help="Also write each matrix's type as llama-quantize's --tensor-type-file, and print the "
            "llama-quantize command that applies it to the original (with --imatrix-out's file).",
        ),
    ] = None,
    tokenizer_from: Annotated[
        str | None,
        typer.Option(
            "--tokenizer-from",
            metavar="FILE.gguf",
            help="A GGUF of the same model whose tokenizer to copy (default: the source's own GGUF; a Hugging "
            "Face folder's tokenizer is converted as llama.cpp's converter does).",
        ),
    ] = None,
    layout: Annotated[
        str,
        typer.Option(
            "--layout",
            metavar="LAYOUT",
            help="--format hf: padded (every MLP as wide as the widest) or deci (per-layer widths, DeciLM "
            "layout: vLLM runs it).",
        ),
    ] = "padded",
    overwrite: o.Overwrite = False,
    as_json: o.Json = False,
) -> None:
    """The model in the form an engine runs: a GGUF file for llama.cpp, or a Hugging Face folder for vLLM.

    Same shapes in every layer: llama.cpp's own architecture (llama, qwen2); per-layer MLP widths or head
    counts: its `deci` architecture. What `compress --native` writes exports (whole heads, narrower MLPs); a
    low-rank or shared attention has no engine form and is refused. Score the file with
    `masa-compress eval OUT.gguf --engine llama.cpp`. `--format hf --layout deci` keeps per-layer MLP widths
    in the DeciLM layout that vLLM serves.
    """
    from compressor.api.export import export

    result = export(
        model, out, format=format, tensor_type=tensor_type, tokenizer_from=tokenizer_from, layout=layout,
        imatrix=imatrix, calib_samples=calib_samples, size=size, bits_per_weight=bits_per_weight,
        only_types=only_types, overwrite=overwrite, progress=not as_json, imatrix_out=imatrix_out,
        rounding=rounding, tensor_types_out=tensor_types_out, speed=speed,
    )  # fmt: skip
    if as_json:
        print(json.dumps(result.to_dict()))
        return
    if result.format == "hf":
        _print_dense(result.to_dict())
        return
    print_export_summary(result.path, result.details)


def export_dense_command(
    path: Annotated[str, typer.Argument(metavar="CHECKPOINT", help="A checkpoint written by masa-compress.")],
    out: Annotated[str, typer.Argument(metavar="OUT", help="Where to write the dense checkpoint.")],
    overwrite: o.Overwrite = False,
    as_json: o.Json = False,
) -> None:
    """Same as `export CHECKPOINT OUT --format hf` (this name goes in the next release): a plain Hugging Face
    model, never smaller than the checkpoint.

    For runtimes that take only dense weights: it loads without trust_remote_code and gives the same logits.
    The attention is expanded to dense matrices, the MLP kept at its narrower width: smaller than the original
    only when the MLP was narrowed.
    """
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
    _print_dense(payload)


def _print_dense(payload: dict) -> None:
    if payload.get("layout") == "deci":
        console.print(
            f"Wrote {payload['out']} in the DeciLM layout (DeciLMForCausalLM, per-layer MLP widths; vLLM serves it "
            f"with trust_remote_code): {payload['dense_params']:,} parameters, {payload['dense_bytes'] / 2**20:.1f} "
            f"MiB ({payload['compressed_params']:,} in the checkpoint: query heads it dropped are zero heads here)."
        )
        return
    console.print(
        f"Wrote a dense checkpoint to {payload['out']}: {payload['dense_params']:,} parameters, "
        f"{payload['dense_bytes'] / 2**20:.1f} MiB on disk, vs {payload['compressed_params']:,} parameters and "
        f"{payload['compressed_bytes'] / 2**20:.1f} MiB compressed. [bold]It is not smaller than the checkpoint[/]"
        " (the attention is dense again): use it only for runtimes that need dense weights."
    )


def show_command(
    path: Annotated[
        str,
        typer.Argument(metavar="CHECKPOINT", help="A checkpoint written by masa-compress, or a .gguf file."),
    ],
    tensor_types: Annotated[
        bool,
        typer.Option(
            "--tensor-types",
            help="Of a GGUF file: print each matrix's type as llama-quantize's --tensor-type overrides "
            "(the lines --tensor-type-file reads).",
        ),
    ] = False,
    as_json: o.Json = False,
) -> None:
    """What a compressed checkpoint holds: settings, groups, ranks; of a GGUF file, each matrix's type."""
    if tensor_types:
        print_tensor_types(path)
        return
    if path.endswith(".gguf"):
        show_gguf(path, as_json)
        return
    info = describe_checkpoint(path)
    if as_json:
        print(json.dumps(info))
        return
    table = Table(title=f"masa-compress checkpoint · {info['path']}", show_header=False)
    for key, value in _checkpoint_rows(info):
        table.add_row(key, value)
    console.print(table)
    console.print(_ranks_table(info))
    if info["kept_by_type"]:
        console.print(_kept_table(info["kept_by_type"]))


def _kept_table(rows: list[dict]) -> Table:
    """Where the budget went, per projection type (the run's allocation.png draws it per layer)."""
    table = Table(title="kept fraction of the dense numbers, per projection type")
    for column in ("projection", "kept", "least kept (layer)", "most kept (layer)"):
        table.add_column(column, justify="left" if column == "projection" else "right")
    for r in rows:
        table.add_row(
            r["projection"], f"{r['kept']:.1%}", f"{r['least_kept']:.1%} ({r['least_kept_layer']})",
            f"{r['most_kept']:.1%} ({r['most_kept_layer']})",
        )  # fmt: skip
    return table


def _checkpoint_rows(info: dict) -> list[tuple[str, str]]:
    """(what, value) rows describing a checkpoint, from `describe_checkpoint`."""
    source = info["source"]
    if isinstance(source, dict):
        source = f"{source.get('spec')} ({source.get('kind')}: {source.get('location')})"
    made = [info["tool"], f"format {info['format_version']}"]
    if info["device"]:
        made.append(f"on {info['device']}")
    if info["seconds"] is not None:
        made.append(f"in {info['seconds']:.0f} s")
    rows = [
        ("source", str(source)),
        ("recipe", info["recipe"] or "—"),
        ("architecture", f"{info['base_architecture']} · stored as {info['dtype']}"),
        ("created", f"{info['created']} · " + " · ".join(made)),
        ("method", str(info["method"])),
        (
            "ratio",
            _ratio_row(info),
        ),
    ]
    if info["target_params_before"] is not None:
        rows.append(
            (
                "attention parameters"
                if info["targets"] == ["q_proj", "k_proj", "v_proj", "o_proj"]
                else f"targeted parameters ({'/'.join(p.removesuffix('_proj') for p in info['targets'])})",
                f"{info['target_params_before']:,} → {info['target_params_after']:,}",
            )
        )
    if info["total_params"] is not None:
        rows.append(("model parameters", f"{info['total_params']:,}"))
    if info["ppl_before"] is not None or info["ppl_after"] is not None:
        fmt = lambda v: "—" if v is None else f"{v:.3f}"  # noqa: E731
        rows.append(("perplexity", f"{fmt(info['ppl_before'])} → {fmt(info['ppl_after'])}"))
    cal = info["calibration"]
    if cal:
        rows.append(
            (
                "calibration",
                f"{cal.get('samples')} × {cal.get('seq_len')} tokens of {cal.get('text', cal.get('source'))}, seed {cal.get('seed')}",
            )
        )
    comp = info["compression"]
    if comp:
        rows.append(("settings", ", ".join(f"{k}={v}" for k, v in _settings_read(comp).items())))
    bases = info.get("shared_bases") or []
    if bases:
        rows.append(("shared input bases", "  ".join(basis_label(b) for b in bases)))
    elif info["groups"]:
        groups = "  ".join(
            f"{group_label(g['layers'])} " + (f"B={g['n_atoms']}" if len(g["layers"]) > 1 else "alone")
            for g in info["groups"]
        )
        rows.append(("groups", groups + (f"  ({info['grouping_rule']})" if info["grouping_rule"] else "")))
    rows.append(("weights", f"{info['weights_bytes'] / 2**20:.1f} MiB in {len(info['files'])} file(s)"))
    return rows


def _settings_read(comp: dict) -> dict:
    """The compression settings that the checkpoint's method read (the atoms form's G and B are not shown for a
    shared basis), none that is unset; all that are set when the settings are not this version's."""
    try:
        settings = CompressionSettings.model_validate(comp)
        read = get_method(settings.method).settings_read_for(settings) | {"method", "targets"}
    except (ValueError, UserError):  # pydantic's ValidationError is a ValueError
        read = set(comp)
    return {k: v for k, v in comp.items() if k in read and v is not None}


def _ratio_row(info: dict) -> str:
    """What was asked and what the targets lost: `0.2 of the model requested (0.2534 of the targets), achieved
    0.2534 of the targets`, or for a ratio of the targets `requested 0.2, achieved 0.2000`."""
    achieved = "" if info["achieved_ratio"] is None else f", achieved {info['achieved_ratio']:.4f}"
    if info.get("ratio_of") == "model":
        return (
            f"{info['user_ratio']:g} of the model requested ({info['ratio_requested']:.4f} of the targets)"
            + (f"{achieved} of the targets" if achieved else "")
        )
    return f"requested {info['ratio_requested']:g}{achieved}"


def _ranks_table(info: dict) -> Table:
    """Per layer: the rank of every compressed projection (atoms in brackets, ◇ a shared basis's readers), and an
    MLP in `neurons` mode as its one width."""
    named = [p for p in (*PROJECTIONS, *MLP_PROJECTIONS) if any(p in row for row in info["ranks"])]
    neurons = any(row.get(f"{p}_mode") == "neurons" for row in info["ranks"] for p in MLP_PROJECTIONS)
    columns = [p for p in named if not (neurons and p in MLP_PROJECTIONS)] + (
        ["mlp width"] if neurons else []
    )
    ranks = Table(
        title="per layer: rank of each projection · (B) B atoms · ◇ reads a shared input basis of this size"
        + (" · mlp width: neurons kept" if neurons else "")
    )
    for col in ("layer", "mode", "group", *(c.removesuffix("_proj") for c in columns)):
        ranks.add_column(col, justify="right" if col != "mode" else "left")
    for row in info["ranks"]:
        cells = [_rank_cell(row, NEURON_READER if c == "mlp width" else c) for c in columns]
        ranks.add_row(
            str(row["layer"]), row["mode"], "—" if row["group"] is None else str(row["group"]), *cells
        )
    return ranks


def _rank_cell(row: dict, p: str) -> str:
    mode = row.get(f"{p}_mode", row["mode"])  # checkpoints read before per-projection modes
    if mode == "dense":
        return "whole"
    if mode == "basis":
        return f"{row.get(p)} ◇"
    atoms = row.get(f"{p}_atoms", 0)
    return f"{row.get(p)}" + (f" ({atoms})" if atoms else "")


def register(app: typer.Typer) -> None:
    app.command("show", cls=HelpCommand)(show_command)
    app.command("export", cls=HelpCommand)(export_command)
    app.command("export-dense", cls=HelpCommand)(export_dense_command)
