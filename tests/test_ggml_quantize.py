"""llama.cpp's k-quant mixes: its quantizer reached through ctypes, and `llama-quantize`'s type per tensor."""

from __future__ import annotations

import numpy as np
import pytest

from compressor.checkpoint.ggml_quantize import (
    K_QUANT_MIXES,
    fitting_type,
    mix_type,
    quantize_with_llama_cpp,
    use_more_bits,
)


def needs_llama_cpp():
    pytest.importorskip(
        "xllamacpp", reason="llama.cpp's wheel is not installed (pip install masa-compress[gguf])"
    )


@pytest.mark.parametrize("type_name", ["Q8_0", "Q5_0", "Q4_0"])
def test_llama_cpp_blocks_equal_gguf_own_quantizer(type_name):
    """Where `gguf` has a quantizer of its own, llama.cpp's bytes through ctypes are the same bytes: the
    binding passes the right type, rows and pointers."""
    needs_llama_cpp()
    import gguf
    from gguf import quants

    array = np.random.default_rng(0).standard_normal((8, 96)).astype(np.float32)
    qtype = gguf.GGMLQuantizationType[type_name]
    assert np.array_equal(quantize_with_llama_cpp(array, type_name), quants.quantize(array, qtype))


@pytest.mark.parametrize(("type_name", "bound"), [("Q6_K", 0.03), ("Q5_K", 0.05), ("Q4_K", 0.1)])
def test_k_quant_blocks_decode_to_the_matrix_within_their_rounding(type_name, bound):
    """Decoded by `gguf`'s own reader, each k-quant gives the matrix back within its bits (relative Frobenius
    error of a Gaussian matrix, measured: Q6_K 0.018, Q5_K 0.036, Q4_K 0.071)."""
    needs_llama_cpp()
    import gguf
    from gguf import quants

    array = np.random.default_rng(1).standard_normal((16, 512)).astype(np.float32)
    qtype = gguf.GGMLQuantizationType[type_name]
    decoded = quants.dequantize(quantize_with_llama_cpp(array, type_name), qtype)
    assert decoded.shape == array.shape
    assert np.linalg.norm(decoded - array) / np.linalg.norm(array) < bound


def test_rows_that_do_not_fill_blocks_are_refused_by_the_quantizer():
    needs_llama_cpp()
    with pytest.raises(ValueError, match="do not fill Q4_K's blocks of 256"):
        quantize_with_llama_cpp(np.zeros((2, 576), np.float32), "Q4_K")


def test_more_bits_layers_are_llama_quantizes():
    """The attn_v/ffn_down tensors that took Q6_K in a Q4_K_M file written by `llama-quantize`
    (Qwen2.5-Coder-1.5B-Instruct, 28 layers): its converter wrote the layers in string order (0, 1, 10, 11, ...),
    and `llama-quantize` counts them in the file's order."""
    in_file_order = sorted(range(28), key=str)
    chosen = sorted(layer for position, layer in enumerate(in_file_order) if use_more_bits(position, 28))
    assert chosen == [0, 1, 5, 6, 7, 8, 9, 10, 13, 16, 19, 21, 24, 27]
    # the same file: every attn_v of layer 13 (position 5 in its order) is Q6_K, of layer 2 (position 12) Q4_K
    assert mix_type("blk.13.attn_v.weight", "q4_k_m", 28, True, position=5) == "Q6_K"
    assert mix_type("blk.2.attn_v.weight", "q4_k_m", 28, True, position=12) == "Q4_K"
    # this tool writes layers in order: the position is the layer
    assert mix_type("blk.2.ffn_down.weight", "q4_k_m", 28, True) == "Q6_K"


def test_mix_types_per_tensor():
    assert mix_type("output.weight", "q4_k_m", 30, True) == "Q6_K"
    assert mix_type("token_embd.weight", "q4_k_m", 30, True) == "Q4_K"  # an output matrix of its own
    assert mix_type("token_embd.weight", "q4_k_m", 30, False) == "Q6_K"  # tied: the embedding is the output
    assert mix_type("blk.4.attn_q.weight", "q4_k_m", 30, True) == "Q4_K"
    assert mix_type("blk.0.ffn_down.weight", "q5_k_m", 30, True) == "Q6_K"
    assert mix_type("blk.4.ffn_down.weight", "q5_k_m", 30, True) == "Q5_K"
    assert mix_type("blk.0.ffn_down.weight", "q6_k", 30, True) == "Q6_K"
    assert {mix_type("blk.3.ffn_up.weight", mix, 30, True) for mix in K_QUANT_MIXES} == {
        "Q4_K",
        "Q5_K",
        "Q6_K",
    }


def test_fallbacks_for_rows_that_do_not_fill_256_value_blocks():
    assert fitting_type("blk.0.attn_q.weight", "Q4_K", 1536, True) == "Q4_K"
    assert fitting_type("blk.0.attn_q.weight", "Q4_K", 576, True) == "Q5_0"
    assert fitting_type("blk.0.attn_q.weight", "Q5_K", 576, True) == "Q5_1"
    assert fitting_type("blk.0.ffn_down.weight", "Q6_K", 1216, True) == "Q8_0"
    assert fitting_type("token_embd.weight", "Q6_K", 576, False) == "Q8_0"
    assert fitting_type("blk.0.ffn_down.weight", "Q4_K", 1000, True) == "F16"  # not even 32
