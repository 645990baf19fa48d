"""Checkpoints written before the package was laid out by stage (masa-compress 0.1.0 at commit 3f6e0aa, fixtures in
`tests/fixtures/pre-layout-checkpoints/`, how they were written: its README) load with today's code and with plain
transformers through the remote code they carry, and give the logits recorded when they were written."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from compressor.checkpoint import load_compressed
from compressor.modeling.remote_code.masa_modules import LowRankLinear, SharedBasisLinear, SharedInputLinear

FIXTURES = Path(__file__).with_name("fixtures") / "pre-layout-checkpoints"
EXPECTED = json.loads((FIXTURES / "expected_logits.json").read_text())
#: The compressed module each checkpoint must hold: together they cover every form the remote code stores.
FORMS = {"default-attn-mlp": LowRankLinear, "atoms": SharedBasisLinear, "basis": SharedInputLinear}
TOKENS = torch.arange(16).remainder(64).view(1, 16)  # the input the recorded logits were computed on


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(TOKENS).logits[0].flatten()


@pytest.mark.parametrize("case", sorted(FORMS))
def test_a_pre_layout_checkpoint_loads_with_the_recorded_logits(tmp_path, case):
    path = shutil.copytree(FIXTURES / case, tmp_path / case)
    model = load_compressed(path)
    assert any(isinstance(m, FORMS[case]) for m in model.modules())
    torch.testing.assert_close(_logits(model), torch.tensor(EXPECTED[case]), rtol=0, atol=1e-5)


@pytest.mark.parametrize("case", sorted(FORMS))
def test_a_pre_layout_checkpoint_loads_in_plain_transformers(tmp_path, case):
    from transformers import AutoModelForCausalLM

    path = shutil.copytree(FIXTURES / case, tmp_path / case)
    model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True).eval()
    torch.testing.assert_close(_logits(model), torch.tensor(EXPECTED[case]), rtol=0, atol=1e-5)
