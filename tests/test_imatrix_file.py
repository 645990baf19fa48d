"""llama.cpp's imatrix file (`checkpoint/imatrix_file.py`, `export --imatrix-out`): the format llama.cpp's own
GGUF reader opens, the values `llama-quantize` would hand to the quantizer, and the file of the bundled model
carrying exactly the weights its own GGUF was quantized with."""

from __future__ import annotations

import ctypes
import importlib.util
import json

import numpy as np
import pytest
import torch
from conftest import tiny_model

from compressor.checkpoint.imatrix_file import importance_by_tensor, read_imatrix, write_imatrix
from compressor.quantize.importance import measure_importance

VOCAB = 96


class _InitParams(ctypes.Structure):
    _fields_ = [("no_alloc", ctypes.c_bool), ("ctx", ctypes.c_void_p)]


def ggml_reads(path) -> dict:
    """What ggml's own GGUF reader (llama.cpp's `gguf_init_from_file`, as `llama-quantize` opens an imatrix)
    finds in `path`: its tensor names and the imatrix keys."""
    spec = importlib.util.find_spec("xllamacpp.xllamacpp")
    if spec is None or spec.origin is None:
        pytest.skip("llama.cpp's wheel is not installed (pip install masa-compress[gguf])")
    lib = ctypes.CDLL(spec.origin)
    lib.gguf_init_from_file.restype = ctypes.c_void_p
    lib.gguf_init_from_file.argtypes = [ctypes.c_char_p, _InitParams]
    lib.gguf_get_n_tensors.restype = ctypes.c_int64
    lib.gguf_get_n_tensors.argtypes = [ctypes.c_void_p]
    lib.gguf_get_tensor_name.restype = ctypes.c_char_p
    lib.gguf_get_tensor_name.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    lib.gguf_find_key.restype = ctypes.c_int64
    lib.gguf_find_key.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    lib.gguf_get_val_u32.restype = ctypes.c_uint32
    lib.gguf_get_val_u32.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    lib.gguf_get_val_str.restype = ctypes.c_char_p
    lib.gguf_get_val_str.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    lib.gguf_free.argtypes = [ctypes.c_void_p]
    ctx = lib.gguf_init_from_file(str(path).encode(), _InitParams(True, None))
    assert ctx, f"ggml could not read {path}"
    try:
        names = {lib.gguf_get_tensor_name(ctx, i).decode() for i in range(lib.gguf_get_n_tensors(ctx))}
        keys = {}
        for key in ("imatrix.chunk_count", "imatrix.chunk_size"):
            index = lib.gguf_find_key(ctx, key.encode())
            keys[key] = None if index < 0 else lib.gguf_get_val_u32(ctx, index)
        index = lib.gguf_find_key(ctx, b"general.type")
        keys["general.type"] = None if index < 0 else lib.gguf_get_val_str(ctx, index).decode()
        keys["has_datasets"] = lib.gguf_find_key(ctx, b"imatrix.datasets") >= 0
        return {"tensors": names, "keys": keys}
    finally:
        lib.gguf_free(ctx)


