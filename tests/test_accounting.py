"""`math/accounting.py`: the exact parameter accounting. Every count is checked against numbers stored as the
modules store them (atoms once per group and type, coefficients per layer, residual factors, whole matrices,
biases), the uniform rank and the feasibility bound against brute force, and the `--ratio-of model` conversion
against its definition."""

from __future__ import annotations

import itertools
import math

import pytest

from compressor.math.accounting import (
    LEGACY_KEYS,
    check_feasible_before_calibration,
    lowrank_plan,
    read_count,
    shared_plan,
    targets_ratio,
    uniform_rank,
)
from compressor.modeling.adapters import PROJECTIONS, ProjectionGeometry
from compressor.runtime.errors import UserError

GEOMETRY = ProjectionGeometry(hidden_size=24, num_heads=4, num_kv_heads=2, head_dim=6, intermediate_size=40)
LAYERS = 6
BEFORE = LAYERS * sum(math.prod(GEOMETRY.shape(p)) for p in PROJECTIONS)


def _stored(plan, groups: list[list[int]], bases: int, biases: dict) -> int:
    """The numbers a checkpoint of `plan` stores, counted the way the modules hold them."""
    total = 0
    for layers in groups:
        for p in PROJECTIONS:
            out, inp = GEOMETRY.shape(p)
            if len(layers) > 1:
                total += bases * out * inp  # the group's atoms of this type, once
            for layer in layers:
                pp = plan.get(layer, p)
                bias = biases.get((layer, p), 0)
                if pp.mode == "dense":
                    total += out * inp + bias
                    continue
                total += pp.n_atoms + pp.rank * (out + inp) + bias  # coefficients, residual A and B, the bias
    return total


@pytest.mark.parametrize("bases", [0, 1, 2])
def test_a_shared_layout_counts_what_its_modules_store(bases):
    groups = [[0], [1, 2, 3], [4, 5]]
    biases = {
        (layer, p): GEOMETRY.shape(p)[0] for layer in range(LAYERS) for p in ("q_proj", "k_proj", "v_proj")
    }
    before = BEFORE + sum(biases.values())
    plan = shared_plan("masa", 0.3, before, GEOMETRY, groups, bases, None, biases, check_feasible=False)
    for i, pp in enumerate(p for p in plan.projections if p.mode != "dense"):
        pp.rank = 1 + i % 3
    assert plan.params_after() == _stored(plan, groups, bases, biases)
    assert plan.params_after() == plan.fixed_params() + plan.factor_params()
    assert plan.achieved_ratio() == pytest.approx(1 - plan.params_after() / before)
    modes = {pp.mode for pp in plan.projections}
    assert modes == ({"dense", "shared"} if bases else {"dense", "lowrank"})


def test_uniform_rank_is_the_largest_that_keeps_the_share():
    for out, inp, bias, ratio in itertools.product((6, 24, 40), (24, 40), (0, 24), (0.05, 0.3, 0.6, 0.95)):
        r = uniform_rank(out, inp, bias, ratio)
        share = (1 - ratio) * (out * inp + bias)
        assert 0 <= r <= min(out, inp)
        assert r == 0 or r * (out + inp) + bias <= share
        assert r == min(out, inp) or (r + 1) * (out + inp) + bias > share


@pytest.mark.parametrize("ratio", [0.1, 0.5, 0.9])
def test_the_svd_baselines_plan_meets_its_budget_with_biases(ratio):
    biases = {(layer, "q_proj"): 24 for layer in range(LAYERS)}
    plan = lowrank_plan("svd", ratio, BEFORE + sum(biases.values()), GEOMETRY, LAYERS, biases)
    assert plan.params_after() <= plan.budget == math.floor((1 - ratio) * plan.params_before)
    assert plan.params_after() == _stored(plan, [[layer] for layer in range(LAYERS)], 0, biases)


def _compositions(n: int, parts: int):
    """Every way to cut layers 0..n-1 into `parts` consecutive groups."""
    for cuts in itertools.combinations(range(1, n), parts - 1):
        edges = (0, *cuts, n)
        yield [list(range(a, b)) for a, b in itertools.pairwise(edges)]


@pytest.mark.parametrize("groups, bases", [(2, 1), (3, 1), (3, 2), (6, 1)])
def test_the_check_before_calibration_refuses_only_what_no_grouping_fits(groups, bases):
    """Its lower bound is one: where it refuses, every grouping into that many groups is infeasible; where some
    grouping fits, it lets the run go on."""
    ratios, refused = (0.05, 0.1, 0.3, 0.5, 0.7, 0.9), []
    for ratio in ratios:
        feasible = any(
            shared_plan("masa", ratio, BEFORE, GEOMETRY, layout, bases, None, {}, check_feasible=False)
            .residual_budget() >= 0
            for layout in _compositions(LAYERS, groups)
        )  # fmt: skip
        try:
            check_feasible_before_calibration(ratio, BEFORE, GEOMETRY, LAYERS, groups, bases, None, False)
        except UserError:
            assert not feasible, (ratio, groups, bases)
            refused.append(ratio)
    if groups == LAYERS:  # every layer a group of its own, kept whole: nothing fits
        assert tuple(refused) == ratios
    else:  # the largest ratios refused, the smallest let through
        assert refused and ratios[0] not in refused


def test_ratio_of_the_model_removes_that_share_of_every_parameter():
    model, targets = 1_000_000, 400_000
    share = targets_ratio(0.2, "model", model, targets, "attn,mlp")
    assert share * targets == pytest.approx(0.2 * model)
    assert targets_ratio(0.2, "targets", model, targets, "attn") == 0.2
    with pytest.raises(UserError, match="at most 0.400"):
        targets_ratio(0.5, "model", model, targets, "attn")
    with pytest.raises(UserError, match="not one of"):
        targets_ratio(0.2, "layers", model, targets, "attn")
    with pytest.raises(UserError, match=r"outside \(0, 1\)"):
        targets_ratio(1.0, "targets", model, targets, "attn")


def test_a_plan_record_carries_the_former_key_names_and_reads_either():
    plan = lowrank_plan("svd", 0.3, BEFORE, GEOMETRY, LAYERS, {})
    record = plan.to_dict()
    for new, old in LEGACY_KEYS.items():
        if new in record:
            assert record[old] == record[new]
    old_file = {"attention_params_before": 7}
    assert read_count(old_file, "target_params_before") == 7
    assert read_count(record, "target_params_after") == plan.params_after()
