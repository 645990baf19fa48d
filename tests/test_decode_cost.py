"""llama.cpp's decode cost per type (`quantize/decode_cost.py`): measured in llama.cpp on probe files of the model's
layer shape, cached per CPU, and summed over a file's matrices the way decode streams them."""

from __future__ import annotations

import json

import numpy as np
import pytest

from compressor.quantize import decode_cost
from compressor.quantize.decode_cost import (
    LayerShape,
    decode_costs,
    decode_seconds,
    file_layer_shape,
    file_matrices,
    layer_bytes,
    measure_costs,
    measurement_seconds,
    probe_depths,
    unmeasured_types,
)

#: A layer 64 wide, its MLP 256 wide: Q8_0's blocks of 32 fill every row, Q4_K's of 256 only `ffn_down`'s.
TINY = LayerShape(hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=256)


def test_decode_time_sums_every_product_and_skips_the_embedding_lookup():
    costs = {"Q8_0": 0.1, "F16": 0.2, "Q4_K": 0.05}
    matrices = {
        "token_embd.weight": ("Q8_0", 1000),
        "output.weight": ("F16", 1000),
        "blk.0.ffn_up.weight": ("Q4_K", 400),
    }
    assert decode_seconds(matrices, costs) == pytest.approx((1000 * 0.2 + 400 * 0.05) * 1e-9)


def test_costs_spread_the_layer_overhead_so_any_mix_of_types_sums_to_its_layer_time(monkeypatch):
    """With a layer time of `overhead + Σ weights × true cost` (what the probe assumes), the measured costs give
    back every layer's time whatever types its matrices hold, a type that fills only some rows included (Q4_K
    here: `ffn_down` alone, the rest in F16)."""
    true = {"F16": 0.3e-9, "Q8_0": 0.15e-9, "Q4_K": 0.08e-9}
    overhead = 20e-6
    fits_q4k = TINY.fits("Q4_K")
    assert fits_q4k["ffn_down"] and not fits_q4k["attn_q"]

    def layer_time(layout: dict[str, str]) -> float:
        return overhead + sum(r * c * true[layout[n]] for n, (r, c) in TINY.matrices().items())

    depths = []  # of every probe made

    class Probe:  # a probe file decoding in a fixed part plus its layers' times
        def __init__(self, work, shape, layer, depth, threads):
            self.depth, self.layout = depth, {name: stored for name, (stored, _) in layer.items()}
            depths.append(depth)

        def time(self) -> float:
            return 1e-3 + self.depth * layer_time(self.layout)

        def close(self) -> None:
            pass

    monkeypatch.setattr(decode_cost, "_Probe", Probe)
    costs = measure_costs(TINY, ["Q8_0", "Q4_K"])
    mixed = {"attn_q": "Q8_0", "attn_k": "F16", "attn_v": "Q8_0", "attn_output": "F16", "ffn_gate": "Q8_0",
             "ffn_up": "F16", "ffn_down": "Q4_K"}  # fmt: skip
    matrices = {f"blk.0.{n}.weight": (mixed[n], r * c) for n, (r, c) in TINY.matrices().items()}
    assert decode_seconds(matrices, costs) == pytest.approx(layer_time(mixed), rel=1e-9)
    # A type measured later stands on the base measured first: no second slope (every probe at one depth).
    depths.clear()
    later = measure_costs(TINY, ["Q4_K"], base_ns=costs["F16"])
    assert later == pytest.approx({"F16": costs["F16"], "Q4_K": costs["Q4_K"]}, rel=1e-9)
    assert len(set(depths)) == 1


def test_probe_depths_stream_from_memory():
    shallow, deep = probe_depths(3 << 20)
    assert shallow * (3 << 20) >= decode_cost.PROBE_BYTES > (shallow - 1) * (3 << 20) and deep == 2 * shallow


def test_a_tied_output_is_the_embedding_s_product_and_the_shape_is_the_file_s(tmp_path):
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
    config = model.config
    assert file_layer_shape(written.path) == LayerShape(
        config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
        config.hidden_size // config.num_attention_heads, config.intermediate_size,
    )  # fmt: skip


def test_costs_are_measured_in_llama_cpp_once_per_cpu_and_shape_then_read(tmp_path, monkeypatch):
    """The real probe on a tiny shape (small probe files: the test checks the plumbing, not the figures): every
    type priced, the cache written, and read again without measuring."""
    pytest.importorskip("xllamacpp")
    monkeypatch.setenv("MASA_CACHE", str(tmp_path))
    monkeypatch.setattr(decode_cost, "PROBE_BYTES", 1 << 20)
    first = decode_costs(["Q8_0", "Q4_K"], TINY, progress=False)
    # the plumbing, not the figures: a tiny probe's difference to F16 can come out at or below zero on a loaded
    # machine (`speed.speed_plan` refuses such a cost), so only its being a number of the right order is checked
    assert set(first) == {"Q8_0", "Q4_K"} and all(abs(v) < 100 for v in first.values())
    monkeypatch.setattr(decode_cost, "measure_costs", lambda *a, **k: pytest.fail("measured again"))
    assert decode_costs(["Q4_K", "Q8_0"], TINY, progress=False) == first
    asked = []  # a type not measured yet: measured alone, on the cached base
    monkeypatch.setattr(decode_cost, "measure_costs", lambda *a: asked.append(a) or {"Q5_0": 0.1})
    decode_costs(["Q8_0", "Q5_0"], TINY, progress=False)
    cached = json.loads(next((tmp_path / "decode-cost").glob("*.json")).read_text())
    assert asked == [(TINY, ["Q5_0"], 1, cached["F16"])]
    monkeypatch.setattr(decode_cost, "measure_costs", lambda *a, **k: pytest.fail("measured again"))
    assert len(list((tmp_path / "decode-cost").glob("*.json"))) == 1
    with pytest.raises(pytest.fail.Exception):  # another shape is another cache entry
        decode_costs(["Q8_0"], LayerShape(64, 4, 4, 16, 256), progress=False)


