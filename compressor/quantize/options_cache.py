"""The byte budget's measured options (per matrix: each candidate type, its bytes, its predicted loss rise), kept on
disk under the key of the importance weights they were measured with (which names the model's weights, the
calibration windows and the tool's version), the code that measures them, and the rounding: a second budget of the same model, in this process
or a later one, allocates without rounding any matrix again.

A file that cannot be read, or holds another key, is measured again, never trusted; writes are atomic.
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path

from compressor.runtime.cache_root import atomic_write_bytes, cache_dir

#: Bump when what an option means changes (its fields, the error model behind `predicted`).
OPTIONS_FORMAT = 1

Options = dict[str, list[tuple[str, int, float]]]  # tensor name -> [(type, bytes, predicted loss rise)]


#: The modules whose code computes an option: a change to any of them measures every option again (a version
#: number alone would let an edited error model read the last one's results during development).
MEASURED_BY = ("byte_budget.py", "ggml_quantize.py", "rounding.py", "compensated.py")


@functools.cache
def code_fingerprint() -> str:
    here = Path(__file__).parent
    digest = hashlib.sha256()
    for name in MEASURED_BY:
        digest.update((here / name).read_bytes())
    return digest.hexdigest()


def options_path(key: str, rounding: str) -> Path:
    digest = hashlib.sha256(f"{OPTIONS_FORMAT}:{code_fingerprint()}:{key}:{rounding}".encode()).hexdigest()[
        :32
    ]
    return cache_dir() / "byte-options" / f"{digest}.json"


def load_options(key: str, rounding: str) -> Options:
    """The options measured before under this key and rounding (none: {})."""
    path = options_path(key, rounding)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if data.get("key") != key or data.get("rounding") != rounding or data.get("format") != OPTIONS_FORMAT:
        return {}
    return {name: [(str(t), int(b), float(p)) for t, b, p in rows] for name, rows in data["options"].items()}


def save_options(key: str, rounding: str, options: Options) -> Path:
    """Keep `options` (merged with what the file holds) under this key and rounding, atomically."""
    path = options_path(key, rounding)
    merged = load_options(key, rounding) | options
    payload = {"format": OPTIONS_FORMAT, "key": key, "rounding": rounding, "options": merged}
    atomic_write_bytes(path, json.dumps(payload).encode())
    return path
