"""Helpers shared by the benchmark sections: machine description, memory readings, child processes, a cache of a
run's own."""

from __future__ import annotations

import json
import math
import os
import platform
import resource
import shlex
import subprocess
import sys
import time
from pathlib import Path

GIB = 1024**3

#: The bundled SmolLM2-135M's width (its depth is 30 layers).
BUNDLED_WIDTH = {
    "hidden_size": 576,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "intermediate_size": 1536,
    "vocab_size": 49152,
}
#: A narrow model for the quick mode.
NARROW_WIDTH = {
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "vocab_size": 256,
}


def write_json(path: str | Path, payload) -> None:
    """A benchmark's results file, written whole or not at all (a temporary file renamed over it): an
    interrupted run leaves the previous results, never half of a JSON that the report would fail to read."""
    from compressor.runtime.cache_root import atomic_write_bytes

    atomic_write_bytes(Path(path), (json.dumps(payload, indent=2) + "\n").encode())


def command_line(module: str, argv: list[str] | None) -> str:
    """How a results file says it was made: `python -m MODULE ARGS` (the process's own arguments by default),
    quoted as a shell reads them back (an argument with spaces, an empty one)."""
    return " ".join(["python -m", module, shlex.join(sys.argv[1:] if argv is None else argv)]).rstrip()


def log(message: str) -> None:
    """Progress lines go to stderr, so a child's stdout carries only its JSON answer."""
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _proc_status_gib(field: str) -> float | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024**2
    except OSError:
        pass
    return None


def peak_rss_gib() -> float:
    """Peak resident set size of this process so far.

    On Linux this is VmHWM, the high-water mark of the process's current address space, which starts afresh
    at exec. Not `ru_maxrss`: a child inherits its parent's address space at fork, and exec records that
    space's high-water mark into the child's ru_maxrss, so a child started by a large parent (one that has
    run the quality section, say) reports at least the parent's peak. Elsewhere: ru_maxrss.
    """
    hwm = _proc_status_gib("VmHWM")
    if hwm is not None:
        return hwm
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (GIB if sys.platform == "darwin" else 1024**2)


def current_rss_gib() -> float:
    """Resident set size of this process now (VmRSS), or the peak where /proc is missing."""
    rss = _proc_status_gib("VmRSS")
    return rss if rss is not None else peak_rss_gib()


def _cpuinfo_values(*keys: str) -> list[str]:
    """The values of /proc/cpuinfo's lines whose key starts with one of `keys` (any case); none where it is
    missing (not Linux)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return []
    return [line.split(":", 1)[1].strip() for line in lines if line.lower().startswith(keys) and ":" in line]


def _cpu_model() -> str:
    return next(iter(_cpuinfo_values("model name")), None) or platform.processor() or platform.machine()


#: CPU flags (as /proc/cpuinfo names them) -> the vector extension they mark, widest first. Two 2-core AMD EPYC
#: machines, one with AVX-512 and one without, took 68.7 and 110 s for the same forward pass, and the compression's
#: time over it differed too (1.6x and 1.8-1.9x): a timing ratio belongs to its machine.
VECTOR_EXTENSIONS = (("avx512f", "AVX-512"), ("avx2", "AVX2"), ("avx", "AVX"), ("asimd", "NEON"))


def _vector_extension() -> str | None:
    """The widest vector extension of this CPU (`VECTOR_EXTENSIONS`), None where /proc/cpuinfo does not say."""
    flags = {flag for value in _cpuinfo_values("flags", "features") for flag in value.split()}
    return next((name for flag, name in VECTOR_EXTENSIONS if flag in flags), None)


def machine_signature(machine: dict) -> str:
    """What tells two benchmark machines apart: the CPU, its vector extension, cores and threads."""
    vector = machine.get("vector_extension") or "vector extension unknown"
    return f"{machine['cpu']} ({vector}), {machine['usable_cores']} usable cores, {machine['torch_threads']} threads"


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

    from compressor.runtime.device import native_bfloat16_cpu, resolve_device

    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    return {
        "cpu": _cpu_model(),
        "vector_extension": _vector_extension(),
        "native_bfloat16": native_bfloat16_cpu(),
        "cores": os.cpu_count(),
        "usable_cores": usable,
        "ram_gib": _ram_gib(),
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "torch_threads": torch.get_num_threads(),
        # Where `auto` puts the quality section, the compression run and the forward pass; the latency
        # and memory measurements always run on the CPU.
        "device": str(resolve_device("auto")),
        # Which llama.cpp build scores and times GGUF files (the prebuilt wheel's AVX2, or a native build's).
        "llama_cpp": _llama_cpp_build(),
    }


def _llama_cpp_build() -> str | None:
    """llama.cpp's own line of the CPU features its installed build uses; None where it is not installed."""
    try:
        import xllamacpp
    except ImportError:
        return None
    return xllamacpp.get_system_info().strip()


