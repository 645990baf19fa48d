"""`api/holding.py`: `api.compress` is one sequence of steps whether the model is held in memory or layer by layer;
the two ways write the same checkpoint and the same summary (stages, quality) and leave nothing behind, also when
a step fails."""

from __future__ import annotations

import hashlib
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import tiny_model_dir

from compressor.api import CompressOptions, compress
from compressor.api.layerwise import LayerByLayer


def _texts(tmp_path: Path) -> tuple[str, str]:
    calibration, evaluation = tmp_path / "calib.txt", tmp_path / "eval.txt"
    calibration.write_text("The quick brown fox jumps over the lazy dog. " * 400)
    evaluation.write_text("A different text for scoring, with other words in it entirely. " * 200)
    return str(calibration), str(evaluation)


def _options(tmp_path: Path, **values) -> CompressOptions:
    calibration, evaluation = _texts(tmp_path)
    return CompressOptions(
        ratio=0.3, calib=calibration, calib_samples=4, seq_len=32, eval_text=evaluation, eval_seq_len=32,
        stats_cache=False, **values,
    )  # fmt: skip


def _sha(path: str) -> str:
    return hashlib.sha256((Path(path) / "model.safetensors").read_bytes()).hexdigest()


@pytest.mark.parametrize("compare", [True, False], ids=["compared", "perplexity-only"])
def test_both_ways_of_holding_give_the_same_checkpoint_summary_and_quality(tmp_path, compare):
    model = str(tiny_model_dir(tmp_path / "tiny"))
    options = _options(tmp_path, compare=compare)
    runs = {
        "in-memory": compress(model, replace(options, out=str(tmp_path / "in-memory")), progress=False),
        "layerwise": compress(
            model,
            replace(
                options, out=str(tmp_path / "layerwise"), layerwise=True, offload_dir=str(tmp_path / "spill")
            ),
            progress=False,
        ),
    }
    memory, layerwise = runs["in-memory"].summary, runs["layerwise"].summary
    assert _sha(memory["out"]) == _sha(layerwise["out"])
    assert set(layerwise) - set(memory) == {"layerwise"} and set(memory) <= set(layerwise)
    # The same stages in the same order; the original's evaluation before compression in memory only without
    # comparison (with it, both models are scored after), layer by layer always (its outputs spilled first).
    stages = {
        name: [s for s in run["seconds"] if s != "eval_before"]
        for name, run in (("m", memory), ("l", layerwise))
    }
    assert stages["m"] == stages["l"] and "stream_refit" not in stages["m"] and "calibration" in stages["m"]
    assert ("eval_before" in memory["seconds"]) is not compare and "eval_before" in layerwise["seconds"]
    assert memory["calibration_cache"] == "statistics cache off"
    assert layerwise["calibration_cache"] == "not used with --layerwise"
    assert set(layerwise["quality"]) == set(memory["quality"])  # the KL's percentiles too, when compared
    for key, value in memory["quality"].items():
        expected = value if isinstance(value, str) else pytest.approx(value, rel=1e-4)
        assert layerwise["quality"][key] == expected, key
    assert runs["in-memory"].model is not None and runs["layerwise"].model is None
    assert list((tmp_path / "spill").iterdir()) == []


def test_a_step_that_fails_leaves_no_temporary_files_and_no_checkpoint(tmp_path, monkeypatch):
    model = str(tiny_model_dir(tmp_path / "tiny"))
    options = _options(
        tmp_path, out=str(tmp_path / "out"), layerwise=True, offload_dir=str(tmp_path / "spill")
    )

    def failing(self, loaded, text, prepared):
        raise RuntimeError("the statistics failed")

    monkeypatch.setattr(LayerByLayer, "statistics", failing)
    with pytest.raises(RuntimeError, match="the statistics failed"):
        compress(model, options, progress=False)
    assert list((tmp_path / "spill").iterdir()) == [] and not (tmp_path / "out").exists()
