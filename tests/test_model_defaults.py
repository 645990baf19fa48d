"""Settings that follow the model (`compressor.api.model_defaults`): derived from the model's shapes for every model,
below an option and the recipe's explicit value, above the schema's default; `plan` names each setting's source."""

from __future__ import annotations

import json

import pytest

from compressor.api.model_defaults import BLOCK_ORDER_MIN_WIDTH, MLP_CALIBRATION_WINDOWS, model_defaults
from compressor.api.run_options import CompressOptions, resolve_settings
from compressor.recipes.schema import CalibrationSettings, CompressionSettings, parse_recipe

NARROW = {"num_hidden_layers": 30, "hidden_size": 576, "intermediate_size": 1536}  # the bundled model
WIDE = {"num_hidden_layers": 28, "hidden_size": 1536, "intermediate_size": 8960}  # the 1.5B model


def test_the_derivation_follows_the_mlp_width():
    narrow, wide = model_defaults(NARROW), model_defaults(WIDE)
    assert narrow["neuron_order"][0] == "greedy" and wide["neuron_order"][0] == "greedy-block"
    assert narrow["mlp_samples"][0] == wide["mlp_samples"][0] == MLP_CALIBRATION_WINDOWS == 256
    assert "1536" in narrow["neuron_order"][1] and "8960" in wide["neuron_order"][1]
    # the threshold itself: from it on, the block
    at = model_defaults({"intermediate_size": BLOCK_ORDER_MIN_WIDTH})["neuron_order"][0]
    below = model_defaults({"intermediate_size": BLOCK_ORDER_MIN_WIDTH - 1})["neuron_order"][0]
    assert (at, below) == ("greedy-block", "greedy")
    assert model_defaults({"intermediate_size": 2560})["neuron_order"][0] == "greedy"  # SmolLM2-360M
    assert model_defaults({"intermediate_size": 4864})["neuron_order"][0] == "greedy-block"  # Qwen2.5-0.5B
    assert model_defaults({"hidden_size": 576}) == {}  # no MLP width: nothing derived


def _recipe(calibration: dict | None = None, compression: dict | None = None):
    return parse_recipe(
        {"name": "r", "model": "x/y", "calibration": calibration or {}, "compression": compression or {}},
        "test",
    )


def test_an_option_beats_the_recipe_which_beats_the_shapes_which_beat_the_default():
    mlp = {"targets": "attn,mlp"}
    # the shapes, with no recipe: the wide MLP's block order, 256 windows
    found = resolve_settings(CompressOptions(**mlp), None, WIDE)
    assert found.compression.neuron_order == "greedy-block" and found.calibration.samples == 256
    assert found.sources["compression"]["neuron_order"] == "model shapes (MLP 8960 wide, from 4096)"
    assert found.sources["calibration"]["samples"].startswith("model shapes (MLP 8960 wide")
    assert found.sources["compression"]["targets"] == "option"
    assert found.sources["compression"]["allocation"] == "default"
    # the recipe's explicit values beat the shapes (a null mlp_samples too: `samples` for the MLP)
    recipe = _recipe({"samples": 32, "mlp_samples": None}, {"neuron_order": "energy"})
    found = resolve_settings(CompressOptions(**mlp), recipe, WIDE)
    assert found.compression.neuron_order == "energy" and found.calibration.samples == 32
    assert found.sources["compression"]["neuron_order"] == "recipe r"
    assert found.sources["calibration"]["samples"] == "recipe r"
    # an option beats both
    found = resolve_settings(CompressOptions(**mlp, neuron_order="greedy", calib_samples=8), recipe, WIDE)
    assert found.compression.neuron_order == "greedy" and found.calibration.samples == 8
    assert found.sources["compression"]["neuron_order"] == found.sources["calibration"]["samples"] == "option"
    # without shapes: the schema's defaults
    found = resolve_settings(CompressOptions(**mlp), None, {})
    assert found.compression.neuron_order == CompressionSettings().neuron_order
    assert found.calibration.samples == CalibrationSettings().samples
    assert (
        found.sources["compression"]["neuron_order"] == found.sources["calibration"]["samples"] == "default"
    )
    # a derived window count never lowers the recipe's samples; the attention alone keeps `samples`
    more = resolve_settings(CompressOptions(**mlp), _recipe({"samples": 512}), WIDE)
    assert more.calibration.samples == 512 and more.calibration.mlp_samples is None
    assert resolve_settings(CompressOptions(targets="attn"), None, WIDE).calibration.samples == 64


@pytest.fixture(scope="module")
def bundled_config_dir(tmp_path_factory):
    """A local folder holding the bundled model's own config (read from it, no weights) and no recipe."""
    from compressor.api.model_loading import read_config, resolve_model

    config, _, _ = read_config(resolve_model("smollm2-135m"))
    path = tmp_path_factory.mktemp("smollm2-copy")
    config.save_pretrained(path)
    return path


@pytest.mark.parametrize("targets", ["attn", "attn,mlp", "mlp"])
def test_a_local_copy_of_the_bundled_model_resolves_as_its_recipe(bundled_config_dir, targets):
    from compressor.api.session import resolve_run

    options = CompressOptions(targets=targets)
    local, alias = resolve_run(str(bundled_config_dir), options), resolve_run("smollm2-135m", options)
    assert local.recipe is None and alias.recipe is not None
    assert local.calibration == alias.calibration and local.compression == alias.compression
    # the bundled model's settings as its recipe chose them before they followed the model
    assert alias.calibration.samples == (64 if targets == "attn" else 256)
    assert alias.calibration.mlp_samples == 256 and alias.compression.neuron_order == "greedy"


def test_plan_names_where_each_setting_comes_from(bundled_config_dir, tmp_path, capsys, monkeypatch):
    from compressor.cli import main

    monkeypatch.setenv("COLUMNS", "200")
    args = ["--targets", "attn,mlp", "--ratio", "0.2", "--ratio-of", "model"]
    capsys.readouterr()
    main(["plan", "smollm2-135m", *args])
    out = capsys.readouterr().out
    assert "  option: targets attn,mlp" in out
    assert "  recipe smollm2-135m: method masa, allocation global-loss, calib wikipedia" in out
    assert (
        "  model shapes: neuron_order greedy (MLP 1536 wide, under 4096), calib_samples 256 (MLP 1536" in out
    )
    assert "  default: sensitivity_samples 4" in out and "Settings, by where each comes from" in out

    wide = tmp_path / "wide"
    config = json.loads((bundled_config_dir / "config.json").read_text())
    config.update(num_hidden_layers=2, intermediate_size=8960)
    wide.mkdir()
    (wide / "config.json").write_text(json.dumps(config))
    main(["plan", str(wide), *args, "--json"])
    plan = json.loads(capsys.readouterr().out)
    sources = plan["settings_source"]
    assert plan["settings"]["neuron_order"] == "greedy-block" and plan["calibration"]["samples"] == 256
    assert sources["compression"]["neuron_order"] == "model shapes (MLP 8960 wide, from 4096)"
    assert sources["calibration"]["samples"] == sources["calibration"]["mlp_samples"]
    assert sources["compression"]["targets"] == "option" and sources["calibration"]["seed"] == "default"
    assert "neuron_order" in plan["settings_read"]
