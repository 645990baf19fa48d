"""The tool's files against llama.cpp's own command-line tools, built from the sources the installed xllamacpp
vendors (`conftest.llama_cpp_tools`): `llama-imatrix`'s importance files read by `export --imatrix FILE`, and the
`--tensor-types-out` recipe applied by `llama-quantize` reproducing an `export --size` file."""

from __future__ import annotations

import json
import subprocess

import numpy as np
import pytest

pytestmark = [pytest.mark.long, pytest.mark.slow]


@pytest.fixture(scope="module")
def bundled_gguf():
    from compressor.api.packaged_models import gguf_directory, packaged_model

    model = packaged_model("smollm2-135m")
    return gguf_directory(model) / model.gguf_file


def tensors_of(path) -> dict:
    import gguf

    return {t.name: (t.tensor_type.name, bytes(t.data)) for t in gguf.GGUFReader(str(path)).tensors}


def test_llama_imatrix_files_in_both_formats_are_read_and_used(
    tmp_path, llama_cpp_tools, bundled_gguf, capsys
):
    pytest.importorskip("xllamacpp")
    from calibration.sources import load_documents
    from compressor.api.model_loading import load_model, resolve_model
    from compressor.checkpoint.imatrix_file import read_imatrix_file
    from compressor.cli import main
    from compressor.quantize.ggml_quantize import quantize_with_llama_cpp

    text = tmp_path / "page.txt"
    text.write_text("\n\n".join(load_documents("wikipedia", "calibration").documents[:3]), encoding="utf-8")
    files = {}
    for form in ("gguf", "dat"):
        files[form] = tmp_path / f"imatrix.{form}"
        subprocess.run(
            [str(llama_cpp_tools / "llama-imatrix"), "-m", str(bundled_gguf), "-f", str(text), "-o", str(files[form]),
             "--output-format", form, "-c", "128", "--chunks", "4", "--no-ppl", "-t", "2"],
            check=True, capture_output=True,
        )  # fmt: skip
    read = {form: read_imatrix_file(path) for form, path in files.items()}
    assert read["gguf"].format == "gguf" and read["dat"].format == "legacy"
    assert set(read["gguf"].means) == set(read["dat"].means) and len(read["gguf"].means) == 30 * 7
    for name, rows in read[
        "gguf"
    ].means.items():  # the .dat rounds (sum / count) * calls to float32 on the way
        np.testing.assert_allclose(read["dat"].means[name], rows, rtol=1e-5, atol=1e-12)
    source = load_model(resolve_model("smollm2-135m"), device="cpu", dtype="float32", progress=False).model
    array = source.model.layers[3].mlp.down_proj.weight.detach().numpy()
    for form, path in files.items():
        out = tmp_path / f"{form}.gguf"
        main(["export", "smollm2-135m", str(out), "--type", "q4_k_m", "--imatrix", str(path), "--json"])
        assert json.loads(capsys.readouterr().out)["imatrix"].startswith(f"imatrix.{form} (")
        stored_type, stored = tensors_of(out)["blk.3.ffn_down.weight"]
        weights = read[form].means["blk.3.ffn_down.weight"][0]
        assert bytes(quantize_with_llama_cpp(array, stored_type, weights).ravel()) == stored