def test_each_type_is_kept_as_it_is_measured_so_an_interruption_loses_only_the_type_it_was_on(
    tmp_path, monkeypatch
):
    pytest.importorskip("xllamacpp")
    monkeypatch.setenv("MASA_CACHE", str(tmp_path))
    calls = []

    def measure(shape, types, threads, base_ns):
        calls.append((types, base_ns))
        if types == ["Q8_0"]:
            raise KeyboardInterrupt
        return {"F16": 0.2 if base_ns is None else base_ns, types[0]: 0.1}

    monkeypatch.setattr(decode_cost, "measure_costs", measure)
    with pytest.raises(KeyboardInterrupt):
        decode_costs(["Q8_0", "Q4_K"], TINY, progress=False)
    assert calls == [(["Q4_K"], None), (["Q8_0"], 0.2)]  # one type at a time, the second on the first's base
    cached = json.loads(next((tmp_path / "decode-cost").glob("*.json")).read_text())
    assert cached == {"F16": 0.2, "Q4_K": 0.1}


def test_the_layer_shape_of_a_file_about_to_be_written_is_its_widest_layer():
    """Per-layer widths (a narrowed file): the widest layer's; Phi-3's fused attention: the config's heads; a
    mixture of experts (no 2-D MLP matrix): refused in one line."""
    from compressor.modeling.adapters import ProjectionGeometry
    from compressor.quantize.decode_cost import matrices_layer_shape
    from compressor.runtime.errors import UserError

    geometry = ProjectionGeometry(64, 4, 2, 16, 256)
    narrowed = [("token_embd.weight", np.zeros((100, 64)))]
    for layer, (heads, width) in enumerate([(4, 96), (3, 192), (2, 32)]):
        narrowed += [(f"blk.{layer}.attn_q.weight", np.zeros((heads * 16, 64))),
                     (f"blk.{layer}.attn_k.weight", np.zeros((32, 64))),
                     (f"blk.{layer}.ffn_down.weight", np.zeros((64, width)))]  # fmt: skip
    assert matrices_layer_shape(narrowed, geometry) == LayerShape(64, 4, 2, 16, 192)
    fused = [("blk.0.attn_qkv.weight", np.zeros((128, 64))), ("blk.0.ffn_down.weight", np.zeros((64, 256)))]
    assert matrices_layer_shape(fused, geometry) == LayerShape(64, 4, 2, 16, 256)
    with pytest.raises(UserError, match="a mixture of experts' decode cost is not measured: drop --speed"):
        matrices_layer_shape(fused[:1], ProjectionGeometry(64, 4, 2, 16, 0))


def test_the_measurement_is_priced_by_its_probes_layers_and_bytes_and_nothing_once_measured(
    tmp_path, monkeypatch
):
    """`measurement_seconds`: every missing type's two probes, `PROBE_ROUNDS` loads (priced by their bytes) and
    `PROBE_REPEATS` calls each (by their layers), against the timed probe; the base's slope (two depths) where it
    is not cached; one layer quantized at the rate given; nothing where every type is cached."""
    pytest.importorskip("xllamacpp")
    monkeypatch.setenv("MASA_CACHE", str(tmp_path))
    timing = decode_cost.ProbeTiming(layers=4, load=0.5, token=1e-3)
    monkeypatch.setattr(decode_cost, "probe_timing", lambda shape, threads: timing)
    base, q8 = layer_bytes(TINY, "F16"), layer_bytes(TINY, "Q8_0")
    per_layer = decode_cost.PROBE_REPEATS * decode_cost.PROBE_TOKENS * 1e-3 / 4
    per_byte = 0.5 / (4 * base)  # the timed probe: 4 layers of F16
    assert base == 2 * TINY.weights and q8 == TINY.weights // 32 * 34  # Q8_0: 34 bytes a block of 32
    assert layer_bytes(TINY, "Q4_K") == base - 64 * 256 * 2 + 64 * 144  # ffn_down alone holds Q4_K's blocks
    shallow, deep = probe_depths(base)
    q8_depth = probe_depths(q8)[0]
    f16_probes = (shallow + deep) * (per_layer + base * per_byte)
    q8_probes = q8_depth * (2 * per_layer + (base + q8) * per_byte)
    expected = decode_cost.PROBE_ROUNDS * (f16_probes + q8_probes) + 2 * TINY.weights / 1e6
    assert unmeasured_types(["Q8_0"], TINY) == ["F16", "Q8_0"]  # the base first: every cost stands on it
    assert measurement_seconds(["Q8_0"], TINY, quantize_rate=lambda t: 1e6) == pytest.approx(expected)
    monkeypatch.setattr(decode_cost, "measure_costs", lambda *a: {"F16": 0.2, "Q8_0": 0.1})
    decode_costs(["Q8_0"], TINY, progress=False)
    assert measurement_seconds(["Q8_0", "F16"], TINY) == 0.0
    q5 = layer_bytes(TINY, "Q5_0")  # measured later, on the cached base: its own two probes alone
    q5_depth = probe_depths(q5)[0]
    only_q5 = decode_cost.PROBE_ROUNDS * q5_depth * (2 * per_layer + (base + q5) * per_byte)
    assert measurement_seconds(["Q8_0", "Q5_0"], TINY) == pytest.approx(only_q5)
