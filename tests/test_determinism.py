"""Same inputs and seed give the same checkpoint, byte for byte (on CPU). On the bundled model: the command line's
run with its statistics captured afresh writes the shared API run's bytes (tests/test_bundled.py)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from conftest import random_windows, tiny_model

from compressor.api.pipeline import compress_model
from compressor.checkpoint import save_compressed
from compressor.modeling.adapters import get_adapter
from compressor.recipes.schema import CompressionSettings
from compressor.statistics.capture import collect_statistics


def _digests(directory: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.glob("*.safetensors"))
    }


def _tiny_checkpoint(out: Path, method: str) -> Path:
    model = tiny_model("llama")
    adapter = get_adapter(model)
    windows = random_windows()
    stats = collect_statistics(model, adapter, windows, progress=False)
    outcome = compress_model(
        model, adapter, stats, CompressionSettings(method=method), 0.3, progress=False, windows=windows
    )
    return save_compressed(model, outcome.plan, out, metadata={"method": method})


@pytest.mark.parametrize("method", ["masa", "svd-llm", "shared-mean"])
def test_two_runs_write_byte_identical_safetensors(tmp_path, method):
    first = _digests(_tiny_checkpoint(tmp_path / "a", method))
    second = _digests(_tiny_checkpoint(tmp_path / "b", method))
    assert first and first == second


def _run_fresh(args: list[str], cache: Path) -> None:
    """`masa-compress ARGS` in a fresh Python process on a cache of its own (statistics measured afresh)."""
    import os
    import subprocess
    import sys

    from conftest import cache_of_its_own

    env = os.environ | {"MASA_CACHE": str(cache_of_its_own(cache, shared=("text", "rates")))}
    done = subprocess.run(
        [sys.executable, "-m", "compressor", *args], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.long  # four fresh processes: with the long checks (CI runs them), keeping `make test` within 10 minutes
def test_two_processes_write_the_same_checkpoint_and_the_same_size_gguf(tmp_path):
    """The same command in two fresh processes, each measuring its statistics afresh, writes the same bytes: a
    checkpoint (its safetensors) and a `--size` GGUF (the whole file)."""
    from conftest import tiny_model_dir
    from test_gguf_tokenizer import bundled_tokenizer_files

    folder = tiny_model_dir(tmp_path / "tiny")
    common = ["--calib-samples", "4", "--seq-len", "64", "--no-eval", "--targets", "attn,mlp"]
    for run in ("a", "b"):
        _run_fresh([str(folder), "--out", str(tmp_path / f"ckpt-{run}"), *common], tmp_path / f"cache-{run}")
    first, second = _digests(tmp_path / "ckpt-a"), _digests(tmp_path / "ckpt-b")
    assert first and first == second

    gguf_folder = tmp_path / "with-tokenizer"
    tiny_model("llama", vocab_size=49152).save_pretrained(gguf_folder)
    bundled_tokenizer_files(gguf_folder)
    for run in ("a", "b"):
        out = tmp_path / f"size-{run}.gguf"
        args = ["export", str(gguf_folder), str(out), "--size", "6MiB", "--calib-samples", "4"]
        _run_fresh(args, tmp_path / f"cache-size-{run}")
    assert (tmp_path / "size-a.gguf").read_bytes() == (tmp_path / "size-b.gguf").read_bytes()
    import gguf

    matrices = [t for t in gguf.GGUFReader(str(tmp_path / "size-a.gguf")).tensors if len(t.shape) == 2]
    assert len({t.tensor_type for t in matrices}) > 1  # a mix the allocation chose, not one type
