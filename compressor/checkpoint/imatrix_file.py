"""llama.cpp's importance-matrix file (`imatrix.gguf`): the tool's own importance weights, for `llama-quantize
--imatrix FILE` and every tool that reads that file.

The format is the one `llama-imatrix` writes and `llama-quantize` reads (llama.cpp's `tools/imatrix`,
`tools/quantize`): a GGUF whose `general.type` is `imatrix`, with `imatrix.datasets` (strings),
`imatrix.chunk_count` and `imatrix.chunk_size` (u32), and per matrix, under its GGUF tensor name, two F32 tensors:
`NAME.in_sum2`, the sum over the tokens of each input column's square (ggml shape [n_in, n_mat]: one row per
expert, one row for a dense matrix), and `NAME.counts`, the tokens summed ([1, n_mat]). The quantizer divides
one by the other: the mean squares `quantize.importance` measures, what `export --imatrix calibration` hands
to `ggml_quantize_chunk` itself.
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from compressor.checkpoint.gguf_file import gguf_writer
from compressor.modeling.adapters import get_adapter
from compressor.runtime.errors import UserError

#: The GGUF keys and tensor suffixes of llama.cpp's imatrix file.
DATASETS_KEY, CHUNK_COUNT_KEY, CHUNK_SIZE_KEY = (
    "imatrix.datasets",
    "imatrix.chunk_count",
    "imatrix.chunk_size",
)
SUMS, COUNTS = ".in_sum2", ".counts"


@dataclass(frozen=True)
class ImatrixFile:
    path: Path
    entries: int  # matrices with importance weights
    tokens: int  # calibration tokens each entry was summed over
    chunks: int  # windows
    chunk_size: int  # tokens per window

    def to_dict(self) -> dict:
        return {"path": str(self.path), "entries": self.entries, "tokens": self.tokens,
                "chunks": self.chunks, "chunk_size": self.chunk_size}  # fmt: skip


def write_imatrix(
    out: str | os.PathLike,
    mean_squares: dict[str, np.ndarray],
    *,
    tokens: int,
    chunks: int,
    chunk_size: int,
    dataset: str,
    architecture: str = "",
) -> ImatrixFile:
    """Write `mean_squares` (GGUF tensor name → each input column's mean square; shape (n_in,), or (n_mat, n_in)
    for experts) as llama.cpp's imatrix file at `out`, atomically (a temporary sibling renamed into place)."""
    if not mean_squares:
        raise ValueError("no importance weights to write")
    if tokens < 1:
        raise ValueError(f"tokens {tokens}: an imatrix needs at least one token")
    out = Path(out)
    with gguf_writer(out, architecture) as writer:
        writer.add_type("imatrix")
        writer.add_array(DATASETS_KEY, [dataset])
        writer.add_uint32(CHUNK_COUNT_KEY, chunks)
        writer.add_uint32(CHUNK_SIZE_KEY, chunk_size)
        for name, vector in sorted(mean_squares.items()):
            rows = np.atleast_2d(np.asarray(vector, dtype=np.float64))  # (n_mat, n_in)
            if not np.isfinite(rows).all() or (rows < 0).any():
                raise ValueError(f"{name}: importance weights must be finite and non-negative")
            writer.add_tensor(name + SUMS, (rows * tokens).astype(np.float32))
            writer.add_tensor(name + COUNTS, np.full((rows.shape[0], 1), tokens, dtype=np.float32))
    return ImatrixFile(out, len(mean_squares), tokens, chunks, chunk_size)


def as_read_back(weights: Mapping[str, torch.Tensor], tokens: int) -> dict[str, torch.Tensor]:
    """`weights` (mean squares over `tokens`) as `llama-quantize` reads them back from the file `write_imatrix`
    writes: float32 sums divided by the float32 count. The export quantizes with these, so `--imatrix calibration`,
    `--imatrix FILE` with the file `--imatrix-out` wrote and `llama-quantize --imatrix FILE` give the same blocks."""
    count = np.float32(tokens)
    return {
        path: torch.from_numpy(
            ((v.double().cpu().numpy() * tokens).astype(np.float32) / count).astype(np.float64)
        )
        for path, v in weights.items()
    }


