"""llama.cpp's quantization mixes (`q2_k` … `q6_k`, the i-quants) for `write_gguf`, quantized by llama.cpp's own
code, with or without importance weights (an "imatrix").

`gguf`'s Python package has no k-quant or i-quant quantizer, and no wheel here ships `llama-quantize`; but the
`[gguf]` extra's `xllamacpp` library exports ggml's `ggml_quantize_chunk`, the function `llama-quantize` itself
calls per tensor, importance weights included. It is reached through ctypes, so the blocks are llama.cpp's, byte
for byte (tested: its q8_0 and q5_0 equal `gguf`'s quantizers exactly).

Which type each tensor takes follows `llama-quantize`'s rules for each mix (`llama_tensor_get_type_impl` in
llama.cpp's `src/llama-quant.cpp`, ported below for the mixes `--type` offers; checked against the tensor types
of a Q4_K_M file it wrote): the output matrix (or the embedding, when tied) in Q6_K (Q5_K in the 2-bit and
iq3_xxs mixes), more bits for `attn_v`, `ffn_down` and `attn_output` in some layers of some mixes, the rest in
the mix's base type. A row that does not fill whole 256-value blocks takes llama.cpp's fallback
(`tensor_type_fallback`: Q2_K/Q3_K → Q4_0, Q4_K → Q5_0, Q5_K → Q5_1, Q6_K → Q8_0, the 256-block i-quants →
IQ4_NL, then F16), as `llama-quantize` does.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
from dataclasses import dataclass

import numpy as np

from compressor.runtime.errors import UserError


@dataclass(frozen=True)
class Mix:
    """One `llama-quantize` file type: its base GGML type and its `general.file_type` name."""

    base: str
    file_type: str


#: --type → llama.cpp's mix (`llama_ftype_get_default_type`).
K_QUANT_MIXES = {
    "q2_k": Mix("Q2_K", "MOSTLY_Q2_K"),
    "q3_k_s": Mix("Q3_K", "MOSTLY_Q3_K_S"),
    "q3_k_m": Mix("Q3_K", "MOSTLY_Q3_K_M"),
    "q3_k_l": Mix("Q3_K", "MOSTLY_Q3_K_L"),
    "q4_k_s": Mix("Q4_K", "MOSTLY_Q4_K_S"),
    "q4_k_m": Mix("Q4_K", "MOSTLY_Q4_K_M"),
    "q5_k_s": Mix("Q5_K", "MOSTLY_Q5_K_S"),
    "q5_k_m": Mix("Q5_K", "MOSTLY_Q5_K_M"),
    "q6_k": Mix("Q6_K", "MOSTLY_Q6_K"),
    "iq4_nl": Mix("IQ4_NL", "MOSTLY_IQ4_NL"),
    "iq4_xs": Mix("IQ4_XS", "MOSTLY_IQ4_XS"),
    "iq3_m": Mix("IQ3_S", "MOSTLY_IQ3_M"),
    "iq3_s": Mix("IQ3_S", "MOSTLY_IQ3_S"),
    "iq3_xxs": Mix("IQ3_XXS", "MOSTLY_IQ3_XXS"),
    "iq2_xs": Mix("IQ2_XS", "MOSTLY_IQ2_XS"),
    "iq2_xxs": Mix("IQ2_XXS", "MOSTLY_IQ2_XXS"),
}
#: The mixes whose output matrix takes Q5_K rather than Q6_K, and whose attn_v/ffn_down follow the 2-bit rules.
TWO_BIT_MIXES = ("iq2_xs", "iq2_xxs")
#: The GGML types llama.cpp refuses to write without importance weights (`tensor_requires_imatrix`), except for
#: the embedding and the output matrix.
NEEDS_IMATRIX = ("IQ3_XXS", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_S", "IQ1_M")
#: llama.cpp's type when a row is not a whole number of a 256-value block (`tensor_type_fallback`).
K_QUANT_FALLBACK = {
    "Q2_K": "Q4_0",
    "Q3_K": "Q4_0",
    "Q4_K": "Q5_0",
    "Q5_K": "Q5_1",
    "Q6_K": "Q8_0",
    **dict.fromkeys(("IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_XS", "IQ1_S", "IQ1_M"), "IQ4_NL"),
}


def use_more_bits(layer: int, num_layers: int) -> bool:
    """llama.cpp's choice of the layers whose attn_v/ffn_down get more bits in the `_m` mixes."""
    return layer < num_layers // 8 or layer >= 7 * num_layers // 8 or (layer - num_layers // 8) % 3 == 2


