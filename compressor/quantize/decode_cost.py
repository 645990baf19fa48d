"""What each GGML type costs llama.cpp to decode on this CPU, measured with ggml's own kernels, and the decode time
a file's types predict.

Decoding one token multiplies every matrix (the embedding excepted: a row lookup) by one activation vector, so it
streams each matrix's blocks once through its type's dot-product kernel. The probe times exactly that kernel:
`ggml_get_type_traits_cpu(type)->vec_dot` of the installed llama.cpp (the xllamacpp library, through ctypes, one
call over 2^24 weights, the activations quantized to the kernel's own `vec_dot_type` as llama.cpp does), one thread,
the median of 7 calls. Nanoseconds per weight per type, measured in a few seconds and cached per CPU and llama.cpp
build (`~/.cache/masa-compress/decode-cost/`). A file's predicted decode time per token is Σ weights × cost over
its matrices; attention over the context and the rest of the graph are left out, so the prediction is for short
contexts, and ratios between two files of one model are what it is for.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import json
import os
import time
from pathlib import Path

import numpy as np

from compressor.runtime.cache_root import atomic_write_bytes, cache_dir
from compressor.runtime.device import cpu_name
from compressor.runtime.errors import UserError

#: The weights one timed call streams: far beyond the caches, as a model's matrices are.
PROBE_WEIGHTS = 1 << 24
PROBE_REPEATS = 7
COST_FORMAT = 1


class _Traits(ctypes.Structure):  # ggml-cpu.h: struct ggml_type_traits_cpu
    _fields_ = [
        ("from_float", ctypes.c_void_p),
        ("vec_dot", ctypes.c_void_p),
        ("vec_dot_type", ctypes.c_int),
        ("nrows", ctypes.c_int64),
    ]


_VEC_DOT = ctypes.CFUNCTYPE(
    None, ctypes.c_int, ctypes.POINTER(ctypes.c_float), ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t,
    ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
)  # fmt: skip
_FROM_FLOAT = ctypes.CFUNCTYPE(None, ctypes.POINTER(ctypes.c_float), ctypes.c_void_p, ctypes.c_int64)


def _library():
    spec = importlib.util.find_spec("xllamacpp.xllamacpp")
    if spec is None or spec.origin is None:
        raise UserError(
            "decode costs are measured with llama.cpp's kernels: pip install 'masa-compress[gguf]'"
        )
    library = ctypes.CDLL(spec.origin)
    library.ggml_get_type_traits_cpu.restype = ctypes.POINTER(_Traits)
    library.ggml_get_type_traits_cpu.argtypes = [ctypes.c_int]
    library.ggml_cpu_init()
    return library, spec.origin


def cost_key(origin: str) -> str:
    """This CPU and llama.cpp build: what the measured costs belong to."""
    stat = os.stat(origin)
    spec = f"{COST_FORMAT}:{cpu_name()}:{origin}:{stat.st_size}:{stat.st_mtime_ns}"
    return hashlib.sha256(spec.encode()).hexdigest()[:32]


def measure_cost(type_name: str, library=None) -> float:
    """Nanoseconds per weight of llama.cpp's dot-product kernel for `type_name` (a GGML type name), one thread."""
    import gguf

    from compressor.quantize.ggml_quantize import quantize_with_llama_cpp

    library = library or _library()[0]
    rng = np.random.default_rng(0)
    weights = rng.standard_normal((PROBE_WEIGHTS // 4096, 4096)).astype(np.float32)
    activations = rng.standard_normal(PROBE_WEIGHTS).astype(np.float32)
    if type_name == "F16":
        blocks = weights.astype(np.float16)
    elif type_name == "F32":
        blocks = weights
    elif type_name == "BF16":  # the upper half of each float32
        blocks = (weights.view(np.uint32) >> 16).astype(np.uint16)
    else:
        blocks = quantize_with_llama_cpp(weights, type_name, np.ones(4096, np.float32))
    blocks = np.ascontiguousarray(blocks).ravel().view(np.uint8)
    traits = library.ggml_get_type_traits_cpu(int(gguf.GGMLQuantizationType[type_name])).contents
    dot_type = gguf.GGMLQuantizationType(traits.vec_dot_type)
    if dot_type == gguf.GGMLQuantizationType.F32:
        quantized = activations.view(np.uint8)
    else:
        block, size = gguf.GGML_QUANT_SIZES[dot_type]
        quantized = np.zeros(PROBE_WEIGHTS // block * size, np.uint8)
        from_float = _FROM_FLOAT(library.ggml_get_type_traits_cpu(int(dot_type)).contents.from_float)
        from_float(
            activations.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), quantized.ctypes.data, PROBE_WEIGHTS
        )
    vec_dot, out, times = _VEC_DOT(traits.vec_dot), ctypes.c_float(), []
    for _ in range(PROBE_REPEATS):
        start = time.perf_counter()
        vec_dot(PROBE_WEIGHTS, ctypes.byref(out), 0, blocks.ctypes.data, 0, quantized.ctypes.data, 0, 1)
        times.append(time.perf_counter() - start)
    return float(np.median(times)) * 1e9 / PROBE_WEIGHTS


def decode_costs(type_names, progress: bool = True) -> dict[str, float]:
    """Nanoseconds per weight for each of `type_names` on this CPU (measured once, then from the cache)."""
    from compressor.runtime.progress import note

    library, origin = _library()
    path = cache_dir() / "decode-cost" / f"{cost_key(origin)}.json"
    try:
        known = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        known = {}
    missing = sorted(set(type_names) - set(known))
    if missing:
        note(f"Measuring llama.cpp's decode cost of {', '.join(missing)} on this CPU (once)", progress)
        known |= {name: measure_cost(name, library) for name in missing}
        atomic_write_bytes(path, json.dumps(known, indent=1, sort_keys=True).encode())
    return {name: known[name] for name in type_names}


def decode_seconds(matrices: dict[str, tuple[str, int]], costs: dict[str, float]) -> float:
    """Predicted seconds per decoded token: Σ weights × cost over `matrices` (name → (type, weights)); the token
    embedding is a row lookup in decode, not a product, and costs nothing here."""
    return sum(
        weights * costs[type_name] * 1e-9
        for name, (type_name, weights) in matrices.items()
        if name != "token_embd.weight"
    )


def file_matrices(path: str | os.PathLike) -> dict[str, tuple[str, int]]:
    """A GGUF's matrices: name → (GGML type, weights); with a tied output (no `output.weight`), the embedding is
    the output product and counts under that name."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    matrices = {
        t.name: (t.tensor_type.name, int(np.prod(t.shape)))
        for t in reader.tensors
        if len(t.shape) >= 2 and not t.name.startswith("rope_freqs")
    }
    if "output.weight" not in matrices and "token_embd.weight" in matrices:
        matrices["output.weight"] = matrices["token_embd.weight"]
    return matrices


def predicted_decode_seconds(path: str | os.PathLike, progress: bool = False) -> float:
    matrices = file_matrices(Path(path))
    return decode_seconds(matrices, decode_costs({t for t, _ in matrices.values()}, progress))
