"""MASA's input-basis forms (`--sharing basis|qkv|none|auto`): the refit math, their layouts and exact
accounting, the allocation over shared bases, the proxy against the built model, the installed modules and their
checkpoints, and the options they refuse."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import (
    plant_identical_layers,
    random_windows,
    relative_whitened_error,
    reloaded_identically,
    tiny_model,
)

from compressor.api.pipeline import compress_model
from compressor.checkpoint import save_compressed
from compressor.math.whitening import refit_on_basis, refit_tail, shared_basis_factors, whitening_factor
from compressor.methods import get_method
from compressor.methods.allocation_policies import GlobalAllocator
from compressor.methods.base import ModelShape
from compressor.modeling.adapters import PROJECTIONS, get_adapter
from compressor.modeling.remote_code.masa_modules import SharedInputLinear, dense_weight
from compressor.recipes.schema import CompressionSettings
from compressor.runtime.errors import UserError
from compressor.statistics.capture import collect_statistics

BASIS = CompressionSettings(method="masa", sharing="basis", basis_layers=4)


def _form(sharing: str, **update) -> CompressionSettings:
    return BASIS.model_copy(update={"sharing": sharing, **update})


def _plan(family: str, layers: int, ratio: float = 0.3, settings: CompressionSettings = BASIS):
    model = tiny_model(family, num_hidden_layers=layers)
    shape = ModelShape.from_adapter(get_adapter(model), PROJECTIONS)
    return get_method("masa").plan(shape, settings, ratio, None)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _whitening(inputs: torch.Tensor) -> torch.Tensor:
    return whitening_factor(inputs.T @ inputs).S


# -- the refit math -------------------------------------------------------------------------------------------
def test_refit_on_basis_is_exact_when_the_weight_reads_only_the_basis():
    g = _gen(0)
    basis = torch.randn(3, 12, generator=g, dtype=torch.float64)
    a = torch.randn(5, 3, generator=g, dtype=torch.float64)
    s = _whitening(torch.randn(40, 12, generator=g, dtype=torch.float64))
    torch.testing.assert_close(refit_on_basis(a @ basis, basis, s), a, rtol=0, atol=1e-9)
    assert float(refit_tail(a @ basis, basis, s)[3]) == pytest.approx(0.0, abs=1e-9)


def test_refit_on_basis_minimises_the_layers_own_output_error():
    """The refit beats any perturbation of it in ‖(W − A B) S‖² = tr((W − A B) C (W − A B)ᵀ), C = S Sᵀ."""
    g = _gen(1)
    w = torch.randn(6, 10, generator=g, dtype=torch.float64)
    basis = torch.randn(4, 10, generator=g, dtype=torch.float64)
    x = torch.randn(50, 10, generator=g, dtype=torch.float64)
    s, c = _whitening(x), x.T @ x

    def error(a):
        e = w - a @ basis
        return float(torch.trace(e @ c @ e.T))

    best = refit_on_basis(w, basis, s)
    for seed in range(5):
        nudge = 1e-3 * torch.randn(best.shape, generator=_gen(seed), dtype=torch.float64)
        assert error(best) < error(best + nudge)
    assert refit_on_basis(w, basis[:0], s).shape == (6, 0)


def test_refit_tail_is_the_refit_error_at_every_basis_size():
    g = _gen(2)
    w = torch.randn(7, 9, generator=g, dtype=torch.float64)
    basis = torch.randn(6, 9, generator=g, dtype=torch.float64)
    s = _whitening(torch.randn(40, 9, generator=g, dtype=torch.float64))
    tail = refit_tail(w, basis, s)
    assert tail.shape == (7,) and torch.all(tail[:-1] >= tail[1:])
    for r in range(7):
        e = (w - refit_on_basis(w, basis[:r], s) @ basis[:r]) @ s
        assert float(tail[r]) == pytest.approx(float((e**2).sum()), rel=1e-9, abs=1e-9)


def test_a_planted_shared_subspace_is_recovered_exactly():
    """Layers whose weights all read one k-dim subspace P: the stacked basis's first k rows span it, so every
    layer's refit error vanishes at size k (under its own statistics), and not before."""
    g = _gen(3)
    planted = torch.randn(3, 16, generator=g, dtype=torch.float64)
    weights = [torch.randn(5, 3, generator=g, dtype=torch.float64) @ planted for _ in range(4)]
    factors = [_whitening(torch.randn(60, 16, generator=g, dtype=torch.float64)) for _ in range(4)]
    summed = whitening_factor(sum(s @ s.T for s in factors)).S
    _, basis = shared_basis_factors(weights, summed, rank=16)
    for w, s in zip(weights, factors, strict=True):
        tail = refit_tail(w, basis, s)
        assert float(tail[3]) == pytest.approx(0.0, abs=1e-8 * float(tail[0]))
        assert float(tail[2]) > 1e-3 * float(tail[0])


