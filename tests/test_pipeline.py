"""The pipeline on tiny random models: exact accounting, planted sharing recovered, determinism."""

from __future__ import annotations

import pytest
import torch
from conftest import plant_identical_layers, random_windows, tiny_model

from compressor.api.pipeline import compress_model
from compressor.methods import REGISTRY
from compressor.modeling.adapters import PROJECTIONS, get_adapter
from compressor.recipes.schema import CompressionSettings
from compressor.runtime.errors import UserError
from compressor.statistics.capture import collect_statistics


def _compress(model, method="masa", ratio=0.3, windows=None, **settings):
    """Compress with `method`; MASA in its `atoms` form unless `sharing` is given (this file tests the atoms
    machinery: groups, Matrix PCA, residuals; the input-basis forms are `test_masa_basis.py`'s)."""
    adapter = get_adapter(model)
    windows = windows if windows is not None else random_windows()
    stats = collect_statistics(model, adapter, windows, progress=False)
    if method == "masa":
        settings.setdefault("sharing", "atoms")
    settings = CompressionSettings(method=method, **settings)
    return compress_model(model, adapter, stats, settings, ratio, progress=False, windows=windows)


@pytest.mark.parametrize(
    ("method", "form"),
    [(m, {}) for m in sorted(REGISTRY)] + [("masa", {"sharing": f}) for f in ("basis", "qkv")],
)
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_every_method_meets_the_budget_and_counts_exactly(method, form, family):
    model = tiny_model(family)
    before = sum(p.numel() for p in model.parameters())
    attn_before = get_adapter(model).target_parameter_count()
    outcome = _compress(model, method, ratio=0.3, **form)
    plan = outcome.plan
    # The stored count of the installed modules equals the planner's count, within the budget.
    assert get_adapter(model).target_parameter_count() == plan.params_after() <= plan.budget
    assert plan.achieved_ratio() >= 0.3
    assert sum(p.numel() for p in model.parameters()) == before - attn_before + plan.params_after()
    logits = model(input_ids=random_windows(1, 16)).logits
    assert torch.isfinite(logits).all()


def test_planted_identical_layers_are_reproduced_exactly_by_one_atom():
    model = tiny_model("llama", num_hidden_layers=4)
    plant_identical_layers(model, PROJECTIONS)
    x = random_windows(2, 16)
    expected = model(input_ids=x).logits
    _compress(model, "masa", ratio=0.5, groups=1, bases=1)
    # All four layers equal: one atom holds them exactly, the residuals are zero.
    torch.testing.assert_close(model(input_ids=x).logits, expected, rtol=1e-4, atol=1e-4)


def test_zero_atoms_is_the_same_pipeline_without_sharing():
    model = tiny_model("llama")
    outcome = _compress(model, "masa", ratio=0.3, bases=0)
    assert outcome.plan.atom_params() == 0
    assert all(pp.mode in ("dense", "lowrank") for pp in outcome.plan.projections)


def test_infeasible_ratio_says_what_fits():
    model = tiny_model("llama", num_hidden_layers=4)
    with pytest.raises(UserError, match=r"infeasible.*--ratio ≤"):
        _compress(model, "masa", ratio=0.9, groups=3, bases=1)


def test_same_inputs_same_weights():
    a, b = tiny_model("llama"), tiny_model("llama")
    _compress(a, "masa", ratio=0.3)
    _compress(b, "masa", ratio=0.3)
    for (name, pa), (_, pb) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(pa, pb), name


def test_shared_atoms_are_one_tensor_per_group():
    model = tiny_model("llama", num_hidden_layers=6)
    # dense_when_cheaper off: at ratio 0.3 the allocation would keep some tiny k_proj whole instead.
    outcome = _compress(model, "masa", ratio=0.3, groups=1, dense_when_cheaper=False)
    adapter = get_adapter(model)
    atoms = {id(adapter.projection(layer, "k_proj").atoms) for layer in range(6)}
    assert len(atoms) == 1
    assert outcome.report["atom_energy"]


def test_unknown_method_and_bad_ratio_are_user_errors():
    with pytest.raises(UserError, match="unknown --method .nope.: use one of masa"):
        _compress(tiny_model("llama"), "nope")
    with pytest.raises(UserError, match="outside"):
        _compress(tiny_model("llama"), "svd", ratio=1.0)


@pytest.mark.parametrize(
    "settings",
    [
        {"atoms": "whitened"},
        {"allocation": "global"},
        {"allocation": "global-relative"},
        {"singletons": "compress"},
        {"end_boundaries": False},
        {"statistics": "sequential"},
        {"atoms": "whitened", "allocation": "global", "singletons": "compress", "groups": 1},
    ],
    ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()),
)
def test_masa_options_meet_the_budget_and_count_exactly(settings):
    model = tiny_model("llama")
    outcome = _compress(model, "masa", ratio=0.3, **settings)
    plan = outcome.plan
    assert get_adapter(model).target_parameter_count() == plan.params_after() <= plan.budget
    assert torch.isfinite(model(input_ids=random_windows(1, 16)).logits).all()
    if settings.get("singletons") == "compress":  # nothing kept whole but what the allocation chose to
        kept = {(pp.layer, pp.projection) for pp in plan.projections if pp.mode == "dense"}
        assert kept == set(map(tuple, outcome.report.get("kept_whole_by_allocation", [])))


