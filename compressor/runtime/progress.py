"""Progress on stderr (so `--json` stdout stays clean), and a switch to silence it.

On a terminal: rich bars with count, elapsed time and ETA. When stderr is not a terminal (a file, a pipe, CI,
nohup, a cluster job) bars would leave nothing readable, so each stage writes plain lines instead: one when it
ends (or stops on an error), and one at least every `PLAIN_INTERVAL_S` seconds while it runs (stage, done/total,
elapsed, ETA), so a log always shows where a run is. `--quiet` / `--json` silence both.
"""

from __future__ import annotations

import sys
import threading
import time
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

#: The longest a plain log stays silent while a stage runs, in seconds.
PLAIN_INTERVAL_S = 30.0
#: How often the plain log's watcher checks whether a line is due (a step longer than the interval still
#: gets its lines).
_WATCH_S = 5.0
_clock = time.monotonic  # replaced by a fake clock in tests


def stderr_is_terminal() -> bool:
    return stderr_console.is_terminal


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


def _duration(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


class _PlainBar:
    """The same interface as a bar, writing plain lines to stderr (see the module's docstring)."""

    def __init__(self, description: str, total: int | None):
        self.description, self.total, self.completed = description, total, 0
        self._start = self._last = _clock()
        self._lock = threading.Lock()

    def advance(self, steps: int = 1) -> None:
        self.update(advance=steps)

    def update(self, **kwargs: object) -> None:
        """rich's `Progress.update` keywords: description, total, completed, advance."""
        with self._lock:
            self.description = str(kwargs.get("description", self.description))
            self.total = kwargs.get("total", self.total)  # type: ignore[assignment]
            self.completed = int(kwargs.get("completed", self.completed)) + int(kwargs.get("advance", 0) or 0)
        self.line_if_due()

    def line_if_due(self) -> None:
        with self._lock:
            now = _clock()
            if now - self._last < PLAIN_INTERVAL_S:
                return
            self._last = now
            line = self._status(now)
        _write(line)

    def _status(self, now: float, finished: str | None = None) -> str:
        elapsed = now - self._start
        done = f"{self.completed}/{self.total}" if self.total else f"{self.completed}"
        if finished is not None:
            return f"{self.description}: {finished} {done} in {_duration(elapsed)}"
        parts = [f"{self.description}: {done}"]
        if self.total:
            parts.append(f"{self.completed / self.total:.0%}")
        parts.append(f"elapsed {_duration(elapsed)}")
        if self.total and self.completed:
            parts.append(f"ETA {_duration(elapsed / self.completed * (self.total - self.completed))}")
        return " · ".join(parts)

    def finish(self, ok: bool) -> None:
        with self._lock:
            line = self._status(_clock(), "done" if ok else "stopped at")
        _write(line)


def _write(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


@contextmanager
def _watched(bar: _PlainBar) -> Iterator[None]:
    """Let a watcher thread write the due lines while one step runs longer than the interval."""
    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(_WATCH_S):
            bar.line_if_due()

    watcher = threading.Thread(target=watch, name="masa-progress", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        stop.set()
        watcher.join()


@contextmanager
def progress_bar(
    description: str, total: int | None, enabled: bool = True
) -> Iterator[_Bar | _NullBar | _PlainBar]:
    """A bar with count, elapsed time and ETA (plain lines when stderr is not a terminal); a no-op when
    disabled (`--quiet`, `--json`, tests)."""
    if not enabled:
        yield _NullBar()
        return
    if not stderr_is_terminal():
        plain = _PlainBar(description, total)
        ok = False
        try:
            with _watched(plain):
                yield plain
            ok = True
        finally:
            plain.finish(ok)
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