def is_output_matrix(tensor_name: str, has_output: bool) -> bool:
    """The matrix llama.cpp multiplies the final hidden state by: `output.weight`, or the embedding when tied."""
    return tensor_name == "output.weight" or (not has_output and tensor_name == "token_embd.weight")


def mix_type(
    tensor_name: str,
    mix: str,
    num_layers: int,
    has_output: bool,
    position: int | None = None,
    *,
    row_length: int | None = None,
    gqa: int = 1,
    has_imatrix: bool = False,
    n_expert: int = 1,
) -> str:
    """The GGML type `llama-quantize` gives `tensor_name` (a matrix) in `mix`, before any block fallback.

    `llama-quantize` counts the attn_v (and ffn_down) tensors in the order of the file it reads: `position` is
    this one's place among them, by default its layer (the order `write_gguf` writes them in). `gqa`: query heads
    per KV head (of the first layer, as llama.cpp reads it); `row_length`: the output matrix takes Q8_0 when its
    rows do not fill the mix's blocks; `has_imatrix`: whether importance weights are given (a few rules differ);
    `n_expert`: experts per layer of a mixture of experts (llama.cpp gives an 8-expert model's attention more bits).

    Tensors are classed as llama.cpp classes them (`tensor_get_category`, `category_is_attn_v`): a fused
    `attn_qkv` (Phi-3) takes attn_v's rules, an expert tensor (`ffn_down_exps`) those of its projection."""
    base = K_QUANT_MIXES[mix].base
    if is_output_matrix(tensor_name, has_output):
        if row_length is not None and row_length % ggml_block(base):
            return "Q8_0"
        return "Q5_K" if mix in (*TWO_BIT_MIXES, "iq3_xxs") else "Q6_K"
    if tensor_name == "token_embd.weight":
        return {"iq2_xs": "Q2_K", "iq2_xxs": "Q2_K", "iq3_xxs": "IQ3_S"}.get(mix, base)
    if not tensor_name.startswith("blk."):
        return base
    layer = int(tensor_name.split(".")[1]) if position is None else position
    role = tensor_category(tensor_name)
    eight_experts = n_expert == 8
    if mix in TWO_BIT_MIXES:
        if role == "attn_v":
            return "Q4_K" if gqa >= 4 or n_expert >= 4 else "Q2_K"
        if role == "attn_k" and eight_experts:
            return "Q4_K"
        if role == "ffn_down" and layer < num_layers // 8:
            return "Q2_K"
        return "Q5_K" if role == "attn_output" and eight_experts else base
    if role in ("attn_v", "attn_k") and eight_experts:
        return "Q8_0"  # llama.cpp: "for the 8-expert model, bumping this to Q8_0 trades just ~128MB"
    if role == "attn_v":
        return _attn_v_type(mix, base, layer, num_layers, gqa, has_imatrix)
    if role in ("attn_q", "attn_k"):
        return "IQ2_S" if mix == "iq3_xxs" else base
    if role == "ffn_down":
        if mix == "iq3_m" and eight_experts and use_more_bits(layer, num_layers):
            return "Q4_K"
        return _ffn_down_type(mix, base, layer, num_layers, has_imatrix)
    if role == "attn_output" and eight_experts:
        return "Q5_K" if mix in EIGHT_EXPERT_OUTPUT_Q5_K else base
    if role == "attn_output":
        return {"q2_k": "Q3_K", "iq3_xxs": "IQ3_S", "q3_k_m": "Q4_K", "q3_k_l": "Q5_K", "iq3_m": "Q4_K"}.get(
            mix, base
        )
    return base


