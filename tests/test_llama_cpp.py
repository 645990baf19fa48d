"""`evaluation/llama_cpp.py` beyond what tests/test_gguf_export.py runs through llama.cpp: the note that the
installed llama.cpp leaves the CPU's AVX-512 unused."""

from __future__ import annotations

import json
import platform
from pathlib import Path

from compressor.evaluation.llama_cpp import cpu_flags, unused_amx, unused_avx512

SPEED = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "eval-speed-smollm2-135m.json"


def test_the_avx2_wheel_on_an_avx512_cpu_is_told_and_nothing_else_is():
    """The two builds measured (their own `get_system_info()` lines, from the speed benchmark's results): the
    prebuilt wheel leaves AVX-512 unused, the native build uses it; a CPU without AVX-512 loses nothing."""
    builds = json.loads(SPEED.read_text())["builds"]
    prebuilt, native = (builds[name]["llama_cpp"]["system_info"] for name in ("prebuilt", "native"))
    assert unused_avx512(prebuilt, "AVX512") and not unused_avx512(native, "AVX512")
    assert not unused_avx512(prebuilt, "AVX2") and not unused_avx512(prebuilt, "DEFAULT")


def test_amx_left_unused_is_told_only_where_the_cpu_has_it_and_the_build_does_not():
    """The measured builds' own lines: the prebuilt wheel and the earlier native build without AMX leave it
    unused on a CPU with `amx_int8`, the native build (the Makefile's, with the AMX fix) uses it; a CPU
    without AMX loses nothing. The flags are read from the kernel's list on x86 Linux."""
    builds = json.loads(SPEED.read_text())["builds"]
    prebuilt, native, openblas = (
        builds[name]["llama_cpp"]["system_info"] for name in ("prebuilt", "native", "native-openblas")
    )
    amx = {"avx512f", "amx_tile", "amx_int8"}
    assert unused_amx(prebuilt, amx) and unused_amx(openblas, amx) and not unused_amx(native, amx)
    assert not unused_amx(prebuilt, {"avx512f", "avx2"})
    if platform.machine() == "x86_64" and Path("/proc/cpuinfo").is_file():
        assert "sse2" in cpu_flags()  # every x86-64 CPU lists it: the kernel's list was read