def run_json_child(
    args: list[str], what: str, timeout: float | None = None, env: dict[str, str] | None = None
) -> dict:
    """Run `python ARGS` in a fresh process (so its peak memory is its own; `env`: its environment, default
    ours) and parse the JSON object it prints last on stdout. Its stderr passes through. A failure raises with
    the child's exit status."""
    return _json_objects(_run(args, what, timeout, env), what, args)[-1]


def run_module_measured(module: str, args: list[str], what: str, timeout: float | None = None) -> dict:
    """Run `python -m MODULE ARGS` (a command we do not own, e.g. the CLI) in a fresh process under
    `benchmarks.suite.common`, which reports the process's own peak RSS after the module returns: the JSON object
    the module prints last, plus `peak_rss_gib` and `wall_seconds` of the whole process."""
    objects = _json_objects(_run(["-m", "benchmarks.suite.common", module, *args], what, timeout), what, args)
    if len(objects) < 2:
        raise RuntimeError(f"{what} printed no JSON object before the memory report: {module} {args}")
    return {**objects[-2], "process": objects[-1]}


def _run(args: list[str], what: str, timeout: float | None, env: dict[str, str] | None = None) -> str:
    command = [sys.executable, *args]
    # stdin closed: nothing a child runs may stop and wait for an answer.
    proc = subprocess.run(
        command,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        text=True,
        timeout=timeout,
        preexec_fn=_die_with_parent if sys.platform == "linux" else None,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed (exit {proc.returncode}): {' '.join(command)}")
    return proc.stdout


def exit_on_sigterm() -> None:
    """Turn SIGTERM (a `kill`, a CI timeout) into SystemExit, so that `with` blocks unwind: a temporary
    directory of checkpoints (6 GB each at 1.5B) is removed instead of left behind, and a running child is
    ended by `subprocess.run` on the way out."""
    import signal

    def _exit(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _exit)


def _die_with_parent() -> None:
    """In the child, before exec: ask Linux to end it when the benchmark process dies (a killed run leaves
    no orphan computing on)."""
    import ctypes
    import signal

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _json_objects(stdout: str, what: str, args: list[str]) -> list[dict]:
    objects = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    if not objects:
        raise RuntimeError(f"{what} printed no JSON object: {' '.join(args)}\n{stdout[-2000:]}")
    return objects


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


def _measure_module(argv: list[str]) -> None:
    """`python -m benchmarks.suite.common MODULE ARGS...`: run MODULE as __main__, then print this process's peak
    RSS and wall time as one JSON line."""
    import runpy

    start = time.perf_counter()
    sys.argv = [argv[0], *argv[1:]]
    try:
        runpy.run_module(argv[0], run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        if exc.code not in (None, 0):
            raise
    sys.stdout.flush()
    report = {"peak_rss_gib": peak_rss_gib(), "wall_seconds": time.perf_counter() - start}
    print("\n" + json.dumps(report), flush=True)


if __name__ == "__main__":
    _measure_module(sys.argv[1:])


def cache_of_its_own(path: Path, shared: tuple[str, ...] = ("models", "text", "zero-shot", "rates")) -> Path:
    """A fresh cache folder at `path` (for `MASA_CACHE`) with the `shared` folders of the real cache linked in (the
    packaged models, the unpacked texts, this machine's measured rates, `api/time_estimate.py`): what a run writes
    there is its own, what it only reads is not copied. The experiments that time a run from nothing and the
    tests that must not meet an earlier run's statistics use it."""
    from compressor.runtime.cache_root import cache_dir

    path.mkdir()
    for folder in shared:
        if (cache_dir() / folder).is_dir():
            (path / folder).symlink_to(cache_dir() / folder, target_is_directory=True)
    return path
