"""What `export` prints of a GGUF it wrote (`cli/gguf_report.py`): the recipe's command and where its inputs
come from, and the engine's note for a family llama.cpp computes a little apart."""

from __future__ import annotations

from compressor.cli.gguf_report import print_export_summary

INFO = {"architecture": "llama", "type": "size", "parameters": 1000, "bytes": 600, "budget": 640,
        "predicted_loss_rise": 0.01, "type_counts": {"Q4_K": 3, "Q8_0": 1}, "imatrix": "wiki", "fallbacks": {}}  # fmt: skip


def test_the_recipe_is_printed_with_what_its_command_needs(capsys):
    recipe = {"path": "t.txt", "tensors": 4, "input_command": "masa-compress export m MODEL-F32.gguf --type f32",
              "command": "llama-quantize --imatrix IMATRIX.gguf --tensor-type-file t.txt MODEL-F32.gguf OUT.gguf Q4_K_M"}  # fmt: skip
    print_export_summary("m.gguf", INFO | {"tensor_types_file": recipe})
    out = " ".join(capsys.readouterr().out.split())  # rich wraps at the terminal's width
    assert "Wrote t.txt: 4 --tensor-type overrides" in out
    assert (
        "llama-quantize --imatrix IMATRIX.gguf --tensor-type-file t.txt MODEL-F32.gguf OUT.gguf Q4_K_M" in out
    )
    assert "IMATRIX.gguf: the importance weights this file was rounded with: add --imatrix-out" in out
    assert "masa-compress export m MODEL-F32.gguf --type f32" in out


def test_a_named_importance_file_needs_no_hint_and_the_engine_note_is_said(capsys):
    recipe = {"path": "t.txt", "tensors": 4,
              "command": "llama-quantize --imatrix w.gguf --tensor-type-file t.txt MODEL-F32.gguf OUT.gguf Q4_K_M"}  # fmt: skip
    print_export_summary("m.gguf", INFO | {"tensor_types_file": recipe, "engine_note": "llama.cpp differs"})
    out = " ".join(capsys.readouterr().out.split())
    assert "IMATRIX.gguf" not in out and "Note: llama.cpp differs." in out