def gguf_tensors_of(model):
    """(the GGUF architecture `write_gguf` writes the model in, its tensors as (GGUF name, array, module path))."""
    from compressor.checkpoint import gguf_families as fam
    from compressor.checkpoint.gguf_export import _gguf_tensors, choose_architecture, layer_shapes

    config = get_adapter(model).config
    widths, heads, kv_heads = layer_shapes(model)
    architecture = choose_architecture(config.model_type, widths, heads, kv_heads)
    rope_factors = fam.llama3_rope_factors(config)
    return architecture, _gguf_tensors(model, architecture, heads, kv_heads, rope_factors)


def importance_by_tensor(model, importance: Mapping[str, object]) -> tuple[str, dict[str, np.ndarray]]:
    """(the GGUF architecture, each matrix's importance weights under its GGUF tensor name): the vectors
    `write_gguf` hands to the quantizer for the same model, as llama.cpp's imatrix file keys them; shape (n_in,),
    or (experts, n_in) for an experts tensor (every expert reads the same input's statistics here)."""
    architecture, tensors = gguf_tensors_of(model)
    vectors: dict[str, np.ndarray] = {}
    for tensor_name, array, module_path in tensors:
        vector = importance.get(module_path) if array.ndim >= 2 else None
        if vector is None:
            continue
        vector = vector.double().cpu().numpy()
        if vector.shape != (array.shape[-1],):
            raise ValueError(
                f"{tensor_name}: {vector.shape[0]} importance weights for {array.shape[-1]} inputs"
            )
        vectors[tensor_name] = np.tile(vector, (array.shape[0], 1)) if array.ndim == 3 else vector
    return architecture, vectors


@dataclass(frozen=True)
class ImatrixData:
    """What an importance file holds, as `llama-quantize` reads it."""

    path: Path
    means: dict[
        str, np.ndarray
    ]  # tensor name -> each input column's mean square, (n_mat, n_in), float32 values
    format: str  # "gguf" or "legacy" (`llama-imatrix --output-format dat`, the `.dat` of older llama.cpp)
    datasets: tuple[str, ...]
    chunks: int
    digest: str = ""  # sha256 of the file's bytes (what a cache of results measured with it is keyed by)

    def describe(self) -> str:
        """The line a GGUF records of where its importance weights came from."""
        text = ", ".join(self.datasets) or "dataset not recorded"
        return f"{self.path.name} ({self.format} imatrix: {text}; {self.chunks} chunks)"


