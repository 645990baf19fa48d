"""`export`: a compressed checkpoint, or an original model, in the form an engine runs.

`--format gguf` writes a GGUF file for llama.cpp (`checkpoint/gguf_export.py`): the originals export through the
same code, so a baseline and its compressed model differ only by what compression changed. `--format hf` is the
dense Hugging Face checkpoint (`checkpoint/export.py`; it expands factored attention back to full size), with
`layout="deci"` in the DeciLM layout that keeps per-layer MLP widths (vLLM runs it).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, replace
from pathlib import Path

from compressor.api.model_loading import ModelSource, gguf_path, load_model, resolve_model
from compressor.api.size_time import check_speed_early
from compressor.checkpoint import export_dense, read_masa_config
from compressor.checkpoint.gguf_export import GgufExport, check_config_exports, check_gguf_output, write_gguf
from compressor.checkpoint.gguf_families import ENGINE_GAP
from compressor.checkpoint.imatrix_file import as_read_back, importance_from_file, read_imatrix_file
from compressor.checkpoint.layout import kept_columns
from compressor.quantize.byte_budget import ByteBudget, parse_budget, parse_only_types
from compressor.quantize.gguf_types import check_gguf_type, check_imatrix, is_imatrix_path
from compressor.quantize.importance import Importance
from compressor.quantize.rounding import check_rounding
from compressor.quantize.speed import parse_speed
from compressor.quantize.tensor_types import check_recipe_output, write_recipe
from compressor.recipes.schema import CalibrationSettings
from compressor.runtime.errors import UserError
from compressor.runtime.hub import check_hub_model

FORMATS = ("gguf", "hf")
SOURCE_KEY = "masa_compress.source"  # the spec of the original model, in every GGUF this tool writes
SPEED_KEY = "masa_compress.speed"  # the decode speed a --size file was held to (`--speed`)
ONLY_TYPES_KEY = "masa_compress.only_types"  # the types a --size file was restricted to (`--only-types`)
ROUNDING_KEY = "masa_compress.rounding"  # `--rounding compensated` (absent: llama.cpp's own, nearest)


@dataclass
class ExportResult:
    format: str
    path: Path
    details: dict

    def to_dict(self) -> dict:
        return {"format": self.format, "out": str(self.path), **self.details}


def export(
    model: str,
    out: str | os.PathLike,
    *,
    format: str = "gguf",
    tensor_type: str | None = None,
    tokenizer_from: str | None = None,
    layout: str = "padded",
    imatrix: str | None = None,
    calib_samples: int | None = None,
    size: int | str | None = None,
    bits_per_weight: float | None = None,
    only_types: str | None = None,
    overwrite: bool = False,
    progress: bool = True,
    record: dict[str, str] | None = None,
    imatrix_out: str | os.PathLike | None = None,
    rounding: str | None = None,
    rounding_stream: str = "original",
    tensor_types_out: str | os.PathLike | None = None,
    name: str | None = None,
    speed: str | None = None,
) -> ExportResult:
    """Write `model` (a checkpoint, an alias, a folder, a .gguf) for an engine, all it names checked first.

    `imatrix`: `calibration` weighs each quantized matrix's rounding by its inputs' mean squares over the
    calibration text (the checkpoint's own, else the recipe's, `calib_samples` windows; cached), `none` does not,
    a path reads llama.cpp's importance file (a byte budget's sensitivities still come from the calibration);
    None: `calibration` below 8 bits. `imatrix_out`: also write the measured weights as llama.cpp's imatrix file.

    `size` (bytes, or `850MiB`, `1.2GB`): the GGUF is at most that many bytes, each matrix's type chosen by the
    loss-aware allocation of `quantize/byte_budget.py`; `bits_per_weight` (B): B × the parameters / 8 bytes;
    `only_types` (`q4_k,q3_k,q6_k`): the types it may choose from; `speed` (`any`, `mix`, tokens/s): the least
    decode speed (`quantize/speed.py`). `rounding`: `nearest` (llama.cpp's own, the default) or `compensated`
    (`quantize/rounding.py`), from the `rounding_stream` statistics; `tensor_types_out`: the types as
    `llama-quantize`'s `--tensor-type-file`; `record`: more string fields for the file; `name`: `general.name`."""
    if format not in FORMATS:
        raise UserError(f"--format {format}: unknown format: choose one of {', '.join(FORMATS)}")
    wanted = check_export_options(format, layout, parse_budget(size, bits_per_weight), imatrix_out)
    allowed, target = parse_only_types(only_types, wanted is not None), parse_speed(speed, wanted is not None)
    source = resolve_model(model)
    check_types_fit(source, allowed)
    if format == "hf":
        return _export_hf(source, model, out, overwrite, layout)
    check_hub_model(source)
    if (config := source_config(source)) is not None:  # before any weight or statistic
        check_config_exports(config, budgeted=wanted is not None)
        check_speed_early(config, None if source.kind == "compressed" else wanted, target, allowed, progress)
    tensor_type, use_importance = check_quantization(tensor_type, imatrix, wanted, calib_samples, imatrix_out)
    rounding = check_rounding(rounding, None if wanted is not None else tensor_type, imatrix)
    out, imatrix_out, tensor_types_out = check_outputs(out, imatrix_out, tensor_types_out, overwrite, imatrix)
    given = read_imatrix_file(imatrix) if is_imatrix_path(imatrix) else None  # llama.cpp's file, read now
    # Measured: the weights a file uses or --imatrix-out writes, a budget's sensitivities (compensation: the windows)
    measure = (use_importance and given is None) or wanted is not None or imatrix_out is not None
    original = original_source(source)
    check_hub_model(original)
    tokenizer = tokenizer_source(original, tokenizer_from)
    needs_text = measure or rounding == "compensated"
    calibration, calib_text = importance_text(source, original, calib_samples) if needs_text else (None, None)
    loaded = load_model(source, device="cpu", dtype="float32", progress=progress)
    budget = None if wanted is None else wanted.bytes_for(sum(p.numel() for p in loaded.model.parameters()))
    measured, imatrix_note = export_importance(loaded, given, (calibration, calib_text) if measure else None,
                                               progress, source)  # fmt: skip
    rounder = (compensated_rounder(loaded, calibration, calib_text, progress, rounding_stream, out)
               if rounding == "compensated" else None)  # fmt: skip
    with rounder or contextlib.nullcontext():
        chooser = budget and budget_chooser(loaded.model, measured, budget, progress, allowed, rounder, target)  # fmt: skip
        written: GgufExport = write_gguf(
            loaded.model, tokenizer, out, tensor_type=tensor_type, name=name or source.describe(), overwrite=overwrite,
            extra_fields=recorded_fields(original, record, allowed, rounding, target), choose_types=chooser, rounding=rounder,
            importance=measured.weights if use_importance else None, imatrix_note=imatrix_note if use_importance else "",
        )  # fmt: skip
    details = export_details(written, rounder, chooser and (budget, chooser), loaded.model)
    if imatrix_out is not None:
        details["imatrix_file"] = write_imatrix_of(loaded.model, measured, imatrix_note, imatrix_out)
    if tensor_types_out is not None:
        details["tensor_types_file"] = write_recipe(
            written.path, tensor_types_out, recipe_importance(use_importance, imatrix, imatrix_out)
        ) | {"input_command": f"masa-compress export {model} MODEL-F32.gguf --type f32"}
    return ExportResult("gguf", written.path, details)


def export_details(written: GgufExport, rounder, budgeted: tuple | None, model) -> dict:
    """What `export` reports of a GGUF it wrote: the file, the compensated rounding's record, a byte budget's
    (bytes, its chooser: the predicted loss rise, the speed limit's record), and what the engine computes
    differently for this family (`ENGINE_GAP`)."""
    details = written.as_dict() | ({"rounding": rounder.record.to_dict()} if rounder else {})
    if budgeted:
        budget, chooser = budgeted
        details |= {"type": "size", "budget": budget, "predicted_loss_rise": chooser.plan.predicted}
        details |= {"speed": chooser.speed_plan.to_dict()} if chooser.speed_plan else {}
    model_type = model.config.model_type
    return details | ({"engine_note": ENGINE_GAP[model_type]} if model_type in ENGINE_GAP else {})


def recipe_importance(use_importance: bool, imatrix: str | None, imatrix_out) -> str | None:
    """The importance file the recipe's `llama-quantize` command names: "" without importance weights, the file
    read or written, None (a placeholder) when the weights were measured and not written."""
    if not use_importance:
        return ""
    return str(imatrix) if is_imatrix_path(imatrix) else str(imatrix_out) if imatrix_out is not None else None


def check_outputs(out, imatrix_out, tensor_types_out, overwrite: bool, imatrix: str | None) -> tuple:
    """The GGUF's, the imatrix file's and the recipe's paths, or a one-line error, before any weight is read
    (`write_gguf` checks the GGUF's again)."""
    out = check_gguf_output(out, overwrite)
    if imatrix_out is not None:
        imatrix_out = check_imatrix_output(imatrix_out, out, overwrite, imatrix)
    if tensor_types_out is not None:
        tensor_types_out = check_recipe_output(tensor_types_out, [out, imatrix_out], overwrite)
    return out, imatrix_out, tensor_types_out


def export_importance(loaded, given, calibration: tuple | None, progress: bool, source=None) -> tuple:
    """(the importance weights the export quantizes with, the line the file records of where they came from):
    llama.cpp's importance file `given` (its names and widths checked against this model before any calibration;
    of a compressed checkpoint `source`, the file of its original, read at the columns each narrowed matrix
    keeps), the calibration's (`calibration`: its settings and text, or None when nothing is measured), or, under
    a byte budget, the file's weights with the calibration's output sensitivities."""
    from_file = None
    if given is not None:
        kept = None
        if source is not None and source.kind == "compressed":
            kept = kept_columns(loaded.model, read_masa_config(source.location)["layout"])
        from_file = Importance(importance_from_file(loaded.model, given, kept), 0, 0, 0.0)
    if calibration is None:
        return from_file, given.describe() if given is not None else ""
    measured, note = measure_for_export(loaded, *calibration, progress)
    if from_file is None:
        return measured, note
    key = f"{measured.key}+imatrix:{given.digest}"  # what was measured with these weights is theirs
    return replace(measured, weights=from_file.weights, key=key), given.describe()


def budget_chooser(model, measured, budget: int, progress: bool, allowed, rounder=None, target=None):
    """`write_gguf`'s `choose_types` for a byte budget (`quantize/byte_budget.py`), pricing the errors of the
    compensated rounding where the `rounder` is one, within the decode speed `target` (None: any)."""
    from compressor.quantize.budget_chooser import BudgetChooser

    compensated = None if rounder is None else rounder.errors
    return BudgetChooser(model, measured, budget, progress, allowed, compensated, target)


def compensated_rounder(
    loaded, calibration: CalibrationSettings, calib_text, progress: bool, stream: str, out: Path
):
    """`rounding.CompensatedRounder` on the calibration windows the importance weights are measured on."""
    from compressor.api.session import calibration_token_windows
    from compressor.quantize.rounding import CompensatedRounder

    windows = calibration_token_windows(loaded.tokenizer, calibration, calib_text)
    return CompensatedRounder(loaded.model, windows, progress, stream, out)


def importance_text(source: ModelSource, original: ModelSource, calib_samples: int | None) -> tuple:
    """(the calibration the importance weights are measured on, its text's documents)."""
    from compressor.calibration.sources import load_documents

    calibration = importance_calibration(source, original, calib_samples)
    return calibration, load_documents(calibration.source, split="calibration")


def recorded_fields(
    original: ModelSource, record: dict[str, str] | None, allowed, rounding: str = "nearest", target=None
) -> dict[str, str]:
    """The tool's own fields in a GGUF it writes: the original's spec, `record`, `--only-types`'s set,
    `--rounding` where it is not llama.cpp's own, and `--speed` where one was asked."""
    fields = {SOURCE_KEY: original.spec if original.kind != "compressed" else "", **(record or {})}
    fields |= {ROUNDING_KEY: rounding} if rounding != "nearest" else {}
    fields |= {SPEED_KEY: target.describe()} if target is not None else {}
    return fields | ({ONLY_TYPES_KEY: ",".join(sorted(allowed)).lower()} if allowed else {})


def check_export_options(
    format: str, layout: str, wanted: ByteBudget | None, imatrix_out
) -> ByteBudget | None:
    """The byte budget, or a one-line error for the options that belong to the other format."""
    if format == "gguf" and layout != "padded":
        raise UserError(
            f"--layout {layout} applies to --format hf (a GGUF's layout follows the shapes): drop it"
        )
    if wanted is not None and format != "gguf":
        raise UserError(f"{wanted.flag} sets a GGUF file's bytes: use --format gguf (OUT.gguf)")
    if imatrix_out is not None and format != "gguf":
        raise UserError("--imatrix-out writes llama.cpp's importance matrix: use --format gguf (OUT.gguf)")
    return wanted


def _export_hf(source: ModelSource, model: str, out, overwrite: bool, layout: str) -> ExportResult:
    """`--format hf`: the dense Hugging Face checkpoint of a masa-compress checkpoint."""
    if source.kind != "compressed":
        raise UserError(f"--format hf exports a masa-compress checkpoint; '{model}' is already a model")
    result = export_dense(source.location, out, overwrite=overwrite, layout=layout)
    return ExportResult("hf", result.path, {
        "layout": layout,
        "compressed_bytes": result.compressed_bytes, "dense_bytes": result.dense_bytes,
        "compressed_params": result.compressed_params, "dense_params": result.dense_params,
    })  # fmt: skip


def check_quantization(
    tensor_type: str | None,
    imatrix: str | None,
    wanted: ByteBudget | None,
    calib_samples: int | None,
    writes_imatrix=None,
) -> tuple[str, bool]:
    """(the --type written, whether its quantization uses importance weights), or a one-line error for options
    that do not go together. With a byte budget every matrix's type is the budget's: f16 is the type
    `write_gguf` is handed, its `choose_types` decides. `writes_imatrix`: an imatrix file's path (the weights
    are then measured for it anyway, so `calib_samples` applies)."""
    if wanted is not None:
        from compressor.quantize.ggml_quantize import check_quantizer

        if tensor_type is not None:
            raise UserError(f"{wanted.flag} chooses every matrix's type: drop --type {tensor_type}")
        if imatrix == "none":
            raise UserError(
                f"{wanted.flag} weighs each type's rounding by the calibration: drop --imatrix none"
            )
        check_quantizer()
        tensor_type, use_importance = "f16", True
    else:
        tensor_type = check_gguf_type(tensor_type or "f16")
        use_importance = check_imatrix(tensor_type, imatrix)
    measured = (use_importance and not is_imatrix_path(imatrix)) or wanted is not None
    if calib_samples is not None and not (measured or writes_imatrix is not None):
        raise UserError(
            "--calib-samples sets the importance weights' windows: it needs --imatrix calibration or --imatrix-out"
        )
    return tensor_type, use_importance


def check_imatrix_output(imatrix_out: str | os.PathLike, out: Path, overwrite: bool, imatrix=None) -> Path:
    """The imatrix file's path, or a one-line error: not a .gguf name, the model's own path, it exists, or the
    weights come from a file already (`--imatrix FILE`)."""
    path = Path(imatrix_out)
    if is_imatrix_path(imatrix):
        raise UserError(
            f"--imatrix-out writes the calibration's weights, --imatrix {imatrix} reads others: drop one"
        )
    if path.suffix != ".gguf":
        raise UserError(f"--imatrix-out {path}: llama.cpp's imatrix file is a GGUF: name it FILE.gguf")
    if path.resolve() == out.resolve():
        raise UserError(f"--imatrix-out {path}: the model's own path: name the imatrix file differently")
    if path.exists() and not overwrite:
        raise UserError(f"{path}: already exists: pass --overwrite or choose another path")
    return path


def write_imatrix_of(model, measured, note: str, out: Path) -> dict:
    """`measured` importance weights of `model` as llama.cpp's imatrix file at `out` (GGUF tensor names): what
    was written."""
    from compressor.checkpoint.imatrix_file import importance_by_tensor, write_imatrix

    architecture, vectors = importance_by_tensor(model, measured.weights)
    return write_imatrix(
        out, vectors, tokens=measured.tokens, chunks=measured.windows,
        chunk_size=measured.tokens // max(measured.windows, 1), dataset=note, architecture=architecture,
    ).to_dict()  # fmt: skip


def measure_for_export(loaded, calibration: CalibrationSettings, calib_text, progress: bool):
    """The importance weights of the loaded model on its calibration windows (cached), with the output
    sensitivities a byte budget reads; and the line the GGUF records of where they came from."""
    from compressor.api.session import calibration_token_windows
    from compressor.quantize.byte_budget import GRADIENT_WINDOWS
    from compressor.quantize.importance import cached_importance
    from compressor.runtime.progress import note as note_line

    windows = calibration_token_windows(loaded.tokenizer, calibration, calib_text)
    # One pass serves every export of this model: the sensitivities a byte budget reads are measured (and cached)
    # with the importance weights even for a --type, so a --size after it measures nothing again.
    measured = cached_importance(loaded.model, calib_text.fingerprint, windows, progress, GRADIENT_WINDOWS)
    if measured.note.startswith("cached in "):
        note_line(f"Importance weights and sensitivities: from cache ({measured.note.removeprefix('cached in ')})",
                  enabled=progress)  # fmt: skip
    weights = as_read_back(measured.weights, measured.tokens)  # as the imatrix file holds them
    measured = replace(measured, weights=weights, key=f"{measured.key}+read-back")
    note = (
        f"{calib_text.name}: {windows.shape[0]} windows of {windows.shape[1]} tokens, seed {calibration.seed}"
    )
    return measured, note


def importance_calibration(
    source: ModelSource, original: ModelSource, samples: int | None = None
) -> CalibrationSettings:
    """The calibration the importance weights are measured on: a checkpoint's own (as its run recorded it), else
    the recipe's, else the defaults; `samples` windows where given."""
    settings = CalibrationSettings()
    if original.recipe is not None:
        settings = original.recipe.calibration
    if source.kind == "compressed":
        recorded = (read_masa_config(source.location).get("metadata") or {}).get("settings") or {}
        recorded = recorded.get("calibration") or {}
        fields = {k: recorded[k] for k in ("source", "samples", "seq_len", "seed") if k in recorded}
        settings = settings.model_copy(update=fields)
    if samples is not None:
        if samples < 1:
            raise UserError(f"--calib-samples {samples}: must be at least 1")
        settings = settings.model_copy(update={"samples": samples})
    return settings


def smallest_from_config(config, targets: str | None, allowed: frozenset[str] | None = None) -> int:
    """`byte_structure.smallest_matrices` from a model's config (no weights read), within the `allowed` types: a
    set some matrix's rows cannot take is refused here, in one line naming the matrix."""
    from compressor.api.run_options import NATIVE_FORMS
    from compressor.methods.masa.byte_structure import smallest_matrices
    from compressor.modeling.adapters import geometry_from_config

    tied = bool(getattr(config, "tie_word_embeddings", False))
    return smallest_matrices(
        geometry_from_config(config), config.num_hidden_layers, config.vocab_size, tied, targets,
        NATIVE_FORMS["width_multiple"], allowed,
    )  # fmt: skip


def source_config(source: ModelSource):
    """The model's config, read without its weights (a checkpoint's, its original's: the same family); None for a
    checkpoint whose original is not recorded or gone (`write_gguf` checks the family once it is loaded)."""
    from compressor.api.preview import read_model_config

    if source.kind == "compressed":
        source = original_source(source)
        if source.kind == "compressed":
            return None
    return read_model_config(source)[0]


def check_types_fit(source: ModelSource, allowed: frozenset[str] | None) -> None:
    """`--only-types` against an original model's shapes, before any weight is read (a compressed checkpoint's
    shapes are its own: the type choice checks them once it is loaded)."""
    if allowed and source.kind != "compressed":
        from compressor.api.preview import read_model_config

        smallest_from_config(read_model_config(source)[0], None, allowed)


def original_source(source: ModelSource) -> ModelSource:
    """The model a checkpoint was compressed from (as recorded), or the model itself."""
    if source.kind != "compressed":
        return source
    recorded = read_masa_config(source.location).get("metadata", {}).get("source") or {}
    for spec in (recorded.get("spec"), recorded.get("location")):
        if not spec:
            continue
        try:
            return resolve_model(spec)
        except UserError:
            continue
    return source  # unrecorded or gone: only --tokenizer-from can name the tokenizer then


def tokenizer_source(original: ModelSource, tokenizer_from: str | None, fix: str | None = None) -> Path:
    """Where the export's tokenizer comes from: `--tokenizer-from` (a GGUF), else the original's own GGUF file, else
    its Hugging Face folder (converted as llama.cpp's converter converts it); checked here, before any weight is
    read. `fix`: what a refusal tells the user to do (default: pass --tokenizer-from)."""
    from compressor.checkpoint.gguf_tokenizer import FLAG, tokenizer_fields

    fix = fix or f"pass {FLAG}"

    if tokenizer_from:
        path = Path(tokenizer_from).expanduser()
        if path.suffix != ".gguf" or not path.is_file():
            raise UserError(
                f"--tokenizer-from {tokenizer_from}: not a GGUF file: pass a .gguf of the same model"
            )
        return path
    if original.kind in ("bundled", "gguf"):
        return gguf_path(original)
    if original.kind == "hf_dir":
        folder = Path(original.location)
    elif original.kind == "hub":
        folder = hub_tokenizer_folder(original)
    else:
        raise UserError(
            f"{original.describe()}: the model it was compressed from is not recorded or gone: {fix}"
        )
    tokenizer_fields(folder, fix)  # a tokenizer llama.cpp would not recognize fails here, in one line
    return folder


def hub_tokenizer_folder(source: ModelSource) -> Path:
    """The local folder of a hub model's tokenizer and config files (downloaded, or from the cache)."""
    from huggingface_hub import snapshot_download

    patterns = ["config.json", "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "*.jinja"]
    return Path(snapshot_download(
        source.location, revision=source.revision, allow_patterns=patterns, local_files_only=source.local_only,
    ))  # fmt: skip
