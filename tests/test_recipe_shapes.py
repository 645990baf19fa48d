"""Every built-in recipe carries its model's shapes, which `plan ALIAS` reads instead of fetching config.json.
They are checked here against the values published in each model's config.json on the Hugging Face hub (the
page each recipe cites), written out independently below, and for the bundled model against its own config."""

from __future__ import annotations

from pathlib import Path

import pytest

from compressor.api.model_loading import read_config, recipe_config, resolve_model
from compressor.api.preview import model_parameter_count, plan_from_config
from compressor.recipes.schema import CompressionSettings, builtin_recipe, builtin_recipe_names

RECIPES = Path(__file__).resolve().parent.parent / "recipes"


def _config(model_type, layers, hidden, heads, kv, head_dim, inter, vocab, tied):
    return dict(
        model_type=model_type, num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
        num_key_value_heads=kv, head_dim=head_dim, intermediate_size=inter, vocab_size=vocab,
        tie_word_embeddings=tied, attention_bias=False, mlp_bias=False,
    )  # fmt: skip


#: alias: (the repository whose config.json the values are from, its values, the parameter count the hub shows)
PUBLISHED = {
    "smollm2-135m": ("HuggingFaceTB/SmolLM2-135M-Instruct",
                     _config("llama", 30, 576, 9, 3, 64, 1536, 49152, True), 134_515_008),
    "smollm2-360m": ("HuggingFaceTB/SmolLM2-360M",
                     _config("llama", 32, 960, 15, 5, 64, 2560, 49152, True), 361_821_120),
    "llama-3.2-1b": ("meta-llama/Llama-3.2-1B",
                     _config("llama", 16, 2048, 32, 8, 64, 8192, 128256, True), 1_235_814_400),
    "llama-3.2-3b": ("meta-llama/Llama-3.2-3B",
                     _config("llama", 28, 3072, 24, 8, 128, 8192, 128256, True), 3_212_749_824),
    "llama-3.1-8b": ("meta-llama/Llama-3.1-8B",
                     _config("llama", 32, 4096, 32, 8, 128, 14336, 128256, False), 8_030_261_248),
    "qwen2.5-0.5b": ("Qwen/Qwen2.5-0.5B",
                     _config("qwen2", 24, 896, 14, 2, 64, 4864, 151936, True), 494_032_768),
    "qwen2.5-1.5b": ("Qwen/Qwen2.5-1.5B",
                     _config("qwen2", 28, 1536, 12, 2, 128, 8960, 151936, True), 1_543_714_304),
    # Published with tied embeddings; the registry's GGUF stores the output matrix apart, so the model as loaded
    # is untied, and its count is the GGUF's tensor elements (checked against the file when it was added).
    "qwen2.5-coder-1.5b": ("Qwen/Qwen2.5-Coder-1.5B-Instruct",
                           _config("qwen2", 28, 1536, 12, 2, 128, 8960, 151936, False), 1_777_088_000),
    "mistral-7b": ("mistralai/Mistral-7B-v0.1",
                   _config("mistral", 32, 4096, 32, 8, 128, 14336, 32000, False), 7_241_732_096),
}  # fmt: skip


def test_every_recipe_is_checked():
    assert sorted(PUBLISHED) == builtin_recipe_names()


@pytest.mark.parametrize("alias", sorted(PUBLISHED))
def test_recipe_shapes_are_the_published_ones(alias):
    repo, published, params = PUBLISHED[alias]
    recipe = builtin_recipe(alias)
    assert recipe.shapes is not None, f"recipes/{alias}.yaml carries no shapes"
    assert recipe.shapes.model_dump() == published
    assert f"https://huggingface.co/{repo}/blob/main/config.json" in (RECIPES / f"{alias}.yaml").read_text()
    # Built into a model on the meta device, the shapes give the parameter count the hub shows for the model.
    assert model_parameter_count(recipe_config(recipe)) == params


def test_bundled_recipe_matches_the_bundled_model():
    """The bundled model's own config (read without its weights) has the recipe's shapes, and a plan from either
    is the same, to the parameter."""
    recipe = builtin_recipe("smollm2-135m")
    real, _, _ = read_config(resolve_model("smollm2-135m"))
    for key, value in recipe.shapes.model_dump().items():
        got = getattr(real, key, None)
        if key == "head_dim" and got is None:
            got = real.hidden_size // real.num_attention_heads
        assert (got or False) == value if isinstance(value, bool) else got == value, key
    from_recipe = recipe_config(recipe)
    assert model_parameter_count(from_recipe) == model_parameter_count(real)
    for settings in (CompressionSettings(), CompressionSettings(sharing="atoms", targets="attn,mlp")):
        assert plan_from_config(from_recipe, 0.2, settings) == plan_from_config(real, 0.2, settings)
