"""`evaluation/llama_cpp.py` beyond what tests/test_gguf_export.py runs through llama.cpp: the note that the
installed llama.cpp leaves the CPU's AVX-512 unused."""

from __future__ import annotations

import json
from pathlib import Path

from compressor.evaluation.llama_cpp import unused_avx512

SPEED = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "eval-speed-smollm2-135m.json"


def test_the_avx2_wheel_on_an_avx512_cpu_is_told_and_nothing_else_is():
    """The two builds measured (their own `get_system_info()` lines, from the speed benchmark's results): the
    prebuilt wheel leaves AVX-512 unused, the native build uses it; a CPU without AVX-512 loses nothing."""
    builds = json.loads(SPEED.read_text())["builds"]
    prebuilt, native = (builds[name]["llama_cpp"]["system_info"] for name in ("prebuilt", "native"))
    assert unused_avx512(prebuilt, "AVX512") and not unused_avx512(native, "AVX512")
    assert not unused_avx512(prebuilt, "AVX2") and not unused_avx512(prebuilt, "DEFAULT")