def test_llama_quantize_applies_the_recipe_to_the_same_types_and_blocks(tmp_path, llama_cpp_tools, capsys):
    """`export --size --tensor-types-out --imatrix-out`, then `llama-quantize` with that recipe and importance file
    on the original's f32 GGUF: every tensor in the tool's type, with the very blocks the tool wrote."""
    pytest.importorskip("xllamacpp")
    from compressor.cli import main

    ours, recipe, imatrix = tmp_path / "size.gguf", tmp_path / "types.txt", tmp_path / "imatrix.gguf"
    main(["export", "smollm2-135m", str(ours), "--bits-per-weight", "5.0", "--calib-samples", "8",
          "--imatrix-out", str(imatrix), "--tensor-types-out", str(recipe), "--json"])  # fmt: skip
    summary = json.loads(capsys.readouterr().out)
    command = summary["tensor_types_file"]["command"].split()
    assert command[:5] == ["llama-quantize", "--imatrix", str(imatrix), "--tensor-type-file", str(recipe)]
    assert len(summary["type_counts"]) > 1  # a mix: the recipe has something to reproduce
    original = tmp_path / "f32.gguf"
    main(["export", "smollm2-135m", str(original), "--type", "f32", "--json"])
    capsys.readouterr()
    theirs = tmp_path / "theirs.gguf"
    applied = [
        str(llama_cpp_tools / "llama-quantize"),
        *command[1:5],
        str(original),
        str(theirs),
        command[-1],
        "2",
    ]
    subprocess.run(applied, check=True, capture_output=True)
    ours_tensors, their_tensors = tensors_of(ours), tensors_of(theirs)
    assert ours_tensors.keys() == their_tensors.keys()
    for name, (type_name, blocks) in ours_tensors.items():
        assert their_tensors[name][0] == type_name, name
        assert their_tensors[name][1] == blocks, name
    assert abs(ours.stat().st_size - theirs.stat().st_size) < 64 * 1024  # the metadata alone differs


#: Keys one file has and the other not, each harmless: llama.cpp reads the rope's dimensions as the head's when
#: absent, the vocabulary's size from the token list, and Gemma's and Gemma 2's rope base as 10000 when absent
#: (the tiny models' own: their converter does not write it); the tool records its source, the converter's
#: `general.*` extras are labels.
OURS_ONLY = {"rope.dimension_count", "vocab_size", "rope.freq_base"}  # Gemma 3's converter writes its base
THEIRS_ONLY = {"general.quantization_version", "general.size_label", "general.type"}


def run_converter(sources, folder, *options) -> None:
    """llama.cpp's own `convert_hf_to_gguf.py` of the vendored sources, as a user runs it."""
    import sys

    script = sources / "convert_hf_to_gguf.py"
    subprocess.run(
        [sys.executable, str(script), str(folder), *map(str, options)], check=True, capture_output=True
    )


