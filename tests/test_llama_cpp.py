"""`evaluation/llama_cpp.py` beyond what tests/test_gguf_export.py runs through llama.cpp: the note that the
installed llama.cpp leaves the CPU's AVX-512 unused, and the output head run in torch."""

from __future__ import annotations

import json
import platform
from pathlib import Path

import numpy as np
import pytest
import torch

from compressor.evaluation.llama_cpp import cpu_flags, read_output_head, unused_amx, unused_avx512
from compressor.runtime.errors import UserError

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


def head_file(path: Path, architecture: str, **keys: float) -> Path:
    """A GGUF holding an embedding (4 tokens x 2) and the given `{architecture}.KEY` floats."""
    import gguf

    writer = gguf.GGUFWriter(str(path), architecture)
    for key, value in keys.items():
        writer.add_float32(f"{architecture}.{key}", value)
    writer.add_tensor("token_embd.weight", np.arange(8, dtype=np.float32).reshape(4, 2))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_the_output_head_soft_caps_where_llama_cpp_s_graph_does(tmp_path):
    """The file's cap where it has one; Gemma 2's graph caps at llama.cpp's default 30 where it has none, Gemma 3's
    and Llama's not at all; a `logit_scale` (Granite, Command R) is refused in one line, not scored wrong."""
    assert (
        read_output_head(head_file(tmp_path / "a.gguf", "gemma2", final_logit_softcapping=5.0)).softcap == 5.0
    )
    assert read_output_head(head_file(tmp_path / "b.gguf", "gemma2")).softcap == 30.0
    assert read_output_head(head_file(tmp_path / "c.gguf", "gemma3")).softcap is None
    head = read_output_head(head_file(tmp_path / "d.gguf", "llama"))
    assert head.softcap is None and head.matrix.shape == (4, 2)
    hidden = torch.tensor([[100.0, -3.0]])
    capped = head._replace(softcap=5.0).logits(hidden)
    torch.testing.assert_close(capped, 5.0 * torch.tanh(hidden @ head.matrix.T / 5.0))
    assert capped.abs().max() <= 5.0 < (hidden @ head.matrix.T).abs().max()
    with pytest.raises(UserError, match="llama.cpp's granite scales its logits.*llama-perplexity"):
        read_output_head(head_file(tmp_path / "e.gguf", "granite", logit_scale=0.25))
