"""The architecture adapter on tiny random models of each supported family, and refusals."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model
from torch import nn

from compressor.api.model_loading import check_architecture
from compressor.modeling.adapters import PROJECTIONS, get_adapter
from compressor.runtime.errors import UserError


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma", "mistral"])
def test_adapter_finds_layers_projections_norm_and_unembedding(family):
    model = tiny_model(family)
    adapter = get_adapter(model)
    assert adapter.num_layers == 6
    geometry = adapter.geometry
    for layer in range(adapter.num_layers):
        for p in PROJECTIONS:
            module = adapter.projection(layer, p)
            assert isinstance(module, nn.Linear)
            assert tuple(module.weight.shape) == geometry.shape(p)
    # GQA: k/v are narrower than q
    assert (
        geometry.shape("k_proj")[0] == geometry.num_kv_heads * geometry.head_dim < geometry.shape("q_proj")[0]
    )
    assert adapter.unembedding.weight.shape[0] == model.config.vocab_size
    h = torch.randn(2, geometry.hidden_size)
    assert adapter.final_norm(h).shape == h.shape
    assert adapter.projection_path(2, "v_proj") == "model.layers.2.self_attn.v_proj"


def test_attention_parameter_count_includes_qwen_biases():
    model = tiny_model("qwen2")
    adapter = get_adapter(model)
    g = adapter.geometry
    weights = sum(o * i for o, i in (g.shape(p) for p in PROJECTIONS))
    biases = g.shape("q_proj")[0] + 2 * g.shape("k_proj")[0]  # q, k, v have biases in Qwen2
    assert adapter.target_parameter_count() == adapter.num_layers * (weights + biases)


def test_set_projection_replaces_the_module():
    model = tiny_model("llama")
    adapter = get_adapter(model)
    replacement = nn.Linear(*reversed(adapter.geometry.shape("q_proj")), bias=False)
    adapter.set_projection(0, "q_proj", replacement)
    assert model.model.layers[0].self_attn.q_proj is replacement


def test_unsupported_architecture_is_refused_with_its_name():
    import transformers

    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=64, architectures=["GPT2LMHeadModel"]
    )
    with pytest.raises(UserError, match="unsupported architecture 'GPT2LMHeadModel'"):
        check_architecture(config, "tiny-gpt2")
    model = transformers.GPT2LMHeadModel(config)
    with pytest.raises(UserError, match="unsupported architecture 'GPT2LMHeadModel'") as err:
        get_adapter(model)
    assert "\n" not in str(err.value)


def test_forms_a_q_k_norm_would_change_are_refused_by_family():
    """MoDeGPT's zero-filled q/k dimensions on any q/k RMSNorm, whole query heads (`--native`, and FLAP, which
    always removes heads) on a norm across heads: refused in one line naming the family and what works instead;
    every other family and form passes (the families without fused projections or experts: tests/test_families.py
    has those)."""
    from compressor.modeling.adapters import FAMILIES, QK_NORM, SUPPORTED_MODEL_TYPES, check_family_forms

    assert set(QK_NORM) <= set(SUPPORTED_MODEL_TYPES)
    for family in (f for f in SUPPORTED_MODEL_TYPES if not FAMILIES[f].fused and not FAMILIES[f].experts):
        for method, attention, targets in [
            ("masa", "factors", "attn"),
            ("masa", "heads", "attn,mlp"),
            ("masa", "heads", "mlp"),
            ("modegpt", "factors", "attn,mlp"),
            ("flap", "factors", "attn,mlp"),
        ]:
            refused = (method == "modegpt" and family in QK_NORM) or (
                (attention == "heads" or method == "flap")
                and targets != "mlp"
                and QK_NORM.get(family) == "across_heads"
            )
            if not refused:
                check_family_forms(family, method, attention, targets)
                continue
            with pytest.raises(UserError) as err:
                check_family_forms(family, method, attention, targets)
            assert family in str(err.value) and "\n" not in str(err.value) and "use " in str(err.value)


@pytest.mark.parametrize(
    ("family", "argv"),
    [
        ("qwen3", ["--method", "modegpt", "--targets", "attn,mlp", "--ratio-of", "model"]),
        ("olmo2", ["--targets", "attn,mlp", "--ratio", "0.5", "--ratio-of", "model", "--native"]),
    ],
)
def test_a_refused_family_form_writes_nothing(family, argv, tmp_path, capsys):
    from conftest import tiny_model_dir

    from compressor.cli import main

    folder = tiny_model_dir(tmp_path / family, family)
    capsys.readouterr()  # drop what building the folder printed
    with pytest.raises(SystemExit) as exit_:
        main([str(folder), *argv, "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / "out").exists()