def test_a_full_size_basis_reconstructs_every_layer_exactly():
    g = _gen(4)
    weights = [torch.randn(5, 8, generator=g, dtype=torch.float64) for _ in range(3)]  # stacked 15 × 8
    inputs = [torch.randn(30, 8, generator=g, dtype=torch.float64) for _ in range(3)]
    summed = whitening_factor(sum(x.T @ x for x in inputs)).S
    _, basis = shared_basis_factors(weights, summed, rank=8)
    for w, x in zip(weights, inputs, strict=True):
        torch.testing.assert_close(refit_on_basis(w, basis, _whitening(x)) @ basis, w, rtol=0, atol=1e-9)


# -- layouts and accounting ------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("layers", [8, 9, 6])
def test_basis_layout_shares_k_and_v_over_runs_of_layers(family, layers):
    plan = _plan(family, layers)
    runs = [g.layers for g in plan.groups]
    assert runs[0] == [0, 1, 2, 3] and sum(runs, []) == list(range(layers))
    for pp in plan.projections:
        shared = pp.projection in ("k_proj", "v_proj") and len(runs[pp.group]) > 1
        assert pp.mode == ("basis" if shared else "lowrank"), (pp.layer, pp.projection)
        assert pp.basis == (pp.projection if shared else None)
    if layers == 9:  # a run of one layer (9 = 4 + 4 + 1) shares nothing
        assert {plan.get(8, p).mode for p in PROJECTIONS} == {"lowrank"}


def test_qkv_layout_shares_one_basis_for_q_k_v_and_none_shares_nothing():
    qkv = _plan("llama", 8, settings=_form("qkv"))
    for pp in qkv.projections:
        assert (pp.mode, pp.basis) == (("basis", "qkv") if pp.projection != "o_proj" else ("lowrank", None))
    assert len(qkv.allocation_units()[("basis", 0, "qkv")]) == 12  # q, k, v of 4 layers
    none = _plan("llama", 8, settings=_form("none"))
    assert {pp.mode for pp in none.projections} == {"lowrank"}
    auto = _plan("llama", 8, settings=_form("auto"))  # chosen at run time: the preview shares nothing yet
    assert {pp.mode for pp in auto.projections} == {"lowrank"} and [g.layers for g in auto.groups][1] == [
        4,
        5,
        6,
        7,
    ]


def test_allocator_gives_one_rank_per_shared_basis_and_pays_it_once():
    plan = _plan("llama", 8)
    units = plan.allocation_units()
    assert len(units[("basis", 0, "k_proj")]) == 4
    g = _gen(5)
    tails = {}
    for members in units.values():
        k = min(sum(pp.out_features for pp in members), members[0].in_features)
        for pp in members:
            sigma = torch.rand(k, generator=g, dtype=torch.float64).sort(descending=True).values
            tails[(pp.layer, pp.projection)] = torch.cat(
                [sigma.square().flip(0).cumsum(0).flip(0), sigma.new_zeros(1)]
            )
    GlobalAllocator("global-relative", dense_when_cheaper=True).allocate(plan, tails, lambda *key: 1.0)
    assert plan.ranks_allocated()
    for members in units.values():
        if members[0].mode == "basis":
            assert len({pp.rank for pp in members}) == 1
    bases = {(pp.group, pp.basis): pp.rank * pp.in_features for pp in plan.projections if pp.mode == "basis"}
    assert plan.basis_params() == sum(bases.values()) > 0
    assert plan.params_after() <= plan.budget
    # nothing left that a step of the cheapest unit could still buy
    cheapest = min(sum(pp.out_features for pp in m) + m[0].in_features for m in units.values())
    assert plan.budget - plan.params_after() < cheapest