def read_imatrix(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """The mean squares an imatrix file holds, by tensor name, shape (n_mat, n_in) (`read_imatrix_file`)."""
    return read_imatrix_file(path).means


def read_imatrix_file(path: str | os.PathLike) -> ImatrixData:
    """An importance file in either format `llama-imatrix` writes (GGUF, or the legacy binary `.dat`), divided as
    `llama-quantize`'s `load_imatrix` divides it (float32: GGUF sums by their counts, legacy values by their
    calls); a one-line error for a file that is neither."""
    path = Path(path)
    if not path.is_file():
        raise UserError(
            f"--imatrix {path}: no such file: pass llama.cpp's importance file (imatrix.gguf or .dat)"
        )
    raw = path.read_bytes()  # once: the legacy format is parsed from it, and its digest keys what it weighs
    try:
        data = _read_gguf_imatrix(path) if raw[:4] == b"GGUF" else _read_legacy_imatrix(raw, path)
        return replace(data, digest=hashlib.sha256(raw).hexdigest())
    except (ValueError, KeyError, IndexError, UnicodeDecodeError) as err:
        raise UserError(
            f"--imatrix {path}: not an importance file llama.cpp writes ({err}): pass the output of llama-imatrix"
        ) from None


def _read_gguf_imatrix(path: Path) -> ImatrixData:
    import gguf

    reader = gguf.GGUFReader(str(path))
    tensors = {t.name: np.asarray(t.data, dtype=np.float32) for t in reader.tensors}
    means = {}
    for name, sums in tensors.items():
        if not name.endswith(SUMS):
            continue
        base = name[: -len(SUMS)]
        if base + COUNTS not in tensors:
            raise ValueError(f"{name} without {base + COUNTS}")
        counts = np.rint(tensors[base + COUNTS].reshape(-1))  # llama.cpp rounds the counts to integers
        rows = sums.reshape(counts.size, -1)
        means[base] = np.where(
            counts[:, None] > 0, rows / np.maximum(counts, 1).astype(np.float32)[:, None], 1
        )
    if not means:
        raise ValueError(f"no {SUMS} tensors")
    fields = reader.fields
    datasets = tuple(fields[DATASETS_KEY].contents()) if DATASETS_KEY in fields else ()
    chunks = int(fields[CHUNK_COUNT_KEY].contents()) if CHUNK_COUNT_KEY in fields else 0
    return ImatrixData(path, {k: v.astype(np.float32) for k, v in means.items()}, "gguf", datasets, chunks)


def _read_legacy_imatrix(data: bytes, path: Path) -> ImatrixData:
    """`common_imatrix_load_legacy` on the file's bytes: int32 entries; per entry the name's length and bytes,
    int32 calls, int32 values, float32 values (mean squares times calls); then, optionally, int32 chunks and the
    dataset's name."""
    offset = 0

    def take(fmt: str):
        nonlocal offset
        if offset + struct.calcsize(fmt) > len(data):
            raise ValueError(f"it ends early, at byte {len(data)}")
        values = struct.unpack_from(fmt, data, offset)
        offset += struct.calcsize(fmt)
        return values

    (entries,) = take("<i")
    if entries < 1 or entries > 1_000_000:
        raise ValueError(f"{entries} entries")
    means = {}
    for _ in range(entries):
        (length,) = take("<i")
        name = data[offset : offset + length].decode("utf-8")
        offset += length
        calls, count = take("<ii")
        if count < 1:
            raise ValueError(f"{name}: {count} values")
        if offset + 4 * count > len(data):
            raise ValueError(f"it ends early, inside {name}")
        values = np.frombuffer(data, dtype="<f4", count=count, offset=offset).astype(np.float32)
        offset += 4 * count
        means[name] = (values / np.float32(calls) if calls > 0 else values)[None, :]
    chunks, datasets = 0, ()
    if offset + 4 <= len(data):
        (chunks,) = take("<i")
        if offset + 4 <= len(data):
            (length,) = take("<i")
            datasets = (data[offset : offset + length].decode("utf-8", "replace"),) if length > 0 else ()
    return ImatrixData(path, means, "legacy", datasets, chunks)


def importance_from_file(
    model, imatrix: ImatrixData, kept: dict[str, tuple[int, np.ndarray]] | None = None
) -> dict[str, torch.Tensor]:
    """The file's importance weights by module path (what `write_gguf` hands to the quantizer), or a one-line error
    naming the first entry that is not this model's (a name it has no matrix of, or another width). An experts
    tensor's per-expert rows are averaged (the tool holds one vector per experts tensor); matrices the file has
    no entry for get none, as `llama-quantize` quantizes them. `kept`: a compressed checkpoint's narrowed matrices
    (module path -> the original's input width and the columns they read, `checkpoint/layout.kept_columns`),
    whose weights are the original's entry at those columns: the file of the original serves its compressed
    model."""
    architecture, tensors = gguf_tensors_of(model)
    matrices = {name: (array.shape[-1], path) for name, array, path in tensors if array.ndim >= 2}
    layers = len(get_adapter(model).layers)
    weights: dict[str, torch.Tensor] = {}
    for name, rows in sorted(imatrix.means.items()):
        if name not in matrices:
            raise UserError(
                f"--imatrix {imatrix.path}: entry {name} names no matrix of this model ({architecture}, "
                f"{layers} layers): pass the importance file of this model"
            )
        width, module_path = matrices[name]
        original_width, columns = (kept or {}).get(module_path, (None, None))
        if rows.shape[-1] == original_width:
            rows = rows[..., columns]  # the original's weights of the columns the narrowed matrix reads
        if rows.shape[-1] != width:
            unmapped = kept is not None and module_path not in kept  # a checkpoint's matrix of another width
            raise UserError(
                f"--imatrix {imatrix.path}: entry {name} has {rows.shape[-1]} weights for {width} inputs: "
                + ("the checkpoint records no original columns for it (not a native form, or written before they "
                   "were recorded): pass an importance file of the checkpoint itself" if unmapped else
                   "pass the importance file of this model")
            )  # fmt: skip
        weights[module_path] = torch.from_numpy(rows.astype(np.float64).mean(axis=0))
    return weights
