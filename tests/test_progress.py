"""Progress when stderr is not a terminal (a log file, CI, nohup): plain lines, one per stage and one at least
every 30 s while it runs, on a fake clock; `--quiet` (enabled=False) writes nothing."""

from __future__ import annotations

import time

import pytest

from compressor.runtime import progress
from compressor.runtime.progress import progress_bar


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def log(monkeypatch):
    """stderr as a log file, a clock the test moves, and the watcher thread asleep unless a test wakes it."""
    clock = FakeClock()
    monkeypatch.setattr(progress, "stderr_is_terminal", lambda: False)
    monkeypatch.setattr(progress, "_clock", clock)
    monkeypatch.setattr(progress, "_WATCH_S", 3600.0)
    return clock


def test_a_line_every_30_seconds_and_one_at_the_end(log, capsys):
    with progress_bar("Calibration", total=10) as bar:
        for _ in range(10):
            log.now += 10  # 10 s a window: 100 s in all
            bar.advance()
    lines = capsys.readouterr().err.splitlines()
    assert lines == [
        "Calibration: 3/10 · 30% · elapsed 0:30 · ETA 1:10",
        "Calibration: 6/10 · 60% · elapsed 1:00 · ETA 0:40",
        "Calibration: 9/10 · 90% · elapsed 1:30 · ETA 0:10",
        "Calibration: done 10/10 in 1:40",
    ]


def test_a_short_stage_writes_one_line(log, capsys):
    with progress_bar("Spectra", total=4) as bar:
        bar.advance(4)
    assert capsys.readouterr().err.splitlines() == ["Spectra: done 4/4 in 0:00"]


def test_a_stage_without_total_and_an_update(log, capsys):
    with progress_bar("Loading", total=None) as bar:
        log.now += 31
        bar.update(advance=2)
        bar.update(description="Loading shards", total=5, completed=5)
    assert capsys.readouterr().err.splitlines() == [
        "Loading: 2 · elapsed 0:31",
        "Loading shards: done 5/5 in 0:31",
    ]


def test_a_failed_stage_says_where_it_stopped(log, capsys):
    with pytest.raises(RuntimeError), progress_bar("Factors", total=8) as bar:
        bar.advance(3)
        raise RuntimeError("boom")
    assert capsys.readouterr().err.splitlines() == ["Factors: stopped at 3/8 in 0:00"]


def test_one_long_step_still_gets_its_lines(log, capsys, monkeypatch):
    """A single step longer than the interval (a 70B layer): the watcher thread writes the line."""
    monkeypatch.setattr(progress, "_WATCH_S", 0.01)
    with progress_bar("Compression", total=2) as bar:
        log.now += 45
        seen, deadline = "", time.monotonic() + 5
        while "Compression: 0/2" not in seen and time.monotonic() < deadline:
            time.sleep(0.01)
            seen += capsys.readouterr().err
        assert "Compression: 0/2 · 0% · elapsed 0:45" in seen, "no line while one step ran 45 s"
        bar.advance(2)


def test_quiet_writes_nothing(log, capsys):
    with progress_bar("Calibration", total=3, enabled=False) as bar:
        log.now += 100
        bar.advance(3)
    assert capsys.readouterr().err == ""


def test_a_terminal_gets_the_rich_bar(monkeypatch):
    monkeypatch.setattr(progress, "stderr_is_terminal", lambda: True)
    with progress_bar("Calibration", total=3) as bar:
        assert isinstance(bar, progress._Bar)
