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

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from compressor.checkpoint.gguf_file import gguf_writer

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


def importance_by_tensor(model, importance: Mapping[str, object]) -> tuple[str, dict[str, np.ndarray]]:
    """(the GGUF architecture, each matrix's importance weights under its GGUF tensor name): the vectors
    `write_gguf` hands to the quantizer for the same model, as llama.cpp's imatrix file keys them; shape (n_in,),
    or (experts, n_in) for an experts tensor (every expert reads the same input's statistics here)."""
    from compressor.checkpoint import gguf_families as fam
    from compressor.checkpoint.gguf_export import _gguf_tensors, choose_architecture, layer_shapes
    from compressor.modeling.adapters import get_adapter

    adapter = get_adapter(model)
    widths, heads, kv_heads = layer_shapes(model)
    architecture = choose_architecture(adapter.config.model_type, widths, heads, kv_heads)
    rope_factors = fam.llama3_rope_factors(adapter.config)
    vectors: dict[str, np.ndarray] = {}
    for tensor_name, array, module_path in _gguf_tensors(model, architecture, heads, kv_heads, rope_factors):
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


def read_imatrix(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """The mean squares an imatrix file holds, as `llama-quantize` reads them (in_sum2 / counts), by tensor name;
    shape (n_mat, n_in)."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    tensors = {t.name: np.asarray(t.data, dtype=np.float64) for t in reader.tensors}
    means = {}
    for name, sums in tensors.items():
        if not name.endswith(SUMS):
            continue
        base = name[: -len(SUMS)]
        counts = tensors[base + COUNTS].reshape(-1, 1)
        means[base] = np.atleast_2d(sums) / counts
    return means
