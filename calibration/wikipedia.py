"""The default offline text: an excerpt of English Wikipedia shipped inside the gensim wheel.

Why this source: the project's machines (and CI) reach package registries only, never a model or
data-set hub. The gensim 4.4.0 wheel on PyPI carries, as test data, a 1.7 MB bz2 MediaWiki dump of
the first pages of English Wikipedia (206 pages; 106 real articles, 2.8M characters ~ 627k SmolLM2
tokens once markup, tables and reference sections are stripped): more text than the WikiText-2 test
split, in the same domain. We download the wheel with pip, read that one member and never import
(or depend on) gensim.

Pipeline: pip download -> read the bz2 member of the wheel (a zip) -> verify its sha256 -> parse
the MediaWiki XML -> keep namespace-0, non-redirect pages -> strip markup with mwparserfromhell ->
light line-based cleanup -> cache as JSON. The bz2 is cached too, so changing the cleanup rules
(bump ``_FORMAT_VERSION``) re-strips without the network.

Wikipedia text is licensed CC BY-SA.
"""

from __future__ import annotations

import bz2
import hashlib
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from compressor.runtime.cache_root import atomic_write_bytes, cache_dir
from compressor.runtime.errors import UserError

#: The pinned wheel that carries the dump. A wheel on PyPI never changes once published.
GENSIM_VERSION = "4.4.0"
#: Path of the dump inside the wheel.
WHEEL_MEMBER = "gensim/test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
#: sha256 of that member: the same bytes whatever wheel (platform) pip picks or a user supplies.
BZ2_SHA256 = "a53f4648dec40467ebdcbc7a1307eddb51fe6e28e9309f6ebde81ba0d04bea2d"
#: Environment variable naming a hand-placed copy of the dump (or of the whole wheel) for machines
#: without access to PyPI.
WIKI_BZ2_ENV = "MASA_WIKI_BZ2"

#: Bump when the stripping/cleanup rules change: the JSON name carries it, so stale caches are
#: rebuilt from the cached bz2 instead of being silently reused.
_FORMAT_VERSION = 1
#: Pages whose stripped text is shorter than this are stubs or leftovers, not prose worth keeping.
MIN_ARTICLE_CHARS = 200

#: Tags whose content is not running prose: references, tables, galleries, formulas, etc.
_DROP_TAGS = frozenset(
    {
        "ref",
        "references",
        "table",
        "gallery",
        "timeline",
        "imagemap",
        "math",
        "chem",
        "ce",
        "hiero",
        "score",
        "syntaxhighlight",
        "source",
        "graph",
        "mapframe",
        "noinclude",
    }
)
#: Link namespaces that are media or page metadata, not text (``[[File:x.jpg|thumb|caption]]``
#: would otherwise leave "thumb|caption" lines behind).
_DROP_LINK_PREFIXES = ("file:", "image:", "media:", "category:")
#: Trailing sections that are lists of links and citations rather than prose: the article is cut
#: at the first top-level heading with one of these titles.
_TRAILER_HEADINGS = frozenset(
    {
        "references",
        "notes",
        "footnotes",
        "citations",
        "sources",
        "bibliography",
        "further reading",
        "external links",
        "see also",
        "notes and references",
    }
)
#: Line starts that mark table rows or leftover media/category lines the parser did not catch
#: (the dump is "shortened", so some articles end inside a construct and are left unparsed).
_JUNK_LINE_PREFIXES = (
    "{|",
    "|}",
    "|-",
    "|+",
    "|",
    "!",
    "[[file:",
    "[[image:",
    "file:",
    "image:",
    "category:",
)


@dataclass(frozen=True)
class Article:
    """One Wikipedia article after markup stripping."""

    title: str
    text: str


def text_cache_dir() -> Path:
    """Folder under the cache root that holds the downloaded dump and the stripped articles."""
    return cache_dir() / "text"


def _bz2_cache_path() -> Path:
    return text_cache_dir() / Path(WHEEL_MEMBER).name


def _articles_cache_path() -> Path:
    return text_cache_dir() / f"wikipedia-articles.v{_FORMAT_VERSION}.json"