def test_atoms_whose_readers_are_all_kept_whole_are_dropped_and_their_numbers_spent():
    """A group whose every k_proj goes whole frees its atoms: the plan no longer pays them, and the budget is
    spent to within one rank step."""
    model = tiny_model("llama", num_hidden_layers=4)
    shape = ModelShape.from_adapter(get_adapter(model), PROJECTIONS)
    settings = CompressionSettings(method="masa", sharing="atoms", groups=1, bases=1, end_boundaries=False)
    plan = get_method("masa").plan(shape, settings, 0.3, lambda n: [[0, 1, 2, 3]])
    tails = {}
    for pp in plan.projections:
        k = min(pp.out_features, pp.in_features)
        # k_proj's residuals hold far more energy, spread evenly: the greedy buys them up to where factors would
        # cost more than the matrix, so every k_proj is kept whole.
        top = 100.0 if pp.projection == "k_proj" else 1.0
        sigma = torch.linspace(top, 0.1 * top if top == 1.0 else top, k, dtype=torch.float64)
        tails[(pp.layer, pp.projection)] = torch.cat(
            [sigma.square().flip(0).cumsum(0).flip(0), sigma.new_zeros(1)]
        )
    report = GlobalAllocator("global", dense_when_cheaper=True).allocate(plan, tails, lambda *key: 1.0)
    assert report["atoms_dropped_unused"] == [[0, "k_proj"]]
    assert all(plan.get(layer, "k_proj").mode == "dense" for layer in range(4))
    assert plan.atom_params() == 64 * 64 + 32 * 64 + 64 * 64  # q, v (GQA: 32 x 64), o atoms; k's are gone
    step = min(pp.out_features + pp.in_features for pp in plan.projections if pp.mode != "dense")
    assert 0 <= plan.budget - plan.params_after() < step


# -- the built model -------------------------------------------------------------------------------------------
def _compress(model, settings, ratio=0.3):
    adapter = get_adapter(model)
    windows = random_windows()
    stats = collect_statistics(model, adapter, windows, progress=False)
    return compress_model(model, adapter, stats, settings, ratio, progress=False, windows=windows), stats


@pytest.mark.parametrize("sharing", ["basis", "qkv", "none", "auto"])
def test_proxy_equals_the_built_models_relative_whitened_error(sharing):
    original = tiny_model("llama", num_hidden_layers=6)
    model = copy.deepcopy(original)
    outcome, stats = _compress(model, _form(sharing))
    measured = relative_whitened_error(original, model, stats, PROJECTIONS)
    assert outcome.report["sharing"]["proxy_error"] == pytest.approx(measured, rel=1e-4)
    assert get_adapter(model).target_parameter_count() == outcome.plan.params_after()
    assert outcome.plan.params_after() <= outcome.plan.budget


def test_none_is_the_atoms_pipeline_without_atoms():
    """`--sharing none` and `--sharing atoms --bases 0` store the same per-matrix factors."""
    a, b = tiny_model("llama"), tiny_model("llama")
    _compress(a, _form("none"))
    _compress(b, CompressionSettings(method="masa", sharing="atoms", bases=0))
    for layer in range(6):
        for p in PROJECTIONS:
            wa, wb = (dense_weight(get_adapter(m).projection(layer, p)) for m in (a, b))
            torch.testing.assert_close(wa, wb, rtol=0, atol=1e-6)


def test_auto_shares_what_is_planted_and_never_ends_above_none_on_the_objective():
    original = tiny_model("llama", num_hidden_layers=8)
    plant_identical_layers(original, ("k_proj", "v_proj"))
    none_outcome, _ = _compress(copy.deepcopy(original), _form("none"), ratio=0.4)
    auto_outcome, _ = _compress(copy.deepcopy(original), _form("auto"), ratio=0.4)
    choice = auto_outcome.report["sharing_choice"]
    chosen = {(c["group"], c["projection"]) for c in choice["candidates"] if c["chosen"] == "basis"}
    assert {(g, p) for g in (0, 1) for p in ("k_proj", "v_proj")} <= chosen
    # The allocation's objective (loss-weighted under the default global-loss): never above `none`'s.
    assert auto_outcome.report["sharing"]["objective"] <= none_outcome.report["sharing"]["objective"] * (
        1 + 1e-12
    )
    assert choice["proxy_error"] == pytest.approx(auto_outcome.report["sharing"]["objective"], rel=1e-9)


