"""`export`: a compressed checkpoint, or an original model, in the form an engine runs.

`--format gguf` writes a GGUF file for llama.cpp (`checkpoint/gguf_export.py`): the originals export through the
same code, so a baseline and its compressed model differ only by what compression changed. `--format hf` is the
dense Hugging Face checkpoint (`checkpoint/export.py`; it expands factored attention back to full size), with
`layout="deci"` in the DeciLM layout that keeps per-layer MLP widths (vLLM runs it).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from compressor.api.model_loading import ModelSource, gguf_path, load_model, resolve_model
from compressor.checkpoint import export_dense, read_masa_config
from compressor.checkpoint.gguf_export import GgufExport, check_gguf_output, check_gguf_type, write_gguf
from compressor.runtime.errors import UserError
from compressor.runtime.hub import check_hub_model

FORMATS = ("gguf", "hf")
SOURCE_KEY = "masa_compress.source"  # the spec of the original model, in every GGUF this tool writes


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
    tensor_type: str = "f16",
    tokenizer_from: str | None = None,
    layout: str = "padded",
    overwrite: bool = False,
    progress: bool = True,
) -> ExportResult:
    """Write `model` (a checkpoint, an alias, a folder, a .gguf) for an engine; everything the user named is
    checked before any weight is read."""
    if format not in FORMATS:
        raise UserError(f"--format {format}: unknown format: choose one of {', '.join(FORMATS)}")
    if format == "gguf" and layout != "padded":
        raise UserError(
            f"--layout {layout} applies to --format hf (a GGUF's layout follows the shapes): drop it"
        )
    source = resolve_model(model)
    if format == "hf":
        if source.kind != "compressed":
            raise UserError(f"--format hf exports a masa-compress checkpoint; '{model}' is already a model")
        result = export_dense(source.location, out, overwrite=overwrite, layout=layout)
        return ExportResult("hf", result.path, {
            "layout": layout,
            "compressed_bytes": result.compressed_bytes, "dense_bytes": result.dense_bytes,
            "compressed_params": result.compressed_params, "dense_params": result.dense_params,
        })  # fmt: skip
    tensor_type = check_gguf_type(tensor_type)
    out = check_gguf_output(out, overwrite)  # before any weight is read; write_gguf checks it again
    original = original_source(source)
    check_hub_model(source)
    tokenizer_gguf = tokenizer_gguf_of(original, tokenizer_from)
    loaded = load_model(source, device="cpu", dtype="float32", progress=progress)
    written: GgufExport = write_gguf(
        loaded.model,
        tokenizer_gguf,
        out,
        tensor_type=tensor_type,
        name=source.describe(),
        overwrite=overwrite,
        extra_fields={SOURCE_KEY: original.spec if original.kind != "compressed" else ""},
    )
    return ExportResult("gguf", written.path, written.as_dict())


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


def tokenizer_gguf_of(original: ModelSource, tokenizer_from: str | None) -> Path:
    """The GGUF whose tokenizer the export copies: `--tokenizer-from`, else the original's own GGUF file."""
    if tokenizer_from:
        path = Path(tokenizer_from).expanduser()
        if path.suffix != ".gguf" or not path.is_file():
            raise UserError(
                f"--tokenizer-from {tokenizer_from}: not a GGUF file: pass a .gguf of the same model"
            )
        return path
    if original.kind in ("bundled", "gguf"):
        return gguf_path(original)
    raise UserError(
        f"{original.describe()}: has no GGUF to copy the tokenizer from (building one from a Hugging Face "
        "tokenizer needs llama.cpp's converter): pass --tokenizer-from MODEL.gguf, a GGUF of the same model"
    )
