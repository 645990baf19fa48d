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
