"""llama.cpp's k-quant mixes: its quantizer reached through ctypes, and `llama-quantize`'s type per tensor."""

from __future__ import annotations

import numpy as np
import pytest

from compressor.quantize.ggml_quantize import (
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
    assert {mix_type("blk.3.ffn_up.weight", mix, 30, True) for mix in ("q4_k_m", "q5_k_m", "q6_k")} == {
        "Q4_K",
        "Q5_K",
        "Q6_K",
    }
    # every mix's base type is what it writes where no rule asks for more bits
    assert {mix: mix_type("blk.9.ffn_up.weight", mix, 30, True) for mix in K_QUANT_MIXES} == {
        mix: K_QUANT_MIXES[mix].base for mix in K_QUANT_MIXES
    }


def test_low_bit_mixes_follow_llama_quantizes_rules():
    """The rules of `llama_tensor_get_type_impl` (llama.cpp's src/llama-quant.cpp) for the 2- and 3-bit mixes: the
    value matrix by its query heads per KV head, the first layers and the attention output with more bits."""
    # q3_k_m: attn_v Q5_K in the first two, Q4_K after; ffn_down Q5_K in the first sixteenth; attn_output Q4_K
    assert [mix_type(f"blk.{i}.attn_v.weight", "q3_k_m", 32, True) for i in range(3)] == [
        "Q5_K",
        "Q5_K",
        "Q4_K",
    ]
    assert [mix_type(f"blk.{i}.ffn_down.weight", "q3_k_m", 32, True) for i in (0, 1, 2)] == [
        "Q5_K",
        "Q5_K",
        "Q4_K",
    ]
    assert mix_type("blk.5.attn_output.weight", "q3_k_m", 32, True) == "Q4_K"
    assert mix_type("blk.5.attn_q.weight", "q3_k_m", 32, True) == "Q3_K"
    assert mix_type("blk.5.attn_v.weight", "q3_k_s", 32, True) == "Q3_K"
    # q2_k: attn_v Q4_K from 4 query heads per KV head (Qwen2.5-Coder-1.5B: 6), else Q3_K (SmolLM2: 3)
    assert mix_type("blk.5.attn_v.weight", "q2_k", 28, True, gqa=6) == "Q4_K"
    assert mix_type("blk.5.attn_v.weight", "q2_k", 30, True, gqa=3) == "Q3_K"
    assert mix_type("blk.5.ffn_down.weight", "q2_k", 28, True) == "Q3_K"
    assert mix_type("blk.5.attn_output.weight", "q2_k", 28, True) == "Q3_K"
    assert mix_type("blk.5.ffn_gate.weight", "q2_k", 28, True) == "Q2_K"
    # the output matrix: Q6_K, Q5_K in the 2-bit i-quant mixes, Q8_0 when its rows do not fill the base's blocks
    assert mix_type("output.weight", "q2_k", 28, True, row_length=1536) == "Q6_K"
    assert mix_type("output.weight", "iq2_xs", 28, True, row_length=1536) == "Q5_K"
    assert mix_type("token_embd.weight", "q2_k", 30, False, row_length=576) == "Q8_0"
    assert mix_type("token_embd.weight", "iq2_xs", 28, True) == "Q2_K"  # an embedding of its own
    # iq3_xxs's value matrix: IQ3_XXS with importance weights, IQ3_S without
    assert mix_type("blk.5.attn_v.weight", "iq3_xxs", 28, True, gqa=2, has_imatrix=True) == "IQ3_XXS"
    assert mix_type("blk.5.attn_v.weight", "iq3_xxs", 28, True, gqa=2) == "IQ3_S"
    assert mix_type("blk.0.ffn_down.weight", "iq4_xs", 32, True) == "Q5_K"
    assert mix_type("blk.0.ffn_down.weight", "iq4_xs", 32, True, has_imatrix=True) == "IQ4_XS"


def _weighted_error(array, decoded, weights):
    return float((np.square(decoded - array) * weights).sum())


@pytest.mark.parametrize("type_name", ["Q4_0", "Q2_K", "Q3_K", "Q4_K", "IQ4_XS"])
def test_importance_weights_lower_the_weighted_error(type_name):
    """Handed one weight per column (llama.cpp's imatrix entry), ggml's quantizer trades error on the light
    columns for less on the heavy ones: the weighted squared error is lower than without weights."""
    needs_llama_cpp()
    import gguf
    from gguf import quants

    rng = np.random.default_rng(2)
    array = rng.standard_normal((16, 512)).astype(np.float32)
    weights = rng.lognormal(0.0, 2.0, 512).astype(np.float32)  # a few inputs carry most of the energy
    qtype = gguf.GGMLQuantizationType[type_name]
    plain = quants.dequantize(quantize_with_llama_cpp(array, type_name), qtype)
    weighted = quants.dequantize(quantize_with_llama_cpp(array, type_name, weights), qtype)
    assert _weighted_error(array, weighted, weights) < 0.7 * _weighted_error(
        array, plain, weights
    )  # measured: 0.29-0.55


def test_types_that_need_importance_weights_are_refused_without_them():
    needs_llama_cpp()
    with pytest.raises(ValueError, match="IQ2_XS needs importance weights"):
        quantize_with_llama_cpp(np.zeros((2, 256), np.float32), "IQ2_XS")
    with pytest.raises(ValueError, match="256 finite non-negative values"):
        quantize_with_llama_cpp(np.zeros((2, 256), np.float32), "Q4_K", np.full(255, 1.0))


def test_fallbacks_for_rows_that_do_not_fill_256_value_blocks():
    assert fitting_type("blk.0.attn_q.weight", "Q4_K", 1536, True) == "Q4_K"
    assert fitting_type("blk.0.attn_q.weight", "Q4_K", 576, True) == "Q5_0"
    assert fitting_type("blk.0.attn_q.weight", "Q5_K", 576, True) == "Q5_1"
    assert fitting_type("blk.0.ffn_down.weight", "Q6_K", 1216, True) == "Q8_0"
    assert fitting_type("token_embd.weight", "Q6_K", 576, False) == "Q8_0"
    assert fitting_type("blk.0.ffn_down.weight", "Q4_K", 1000, True) == "F16"  # not even 32
    assert fitting_type("blk.0.attn_q.weight", "Q3_K", 576, True) == "Q4_0"
    assert fitting_type("blk.0.attn_q.weight", "Q2_K", 576, True) == "Q4_0"
    assert fitting_type("blk.0.attn_q.weight", "IQ4_XS", 576, True) == "IQ4_NL"