#: The mixes whose attn_output takes Q5_K in an 8-expert model (the ones `--type` offers).
EIGHT_EXPERT_OUTPUT_Q5_K = ("q2_k", "iq3_xxs", "q3_k_s", "q3_k_m", "iq4_nl", "q4_k_s", "q4_k_m", "iq3_s", "iq3_m",
                            "iq4_xs")  # fmt: skip


def tensor_category(tensor_name: str) -> str:
    """llama.cpp's class of a layer's matrix, by name as it matches them: attn_v for attn_v and the fused attn_qkv,
    ffn_down / ffn_gate / ffn_up for the plain and the experts' (`ffn_down_exps`) projections, else the role."""
    role = tensor_name.split(".")[2]
    if role == "attn_qkv":
        return "attn_v"
    return next((name for name in ("ffn_up", "ffn_gate", "ffn_down") if role.startswith(name)), role)


def _attn_v_type(mix: str, base: str, layer: int, num_layers: int, gqa: int, has_imatrix: bool) -> str:
    if mix == "q2_k":
        return "Q4_K" if gqa >= 4 else "Q3_K"
    if mix == "iq3_xxs":
        return "Q4_K" if gqa >= 4 else "IQ3_XXS" if has_imatrix else "IQ3_S"
    if mix == "iq3_s" and gqa >= 4 or mix == "iq3_m":
        return "Q4_K"
    if mix == "q3_k_m":
        return "Q5_K" if layer < 2 else "Q4_K"
    if mix == "q3_k_l":
        return "Q5_K"
    if mix in ("iq4_nl", "iq4_xs") and gqa >= 4:
        return "Q5_K"
    if mix in ("q4_k_m", "q5_k_m") and use_more_bits(layer, num_layers):
        return "Q6_K"
    if mix == "q4_k_s" and layer < 4:
        return "Q5_K"
    return base


def _ffn_down_type(mix: str, base: str, layer: int, num_layers: int, has_imatrix: bool) -> str:
    first_eighth = layer < num_layers // 8
    if mix == "q2_k":
        return "Q3_K"
    if mix == "iq3_xxs" and not has_imatrix:
        return "Q4_K" if first_eighth else "Q3_K"
    if mix == "q3_k_m":
        return "Q5_K" if layer < num_layers // 16 else "Q4_K"
    if mix == "iq3_m" and first_eighth:
        return "Q4_K"
    if mix == "q3_k_l":
        return "Q5_K"
    if mix in ("q4_k_m", "q5_k_m") and use_more_bits(layer, num_layers):
        return "Q6_K"
    if mix in ("iq4_nl", "iq4_xs") and first_eighth and not has_imatrix:
        return "Q5_K"
    if mix == "q4_k_s" and first_eighth:
        return "Q5_K"
    return base


def fitting_type(tensor_name: str, wanted: str, row_length: int, has_output: bool) -> str:
    """`wanted`, or llama.cpp's fallback when a row of `row_length` values does not fill its blocks."""
    if row_length % ggml_block(wanted) == 0:
        return wanted
    fallback = K_QUANT_FALLBACK.get(wanted, "F16")
    return fallback if row_length % ggml_block(fallback) == 0 else "F16"


def needs_imatrix(tensor_name: str, type_name: str) -> bool:
    """Whether llama.cpp refuses to write this tensor in this type without importance weights."""
    return type_name in NEEDS_IMATRIX and tensor_name not in ("token_embd.weight", "output.weight")


def ggml_block(type_name: str) -> int:
    """Values per block of a GGML type by name (`Q4_K`: 256; 1 for the float types)."""
    import gguf

    return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]][0]


