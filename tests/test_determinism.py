"""Same inputs and seed give the same checkpoint, byte for byte (on CPU)."""

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


@pytest.mark.slow
def test_bundled_model_runs_are_byte_identical(tmp_path):
    from compressor.api import CompressOptions, compress

    digests = []
    for name in ("a", "b"):
        options = CompressOptions(
            ratio=0.2, calib_samples=4, seq_len=64, evaluate=False, out=str(tmp_path / name)
        )
        run = compress("smollm2-135m", options, device="cpu", dtype="float32", progress=False)
        digests.append(_digests(Path(run.summary["out"])))
    assert digests[0] and digests[0] == digests[1]
