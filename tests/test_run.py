"""`api/run.py` on its own: which model an evaluation compares with (`reference_source`). The runs themselves:
tests/test_holding.py (both ways of holding the model) and tests/test_bundled.py (the bundled model end to end)."""

from __future__ import annotations

import gguf
import numpy as np
from conftest import tiny_model_dir

import compressor.api.run as run_module
from compressor.api.export import SOURCE_KEY
from compressor.api.model_loading import ModelSource
from compressor.api.run import reference_source
from compressor.api.run_options import EvalSettings


def gguf_recording(path, source: str | None) -> ModelSource:
    """A GGUF file holding only the source an export records (`SOURCE_KEY`), or none."""
    writer = gguf.GGUFWriter(str(path), "llama")
    if source is not None:
        writer.add_string(SOURCE_KEY, source)
    writer.add_tensor("token_embd.weight", np.zeros((4, 2), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return ModelSource(spec=str(path), kind="gguf", location=str(path.parent), gguf_file=path.name)


def test_against_wins_and_no_compare_compares_with_nothing(tmp_path):
    original = str(tiny_model_dir(tmp_path / "original"))
    plain = ModelSource(spec="x", kind="local", location=str(tmp_path))
    found, why = reference_source(plain, EvalSettings(against=original, compare=False))
    assert found.location == original and why == f"--against {original}"
    assert reference_source(plain, EvalSettings(compare=False)) == (None, "comparison off (--no-compare)")
    found, why = reference_source(plain, EvalSettings())
    assert found is None and why.startswith("not a compressed checkpoint") and "--against MODEL" in why


def test_an_exported_gguf_compares_with_the_source_it_records_when_it_is_at_hand(tmp_path):
    original = str(tiny_model_dir(tmp_path / "original"))
    found, why = reference_source(gguf_recording(tmp_path / "a.gguf", original), EvalSettings())
    assert found.location == original and why == f"the GGUF's source {original}"
    found, why = reference_source(gguf_recording(tmp_path / "b.gguf", str(tmp_path / "gone")), EvalSettings())
    assert found is None and "is not available here: pass --against MODEL" in why
    found, why = reference_source(gguf_recording(tmp_path / "c.gguf", None), EvalSettings())
    assert found is None and why.startswith("a GGUF without a recorded source")


def test_a_checkpoint_compares_with_its_recorded_source_spec_then_location(tmp_path, monkeypatch):
    original = str(tiny_model_dir(tmp_path / "original"))
    checkpoint = ModelSource(spec="ckpt", kind="compressed", location=str(tmp_path / "ckpt"))

    def recorded(source: dict):
        monkeypatch.setattr(run_module, "read_masa_config", lambda _: {"metadata": {"source": source}})

    recorded({"spec": original, "location": "/elsewhere"})
    found, why = reference_source(checkpoint, EvalSettings())
    assert found.location == original and why == f"the checkpoint's source {original}"
    recorded({"spec": "/moved/away", "location": original})  # the spec no longer resolves: its location does
    found, why = reference_source(checkpoint, EvalSettings())
    assert found.location == original and why == f"the checkpoint's source {original}"
    recorded({"spec": "/moved/away"})
    found, why = reference_source(checkpoint, EvalSettings())
    assert found is None and why.startswith(
        "the checkpoint's source model (/moved/away) is not available here"
    )
    recorded({})
    assert "(unrecorded) is not available here" in reference_source(checkpoint, EvalSettings())[1]