def test_an_imatrix_file_holds_sums_and_counts_as_llama_imatrix_writes_them(tmp_path):
    """in_sum2 = mean square × tokens (ggml shape [n_in, n_mat]), counts = tokens ([1, n_mat]); reading it back
    as llama-quantize does (in_sum2 / counts) gives the mean squares; an experts tensor keeps one row each."""
    import gguf

    rng = np.random.default_rng(0)
    dense, experts = rng.random(64) + 0.1, rng.random((4, 32)) + 0.1
    written = write_imatrix(
        tmp_path / "m.imatrix.gguf", {"blk.0.attn_q.weight": dense, "blk.0.ffn_up_exps.weight": experts},
        tokens=96, chunks=3, chunk_size=32, dataset="text: 3 windows of 32",
    )  # fmt: skip
    assert written.entries == 2 and written.path.is_file()
    assert not list(tmp_path.glob(".*tmp*"))  # the temporary sibling was renamed
    reader = gguf.GGUFReader(str(written.path))
    shapes = {t.name: [int(n) for n in t.shape] for t in reader.tensors}  # ggml order: ne0 first
    assert shapes == {
        "blk.0.attn_q.weight.in_sum2": [64, 1], "blk.0.attn_q.weight.counts": [1, 1],
        "blk.0.ffn_up_exps.weight.in_sum2": [32, 4], "blk.0.ffn_up_exps.weight.counts": [1, 4],
    }  # fmt: skip
    sums = next(t for t in reader.tensors if t.name == "blk.0.attn_q.weight.in_sum2")
    np.testing.assert_allclose(np.asarray(sums.data).ravel(), dense * 96, rtol=1e-6)
    fields = reader.fields
    assert fields["general.type"].contents() == "imatrix"
    assert fields["imatrix.datasets"].contents() == ["text: 3 windows of 32"]
    assert fields["imatrix.chunk_count"].contents() == 3 and fields["imatrix.chunk_size"].contents() == 32
    back = read_imatrix(written.path)
    np.testing.assert_allclose(back["blk.0.attn_q.weight"], dense[None], rtol=1e-6)
    np.testing.assert_allclose(back["blk.0.ffn_up_exps.weight"], experts, rtol=1e-6)
    seen = ggml_reads(written.path)
    assert seen["tensors"] == set(shapes)
    assert seen["keys"] == {"imatrix.chunk_count": 3, "imatrix.chunk_size": 32, "general.type": "imatrix",
                            "has_datasets": True}  # fmt: skip


def test_an_imatrix_file_refuses_weights_llama_cpp_cannot_use_and_leaves_nothing(tmp_path):
    out = tmp_path / "bad.gguf"
    with pytest.raises(ValueError, match="finite and non-negative"):
        write_imatrix(
            out, {"a.weight": np.array([1.0, np.nan])}, tokens=4, chunks=1, chunk_size=4, dataset="d"
        )
    with pytest.raises(ValueError, match="finite and non-negative"):
        write_imatrix(out, {"a.weight": np.array([1.0, -1.0])}, tokens=4, chunks=1, chunk_size=4, dataset="d")
    with pytest.raises(ValueError, match="at least one token"):
        write_imatrix(out, {"a.weight": np.ones(2)}, tokens=0, chunks=1, chunk_size=4, dataset="d")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("tied", [True, False])
def test_importance_by_tensor_names_every_matrix_as_the_gguf_does(tied):
    """Every matrix of the GGUF that reads an input gets its module's vector under its GGUF name: with tied
    embeddings token_embd carries the output head's; untied, the embedding (a lookup) has none and output does."""
    model = tiny_model("llama", vocab_size=VOCAB, tie_word_embeddings=tied)
    windows = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    importance = measure_importance(model, windows, progress=False)
    architecture, vectors = importance_by_tensor(model, importance.weights)
    layers = model.config.num_hidden_layers
    per_layer = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    expected = {f"blk.{i}.{n}.weight" for i in range(layers) for n in per_layer}
    expected |= {"token_embd.weight"} if tied else {"output.weight"}
    assert architecture == "llama" and set(vectors) == expected
    np.testing.assert_array_equal(
        vectors["blk.1.ffn_down.weight"], importance.of("model.layers.1.mlp.down_proj").double().numpy()
    )
    head = vectors["token_embd.weight" if tied else "output.weight"]
    np.testing.assert_array_equal(head, importance.of("lm_head").double().numpy())


