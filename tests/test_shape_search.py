"""Automatic choice of G and B: the proxy is the relative whitened error the built model really has."""

from __future__ import annotations

import copy

import pytest
from conftest import plant_identical_layers, random_windows, relative_whitened_error, tiny_model

from compressor.api.pipeline import compress_model
from compressor.modeling.adapters import PROJECTIONS, get_adapter
from compressor.recipes.schema import CompressionSettings
from compressor.statistics.capture import collect_statistics


def _run(model, stats, windows, ratio=0.3, **settings):
    """MASA's atoms form (the one `--auto-groups` chooses G and B for) with `settings`, allocated by relative
    error (`global-relative`: the proxy is then the built model's relative whitened error, which these tests
    measure independently)."""
    adapter = get_adapter(model)
    settings = {"sharing": "atoms", "allocation": "global-relative", **settings}
    return compress_model(
        model, adapter, stats, CompressionSettings(**settings), ratio, progress=False,
        windows=windows,
    )  # fmt: skip


def test_proxy_is_the_relative_error_of_the_model_built_with_that_shape():
    original = tiny_model("llama")
    windows = random_windows()
    stats = collect_statistics(original, get_adapter(original), windows, progress=False)
    outcome = _run(copy.deepcopy(original), stats, windows, auto_groups=True)
    search = outcome.report["shape_search"]
    assert "damping" not in outcome.report  # the trace formula assumes undamped statistics
    candidates = search["candidates"]
    assert len(candidates) >= 6 and {c["bases"] for c in candidates} == {0, 1, 2}
    for candidate in candidates[::3]:
        model = copy.deepcopy(original)
        built = _run(model, stats, windows, groups=candidate["groups"], bases=candidate["bases"])
        assert built.report["grouping"]["groups"] == candidate["layers"]
        assert built.plan.params_after() <= built.plan.budget
        assert relative_whitened_error(original, model, stats, PROJECTIONS) == pytest.approx(
            candidate["proxy"], rel=1e-6
        )


def test_the_choice_is_the_lowest_proxy_and_is_what_gets_built():
    original = tiny_model("llama")
    windows = random_windows()
    stats = collect_statistics(original, get_adapter(original), windows, progress=False)
    model = copy.deepcopy(original)
    outcome = _run(model, stats, windows, groups=5, bases=2, auto_groups=True)
    search = outcome.report["shape_search"]
    best = min(search["candidates"], key=lambda c: c["proxy"])
    assert search["chosen"] == {"groups": best["groups"], "bases": best["bases"]}
    effective = outcome.report["effective_settings"]
    assert (effective["groups"], effective["bases"]) == (best["groups"], best["bases"])
    assert outcome.report["grouping"]["groups"] == best["layers"]
    assert outcome.plan.params_after() <= outcome.plan.budget
    assert (
        abs(relative_whitened_error(original, model, stats, PROJECTIONS) - best["proxy"])
        <= 1e-6 * best["proxy"]
    )


def test_planted_shared_layers_are_found_one_group_one_atom():
    model = tiny_model("llama", num_hidden_layers=4)
    plant_identical_layers(model, PROJECTIONS)
    windows = random_windows()
    stats = collect_statistics(model, get_adapter(model), windows, progress=False)
    outcome = _run(model, stats, windows, ratio=0.5, auto_groups=True, end_boundaries=False)
    # One atom holds all four equal layers exactly: zero error, and the fewest atoms and groups win ties.
    assert outcome.report["shape_search"]["chosen"] == {"groups": 1, "bases": 1}
    chosen = next(
        c for c in outcome.report["shape_search"]["candidates"] if (c["groups"], c["bases"]) == (1, 1)
    )
    assert chosen["proxy"] < 1e-12