@pytest.mark.parametrize("family", ["gemma", "gemma2", "gemma3_text"])
def test_gemma_export_is_llama_cpp_s_own_conversion(tmp_path, llama_cpp_sources, family):
    """A tiny Gemma folder of each family (a SentencePiece tokenizer, as Gemma's): the tool's f32 GGUF against the one
    llama.cpp's own `convert_hf_to_gguf.py` writes from the same folder: the same tensors bit for bit, the same
    metadata but the keys named above, the same log-probabilities in llama.cpp; and the gap to transformers, the
    engine's (`ENGINE_GAP`; the f32 bound on weights far from their init: test_gguf_export), bounded."""
    pytest.importorskip("xllamacpp")
    import gguf
    import torch
    from conftest import tiny_model
    from test_gguf_export import GEMMA, GEMMA_ARCHITECTURE, llama_cpp_log_probs
    from test_gguf_tokenizer import SENTENCEPIECE_VOCAB, sentencepiece_tokenizer_files

    from compressor.api.export import export

    overrides, architecture = GEMMA[family], GEMMA_ARCHITECTURE[family]
    folder = tmp_path / family
    model = tiny_model(family, vocab_size=SENTENCEPIECE_VOCAB, **overrides)
    model.save_pretrained(folder)
    sentencepiece_tokenizer_files(folder, family)
    theirs = tmp_path / "theirs.gguf"
    run_converter(llama_cpp_sources, folder, "--outtype", "f32", "--outfile", theirs)
    ours = export(str(folder), tmp_path / "ours.gguf", tensor_type="f32", progress=False).path
    readers = [gguf.GGUFReader(str(p)) for p in (ours, theirs)]
    tensors = [{t.name: np.asarray(t.data) for t in r.tensors} for r in readers]
    assert tensors[0].keys() == tensors[1].keys()
    for name, array in tensors[0].items():
        np.testing.assert_array_equal(array, tensors[1][name], err_msg=name)
    fields = [{k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")} for r in readers]
    ours_only = {f"{architecture}.{key}" for key in OURS_ONLY} | {"masa_compress.source"}
    if family == "gemma3_text":
        ours_only.remove("gemma3.rope.freq_base")
    assert fields[0].keys() - fields[1].keys() == ours_only
    assert fields[1].keys() - fields[0].keys() == THEIRS_ONLY
    if family != "gemma3_text":  # llama.cpp's default where theirs has no base: the same rope
        assert fields[0][f"{architecture}.rope.freq_base"] == 10000.0
    differ = {k for k in fields[0].keys() & fields[1].keys() if fields[0][k] != fields[1][k]}
    assert differ == {"general.name"}
    ids = torch.randint(0, SENTENCEPIECE_VOCAB, (1, 32), generator=torch.Generator().manual_seed(0))
    ours_lp, theirs_lp = llama_cpp_log_probs(ours, ids), llama_cpp_log_probs(theirs, ids)
    assert (ours_lp - theirs_lp).abs().max() < 1e-4
    with torch.no_grad():
        expected = torch.log_softmax(model(ids).logits.float(), dim=-1)
    assert (ours_lp - expected).abs().max() < 2e-3  # the engine's float16 GELU table (4e-4 measured at most)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "phi3"])
def test_sentencepiece_tokenizer_fields_are_llama_cpp_s_converter_s(tmp_path, llama_cpp_sources, family):
    """A folder with a SentencePiece `tokenizer.model`, converted by the tool and by llama.cpp's own converter
    (`--vocab-only`) for each path the converter reads it by (Llama's, Qwen2's and Qwen3's, Phi-3's own): the same
    `tokenizer.*` fields, value for value (Gemma's: the test above, whole files)."""
    from conftest import tiny_model
    from test_gguf_tokenizer import SENTENCEPIECE_VOCAB, as_dict, sentencepiece_tokenizer_files

    from compressor.checkpoint.gguf_tokenizer import fields_from_gguf, fields_from_hf

    folder = tmp_path / family
    tiny_model(family, vocab_size=SENTENCEPIECE_VOCAB).save_pretrained(folder)
    sentencepiece_tokenizer_files(folder, family)
    theirs = tmp_path / "theirs.gguf"
    run_converter(llama_cpp_sources, folder, "--vocab-only", "--outfile", theirs)
    ours = as_dict(fields_from_hf(folder))
    tokens = ours.pop("tokenizer.ggml.tokens")  # bytes as written, as the converter's; read back, text
    theirs_fields = as_dict(fields_from_gguf(theirs))
    assert [t.decode() for t in tokens] == theirs_fields.pop("tokenizer.ggml.tokens")
    assert (
        ours == theirs_fields
        and ours["tokenizer.ggml.model"] == "llama"
        and len(tokens) == SENTENCEPIECE_VOCAB
    )


def test_the_tool_s_mixes_are_llama_quantize_s(tmp_path, llama_cpp_tools, bundled_gguf):
    """The tool's port of `llama-quantize`'s per-tensor rules (`gguf_types.matrix_types`) gives every tensor the
    type `llama-quantize --dry-run` gives it, at every mix, with the same importance file; and both tools' files of
    two mixes hold the same blocks (`benchmarks/engines/llama_quantize_port.py`, whose committed run covers both
    packaged models)."""
    pytest.importorskip("xllamacpp")
    from benchmarks.engines.llama_quantize_port import compare_files, our_types, their_types
    from compressor.api.export import export
    from compressor.quantize.ggml_quantize import K_QUANT_MIXES

    imatrix, f32 = tmp_path / "imatrix.gguf", tmp_path / "f32.gguf"
    export("smollm2-135m", f32, tensor_type="f32", imatrix_out=imatrix, calib_samples=8, progress=False)
    quantize = llama_cpp_tools / "llama-quantize"
    for mix in K_QUANT_MIXES:
        theirs = their_types(quantize, bundled_gguf, imatrix, mix)
        assert len(theirs) == 272 and our_types(bundled_gguf, mix) == theirs, mix
    for mix in ("q4_k_m", "iq2_xs"):
        files = compare_files("smollm2-135m", mix, f32, imatrix, quantize, tmp_path)
        assert files["other_type"] == [] and files["other_blocks"] == [], mix
        assert abs(files["ours_bytes"] - files["theirs_bytes"]) < 1024  # the metadata alone differs