@functools.cache
def _quantize_chunk():
    spec = importlib.util.find_spec("xllamacpp.xllamacpp")
    if spec is None or spec.origin is None:
        raise UserError(
            "the k-quant and i-quant types, and importance weights, are quantized by llama.cpp's library from the "
            "[gguf] extra: pip install 'masa-compress[gguf]', or choose --type q8_0/q5_0/q4_0 --imatrix none"
        )
    library = ctypes.CDLL(spec.origin)
    try:
        function = library.ggml_quantize_chunk
    except AttributeError:
        raise UserError(
            f"{spec.origin}: this xllamacpp build does not export ggml_quantize_chunk: install the version "
            "the [gguf] extra names, or choose --type q8_0/q5_0/q4_0 --imatrix none"
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


def quantize_with_llama_cpp(
    array: np.ndarray, type_name: str, importance: np.ndarray | None = None
) -> np.ndarray:
    """The blocks of a 2-D fp32 `array` in GGML type `type_name`, by ggml's own quantizer: a uint8 array of
    one row of blocks per matrix row, as `gguf.GGUFWriter.add_tensor(..., raw_dtype=...)` takes it.

    `importance`: one non-negative weight per column (llama.cpp's imatrix entry for this matrix: the mean square
    of each input over the calibration tokens); the quantizer then minimizes the weighted error of each row."""
    import gguf

    qtype = gguf.GGMLQuantizationType[type_name]
    block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    rows, row_length = array.shape
    if row_length % block:
        raise ValueError(f"rows of {row_length} values do not fill {type_name}'s blocks of {block}")
    weights = None
    if importance is not None:
        weights = np.ascontiguousarray(importance, dtype=np.float32)
        if weights.shape != (row_length,) or not np.isfinite(weights).all() or (weights < 0).any():
            raise ValueError(
                f"importance weights must be {row_length} finite non-negative values, one per column; got "
                f"shape {weights.shape}"
            )
    elif type_name in NEEDS_IMATRIX:
        raise ValueError(f"{type_name} needs importance weights (llama.cpp refuses it without an imatrix)")
    source = np.ascontiguousarray(array, dtype=np.float32)
    blocks = np.empty((rows, row_length // block * block_bytes), dtype=np.uint8)
    written = _quantize_chunk()(
        int(qtype), source.ctypes.data, blocks.ctypes.data, 0, rows, row_length,
        None if weights is None else weights.ctypes.data,
    )  # fmt: skip
    if written != blocks.nbytes:
        raise RuntimeError(
            f"ggml_quantize_chunk wrote {written} bytes for {type_name}, {blocks.nbytes} expected"
        )
    return blocks


@functools.cache
def _dequantize_row(type_name: str):
    spec = importlib.util.find_spec("xllamacpp.xllamacpp")
    library = ctypes.CDLL(spec.origin)  # _quantize_chunk has checked the library is there
    # ggml's names keep the k-quants' capital K: dequantize_row_q4_K, dequantize_row_q8_0, dequantize_row_iq4_xs
    suffix = type_name.lower() if type_name.startswith("IQ") else type_name[:-1].lower() + type_name[-1]
    function = getattr(library, f"dequantize_row_{suffix}")
    function.restype = None
    function.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    return function


def dequantize_with_llama_cpp(blocks: np.ndarray, type_name: str, shape: tuple[int, int]) -> np.ndarray:
    """The fp32 matrix of `shape` that `blocks` (as `quantize_with_llama_cpp` returns them) decode to, by ggml's own
    `dequantize_row_*` (what llama.cpp multiplies by, up to its activations' rounding)."""
    _quantize_chunk()
    source = np.ascontiguousarray(blocks)
    decoded = np.empty(shape, dtype=np.float32)
    _dequantize_row(type_name)(source.ctypes.data, decoded.ctypes.data, decoded.size)
    return decoded


def row_bytes(type_name: str, row_length: int) -> int:
    """Bytes of one row of `row_length` values in GGML type `type_name` (a whole number of its blocks)."""
    import gguf

    block, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]]
    return row_length // block * block_bytes


def padded(nbytes: int, alignment: int = 32) -> int:
    """Bytes a tensor (or the metadata) takes in a GGUF file: rounded up to the file's alignment (gguf's 32)."""
    return -(-nbytes // alignment) * alignment
