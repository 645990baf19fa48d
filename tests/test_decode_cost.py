"""llama.cpp's decode cost per type (`quantize/decode_cost.py`): measured with ggml's own kernels, cached per CPU,
and summed over a file's matrices the way decode streams them."""

from __future__ import annotations

import pytest

from compressor.quantize import decode_cost
from compressor.quantize.decode_cost import decode_costs, decode_seconds, file_matrices


def test_decode_time_sums_every_product_and_skips_the_embedding_lookup():
    costs = {"Q8_0": 0.1, "F16": 0.2, "Q4_K": 0.05}
    matrices = {
        "token_embd.weight": ("Q8_0", 1000),
        "output.weight": ("F16", 1000),
        "blk.0.ffn_up.weight": ("Q4_K", 400),
    }
    assert decode_seconds(matrices, costs) == pytest.approx((1000 * 0.2 + 400 * 0.05) * 1e-9)


def test_a_tied_output_is_the_embedding_s_product(tmp_path):
    pytest.importorskip("xllamacpp")
    from conftest import tiny_model
    from test_gguf_export import VOCAB, byte_tokenizer_gguf

    from compressor.checkpoint.gguf_export import write_gguf

    model = tiny_model("llama", vocab_size=VOCAB, tie_word_embeddings=True)
    written = write_gguf(
        model, byte_tokenizer_gguf(tmp_path / "t.gguf"), tmp_path / "m.gguf", tensor_type="q8_0"
    )
    matrices = file_matrices(written.path)
    assert matrices["output.weight"] == matrices["token_embd.weight"]
    assert len(matrices) == 2 + 7 * model.config.num_hidden_layers


def test_costs_are_measured_once_per_cpu_then_read(tmp_path, monkeypatch):
    pytest.importorskip("xllamacpp")
    monkeypatch.setenv("MASA_CACHE", str(tmp_path))
    monkeypatch.setattr(
        decode_cost, "PROBE_WEIGHTS", 1 << 20
    )  # a smaller probe: the test checks the plumbing
    first = decode_costs(["Q8_0", "F16"], progress=False)
    assert all(0 < v < 100 for v in first.values())
    monkeypatch.setattr(decode_cost, "measure_cost", lambda *a, **k: pytest.fail("measured again"))
    assert decode_costs(["F16", "Q8_0"], progress=False) == first
    assert list((tmp_path / "decode-cost").glob("*.json"))
