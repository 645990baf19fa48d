"""Progress bars (rich, on stderr so `--json` stdout stays clean) and a switch to silence them."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

stderr_console = Console(stderr=True)


class _NullBar:
    def advance(self, steps: int = 1) -> None:
        pass

    def update(self, **_: object) -> None:
        pass


class _Bar:
    def __init__(self, progress: Progress, task_id: int):
        self._progress, self._task = progress, task_id

    def advance(self, steps: int = 1) -> None:
        self._progress.advance(self._task, steps)

    def update(self, **kwargs: object) -> None:
        self._progress.update(self._task, **kwargs)


@contextmanager
def progress_bar(description: str, total: int | None, enabled: bool = True) -> Iterator[_Bar | _NullBar]:
    """A bar with count, elapsed time and ETA; a no-op when disabled (`--quiet`, `--json`, tests)."""
    if not enabled:
        yield _NullBar()
        return
    columns = (
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=stderr_console, transient=False) as progress:
        yield _Bar(progress, progress.add_task(description, total=total))


def note(message: str, enabled: bool = True) -> None:
    if enabled:
        stderr_console.print(message)
