"""A GGUF's per-tensor types as `llama-quantize`'s recipe: `--tensor-type` overrides, one per matrix, in the file
`--tensor-type-file` reads (`tools/quantize/quantize.cpp`), with the command line that applies them.

`llama-quantize` matches each override's name as a regular expression against the tensor names (`std::regex_search`,
the first match wins, `src/llama-quant.cpp`), so every name is anchored and escaped: `^blk\\.3\\.attn_q\\.weight$`.
Its file format has no comments (each whitespace-separated word is one `NAME=TYPE`), so the command line travels
beside the file, not in it. Applied to the same original weights with the same importance file, it writes the
tensors this tool wrote with `--rounding nearest` (a test builds `llama-quantize` from the vendored sources and
checks it); the file's structure (per-layer widths, `deci`) must be the original's: a recipe only chooses types.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from compressor.runtime.errors import UserError


def tensor_type_overrides(gguf_path: str | os.PathLike) -> dict[str, str]:
    """Each matrix's GGML type in a GGUF file, by tensor name (`rope_freqs`, a table, is not a weight)."""
    import gguf

    reader = gguf.GGUFReader(str(gguf_path))
    return {
        t.name: t.tensor_type.name.lower()
        for t in reader.tensors
        if len(t.shape) == 2 and not t.name.startswith("rope_freqs")
    }


def recipe_lines(types: dict[str, str]) -> list[str]:
    """`NAME=TYPE` lines `llama-quantize --tensor-type-file` reads, every name an anchored, escaped pattern."""
    return [f"^{re.escape(name)}$={type_name}" for name, type_name in types.items()]


def file_type_name(gguf_path: str | os.PathLike) -> str:
    """The file type `llama-quantize` takes as its last argument for this file (`Q4_K_M`, `F16`): the one the file
    records (it only names the file: every matrix is overridden)."""
    import gguf

    reader = gguf.GGUFReader(str(gguf_path))
    field = reader.fields.get("general.file_type")
    if field is None:
        return "Q8_0"
    return gguf.LlamaFileType(int(field.contents())).name.removeprefix("MOSTLY_").removeprefix("ALL_")


def check_recipe_output(path: str | os.PathLike, taken: list[Path], overwrite: bool) -> Path:
    """The recipe's path, or a one-line error: one of the other outputs' paths, or it exists."""
    path = Path(path)
    if any(path.resolve() == Path(other).resolve() for other in taken if other is not None):
        raise UserError(f"--tensor-types-out {path}: another output's path: name the recipe differently")
    if path.exists() and not overwrite:
        raise UserError(f"{path}: already exists: pass --overwrite or choose another path")
    return path


def write_recipe(gguf_path: str | os.PathLike, out: str | os.PathLike, imatrix: str | None = None) -> dict:
    """Write the GGUF's per-tensor types as `llama-quantize`'s `--tensor-type-file` at `out` (atomically): what
    was written and the command line that applies it (`imatrix`: the importance file to name in it; None: a
    placeholder; "": the file was quantized without one)."""
    types = tensor_type_overrides(gguf_path)
    out = Path(out)
    temporary = out.with_name(out.name + ".partial")
    temporary.write_text("\n".join(recipe_lines(types)) + "\n", encoding="utf-8")
    os.replace(temporary, out)
    command = quantize_command(out, file_type_name(gguf_path), imatrix)
    return {"path": str(out), "tensors": len(types), "command": command}


def quantize_command(recipe: Path, file_type: str, imatrix: str | None) -> str:
    """The `llama-quantize` command line that applies the recipe to the original model in f32 (or f16)."""
    importance = "" if imatrix == "" else f"--imatrix {imatrix or 'IMATRIX.gguf'} "
    return f"llama-quantize {importance}--tensor-type-file {recipe} MODEL-F32.gguf OUT.gguf {file_type}"