@pytest.mark.slow
def test_bundled_export_writes_the_imatrix_its_own_gguf_was_quantized_with(tmp_path, capsys):
    """`export --type q4_k_m --imatrix-out`: the file names every matrix of the GGUF, and quantizing a matrix
    with the file's weights (what `llama-quantize --imatrix` does) gives the very blocks the GGUF holds."""
    pytest.importorskip(
        "xllamacpp", reason="llama.cpp's wheel is not installed (pip install masa-compress[gguf])"
    )
    import gguf

    from compressor.api.model_loading import load_model, resolve_model
    from compressor.cli import main
    from compressor.quantize.ggml_quantize import quantize_with_llama_cpp

    out, imatrix = tmp_path / "q4.gguf", tmp_path / "q4.imatrix.gguf"
    main(["export", "smollm2-135m", str(out), "--type", "q4_k_m", "--imatrix-out", str(imatrix),
          "--calib-samples", "4", "--json"])  # fmt: skip
    summary = json.loads(capsys.readouterr().out)
    assert summary["imatrix_file"]["entries"] == 30 * 7 + 1 and summary["imatrix_file"]["chunks"] == 4
    model_file = gguf.GGUFReader(str(out))
    matrices = {t.name: t for t in model_file.tensors if len(t.shape) == 2 and t.name != "rope_freqs.weight"}
    weights = read_imatrix(imatrix)
    assert set(weights) == set(matrices)
    assert ggml_reads(imatrix)["keys"]["imatrix.chunk_count"] == 4
    stored = matrices["blk.3.ffn_down.weight"]
    assert stored.tensor_type.name in ("Q4_K", "Q6_K")
    source = load_model(resolve_model("smollm2-135m"), device="cpu", dtype="float32", progress=False).model
    array = source.model.layers[3].mlp.down_proj.weight.detach().numpy()
    again = quantize_with_llama_cpp(array, stored.tensor_type.name, weights["blk.3.ffn_down.weight"][0])
    np.testing.assert_array_equal(again.ravel(), np.asarray(stored.data).view(np.uint8).ravel())
    plain = quantize_with_llama_cpp(array, stored.tensor_type.name, None)
    assert not np.array_equal(plain.ravel(), again.ravel())  # the weights changed the blocks


def legacy_imatrix(path, means: dict[str, np.ndarray], calls: int, chunks: int, dataset: str):
    """A `.dat` as `llama-imatrix --output-format dat` writes it (`save_imatrix_legacy`): values stored as the
    mean squares times the calls."""
    import struct

    with open(path, "wb") as out:
        out.write(struct.pack("<i", len(means)))
        for name, vector in means.items():
            out.write(struct.pack("<i", len(name)) + name.encode())
            out.write(struct.pack("<ii", calls, vector.size))
            out.write((vector.astype(np.float32) * np.float32(calls)).astype("<f4").tobytes())
        out.write(struct.pack("<i", chunks) + struct.pack("<i", len(dataset)) + dataset.encode())
    return path


def test_both_formats_read_as_llama_quantize_divides_them(tmp_path):
    from compressor.checkpoint.imatrix_file import read_imatrix_file

    rng = np.random.default_rng(0)
    means = {"blk.0.attn_q.weight": rng.uniform(0.01, 2, 64), "output.weight": rng.uniform(0.01, 2, 64)}
    dat = read_imatrix_file(
        legacy_imatrix(tmp_path / "a.dat", means, calls=10, chunks=10, dataset="wiki.txt")
    )
    written = write_imatrix(
        tmp_path / "a.gguf", means, tokens=1280, chunks=10, chunk_size=128, dataset="wiki.txt"
    )
    gguf_file = read_imatrix_file(written.path)
    for data, form in ((dat, "legacy"), (gguf_file, "gguf")):
        assert data.format == form and data.datasets == ("wiki.txt",) and data.chunks == 10
        assert set(data.means) == set(means)
        for name, vector in means.items():
            expected = vector.astype(np.float32)
            np.testing.assert_allclose(data.means[name][0], expected, rtol=2e-7)
    assert "a.dat (legacy imatrix: wiki.txt; 10 chunks)" == dat.describe()


@pytest.fixture
def tiny_folder_and_tokenizer(tmp_path):
    from conftest import tiny_model_dir
    from test_gguf_export import byte_tokenizer_gguf

    return tiny_model_dir(tmp_path / "model"), byte_tokenizer_gguf(tmp_path / "bytes.gguf")


