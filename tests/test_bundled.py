"""The real path end to end on the bundled SmolLM2-135M and the real Wikipedia text (slow)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from compressor.cli import main
from compressor.models import load_model

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def bundled():
    return load_model("smollm2-135m", device="cpu", dtype="float32", progress=False)


def test_bundled_model_completes_paris(bundled):
    tokenizer, model = bundled.tokenizer, bundled.model
    ids = tokenizer("The capital of France is", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=3, do_sample=False)
    completion = tokenizer.decode(out[0, ids["input_ids"].shape[1] :])
    assert completion.strip().startswith("Paris")
    assert model.config.num_hidden_layers == 30 and model.config.num_key_value_heads == 3


def test_eval_cli_json_prints_a_finite_perplexity(capsys):
    main(["eval", "smollm2-135m", "--max-tokens", "1024", "--seq-len", "256", "--json"])
    payload = json.loads(capsys.readouterr().out)
    assert {"ppl", "tokens", "seq_len", "seconds"} <= payload.keys()
    assert math.isfinite(payload["ppl"]) and 5 < payload["ppl"] < 100
    assert payload["seq_len"] == 256 and payload["tokens"] == 4 * 255


def test_compress_cli_end_to_end_on_the_bundled_model(capsys, tmp_path):
    out = tmp_path / "ckpt"
    main(
        [
            "smollm2-135m", "--ratio", "0.2", "--calib-samples", "8", "--seq-len", "128",
            "--eval-max-tokens", "1024", "--eval-seq-len", "256", "--out", str(out), "--json",
        ]
    )  # fmt: skip
    summary = json.loads(capsys.readouterr().out)
    required = {
        "method", "ratio_requested", "achieved_ratio", "attention_params_before", "attention_params_after",
        "model_params_before", "model_params_after", "ppl_before", "ppl_after", "seconds", "out",
    }  # fmt: skip
    assert required <= summary.keys()
    assert summary["achieved_ratio"] >= 0.2
    assert summary["attention_params_after"] <= 0.8 * summary["attention_params_before"]
    assert summary["model_params_before"] - summary["model_params_after"] == (
        summary["attention_params_before"] - summary["attention_params_after"]
    )
    assert math.isfinite(summary["ppl_after"]) and summary["ppl_after"] > summary["ppl_before"] * 0.9
    assert {"calibration", "grouping", "pca", "residual_svd"} <= summary["seconds"].keys()
    assert (out / "masa_config.json").is_file()
