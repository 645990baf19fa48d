"""Model resolution for every kind of spec, loading a local directory, and clear errors."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import tiny_model, tiny_model_dir

from compressor.api.model_loading import BUNDLED_GGUF, load_model, resolve_model
from compressor.recipes.schema import builtin_recipe_names
from compressor.runtime.cache_root import cache_dir
from compressor.runtime.errors import UserError

REQUIRED_ALIASES = {
    "smollm2-135m",
    "llama-3.2-1b",
    "llama-3.2-3b",
    "llama-3.1-8b",
    "qwen2.5-0.5b",
    "mistral-7b",
}


def test_every_alias_resolves_to_its_recipe_target():
    names = set(builtin_recipe_names())
    assert REQUIRED_ALIASES <= names
    for name in names:
        source = resolve_model(name)
        assert source.recipe is not None and source.recipe.name == name
        if name == "smollm2-135m":
            assert source.kind == "bundled" and source.gguf_file == BUNDLED_GGUF
        elif source.recipe.model.startswith("bundled:"):  # a packaged model fetched on first use
            assert source.kind == "bundled" and source.packaged == source.recipe.model.removeprefix(
                "bundled:"
            )
        else:
            assert source.kind == "hub" and source.location == source.recipe.model


def test_local_hf_directory_resolves_and_loads(tmp_path):
    tiny_model_dir(tmp_path / "tiny")  # a tiny random model and a byte-level tokenizer, as a user's folder
    source = resolve_model(str(tmp_path / "tiny"))
    assert source.kind == "hf_dir"
    loaded = load_model(source, device="cpu", dtype="float32", progress=False)
    assert loaded.model.config.num_hidden_layers == 6
    torch.testing.assert_close(loaded.model.state_dict(), tiny_model("llama", vocab_size=260).state_dict())
    assert loaded.tokenizer.decode(loaded.tokenizer("Paris")["input_ids"]) == "Paris"
    # its own modules, not Hub kernels (transformers' default from 5.2x: runtime.device.weight_loading)
    assert loaded.model.use_kernels is False


def test_gguf_file_resolves():
    bundled = resolve_model("smollm2-135m")
    source = resolve_model(f"{bundled.location}/{BUNDLED_GGUF}")
    assert source.kind == "gguf" and source.gguf_file == BUNDLED_GGUF


def test_hub_id_resolves_without_network_access():
    source = resolve_model("meta-llama/Llama-3.2-1B")
    assert source.kind == "hub" and source.location == "meta-llama/Llama-3.2-1B"


def test_hub_model_without_network_is_a_one_line_user_error(monkeypatch):
    from compressor.runtime import hub

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hub, "cached_config", lambda repo, revision: False)
    with pytest.raises(UserError, match="'someone/not-a-model' is a model on the Hugging Face hub") as err:
        load_model("someone/not-a-model", progress=False)
    assert "\n" not in str(err.value)


def test_hub_model_the_hub_refuses_is_a_one_line_user_error(monkeypatch):
    """The hub answers, but the id is wrong or the model gated: what the hub client raises, in one line."""
    from compressor.runtime import hub

    monkeypatch.setattr(hub, "unreachable", lambda: None)

    def refused(*args, **kwargs):
        raise OSError("someone/not-a-model is not a local folder and is not a valid model identifier\n...")

    monkeypatch.setattr("transformers.AutoConfig.from_pretrained", refused)
    with pytest.raises(UserError, match="could not fetch 'someone/not-a-model'") as err:
        load_model("someone/not-a-model", progress=False)
    assert "\n" not in str(err.value)


def test_compressed_checkpoint_directory_is_recognised(tmp_path):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "masa_config.json").write_text(json.dumps({"format_version": 1}))
    assert resolve_model(str(tmp_path / "ckpt")).kind == "compressed"


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("smollm9-1t", "unknown model 'smollm9-1t': not a recipe alias"),
        ("./no/such/dir", "model path './no/such/dir' does not exist"),
        ("/no/such/model.gguf", "does not exist"),
        ("", "no model given"),
    ],
)
def test_bad_model_specs_are_one_line_errors(spec, message):
    with pytest.raises(UserError, match=message) as err:
        resolve_model(spec)
    assert "\n" not in str(err.value)


def test_directory_without_config_and_non_gguf_file(tmp_path):
    with pytest.raises(UserError, match="has no config.json"):
        resolve_model(str(tmp_path))
    (tmp_path / "weights.bin").write_bytes(b"\0")
    with pytest.raises(UserError, match="not a GGUF file"):
        resolve_model(str(tmp_path / "weights.bin"))


def test_cache_location_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("MASA_CACHE", str(tmp_path / "cache"))
    assert cache_dir() == tmp_path / "cache"
