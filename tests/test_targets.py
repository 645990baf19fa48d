"""`--targets mlp`: the same machinery on gate/up/down projections (`--mlp lowrank`), on tiny random models.
The MLP's default form, `--mlp neurons`, is tested in `test_neurons.py`."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import plant_identical_layers, random_windows, relative_whitened_error, tiny_model
from test_capture import assert_within_gram_bound

from compressor.api.pipeline import compress_model
from compressor.checkpoint import load_compressed, save_compressed
from compressor.modeling.adapters import MLP_PROJECTIONS, PROJECTIONS, get_adapter, target_projections
from compressor.modeling.remote_code.masa_modules import LowRankLinear, SharedBasisLinear
from compressor.recipes.schema import CompressionSettings
from compressor.runtime.errors import UserError
from compressor.statistics.capture import collect_statistics


def _compress(model, ratio=0.3, windows=None, **settings):
    """MASA in its `atoms` form unless `sharing` (or another method) is given: this file tests the atoms
    machinery on MLP targets; `test_masa_basis.py` the input-basis forms."""
    adapter = get_adapter(model)
    windows = windows if windows is not None else random_windows()
    stats = collect_statistics(model, adapter, windows, progress=False, mlp=True)
    if settings.get("method", "masa") == "masa":
        settings.setdefault("sharing", "atoms")
        if "mlp" in settings.get("targets", "attn"):
            settings.setdefault("mlp", "lowrank")  # the factor machinery; the neurons form: test_neurons.py
    return compress_model(
        model, adapter, stats, CompressionSettings(**settings), ratio, progress=False, windows=windows
    )


def test_target_names():
    assert target_projections("attn") == PROJECTIONS
    assert target_projections("mlp") == MLP_PROJECTIONS
    assert target_projections("mlp,attn") == PROJECTIONS + MLP_PROJECTIONS
    with pytest.raises(UserError, match="unknown target 'ffn'"):
        target_projections("attn,ffn")


def test_mlp_autocorrelations_are_the_grams_of_the_mlp_inputs():
    model = tiny_model("llama", num_hidden_layers=2)
    adapter = get_adapter(model)
    windows = random_windows(4, 16)
    seen = {"gate_proj": [], "down_proj": []}
    handles = [
        adapter.projection(1, name).register_forward_hook(
            lambda m, a, out, name=name: seen[name].append(a[0])
        )
        for name in seen
    ]
    with torch.no_grad():
        for window in windows:
            model(input_ids=window[None])
    for handle in handles:
        handle.remove()
    stats = collect_statistics(model, adapter, windows, progress=False, mlp=True)
    for name, kind in (("gate_proj", "mlp"), ("down_proj", "down")):
        x = torch.cat([t.reshape(-1, t.shape[-1]) for t in seen[name]])
        # The token mean of the Grams (capture stores means: they do not grow with the calibration's length).
        assert_within_gram_bound(stats.autocorr(kind, 1), x, tokens=len(x))
    assert stats.autocorr("down", 0).shape == (128, 128)  # intermediate_size


@pytest.mark.parametrize("targets", ["mlp", "attn,mlp"])
@pytest.mark.parametrize("method", ["masa", "svd-llm"])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_targets_meet_the_budget_and_count_exactly(targets, method, family):
    model = tiny_model(family)
    adapter = get_adapter(model)
    names = target_projections(targets)
    before_total = sum(p.numel() for p in model.parameters())
    before = adapter.target_parameter_count(names)
    attention_before = adapter.target_parameter_count()
    outcome = _compress(model, ratio=0.3, method=method, targets=targets)
    plan = outcome.plan
    assert plan.targets == names and plan.params_before == before
    assert adapter.target_parameter_count(names) == plan.params_after() <= plan.budget
    assert plan.achieved_ratio() >= 0.3
    assert sum(p.numel() for p in model.parameters()) == before_total - before + plan.params_after()
    # Every MLP projection was replaced; attention untouched when not targeted.
    compressed = (SharedBasisLinear, LowRankLinear)
    middle = adapter.num_layers // 2
    assert all(isinstance(adapter.projection(middle, p), compressed) for p in MLP_PROJECTIONS)
    if targets == "mlp":
        assert adapter.target_parameter_count() == attention_before
    assert torch.isfinite(model(input_ids=random_windows(1, 16)).logits).all()


def test_planted_identical_mlps_are_reproduced_exactly_by_one_atom():
    model = tiny_model("llama", num_hidden_layers=4)
    plant_identical_layers(model, MLP_PROJECTIONS)
    x = random_windows(2, 16)
    expected = model(input_ids=x).logits
    outcome = _compress(model, ratio=0.5, targets="mlp", groups=1, bases=1)
    assert outcome.plan.params_after() <= outcome.plan.budget
    torch.testing.assert_close(model(input_ids=x).logits, expected, rtol=1e-4, atol=1e-4)


def test_mlp_errors_are_the_whitened_tails_the_allocation_saw():
    """Each compressed MLP projection's whitened error equals the discarded energy at its allocated rank."""
    original = tiny_model("llama")
    model = copy.deepcopy(original)
    windows = random_windows()
    stats = collect_statistics(original, get_adapter(original), windows, progress=False, mlp=True)
    outcome = compress_model(
        model, get_adapter(model), stats, CompressionSettings(sharing="atoms", targets="mlp", mlp="lowrank", auto_groups=True, allocation="global-relative"), 0.3,
        progress=False, windows=windows,
    )  # fmt: skip
    chosen = outcome.report["shape_search"]["chosen"]
    proxy = next(
        c["proxy"]
        for c in outcome.report["shape_search"]["candidates"]
        if (c["groups"], c["bases"]) == (chosen["groups"], chosen["bases"])
    )
    assert relative_whitened_error(original, model, stats, MLP_PROJECTIONS) == pytest.approx(proxy, rel=1e-6)


