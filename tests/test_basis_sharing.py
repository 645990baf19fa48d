"""The `basis-sharing` baseline: the shared-basis math, its exact accounting, and its checkpoints."""

from __future__ import annotations

import pytest
import torch
from conftest import random_windows, reloaded_identically, tiny_model

from compressor.api.pipeline import compress_model
from compressor.checkpoint import save_compressed
from compressor.math.whitening import shared_basis_factors, whitening_factor
from compressor.methods import get_method
from compressor.methods.base import ModelShape
from compressor.modeling.adapters import PROJECTIONS, get_adapter
from compressor.modeling.remote_code.masa_modules import LowRankLinear, SharedInputLinear
from compressor.recipes.schema import CompressionSettings
from compressor.statistics.capture import collect_statistics


def _whitening(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4 * n, n, generator=g, dtype=torch.float64)
    return whitening_factor(x.T @ x).S


def test_planted_shared_input_subspace_is_recovered_exactly():
    g = torch.Generator().manual_seed(0)
    basis = torch.randn(3, 20, generator=g, dtype=torch.float64)  # rank-3 subspace both layers read
    weights = [torch.randn(8, 3, generator=g, dtype=torch.float64) @ basis for _ in range(2)]
    coefficients, found = shared_basis_factors(weights, _whitening(20, 1), rank=3)
    for w, a in zip(weights, coefficients, strict=True):
        torch.testing.assert_close(a @ found, w, rtol=0, atol=1e-10)
    # the basis found spans the planted one: projecting the planted rows onto it loses nothing
    q, _ = torch.linalg.qr(found.T)
    torch.testing.assert_close(basis @ q @ q.T, basis, rtol=0, atol=1e-10)


def test_full_rank_reconstructs_every_matrix_exactly():
    g = torch.Generator().manual_seed(2)
    weights = [torch.randn(6, 10, generator=g, dtype=torch.float64) for _ in range(3)]  # stacked 18 × 10
    coefficients, basis = shared_basis_factors(weights, _whitening(10, 3), rank=10)
    for w, a in zip(weights, coefficients, strict=True):
        torch.testing.assert_close(a @ basis, w, rtol=0, atol=1e-10)


def test_truncation_is_the_best_shared_basis_under_the_summed_whitening():
    """Eckart–Young on the stacked matrix: the whitened error equals the discarded singular energy."""
    g = torch.Generator().manual_seed(4)
    weights = [torch.randn(6, 10, generator=g, dtype=torch.float64) for _ in range(2)]
    s = _whitening(10, 5)
    coefficients, basis = shared_basis_factors(weights, s, rank=4)
    sigma = torch.linalg.svdvals(torch.cat(weights) @ s)
    error = sum(
        float(((w - a @ basis) @ s).square().sum()) for w, a in zip(weights, coefficients, strict=True)
    )
    assert error == pytest.approx(float(sigma[4:].square().sum()), rel=1e-9)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("layers", [6, 5])
def test_plan_pairs_layers_and_counts_each_basis_once(family, layers):
    model = tiny_model(family, num_hidden_layers=layers)
    shape = ModelShape.from_adapter(get_adapter(model), PROJECTIONS)
    plan = get_method("basis-sharing").plan(shape, CompressionSettings(method="basis-sharing"), 0.3)
    assert [g.layers for g in plan.groups][:2] == [[0, 1], [2, 3]]
    for pp in plan.projections:
        paired = pp.layer < 2 * (layers // 2)
        expected = "basis" if paired and pp.projection != "o_proj" else "lowrank"
        assert pp.mode == expected, (pp.layer, pp.projection)
    # one basis (rank × in) per pair and shared type, per-layer coefficients (rank × out) and biases
    bases = {(pp.group, pp.basis): pp.rank * pp.in_features for pp in plan.projections if pp.mode == "basis"}
    assert plan.basis_params() == sum(bases.values()) > 0
    assert plan.params_after() <= plan.budget


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_installed_modules_share_one_basis_per_pair_and_save_load_identically(family, tmp_path):
    model = tiny_model(family)
    adapter = get_adapter(model)
    windows = random_windows()
    stats = collect_statistics(model, adapter, windows, progress=False)
    settings = CompressionSettings(method="basis-sharing")
    outcome = compress_model(model, adapter, stats, settings, 0.3, progress=False, windows=windows)
    assert adapter.target_parameter_count() == outcome.plan.params_after() <= outcome.plan.budget
    layers = model.model.layers
    assert layers[0].self_attn.v_proj.basis is layers[1].self_attn.v_proj.basis
    assert layers[1].self_attn.v_proj.basis is not layers[2].self_attn.v_proj.basis
    assert isinstance(layers[0].self_attn.o_proj, LowRankLinear)
    assert isinstance(layers[0].self_attn.q_proj, SharedInputLinear)

    path = save_compressed(model, outcome.plan, tmp_path / "ckpt", metadata={"method": "basis-sharing"})
    for reloaded in reloaded_identically(model, path):
        reloaded_layers = reloaded.model.layers
        assert reloaded_layers[0].self_attn.k_proj.basis is reloaded_layers[1].self_attn.k_proj.basis
