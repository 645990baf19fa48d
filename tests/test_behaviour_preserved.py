"""The checkpoints the tool writes do not change under refactoring: tiny models, every method and the main
options, compared with the sha256 of `model.safetensors` recorded before the structural redesign (CPU,
float32, the torch wheel CI installs). A failure here means a change of behaviour: if it is intended, say so
in the commit and record the new digests with `python tests/test_behaviour_preserved.py`."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest
from conftest import random_windows, tiny_model

from compressor.adapters import get_adapter
from compressor.capture import collect_statistics
from compressor.checkpoint import save_compressed
from compressor.pipeline import compress_model
from compressor.recipes.schema import CompressionSettings

DIGESTS = Path(__file__).with_name("checkpoint_digests.json")

CASES = {
    "llama-masa": ("llama", {}, 0.3),
    "llama-masa-paper": ("llama", {"method": "masa-paper"}, 0.3),
    "llama-svd-llm": ("llama", {"method": "svd-llm"}, 0.3),
    "llama-svd": ("llama", {"method": "svd"}, 0.3),
    "llama-shared-mean": ("llama", {"method": "shared-mean"}, 0.3),
    "llama-bases0": ("llama", {"bases": 0}, 0.3),
    "llama-attn-mlp": ("llama", {"targets": "attn,mlp"}, 0.3),
    "llama-whitened-atoms": ("llama", {"atoms": "whitened", "groups": 2}, 0.3),
    "llama-sequential": ("llama", {"statistics": "sequential"}, 0.3),
    "llama-auto-groups": ("llama", {"auto_groups": True}, 0.3),
    "llama-global": ("llama", {"allocation": "global", "dense_when_cheaper": False}, 0.3),
    "qwen2-masa": ("qwen2", {}, 0.25),
    "qwen2-svd-llm": ("qwen2", {"method": "svd-llm"}, 0.25),
    "qwen2-masa-paper": ("qwen2", {"method": "masa-paper"}, 0.25),
}


def checkpoint_digest(case: str, out: Path) -> str:
    family, overrides, ratio = CASES[case]
    model = tiny_model(family)
    adapter = get_adapter(model)
    settings = CompressionSettings(**overrides)
    windows = random_windows()
    stats = collect_statistics(model, adapter, windows, progress=False, mlp="mlp" in settings.targets)
    outcome = compress_model(model, adapter, stats, settings, ratio, progress=False, windows=windows)
    path = save_compressed(model, outcome.plan, out, metadata={"case": case})
    return hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()


@pytest.mark.parametrize("case", sorted(CASES))
def test_checkpoint_bytes_unchanged(tmp_path, case):
    recorded = json.loads(DIGESTS.read_text())
    assert checkpoint_digest(case, tmp_path / case) == recorded[case]


if __name__ == "__main__":  # record the digests (only when a change of behaviour is intended)
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        digests = {case: checkpoint_digest(case, Path(tmp) / case) for case in sorted(CASES)}
    DIGESTS.write_text(json.dumps(digests, indent=1) + "\n")
    print(f"wrote {len(digests)} digests to {DIGESTS}", file=sys.stderr)