def test_export_with_its_own_imatrix_file_writes_the_same_tensors(tmp_path, tiny_folder_and_tokenizer):
    """--imatrix FILE with the file --imatrix-out wrote: the same blocks as --imatrix calibration (the weights
    round-trip exactly through the file's float32 sums over a power-of-two token count); only the line saying
    where the weights came from differs."""
    import gguf

    from compressor.api.export import export

    folder, tokenizer = tiny_folder_and_tokenizer
    common = {"tensor_type": "q4_0", "tokenizer_from": str(tokenizer), "progress": False}
    measured = export(
        str(folder), tmp_path / "a.gguf", imatrix_out=tmp_path / "w.gguf", calib_samples=2, **common
    )
    from_file = export(str(folder), tmp_path / "b.gguf", imatrix=str(tmp_path / "w.gguf"), **common)
    plain = export(str(folder), tmp_path / "c.gguf", imatrix="none", **common)
    blocks = [
        {t.name: bytes(t.data) for t in gguf.GGUFReader(str(r.path)).tensors}
        for r in (measured, from_file, plain)
    ]
    assert blocks[0] == blocks[1] and blocks[0] != blocks[2]
    assert from_file.details["imatrix"].startswith("w.gguf (gguf imatrix: ")


def test_an_importance_file_of_another_model_is_refused_naming_the_first_mismatch(
    tmp_path, tiny_folder_and_tokenizer
):
    from compressor.api.export import export
    from compressor.runtime.errors import UserError

    folder, tokenizer = tiny_folder_and_tokenizer
    common = {"tensor_type": "q4_0", "tokenizer_from": str(tokenizer), "progress": False}
    wider = write_imatrix(tmp_path / "wider.gguf", {"blk.0.ffn_down.weight": np.ones(999)}, tokens=1, chunks=1,
                          chunk_size=1, dataset="x")  # fmt: skip
    with pytest.raises(UserError, match=r"entry blk.0.ffn_down.weight has 999 weights for \d+ inputs"):
        export(str(folder), tmp_path / "m.gguf", imatrix=str(wider.path), **common)
    deeper = legacy_imatrix(tmp_path / "deeper.dat", {"blk.40.attn_q.weight": np.ones(64)}, 1, 1, "x")
    with pytest.raises(UserError, match=r"entry blk.40.attn_q.weight names no matrix of this model"):
        export(str(folder), tmp_path / "m.gguf", imatrix=str(deeper), **common)
    (tmp_path / "junk.dat").write_bytes(b"\x05\x00")
    with pytest.raises(UserError, match=r"not an importance file llama.cpp writes"):
        export(str(folder), tmp_path / "m.gguf", imatrix=str(tmp_path / "junk.dat"), **common)
    assert not (tmp_path / "m.gguf").exists()


def test_a_narrowed_matrix_reads_the_original_s_entry_at_its_kept_columns(tmp_path):
    """`importance_from_file` with a checkpoint's kept columns: a narrower down_proj reads the original's entry at
    the columns it keeps; one the checkpoint records no columns for is refused in one line saying so."""
    from compressor.checkpoint.imatrix_file import importance_from_file, read_imatrix_file
    from compressor.runtime.errors import UserError

    model = tiny_model("llama", vocab_size=VOCAB)
    down = model.model.layers[0].mlp.down_proj
    width = down.in_features
    kept = np.arange(0, width, 2)  # every other neuron of the original's
    model.model.layers[0].mlp.down_proj = torch.nn.Linear(len(kept), down.out_features, bias=False)
    entry = np.arange(1, width + 1, dtype=np.float64)
    file = write_imatrix(tmp_path / "w.gguf", {"blk.0.ffn_down.weight": entry}, tokens=1, chunks=1, chunk_size=1,
                         dataset="x").path  # fmt: skip
    data = read_imatrix_file(file)
    weights = importance_from_file(model, data, {"model.layers.0.mlp.down_proj": (width, kept)})
    assert weights["model.layers.0.mlp.down_proj"].tolist() == entry[kept].tolist()
    with pytest.raises(UserError, match="the checkpoint records no original columns for it"):
        importance_from_file(model, data, {})
    with pytest.raises(UserError, match="pass the importance file of this model"):
        importance_from_file(model, data)