def _log(progress: bool, message: str) -> None:
    # stderr, so commands that print results (JSON, tables) on stdout stay machine-readable.
    if progress:
        print(message, file=sys.stderr, flush=True)


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _read_dump_bytes(path: Path) -> bytes:
    """Return the bz2 dump from ``path``, which is either the bz2 itself or a gensim wheel (zip)."""
    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as wheel:
            try:
                return wheel.read(WHEEL_MEMBER)
            except KeyError:
                raise UserError(
                    f"{path} has no member {WHEEL_MEMBER}: use the gensim=={GENSIM_VERSION} wheel "
                    f"or that member extracted from it"
                ) from None
    return path.read_bytes()


def _dump_from_env(value: str) -> bytes:
    """Load and verify the hand-placed dump named by ``$MASA_WIKI_BZ2``."""
    path = Path(value).expanduser()
    if not path.is_file():
        raise UserError(
            f"{WIKI_BZ2_ENV}={value} does not exist: point it at {Path(WHEEL_MEMBER).name} "
            f"(from the gensim=={GENSIM_VERSION} wheel) or at the wheel itself, or unset it"
        )
    data = _read_dump_bytes(path)
    if _sha256(data) != BZ2_SHA256:
        raise UserError(
            f"{WIKI_BZ2_ENV}={value} is not the expected Wikipedia dump (sha256 {_sha256(data)[:12]}…, "
            f"expected {BZ2_SHA256[:12]}…): use {WHEEL_MEMBER} from the gensim=={GENSIM_VERSION} wheel"
        )
    return data


def _download_dump(progress: bool) -> bytes:
    """Download the gensim wheel with pip into a temporary folder and return the verified member."""
    _log(
        progress, f"Downloading the Wikipedia text (gensim=={GENSIM_VERSION} wheel, ~28 MB, once) from PyPI…"
    )
    with tempfile.TemporaryDirectory(prefix="masa-gensim-") as tmp:
        # Pin one platform's wheel and forbid source distributions: the member is platform-
        # independent, and this way pip never tries to build gensim (numpy, Cython, a compiler)
        # on a platform or Python version without a matching wheel. We never install it.
        command = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--platform",
            "manylinux_2_28_x86_64",
            "--python-version",
            "3.11",
            "--implementation",
            "cp",
            f"gensim=={GENSIM_VERSION}",
            "-d",
            tmp,
            "--quiet",
        ]
        try:
            result = subprocess.run(command, capture_output=True, text=True, check=False)
            failure = result.stderr if result.returncode != 0 else None
        except OSError as exc:  # e.g. an interpreter without pip
            failure = str(exc)
        wheels = sorted(Path(tmp).glob("gensim-*.whl"))
        if failure is not None or not wheels:
            # Keep pip's own last line: it tells "no network" from "no such version" apart.
            reason = [line.strip() for line in (failure or "no wheel saved").splitlines() if line.strip()]
            last = reason[-1][:200] if reason else "unknown error"
            raise UserError(
                f"could not download the Wikipedia text (gensim=={GENSIM_VERSION} wheel) from PyPI "
                f"({last}): no access to PyPI? On a machine with access run "
                f"`pip download --no-deps gensim=={GENSIM_VERSION}`, copy the wheel (or its member "
                f"{Path(WHEEL_MEMBER).name}) here and set {WIKI_BZ2_ENV}=/path/to/that/file"
            )
        data = _read_dump_bytes(wheels[0])
    if _sha256(data) != BZ2_SHA256:
        # A wheel on PyPI is immutable, so this means a broken mirror or proxy, not a new release.
        raise UserError(
            f"the Wikipedia dump in the downloaded gensim=={GENSIM_VERSION} wheel has sha256 "
            f"{_sha256(data)[:12]}…, expected {BZ2_SHA256[:12]}…: check your package index/mirror, "
            f"or place the file by hand with {WIKI_BZ2_ENV}=/path/to/{Path(WHEEL_MEMBER).name}"
        )
    return data


