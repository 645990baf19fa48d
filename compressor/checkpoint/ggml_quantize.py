"""llama.cpp's k-quant mixes (`q4_k_m`, `q5_k_m`, `q6_k`) for `write_gguf`, quantized by llama.cpp's own code.

`gguf`'s Python package has no k-quant quantizer, and no wheel here ships `llama-quantize`; but the `[gguf]`
extra's `xllamacpp` library exports ggml's `ggml_quantize_chunk`, the function `llama-quantize` itself calls
per tensor. It is reached through ctypes, so the blocks are llama.cpp's, byte for byte (tested: its q8_0 and
q5_0 equal `gguf`'s quantizers exactly).

Which type each tensor takes follows `llama-quantize`'s rules for these mixes (`llama_tensor_get_type` in
llama.cpp's `llama-quant.cpp`; checked against the tensor types of a Q4_K_M file it wrote): the output matrix
(or the embedding, when tied) in Q6_K; `attn_v` and `ffn_down` in Q6_K in the layers `use_more_bits` picks
(the first and last eighth, and every third between) for the `_m` mixes; the rest in the mix's base type. A
row that does not fill whole 256-value blocks takes llama.cpp's fallback (Q4_K → Q5_0, Q5_K → Q5_1,
Q6_K → Q8_0, then F16), as `llama-quantize` does.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util

import numpy as np

from compressor.runtime.errors import UserError

#: --type → (the base type of the mix, `general.file_type`, whether attn_v/ffn_down take Q6_K in some layers).
K_QUANT_MIXES = {
    "q4_k_m": ("Q4_K", "MOSTLY_Q4_K_M", True),
    "q5_k_m": ("Q5_K", "MOSTLY_Q5_K_M", True),
    "q6_k": ("Q6_K", "MOSTLY_Q6_K", False),
}
#: llama.cpp's type when a row is not a whole number of a k-quant's 256-value blocks.
K_QUANT_FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}
MORE_BITS_TYPE = "Q6_K"
OUTPUT_TYPE = "Q6_K"
OUTPUT_FALLBACK = "Q8_0"


def use_more_bits(layer: int, num_layers: int) -> bool:
    """llama.cpp's choice of the layers whose attn_v/ffn_down get more bits in the `_m` mixes."""
    return layer < num_layers // 8 or layer >= 7 * num_layers // 8 or (layer - num_layers // 8) % 3 == 2


def mix_type(
    tensor_name: str, mix: str, num_layers: int, has_output: bool, position: int | None = None
) -> str:
    """The GGML type `llama-quantize` gives `tensor_name` (a matrix) in `mix`, before any block fallback.

    `llama-quantize` counts the attn_v (and ffn_down) tensors in the order of the file it reads: `position` is
    this one's place among them, by default its layer (the order `write_gguf` writes them in)."""
    base, _, more_bits = K_QUANT_MIXES[mix]
    if tensor_name == "output.weight" or (not has_output and tensor_name == "token_embd.weight"):
        return OUTPUT_TYPE
    if (
        more_bits
        and tensor_name.startswith("blk.")
        and tensor_name.endswith(("attn_v.weight", "ffn_down.weight"))
    ):
        if use_more_bits(int(tensor_name.split(".")[1]) if position is None else position, num_layers):
            return MORE_BITS_TYPE
    return base


def fitting_type(tensor_name: str, wanted: str, row_length: int, has_output: bool) -> str:
    """`wanted`, or llama.cpp's fallback when a row of `row_length` values does not fill its blocks."""
    if row_length % ggml_block(wanted) == 0:
        return wanted
    is_output = tensor_name == "output.weight" or (not has_output and tensor_name == "token_embd.weight")
    fallback = OUTPUT_FALLBACK if is_output else K_QUANT_FALLBACK.get(wanted, "F16")
    return fallback if row_length % ggml_block(fallback) == 0 else "F16"


def ggml_block(type_name: str) -> int:
    """Values per block of a GGML type by name (`Q4_K`: 256; 1 for the float types)."""
    import gguf

    return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]][0]


@functools.cache
def _quantize_chunk():
    spec = importlib.util.find_spec("xllamacpp.xllamacpp")
    if spec is None or spec.origin is None:
        raise UserError(
            "k-quant types (q4_k_m, q5_k_m, q6_k) are quantized by llama.cpp's library from the [gguf] extra: "
            "pip install 'masa-compress[gguf]', or choose --type q8_0/q5_0/q4_0"
        )
    library = ctypes.CDLL(spec.origin)
    try:
        function = library.ggml_quantize_chunk
    except AttributeError:
        raise UserError(
            f"{spec.origin}: this xllamacpp build does not export ggml_quantize_chunk: install the version "
            "the [gguf] extra names, or choose --type q8_0/q5_0/q4_0"
        ) from None
    function.restype = ctypes.c_size_t
    function.argtypes = [
        ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
        ctypes.c_void_p,
    ]  # fmt: skip
    return function


def check_quantizer() -> None:
    """A one-line error, before anything is written, when llama.cpp's quantizer cannot be reached."""
    _quantize_chunk()


def quantize_with_llama_cpp(array: np.ndarray, type_name: str) -> np.ndarray:
    """The blocks of a 2-D fp32 `array` in GGML type `type_name`, by ggml's own quantizer: a uint8 array of
    one row of blocks per matrix row, as `gguf.GGUFWriter.add_tensor(..., raw_dtype=...)` takes it."""
    import gguf

    qtype = gguf.GGMLQuantizationType[type_name]
    block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    rows, row_length = array.shape
    if row_length % block:
        raise ValueError(f"rows of {row_length} values do not fill {type_name}'s blocks of {block}")
    source = np.ascontiguousarray(array, dtype=np.float32)
    blocks = np.empty((rows, row_length // block * block_bytes), dtype=np.uint8)
    written = _quantize_chunk()(int(qtype), source.ctypes.data, blocks.ctypes.data, 0, rows, row_length, None)
    if written != blocks.nbytes:
        raise RuntimeError(
            f"ggml_quantize_chunk wrote {written} bytes for {type_name}, {blocks.nbytes} expected"
        )
    return blocks
