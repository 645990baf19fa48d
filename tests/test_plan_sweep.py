"""Every method's plan holds its budget on every built-in recipe's shapes, or says in one line why not.

No weights are needed: the configs below are the published shapes of the models the built-in recipes name
(hidden size, layers, heads, KV heads, head size, and whether q/k/v carry biases), built in-process.
"""

from __future__ import annotations

import pytest
import transformers

from compressor.api.preview import plan_from_config
from compressor.methods import REGISTRY
from compressor.recipes.schema import builtin_recipe, builtin_recipe_names
from compressor.runtime.errors import UserError

# recipe -> (config class, hidden, layers, heads, kv heads, head_dim, intermediate)
SHAPES = {
    "smollm2-135m": (transformers.LlamaConfig, 576, 30, 9, 3, 64, 1536),
    "smollm2-360m": (transformers.LlamaConfig, 960, 32, 15, 5, 64, 2560),
    "llama-3.2-1b": (transformers.LlamaConfig, 2048, 16, 32, 8, 64, 8192),
    "llama-3.2-3b": (transformers.LlamaConfig, 3072, 28, 24, 8, 128, 8192),
    "llama-3.1-8b": (transformers.LlamaConfig, 4096, 32, 32, 8, 128, 14336),
    "qwen2.5-0.5b": (transformers.Qwen2Config, 896, 24, 14, 2, 64, 4864),  # q/k/v biases
    "qwen2.5-1.5b": (transformers.Qwen2Config, 1536, 28, 12, 2, 128, 8960),  # q/k/v biases
    "qwen2.5-coder-1.5b": (transformers.Qwen2Config, 1536, 28, 12, 2, 128, 8960),  # q/k/v biases
    "mistral-7b": (transformers.MistralConfig, 4096, 32, 32, 8, 128, 14336),
}
RATIOS = [round(0.05 * i, 2) for i in range(1, 19)]  # 0.05 ... 0.9


def test_every_builtin_recipe_has_its_shapes_here():
    assert set(SHAPES) == set(builtin_recipe_names())


def _config(recipe: str):
    cls, hidden, layers, heads, kv, head_dim, inter = SHAPES[recipe]
    return cls(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=head_dim,
        intermediate_size=inter,
        vocab_size=1024,  # not counted: the ratio is of the attention projections
    )


#: (method, form) pairs swept; the MLP's settings only where an MLP is targeted (on the attention alone the CLI
#: refuses them, tests/test_cli_errors.py: nothing to plan).
FORMS = (
    [(m, {}) for m in sorted(REGISTRY)]
    + [("masa", {"sharing": f}) for f in ("atoms", "qkv", "none", "auto")]
    + [
        ("masa", {"mlp": "lowrank"}),
        ("masa", {"uniform_mlp": True}),
        ("masa", {"sharing": "atoms", "uniform_mlp": True}),
    ]
)
CASES = [
    (method, form, targets)
    for method, form in FORMS
    for targets in ("attn", "attn,mlp")
    if targets == "attn,mlp" or not set(form) & {"mlp", "uniform_mlp"}
]


@pytest.mark.parametrize("recipe", sorted(SHAPES))
@pytest.mark.parametrize(("method", "form", "targets"), CASES)
def test_plan_holds_the_budget_or_says_why(recipe, method, form, targets):
    config = _config(recipe)
    settings = builtin_recipe(recipe).compression.model_copy(
        update={"method": method, "targets": targets, **form}
    )
    try:
        REGISTRY[method].effective_settings(settings)
    except UserError as err:  # the method has no rule for these settings (masa-paper and MLPs): one line
        assert "\n" not in str(err) and "--targets" in str(err)
        return
    planned = 0
    for ratio in RATIOS:
        try:
            plan = plan_from_config(config, ratio, settings)
        except UserError as err:  # a user's choice that cannot fit: one line, naming the fix
            assert "\n" not in str(err) and str(err)
            continue
        if not plan["feasible"]:  # the assumed groups cannot fit: the plan says why, and what would
            assert plan["reason"] and plan["target_params_after_max"] is None, plan
            continue
        after = plan["target_params_after_max"]
        assert after <= plan["budget"], (ratio, after, plan["budget"])
        planned += 1
    assert planned >= len(RATIOS) // 2  # most ratios are plannable: the sweep really checks budgets