@pytest.mark.parametrize(
    "settings,message",
    [
        ({"allocation": "paper"}, "Algorithm 1"),
        ({"method": "masa-paper"}, "Algorithm 1"),
        ({"statistics": "sequential"}, "sequential"),
    ],
)
def test_settings_without_an_mlp_rule_are_refused(settings, message):
    with pytest.raises(UserError, match=message):
        _compress(tiny_model("llama"), targets="attn,mlp", **settings)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_mlp_checkpoints_round_trip_with_both_loaders(family, tmp_path):
    from transformers import AutoModelForCausalLM

    model = tiny_model(family)
    outcome = _compress(model, ratio=0.3, targets="attn,mlp")
    path = save_compressed(model, outcome.plan, tmp_path / "ckpt")
    x = random_windows(2, 48, seed=3)  # long enough for the materialized-weight prefill path
    with torch.no_grad():
        expected = model(input_ids=x).logits
        for reloaded in (
            load_compressed(path),
            AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True),
        ):
            assert torch.equal(reloaded(input_ids=x).logits, expected)
            assert sum(p.numel() for p in reloaded.parameters()) == sum(p.numel() for p in model.parameters())
            layers = reloaded.model.layers
            # The remote code defines its own SharedBasisLinear: compare by name.
            shared = [
                p
                for p in MLP_PROJECTIONS
                if type(layers[2].mlp.get_submodule(p)).__name__ == "SharedBasisLinear"
            ]
            assert shared == list(MLP_PROJECTIONS)
            for p in shared:  # one atoms Parameter per group, in every layer that shares it
                assert layers[2].mlp.get_submodule(p).atoms is layers[3].mlp.get_submodule(p).atoms


def test_a_run_that_targets_the_mlp_takes_the_recipes_mlp_windows():
    """The bundled model calibrates on more windows when an MLP projection is targeted (its refits were measured
    better with them, on validation; they follow the model's shapes, `model_defaults`); `-n` wins, a run of the
    attention alone keeps `samples`, and a recipe that sets `mlp_samples` to null keeps `samples` for every
    target."""
    from compressor.api.model_defaults import MLP_CALIBRATION_WINDOWS
    from compressor.api.run_options import CompressOptions, resolve_run_settings
    from compressor.recipes.schema import builtin_recipe

    recipe = builtin_recipe("smollm2-135m")
    windows, mlp_windows = recipe.calibration.samples, MLP_CALIBRATION_WINDOWS
    assert mlp_windows > windows
    for targets in ("attn,mlp", "mlp"):
        for native in (False, True):
            options = CompressOptions(targets=targets, native=native)
            assert resolve_run_settings(options, recipe)[0].samples == mlp_windows
    assert (
        resolve_run_settings(CompressOptions(targets="attn,mlp", calib_samples=32), recipe)[0].samples == 32
    )
    assert resolve_run_settings(CompressOptions(targets="attn"), recipe)[0].samples == windows
    assert resolve_run_settings(CompressOptions(targets="attn", native=True), recipe)[0].samples == windows
    plain = recipe.model_copy(
        update={"calibration": recipe.calibration.model_copy(update={"mlp_samples": None})}
    )
    assert resolve_run_settings(CompressOptions(targets="attn,mlp"), plain)[0].samples == windows
