"""Helpers shared by the benchmark sections: machine description, memory readings, child processes."""

from __future__ import annotations

import json
import math
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

GIB = 1024**3


def log(message: str) -> None:
    """Progress lines go to stderr, so a child's stdout carries only its JSON answer."""
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def peak_rss_gib() -> float:
    """Peak resident set size of this process so far (ru_maxrss: KiB on Linux, bytes on macOS)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (GIB if sys.platform == "darwin" else 1024**2)


def current_rss_gib() -> float:
    """Resident set size of this process now (VmRSS), or the peak where /proc is missing."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024**2
    except OSError:
        pass
    return peak_rss_gib()


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _ram_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 1024**2, 1)
    except OSError:
        pass
    return None


def machine_info() -> dict:
    import torch
    import transformers

    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    return {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "usable_cores": usable,
        "ram_gib": _ram_gib(),
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "torch_threads": torch.get_num_threads(),
        "device": "cpu",
    }


def run_json_child(args: list[str], what: str, timeout: float | None = None) -> dict:
    """Run `python ARGS` in a fresh process (so its peak memory is its own) and parse the JSON object it
    prints last on stdout. Its stderr passes through. A failure raises with the child's exit status."""
    command = [sys.executable, *args]
    start = time.perf_counter()
    proc = subprocess.run(
        command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True, timeout=timeout
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed (exit {proc.returncode}): {' '.join(command)}")
    lines = [line for line in proc.stdout.splitlines() if line.strip().startswith("{")]
    if not lines:
        raise RuntimeError(f"{what} printed no JSON object: {' '.join(command)}\n{proc.stdout[-2000:]}")
    result = json.loads(lines[-1])
    result.setdefault("child_wall_seconds", time.perf_counter() - start)
    return result


def non_finite(value, path: str = "") -> list[str]:
    """Paths of the numbers in a JSON-like value that are not finite (NaN, inf)."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return []
    if isinstance(value, (int, float)):
        return [] if math.isfinite(value) else [path or "(root)"]
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in non_finite(v, f"{path}.{k}" if path else str(k))]
    if isinstance(value, (list, tuple)):
        return [p for i, v in enumerate(value) for p in non_finite(v, f"{path}[{i}]")]
    return [f"{path} ({type(value).__name__})"]
