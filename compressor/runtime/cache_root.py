"""Where masa-compress keeps downloaded assets (text, converted models) between runs.

One root for everything, so a user can inspect or delete it in one place, and CI can point it at
a cached folder with a single environment variable.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

#: Environment variable that overrides the cache root (e.g. a CI cache folder or a shared disk).
CACHE_ENV = "MASA_CACHE"


def cache_dir() -> Path:
    """Return the cache root: ``$MASA_CACHE`` if set, else ``~/.cache/masa-compress``.

    The folder is not created here (callers create the subfolder they write to), so that merely
    asking for the path never touches the disk.
    """
    override = os.environ.get(CACHE_ENV)
    if override:
        return Path(override).expanduser()
    return Path.home() / ".cache" / "masa-compress"


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see either the old file or the complete new one.

    Two commands may fill the cache at the same time, and a run may be interrupted: writing to a
    temporary file in the same folder and ``os.replace``-ing it (atomic on POSIX and Windows) means
    a half-written cache file can never be read back as valid.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        # mkstemp creates the file 0600; a cache file is ordinary data, readable like any other.
        os.chmod(tmp_name, 0o644)
        os.replace(tmp_name, path)
    except BaseException:
        # Leave no stray temporary file behind, whatever interrupted us.
        try:
            os.unlink(tmp_name)
        except FileNotFoundError:
            pass
        raise


def sha256_of(path: Path) -> str:
    """The sha256 of a file, read in 16 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            digest.update(block)
    return digest.hexdigest()


#: The least share of the CPU (its process time over the wall time and the threads) a measurement kept in the cache
#: had: below it, other work held the cores while it ran, and its rates (a third of the machine's, seen here while
#: a benchmark ran beside the tests) would price every later plan. On an idle machine it reads about 0.9-1.
BUSY_SHARE = 0.75


class CpuShared:
    """A timing's dataclass that records the share of the CPU it had (its `cpu_share` field): `measured_once`
    keeps it only where other work did not hold the cores (`busy`)."""

    cpu_share: float

    @property
    def busy(self) -> bool:
        """Measured while other work held the CPU: prices one estimate, never cached."""
        return self.cpu_share < BUSY_SHARE


def measured_once(name: str, identity: str, measure, kind):
    """A timing measured once per machine: `kind(**fields)` of the JSON cached under `rates/<name><identity's
    hash>.json` where it reads, else `measure()`, kept there unless it was taken while other work held the CPU
    (its `busy`: it would price every later estimate too long), then priced this once."""
    import json
    from dataclasses import asdict

    path = cache_dir() / "rates" / f"{name}{hashlib.sha256(identity.encode()).hexdigest()[:16]}.json"
    try:
        return kind(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        pass
    measured = measure()
    if not measured.busy:
        atomic_write_bytes(path, json.dumps(asdict(measured)).encode())
    return measured
