"""`--ratio-of model`: the ratio counts every parameter of the model, only the targets shrink; the summary and
the plan say the model's size before and after."""

from __future__ import annotations

from dataclasses import replace

import pytest
from conftest import tiny_config, tiny_model, tiny_model_dir

from compressor.api import compress
from compressor.api.preview import model_parameter_count, plan_compression
from compressor.api.run_options import CompressOptions
from compressor.api.session import heavy_share_warning
from compressor.math.accounting import targets_ratio
from compressor.runtime.errors import UserError


def test_targets_ratio_converts_a_model_ratio_and_refuses_what_the_targets_cannot_hold():
    assert targets_ratio(0.2, "targets", 1000, 400, "attn") == 0.2
    assert targets_ratio(0.2, "model", 1000, 400, "attn") == pytest.approx(0.5)
    with pytest.raises(UserError, match=r"at most 0\.400\) or target more"):
        targets_ratio(0.4, "model", 1000, 400, "attn")
    with pytest.raises(UserError, match="outside"):
        targets_ratio(1.2, "model", 1000, 400, "attn")


def test_model_parameter_count_from_the_config_alone_matches_the_built_model():
    for tied in (True, False):
        config = tiny_config("llama", num_hidden_layers=3, tie_word_embeddings=tied)
        model = tiny_model("llama", num_hidden_layers=3, tie_word_embeddings=tied)
        assert model_parameter_count(config) == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("method", ["svd-llm", "masa"])
def test_a_model_ratio_shrinks_the_whole_model_by_that_much(tmp_path, method):
    folder = str(tiny_model_dir(tmp_path / "tiny", num_hidden_layers=4))
    options = CompressOptions(
        ratio=0.2, ratio_of="model", targets="attn,mlp", method=method, calib_samples=4, seq_len=64,
        evaluate=False, out=str(tmp_path / "ck"),
    )  # fmt: skip
    summary = compress(folder, options, progress=False).summary
    before, after = summary["model_params_before"], summary["model_params_after"]
    # Never more than asked for; short of it by at most one rank step (≤ 64 + 128 numbers) per targeted matrix
    # (4 layers × 7), as uniform ranks round down per matrix.
    assert after <= 0.8 * before
    assert after >= 0.8 * before - 4 * 7 * (64 + 128)
    assert summary["ratio_of"] == "model" and summary["targets_ratio"] > 0.2
    assert summary["weights_bytes_after"] == after * 4
    assert summary["checkpoint_bytes"] < summary["weights_bytes_before"]
    # The plan from the config alone counts the same model and the same target ratio.
    plan = plan_compression(folder, options)
    assert plan["model_params_before"] == before
    assert plan["targets_ratio"] == pytest.approx(summary["targets_ratio"])


def test_a_model_ratio_warns_only_when_it_takes_over_forty_percent_of_the_targets():
    assert heavy_share_warning(0.2, "model", 0.25, 1000, 800, "attn,mlp") is None
    assert heavy_share_warning(0.3, "model", 0.40, 1000, 750, "attn,mlp") is None
    assert (
        heavy_share_warning(0.5, "targets", 0.5, 1000, 790, "attn,mlp") is None
    )  # the share asked for itself
    line = heavy_share_warning(0.35, "model", 0.4434, 1000, 790, "attn,mlp")
    assert "takes 44% of the targeted parameters" in line and "21% of the model" in line
    assert "\n" not in line and "--ratio-of targets" in line and "--targets attn,mlp" not in line
    # With the MLP left out, adding it is the first thing to try.
    assert "target the MLP too (--targets attn,mlp)" in heavy_share_warning(
        0.2, "model", 0.8, 1000, 250, "attn"
    )


def test_the_warning_is_said_before_calibrating_and_shown_by_plan(tmp_path, monkeypatch, capsys):
    import compressor.api.session as session

    folder = str(tiny_model_dir(tmp_path / "tiny", num_hidden_layers=2))
    options = CompressOptions(
        ratio=0.15, ratio_of="model", targets="attn", calib_samples=4, seq_len=64, evaluate=False,
        out=str(tmp_path / "ck"),
    )  # fmt: skip
    plan = plan_compression(folder, options)
    assert plan["targets_ratio"] > 0.4 and "--ratio 0.15 --ratio-of model takes" in plan["warning"]

    class Stopped(Exception):
        pass

    def no_calibration(*args, **kwargs):
        raise Stopped

    monkeypatch.setattr(session, "calibration_token_windows", no_calibration)
    with pytest.raises(Stopped):
        compress(folder, options, progress=False)
    assert "warning: --ratio 0.15 --ratio-of model takes" in " ".join(capsys.readouterr().err.split())
    # A share of the targets at most 40%: no warning.
    assert plan_compression(folder, replace(options, ratio_of="targets"))["warning"] is None