@pytest.mark.parametrize(("family", "sharing"), [("llama", "basis"), ("qwen2", "basis"), ("llama", "qkv")])
def test_compressed_model_shares_bases_and_saves_loads_identically(family, sharing, tmp_path):
    model = tiny_model(family, num_hidden_layers=6)
    outcome, _ = _compress(model, _form(sharing))
    plan = outcome.plan
    layers = model.model.layers
    shared = "v_proj" if sharing == "basis" else "q_proj"
    readers = [getattr(layer.self_attn, shared) for layer in layers]
    if isinstance(readers[0], SharedInputLinear):  # unless the allocation kept the stack whole
        assert readers[0].basis is readers[3].basis and readers[3].basis is not readers[4].basis
        if sharing == "qkv":
            assert layers[1].self_attn.k_proj.basis is readers[0].basis
    assert not isinstance(layers[0].self_attn.o_proj, SharedInputLinear)
    rows = outcome.report["sharing"]["bases"]
    assert all(0.0 <= r["relative_error"] <= 1.0 for r in rows)

    reloaded_identically(model, save_compressed(model, plan, tmp_path / "ckpt", metadata={"method": "masa"}))


# -- options ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("update", "message"),
    [
        ({"allocation": "paper"}, "--allocation global-loss"),
        ({"statistics": "sequential"}, "--statistics original"),
        ({"auto_groups": True}, "--fixed-groups"),
    ],
)
def test_settings_without_a_rule_are_refused(update, message):
    with pytest.raises(UserError, match=message):
        get_method("masa").effective_settings(BASIS.model_copy(update=update))


def test_sequential_statistics_without_sharing_name_the_form_that_has_them():
    """`--sharing none` (the default) shares nothing: the refusal must not blame a shared basis."""
    settings = BASIS.model_copy(update={"sharing": "none", "statistics": "sequential"})
    with pytest.raises(UserError, match="--sharing atoms only") as refused:
        get_method("masa").effective_settings(settings)
    assert "shared basis" not in str(refused.value)


@pytest.mark.parametrize("sharing", ["basis", "qkv"])
def test_a_form_sharing_attention_bases_works_on_the_mlp_alone_and_says_so(sharing):
    """The default form shares k/v bases; with --targets mlp there are none to share: the run compresses every
    projection on its own (the same as `none`) and its report says so, instead of refusing the default."""
    model, windows = tiny_model("llama"), random_windows()
    adapter = get_adapter(model)
    stats = collect_statistics(model, adapter, windows, progress=False, mlp=True)
    settings = BASIS.model_copy(update={"sharing": sharing, "targets": "mlp"})
    outcome = compress_model(model, adapter, stats, settings, 0.3, progress=False, windows=windows)
    assert not any(pp.mode == "basis" for pp in outcome.plan.projections)
    assert "nothing is shared" in outcome.report["sharing_note"]


def test_mlp_only_targets_work_with_auto_and_none():
    for sharing in ("auto", "none"):
        get_method("masa").effective_settings(_form(sharing, targets="mlp"))


@pytest.mark.parametrize("sharing", ["none", "basis", "qkv", "auto"])
def test_every_mlp_setting_of_the_neurons_form_is_accepted_by_every_input_basis_form(sharing):
    """The neuron form reads its order, width multiple and uniform width whatever the attention's form: none of
    them is refused as unread (`--neuron-order greedy-block` with the default form once was)."""
    settings = _form(sharing, targets="attn,mlp")
    get_method("masa").refuse_unread(
        {"mlp": "neurons", "neuron_order": "greedy-block", "width_multiple": 32, "uniform_mlp": True},
        settings,
    )


def test_options_of_the_other_form_are_refused():
    masa = get_method("masa")
    with pytest.raises(UserError, match="--bases has no effect with --method masa --sharing basis"):
        masa.refuse_unread({"bases": 2, "sharing": "basis"}, BASIS)
    with pytest.raises(UserError, match="--basis-layers has no effect with --method masa --sharing atoms"):
        masa.refuse_unread({"basis_layers": 2}, CompressionSettings(sharing="atoms"))
    with pytest.raises(UserError, match="--basis-layers has no effect with --method masa --sharing none"):
        masa.refuse_unread({"basis_layers": 2}, _form("none"))
    masa.refuse_unread({"basis_layers": 2, "allocation": "global"}, BASIS)  # read by the basis form
