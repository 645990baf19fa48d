"""A GGUF file written whole or not at all: gguf's writer on a temporary sibling, renamed into place. Both GGUFs
the tool writes go through it: a model (`gguf_export`) and llama.cpp's imatrix file (`imatrix_file`)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def gguf_writer(out: Path, architecture: str) -> Iterator:
    """A `gguf.GGUFWriter` to add key-values and tensors to; when the block ends, the header, key-values and
    tensors are written and the temporary sibling renamed to `out`. On an error (or an interrupt) the temporary
    file goes and `out` is left as it was."""
    import gguf

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    writer = gguf.GGUFWriter(str(tmp), architecture)
    try:
        yield writer
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp, out)
    finally:
        writer.close()
        tmp.unlink(missing_ok=True)
