"""Errors a user can fix. The CLI prints these as one line, without a traceback.

A message names the fix in the caller's own words: the CLI's flags (`--overwrite`) when the command line called,
the Python API's arguments (`overwrite=True`) otherwise. `cli.main` runs every command inside `cli_wording()`;
code that raises picks its words with `wording(cli, python)`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch

_CALLER: ContextVar[str] = ContextVar("masa_compress_caller", default="python")


class UserError(Exception):
    """A problem with the user's input: the message names the problem and the fix, on one line."""


class CheckpointError(UserError):
    """A compressed checkpoint that is missing, truncated, edited or from a newer tool version."""


class NumericalError(RuntimeError):
    """A numerical failure (non-finite values, an SVD that did not converge) that we refuse to hide."""


#: Rows `all_finite` checks at a time: `torch.isfinite(t).all()` of a whole fp64 matrix makes an |x| copy of it and
#: two boolean masks (1.4 matrices measured at 8960², 0.8 GiB), more than the Cholesky it guards.
FINITE_CHECK_ROWS = 256


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether every entry of `tensor` is finite, checked by blocks of leading rows (no whole-size temporary)."""
    blocks = tensor.split(FINITE_CHECK_ROWS) if tensor.ndim > 1 else (tensor,)
    return all(bool(torch.isfinite(block).all()) for block in blocks)


@contextmanager
def cli_wording() -> Iterator[None]:
    """Within this block, errors name the command line's flags (`cli.main` wraps every command in it)."""
    token = _CALLER.set("cli")
    try:
        yield
    finally:
        _CALLER.reset(token)


def wording(cli: str, python: str) -> str:
    """`cli` when the command line called (inside `cli_wording`), `python` for a library caller."""
    return cli if _CALLER.get() == "cli" else python
