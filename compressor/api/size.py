"""`compress --size`: a GGUF of at most SIZE bytes whose structure (each MLP's width, each attention's query
heads) and every matrix's quantization type come from one loss-aware allocation (`methods/masa/byte_structure.py`).

1. Checks before any weight is read: the budget, the output (OUT.gguf), options that a byte budget decides itself
   (`--ratio`, `--method`, the forms), the family's llama.cpp architecture, a GGUF to copy the tokenizer from.
2. The original's importance weights and output sensitivities on the recipe's calibration (cached: the same that
   `export --imatrix calibration` measures), and the file's bytes that no type changes (metadata, tokenizer).
3. `compress` in the engine-native forms with that byte budget (`--layerwise` where only it fits): the method
   chooses the widths and head counts with the types; the checkpoint goes to a temporary folder beside OUT.
4. `export --size` of that checkpoint (of the original when the allocation removed nothing): each matrix's type is
   allocated again on the weights as written, under the exact bytes, so the file is at most SIZE.
5. Unless told not to, the file is scored in llama.cpp against the original.

Families whose llama.cpp architecture takes one MLP width and head count for every layer (all but Llama, Mistral
and Qwen2: `gguf_families.PER_LAYER_FAMILIES`) keep their structure: the file is `export --size`'s types alone.
So does a unit whose refit would read too few calibration tokens per input (`byte_structure.trusted_targets`): the
1.5B model's MLPs on its recipe's 32 windows, whose error on the calibration is a fraction of its error on new text.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass, replace
from pathlib import Path

from compressor.api.export import (
    SOURCE_KEY,
    export,
    export_importance,
    importance_text,
    smallest_from_config,
    tokenizer_source,
)
from compressor.api.model_loading import check_window_fits, load_model, resolve_model
from compressor.api.preview import model_parameter_count, read_model_config
from compressor.api.run_options import CompressOptions, EvalSettings, resolve_eval_settings
from compressor.api.size_time import check_speed_early
from compressor.checkpoint.gguf_export import (
    UNIFORM_ARCHITECTURE,
    check_config_exports,
    check_gguf_output,
    planned_fixed_bytes,
)
from compressor.checkpoint.gguf_families import per_layer_refusal
from compressor.checkpoint.imatrix_file import read_imatrix_file
from compressor.methods.masa.byte_structure import (
    STRUCTURE_FLOOR,
    STRUCTURE_WEIGHT,
    UNIT_NAMES,
    SizeTarget,
    trusted_targets,
)
from compressor.quantize.byte_budget import check_fits, parse_budget, parse_only_types
from compressor.quantize.gguf_types import is_imatrix_path
from compressor.quantize.speed import describe_speed, parse_speed
from compressor.runtime.errors import UserError
from compressor.runtime.hub import check_hub_model
from compressor.runtime.progress import note

#: The forms a byte budget chooses itself: options that would set them are refused with `--size`.
DECIDED = {"method": "--method", "sharing": "--sharing", "attention": "--attention", "mlp": "--mlp",
           "allocation": "--allocation", "uniform_mlp": "--uniform-mlp"}  # fmt: skip


@dataclass
class SizeRun:
    """What `compress_to_size` wrote and measured (`summary`: the CLI's table and `--json`)."""

    summary: dict


def check_size_options(options: CompressOptions, ratio_given: bool) -> None:
    """One line for each option a byte budget decides itself, before anything is read."""
    flag = "--size" if options.size is not None else "--bits-per-weight"
    if ratio_given:
        raise UserError(
            f"{flag} and --ratio both set how much is removed: keep one ({flag} sets the file's bytes)"
        )
    for name, option in DECIDED.items():
        if getattr(options, name) is not None:
            raise UserError(f"{flag} chooses the engine-native forms and their sizes itself: drop {option}")
    if options.ratio_of != "targets":
        raise UserError(f"{flag} counts bytes, not a share of the parameters: drop --ratio-of")
    parse_only_types(options.only_types)
    parse_speed(options.speed)
    if options.imatrix is not None and not is_imatrix_path(options.imatrix):
        raise UserError(
            f"--imatrix {options.imatrix}: {flag} weighs each type's rounding by the calibration (the default) or "
            "by llama.cpp's importance file: pass FILE (imatrix.gguf or .dat), or drop --imatrix"
        )


def structure_targets(model: str, config, options: CompressOptions) -> tuple[str | None, str]:
    """What the allocation may narrow (`--targets` form, None: nothing) and why, for the family, the options and
    the calibration the structure's run reads (`byte_structure.trusted_targets`: a refit fitted on too few tokens
    per input is not offered)."""
    from compressor.api.session import resolve_run
    from compressor.modeling.adapters import geometry_from_config, target_projections

    model_type = config.model_type
    if per_layer_refusal(model_type):
        return (
            None,
            f"{model_type}: its llama.cpp architecture takes one MLP width for all layers: types only",
        )
    geometry = geometry_from_config(config)
    widths = {"attn": geometry.input_size("o"), "mlp": geometry.input_size("down")}

    def windows_for(targets: str) -> tuple[int, int]:
        calibration = resolve_run(model, native_options(options, targets)).calibration
        return calibration.samples, calibration.seq_len

    asked = options.targets or "attn,mlp"
    target_projections(asked)  # an unknown target: its one-line error, before anything is left out
    targets, left_out = trusted_targets(asked, widths, windows_for)
    what = " and ".join(UNIT_NAMES[t] for t in ("mlp", "attn") if t in (targets or "").split(","))
    return targets, "; ".join([what or "types only", *left_out])


def native_options(options: CompressOptions, targets: str) -> CompressOptions:
    """The options of the `compress` run that builds the structure: the engine-native forms of `targets`, every
    width down to the floor on offer, no byte budget of its own. Its refit is `calibration` unless `--refit` is
    given: `--native`'s stream refit was chosen on validation at a fixed ratio, and under a byte budget it would
    also rewrite the matrices of the layers the allocation keeps whole (so "remove nothing" would no longer be
    the types alone); measured there, on the bundled model's validation split, it tied
    (`benchmarks/experiments/size_refit`)."""
    return replace(options, ratio=1.0 - STRUCTURE_FLOOR, targets=targets, native=True, allocation="global",
                   size=None, bits_per_weight=None, refit=options.refit or "calibration")  # fmt: skip


def default_out(model: str, flag_value: str) -> str:
    stem = Path(model.rstrip("/")).name.removesuffix(".gguf") or "model"
    return f"out/{stem}-{flag_value}.gguf"


@dataclass
class _Prepared:
    """What the structure's allocation and the export share: the budget, the file's fixed bytes, the original's
    importance weights and the calibration they were measured on."""

    budget: int
    fixed: int
    measured: object
    calibration: object
    calib_text: object


def compress_to_size(
    model: str,
    options: CompressOptions,
    device: str = "auto",
    dtype: str = "auto",
    progress: bool = True,
    structure_weight: float = STRUCTURE_WEIGHT,
) -> SizeRun:
    """Write MODEL as a GGUF of at most `options.size` bytes (or `bits_per_weight`), structure and types chosen
    together; score it in llama.cpp against the original unless `options.evaluate` is off. `structure_weight`: κ,
    the weight of the structure's predicted rise (the default was chosen on validation; experiments vary it)."""
    start = time.perf_counter()
    wanted = parse_budget(options.size, options.bits_per_weight)
    if wanted is None:
        raise ValueError("compress_to_size needs options.size or options.bits_per_weight")
    label = str(options.size or f"{options.bits_per_weight:g}bpw").replace(" ", "")
    out = check_gguf_output(options.out or default_out(model, label), options.overwrite)
    source, config, targets, structure_note = check_source(model, options, wanted, progress)
    # The file is scored in llama.cpp, whose context is the config's: a window too long is known before any work.
    if options.evaluate:
        window = resolve_eval_settings(EvalSettings(seq_len=options.eval_seq_len), None).seq_len
        check_window_fits(out.name, window, getattr(config, "max_position_embeddings", None))
    note(f"[dim]structure: {structure_note}[/]", progress)
    structure_options = None
    if (
        targets is not None
    ):  # its memory checked, --layerwise chosen where only it fits, before any weight is read
        structure_options = fitting(
            model, config, structure_run(options, targets, out), device, dtype, progress
        )
    planned = size_time(
        model, source, config, options, structure_options, wanted.bytes_for(model_parameter_count(config))
    )
    seconds: dict[str, float] = {}
    t = time.perf_counter()
    prepared = measure_original(source, config, targets, wanted, options, device, progress)
    seconds["importance"] = time.perf_counter() - t
    structure: dict = {"targets": targets, "note": structure_note}
    work = out.parent / f".{out.stem}.structure-{os.getpid()}"
    try:
        exported_from = model
        if structure_options is not None:
            target = SizeTarget(prepared.budget, prepared.fixed, prepared.measured, structure_weight,
                                parse_only_types(options.only_types))  # fmt: skip
            run_options = replace(structure_options, out=str(work), byte_target=target)
            summary = _compress(model, run_options, device, dtype, progress)
            structure |= summary["report"]["byte_budget"]
            structure["removed_parameters"] = summary["model_params_before"] - summary["model_params_after"]
            structure.pop("forecast_types", None)
            seconds |= {f"structure_{k}": v for k, v in summary["seconds"].items()}
            exported_from = str(work) if structure["removed_parameters"] else model
        t = time.perf_counter()
        written = export(
            exported_from, out, size=prepared.budget, calib_samples=prepared.calibration.samples, imatrix=options.imatrix,
            only_types=options.only_types, rounding=options.rounding, overwrite=options.overwrite, progress=progress,
            record={"masa_compress.structure": _record(structure)}, speed=options.speed,
            name=source.describe(),  # not the structure's temporary folder: the same command, the same bytes
        ).details  # fmt: skip
        seconds["export"] = time.perf_counter() - t
    finally:
        shutil.rmtree(work, ignore_errors=True)
    note(f"[green]Wrote[/] {out}", progress)
    summary = {
        "model": source.describe(), "out": str(out), "budget": prepared.budget, "budget_flag": wanted.flag,
        "bytes": written["bytes"], "parameters": written["parameters"],
        "bits_per_weight": 8 * written["bytes"] / written["parameters"], "architecture": written["architecture"],
        "type_counts": written["type_counts"], "predicted_loss_rise": written.get("predicted_loss_rise"),
        "structure": structure, "mlp_widths": written["mlp_widths"], "heads": written["heads"],
        "speed": written.get("speed"),
        "importance": {"windows": prepared.calibration.samples, "text": prepared.calib_text.name,
                       **({"file": written["imatrix"]} if options.imatrix else {})},
    }  # fmt: skip
    if options.evaluate:
        t = time.perf_counter()
        summary["quality"] = _score(out, options, device, dtype, progress)
        seconds["eval"] = time.perf_counter() - t
    seconds["total"] = time.perf_counter() - start
    summary["seconds"] = {k: round(v, 3) for k, v in seconds.items()}
    summary["seconds_planned"] = planned["stages"] | {"total": planned["total"]}
    return SizeRun(summary)


def size_time(model: str, source, config, options: CompressOptions, structure_options, budget: int) -> dict:
    """`size_time.size_time_estimate` of this run: its importance pass's calibration, its evaluation, and the
    structure's `compress` run (`structure_options`, None: types only) as `compress` would make it."""
    from compressor.api.export import importance_calibration
    from compressor.api.session import resolve_run
    from compressor.api.size_time import size_time_estimate
    from compressor.runtime.device import resolve_device

    evaluation = None
    if options.evaluate:
        evaluation = resolve_eval_settings(EvalSettings(
            text=options.eval_text, split=options.eval_split, seq_len=options.eval_seq_len,
            max_tokens=options.eval_max_tokens or None), None)  # fmt: skip
    structure = (
        None if structure_options is None else (resolve_run(model, structure_options), structure_options)
    )
    importance = importance_calibration(source, source, options.calib_samples)
    gpu = resolve_device("auto").type == "cuda"
    return size_time_estimate(
        config, importance, evaluation, budget, structure, gpu, options.rounding == "compensated", options.speed,
        parse_only_types(options.only_types),
    )  # fmt: skip


#: What to do when a folder's tokenizer cannot be converted (compress has no --tokenizer-from).
GGUF_FIX = "pass the model as its .gguf file (its tokenizer is copied from it)"


def check_size_family(config) -> None:
    """A family with no llama.cpp architecture, or a configuration its architecture would compute differently,
    refused from the config alone (`--size` writes a GGUF)."""
    if config.model_type not in UNIFORM_ARCHITECTURE:
        raise UserError(
            f"model_type '{config.model_type}': llama.cpp has no architecture for it here: --size writes a GGUF "
            f"(families with one: {', '.join(UNIFORM_ARCHITECTURE)})"
        )
    check_config_exports(config, budgeted=True)


def check_source(model: str, options: CompressOptions, wanted, progress: bool = True):
    """(source, config, what the allocation may narrow, why), or a one-line error before any weight is read: a
    family llama.cpp does not run here, a tokenizer llama.cpp would not take, a budget below the matrices' least,
    a `--speed` of tokens per second no file of the types alone reaches (a structure may make one faster)."""
    source = resolve_model(model)
    check_hub_model(source)
    config = read_model_config(source)[0]
    check_size_family(config)
    targets, structure_note = structure_targets(model, config, options)
    tokenizer_source(
        source, None, GGUF_FIX
    )  # a tokenizer llama.cpp would not take: refused before any weight
    allowed = parse_only_types(options.only_types)
    check_least_bytes(config, targets, wanted, allowed)
    if targets is None:  # a structure may make a file faster: then refused once the calibration priced it
        check_speed_early(config, wanted, parse_speed(options.speed), allowed, progress)
    if options.imatrix is not None:
        read_imatrix_file(options.imatrix)  # unreadable: one line before any weight (names: once loaded)
    return source, config, targets, structure_note


def measure_original(source, config, targets, wanted, options, device, progress) -> _Prepared:
    """The budget in bytes, the file's fixed bytes (the smallest file checked against them before any
    calibration), and the original's importance weights with their output sensitivities (cached; with `--imatrix
    FILE`, the file's weights, checked against the model before the calibration, and the calibration's
    sensitivities)."""
    tokenizer = tokenizer_source(source, None, GGUF_FIX)  # checked by `check_source` already
    calibration, calib_text = importance_text(source, source, options.calib_samples)
    loaded = load_model(source, device=device, dtype="float32", progress=progress)
    budget = wanted.bytes_for(sum(p.numel() for p in loaded.model.parameters()))
    fixed = planned_fixed_bytes(loaded.model, tokenizer, source.describe(), {SOURCE_KEY: source.spec})
    check_fits(fixed + smallest_from_config(config, targets, parse_only_types(options.only_types)), budget)
    given = read_imatrix_file(options.imatrix) if options.imatrix is not None else None
    measured, _ = export_importance(loaded, given, (calibration, calib_text), progress)
    return _Prepared(budget, fixed, measured, calibration, calib_text)


def structure_run(options: CompressOptions, targets: str, out: Path) -> CompressOptions:
    """The `compress` run that builds the structure: the engine-native forms of `targets`, no evaluation (the GGUF
    is scored instead), its checkpoint to a temporary folder beside `out` (set when it runs)."""
    return replace(
        native_options(options, targets), evaluate=False, save=True, overwrite=True,
        out=str(out.parent / ".structure"),
    )  # fmt: skip


def fitting(model: str, config, run_options: CompressOptions, device: str, dtype: str, progress: bool):
    """`run_options` with `--layerwise` where the run fits only so (the 1.5B model's MLP statistics: about 34 GiB
    in memory), said in a line; a one-line error where it fits neither way (`memory_check.check_memory`)."""
    from compressor.api.memory_check import check_memory, run_memory
    from compressor.api.session import resolve_run

    estimate = run_memory(config, resolve_run(model, run_options), run_options, device, dtype)
    available = estimate["available_bytes"]
    if not run_options.layerwise and available is not None and estimate["in_memory_bytes"] > available:
        if estimate["layerwise_bytes"] <= available:
            note(f"[dim]the structure's statistics need about {estimate['in_memory_bytes'] / 2**30:.1f} GiB in memory: "
                 "compressing layer by layer (--layerwise, the same checkpoint)[/]", progress)  # fmt: skip
            return replace(run_options, layerwise=True)
    check_memory(estimate)
    return run_options


def _compress(model, options, device, dtype, progress) -> dict:
    from compressor.api.run import compress

    return compress(model, options, device=device, dtype=dtype, progress=progress).summary


def check_least_bytes(config, targets: str | None, wanted, allowed: frozenset[str] | None = None) -> None:
    """A one-line error, before any weight is read, when the matrices alone in their smallest types exceed the
    budget (the exact check, metadata and tokenizer counted, follows once the model is loaded)."""
    least = smallest_from_config(config, targets, allowed)
    budget = wanted.bytes_for(model_parameter_count(config))
    if least > budget:
        raise UserError(
            f"{wanted.flag} {budget:,} bytes: the smallest file this model can make is more than {least:,} bytes "
            f"({least / 2**20:.1f} MiB: every matrix in its smallest type, before the metadata and tokenizer): "
            "ask for more"
        )


def _record(structure: dict) -> str:
    """What the GGUF records of its structure's allocation (`show FILE.gguf` prints it)."""
    keys = ("targets", "note", "removed_parameters", "predicted_loss_rise", "structure_loss_rise",
            "quantization_loss_rise", "structure_weight")  # fmt: skip
    return json.dumps({k: structure[k] for k in keys if k in structure})


def _score(out: Path, options: CompressOptions, device: str, dtype: str, progress: bool) -> dict:
    """The file in llama.cpp against the original in transformers, on the evaluation the options name."""
    from compressor.api.run import evaluate

    settings = EvalSettings(
        text=options.eval_text, split=options.eval_split, seq_len=options.eval_seq_len,
        max_tokens=options.eval_max_tokens or None, engine="llama.cpp",
    )  # fmt: skip
    return evaluate(str(out), settings, device=device, dtype=dtype, progress=progress).to_dict()


def runs_layerwise(memory: dict) -> bool:
    """Whether the structure's run goes layer by layer: asked, or the only way it fits in the memory free now (as
    `fitting` chooses for the run)."""
    free = memory["available_bytes"]
    return bool(
        memory["layerwise"] or (free and memory["in_memory_bytes"] > free >= memory["layerwise_bytes"])
    )


def plan_size(model: str, options: CompressOptions, ratio_given: bool = False) -> dict:
    """What `compress --size` would do, from the config alone (no weights, no calibration): the budget in bytes and
    bits per weight, what the allocation may narrow (the widths and head counts it chooses from), and the memory
    the run needs. The widths and types themselves follow from the calibration."""
    from compressor.api.memory_check import memory_estimate
    from compressor.api.session import resolve_run
    from compressor.methods.masa.byte_structure import candidate_widths
    from compressor.runtime.device import resolve_device

    check_size_options(options, ratio_given)
    wanted = parse_budget(options.size, options.bits_per_weight)
    source = resolve_model(model)
    config = read_model_config(source)[0]
    check_size_family(config)
    targets, note_ = structure_targets(model, config, options)
    structure_options = None
    allowed = parse_only_types(options.only_types)
    parameters = model_parameter_count(config)
    budget = wanted.bytes_for(parameters)
    result = {
        "model": source.describe(), "parameters": parameters, "budget": budget, "budget_flag": wanted.flag,
        "bits_per_weight": 8 * budget / parameters, "f16_bytes": 2 * parameters, "structure": note_,
        "candidates": {}, "memory": None,
        "smallest_matrices": smallest_from_config(config, targets, allowed), "only_types": sorted(allowed or []),
        "speed": describe_speed(options.speed),
        "after_calibration": {"attn": "each attention's heads and every matrix's type",
                              "mlp": "each MLP's width and every matrix's type", None: "every matrix's type"}.get(
            targets, "each MLP's width, each attention's heads and every matrix's type"),
    }  # fmt: skip
    if targets is not None:
        run_options = native_options(options, targets)
        run = resolve_run(model, run_options)
        heads = config.num_attention_heads // config.num_key_value_heads
        result["candidates"] = {
            "mlp_widths": candidate_widths(config.intermediate_size, run.compression.width_multiple or 1)
            if "mlp" in targets else [],
            "heads_per_kv_group": list(range(heads, -(-heads // 2) - 1, -1)) if "attn" in targets else [],
        }  # fmt: skip
        gpu = resolve_device("auto").type == "cuda"
        result["memory"] = memory = memory_estimate(config, run, run_options, gpu=gpu)
        structure_options = structure_run(options, targets, Path(default_out(model, "plan")))
        if runs_layerwise(memory):
            structure_options = replace(structure_options, layerwise=True)
    result["time"] = size_time(model, source, config, options, structure_options, budget)
    return result