def _ensure_dump(progress: bool) -> Path:
    """Return the path of the verified bz2 dump in the cache, obtaining it if needed."""
    target = _bz2_cache_path()
    env_value = os.environ.get(WIKI_BZ2_ENV)
    if env_value:
        # An explicit hand-placed file wins over the cache: the user asked for it.
        data = _dump_from_env(env_value)
        if not (target.is_file() and _sha256(target.read_bytes()) == BZ2_SHA256):
            atomic_write_bytes(target, data)
        return target
    if target.is_file() and _sha256(target.read_bytes()) == BZ2_SHA256:
        return target
    atomic_write_bytes(target, _download_dump(progress))
    return target


def _local_tag(tag: str) -> str:
    """``{http://www.mediawiki.org/xml/export-0.10/}page`` -> ``page`` (the export version varies)."""
    return tag.rsplit("}", 1)[-1]


def _iter_pages(dump: bytes) -> Iterator[tuple[str, int, bool, str]]:
    """Yield ``(title, namespace, is_redirect, wikitext)`` for each ``<page>`` of the XML dump."""
    stream = io.BytesIO(bz2.decompress(dump))
    for _event, element in ET.iterparse(stream, events=("end",)):
        if _local_tag(element.tag) != "page":
            continue
        # "{*}" matches any namespace, so we need not know the export schema version.
        title = element.findtext("{*}title") or ""
        ns_text = (element.findtext("{*}ns") or "").strip()
        namespace = int(ns_text) if ns_text.lstrip("-").isdigit() else -1
        is_redirect = element.find("{*}redirect") is not None
        text = element.findtext("{*}revision/{*}text") or ""
        yield title, namespace, is_redirect, text
        element.clear()  # keep memory flat: the page is fully consumed


def _strip_markup(wikitext: str) -> str:
    """Turn MediaWiki markup into plain prose (mwparserfromhell, then light line cleanup)."""
    # Imported lazily: only the (rare) strip step needs it, and importing this module must stay cheap.
    import mwparserfromhell

    code = mwparserfromhell.parse(wikitext)

    # Cut the article at the first trailer section ("References", "External links", ...).
    for index, node in enumerate(code.nodes):
        if isinstance(node, mwparserfromhell.nodes.Heading):
            if str(node.title.strip_code()).strip().lower() in _TRAILER_HEADINGS:
                del code.nodes[index:]
                break

    # Drop media/category links and non-prose tags before strip_code, which would otherwise keep
    # image captions as "thumb|upright|caption" and formula/table source as text.
    _prune(code)

    text = code.strip_code(normalize=True, collapse=True)
    return _clean_lines(text)


def _is_doomed(node: object) -> bool:
    """True for a node whose text is not prose: a media/category link or a non-prose tag."""
    import mwparserfromhell

    if isinstance(node, mwparserfromhell.nodes.Wikilink):
        return str(node.title).strip().lstrip(":").lower().startswith(_DROP_LINK_PREFIXES)
    if isinstance(node, mwparserfromhell.nodes.Tag):
        return str(node.tag).strip().lower() in _DROP_TAGS
    return False


def _prune(code: object) -> None:
    """Remove doomed nodes from ``code`` in one pass over the tree.

    ``Wikicode.remove`` searches the whole tree for each node (quadratic: 14 s instead of 3 s on
    this dump), so we filter node lists directly. We only descend where ``strip_code`` keeps
    text (tag contents, headings, link labels): templates are dropped whole by ``strip_code``.
    """
    import mwparserfromhell

    code.nodes = [node for node in code.nodes if not _is_doomed(node)]
    for node in code.nodes:
        if isinstance(node, mwparserfromhell.nodes.Tag) and node.contents is not None:
            _prune(node.contents)
        elif isinstance(node, mwparserfromhell.nodes.Heading):
            _prune(node.title)
        elif isinstance(node, mwparserfromhell.nodes.Wikilink) and node.text is not None:
            _prune(node.text)