def test_dense_when_cheaper_keeps_whole_only_what_factors_would_overpay():
    model = tiny_model("llama")
    outcome = _compress(model, "masa", ratio=0.1, singletons="compress")
    plan = outcome.plan
    kept = outcome.report["kept_whole_by_allocation"]
    assert kept  # at ratio 0.1 some residuals would need factors dearer than the matrix
    adapter = get_adapter(model)
    for layer, p in kept:
        assert plan.get(layer, p).mode == "dense" and isinstance(
            adapter.projection(layer, p), torch.nn.Linear
        )
    for pp in plan.projections:
        if pp.mode != "dense":
            assert pp.rank * (pp.out_features + pp.in_features) < pp.out_features * pp.in_features
    assert adapter.target_parameter_count() == plan.params_after() <= plan.budget


def test_global_allocation_spends_the_budget_better_than_the_paper_split():
    """Global allocation minimizes the summed whitened error, so it is never worse on that objective."""
    errors = {}
    for allocation in ("paper", "global"):
        model = tiny_model("llama")
        outcome = _compress(model, "masa", ratio=0.3, allocation=allocation)
        errors[allocation] = outcome.report.get("residual_error")
    assert errors["global"] <= errors["paper"] * (1 + 1e-9)


@pytest.mark.parametrize("family", ["llama", "gemma"])
def test_sequential_statistics_of_an_uncompressed_model_equal_the_original(family):
    """The layer runner reproduces the model's own forward: with nothing compressed, its statistics equal
    the hooks' ones layer after layer (Gemma: per-layer kwargs such as sliding-window masks)."""
    from compressor.statistics.layer_runner import LayerRunner

    model = tiny_model(family)
    adapter = get_adapter(model)
    windows = random_windows(4, 16)
    stats = collect_statistics(model, adapter, windows, progress=False)
    runner = LayerRunner(adapter, windows)
    for layer in range(adapter.num_layers):
        torch.testing.assert_close(
            runner.autocorr(layer, "q_proj"), stats.attn_autocorr[layer], rtol=1e-5, atol=1e-6
        )
        torch.testing.assert_close(
            runner.autocorr(layer, "o_proj"), stats.o_autocorr[layer], rtol=1e-5, atol=1e-6
        )
        runner.advance(layer)


def test_rank_deficient_statistics_are_damped_and_reported():
    """8 calibration tokens for a 64-wide model: C is singular, Cholesky needs damping, and the run says so."""
    model = tiny_model("llama")
    outcome = _compress(model, "svd-llm", ratio=0.3, windows=random_windows(1, 8))
    damping = outcome.report["damping"]
    assert damping and all(entry["damping"] > 0 and entry["attempts"] > 1 for entry in damping)
    assert {entry["layer"] for entry in damping} == set(range(6))


def test_whitened_atoms_report_the_damping_of_the_group_cholesky():
    """--atoms whitened factors the group's summed autocorrelation: its damping is reported like any other."""
    model = tiny_model("llama")
    outcome = _compress(model, ratio=0.3, windows=random_windows(1, 8), atoms="whitened", groups=2)
    grouped = [e for e in outcome.report["damping"] if e.get("input") == "group sum (whitened atoms)"]
    assert grouped and all(e["damping"] > 0 and len(e["layers"]) > 1 for e in grouped)


def test_non_finite_activations_are_reported_with_the_layer():
    from compressor.runtime.errors import NumericalError

    model = tiny_model("llama")
    with torch.no_grad():
        model.model.layers[2].self_attn.v_proj.weight[0, 0] = float("inf")
    with pytest.raises(NumericalError, match="layer 2 o_proj"):
        _compress(model, "masa")


def test_non_finite_weights_are_reported_with_the_module_name():
    from compressor.runtime.errors import NumericalError

    model = tiny_model("llama")
    adapter = get_adapter(model)
    stats = collect_statistics(model, adapter, random_windows(), progress=False)
    with torch.no_grad():
        model.model.layers[3].self_attn.k_proj.weight[1, 1] = float("nan")
    with pytest.raises(NumericalError, match=r"model\.layers\.3\.self_attn\.k_proj"):
        compress_model(model, adapter, stats, CompressionSettings(method="svd-llm"), 0.3, progress=False)


@pytest.mark.parametrize("method", ["masa", "svd-llm"])
def test_an_all_zero_projection_compresses_to_zero_within_the_budget(method):
    """A projection whose weights are all zero has nothing to compress: no 0/0 in the relative allocation."""
    model = tiny_model("llama")
    adapter = get_adapter(model)
    with torch.no_grad():
        adapter.projection(2, "k_proj").weight.zero_()
    outcome = _compress(model, method, ratio=0.3)
    assert adapter.target_parameter_count() == outcome.plan.params_after() <= outcome.plan.budget
    from compressor.modeling.remote_code.masa_modules import dense_weight

    assert torch.count_nonzero(dense_weight(adapter.projection(2, "k_proj"))) == 0
    assert torch.isfinite(model(input_ids=random_windows(1, 16)).logits).all()