_RE_REF = re.compile(r"<ref[^>]*/>|<ref[^>]*>.*?</ref\s*>", re.IGNORECASE | re.DOTALL)
_RE_HTML_TAG = re.compile(r"</?[A-Za-z][^<>\n]*>")
_RE_TEMPLATE = re.compile(r"\{\{[^{}]*\}\}")
_RE_LINK = re.compile(r"\[\[(?:[^\[\]|]*\|)?([^\[\]|]*)\]\]")
_RE_MAGIC = re.compile(r"__[A-Z]+__")
# "Alabama () is a state": the parentheses held a pronunciation template that strip_code removed.
_RE_EMPTY_PARENS = re.compile(r"[ \t]*\([ \t,;:]*\)")
_RE_BLANKS = re.compile(r"\n{3,}")


def _clean_lines(text: str) -> str:
    """Remove what the parser left behind in unbalanced (truncated) markup, then tidy whitespace."""
    text = text.replace("\xa0", " ")
    text = _RE_REF.sub("", text)
    text = _RE_HTML_TAG.sub("", text)
    # Innermost templates first, repeated, so nested ones vanish too.
    while True:
        reduced = _RE_TEMPLATE.sub("", text)
        if reduced == text:
            break
        text = reduced
    text = _RE_LINK.sub(r"\1", text)
    text = _RE_MAGIC.sub("", text)
    text = _RE_EMPTY_PARENS.sub("", text)

    lines = []
    for raw in text.split("\n"):
        line = raw.strip()
        # An unclosed template or link (article cut mid-construct) runs to the end of the line.
        for opener in ("{{", "[["):
            if opener in line:
                line = line.split(opener, 1)[0].rstrip()
        if line.lower().startswith(_JUNK_LINE_PREFIXES):
            continue
        lines.append(line)
    return _RE_BLANKS.sub("\n\n", "\n".join(lines)).strip()


def _parse_dump(dump: bytes) -> list[Article]:
    """Extract the real articles (namespace 0, not redirects, not stubs) in dump order."""
    articles = []
    for title, namespace, is_redirect, wikitext in _iter_pages(dump):
        if namespace != 0 or is_redirect:
            continue
        text = _strip_markup(wikitext)
        if len(text) < MIN_ARTICLE_CHARS:
            continue
        articles.append(Article(title=title, text=text))
    return articles


def fetch_wikipedia(progress: bool = True) -> Path:
    """Make sure the stripped Wikipedia articles are in the cache; return the JSON file's path.

    Idempotent: a second call only checks that the file exists. The first call downloads the
    gensim wheel from PyPI (or uses ``$MASA_WIKI_BZ2``), then parses and strips the dump (a few
    seconds). Raises :class:`UserError` when PyPI cannot be reached and no file was placed by hand.
    """
    target = _articles_cache_path()
    if target.is_file():
        return target
    dump_path = _ensure_dump(progress)
    started = time.perf_counter()
    articles = _parse_dump(dump_path.read_bytes())
    if not articles:
        # Cannot happen with the verified dump; refuse to cache an empty corpus if it ever does.
        raise RuntimeError(f"no articles parsed from {dump_path}")
    payload = json.dumps([{"title": a.title, "text": a.text} for a in articles], ensure_ascii=False)
    atomic_write_bytes(target, payload.encode("utf-8"))
    n_chars = sum(len(a.text) for a in articles)
    _log(
        progress,
        f"Wikipedia text: {len(articles)} articles, {n_chars:,} characters "
        f"(stripped in {time.perf_counter() - started:.1f} s) -> {target}",
    )
    return target


def wikipedia_articles(progress: bool = True) -> list[Article]:
    """Return the stripped Wikipedia articles in dump order, fetching them first if needed."""
    return read_cached_articles(fetch_wikipedia, progress)


def read_cached_articles(fetch: Callable[..., Path], progress: bool) -> list[Article]:
    """The articles of the JSON cache file that ``fetch(progress=...)`` makes sure of and returns."""
    path = fetch(progress=progress)
    try:
        records = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        # Writes are atomic, so this is outside damage (disk, a hand edit): rebuild once from the
        # cached download rather than fail on something the user did not cause.
        path.unlink(missing_ok=True)
        records = json.loads(fetch(progress=progress).read_text(encoding="utf-8"))
    return [Article(title=r["title"], text=r["text"]) for r in records]


if __name__ == "__main__":
    # `python -m compressor.calibration.wikipedia`: the set-up step that fetches and strips the text.
    fetch_wikipedia(progress=True)
