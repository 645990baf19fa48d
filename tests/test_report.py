"""Reports: the run report's JSON and plots (opened and looked at as images), the records behind them."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import random_windows, tiny_model
from PIL import Image

from compressor.api.pipeline import compress_model
from compressor.modeling.adapters import get_adapter
from compressor.recipes.schema import CompressionSettings
from compressor.report import (
    ALLOCATION_EXTRA_INCHES,
    ALLOCATION_ROW_INCHES,
    DPI,
    INSPECT_ENERGY_FIGSIZE,
    KL_PANEL_INCHES,
    MAP_EXTRA_INCHES,
    MAP_ROW_INCHES,
    RUN_FIGSIZE,
    energy_record,
    kept_by_type,
    kept_fractions,
    plot_grouping,
    plot_inspect_energy,
    pooled_energy,
    write_run_report,
)
from compressor.statistics.capture import collect_statistics


def _run_summary(method: str = "masa", **settings) -> dict:
    """The parts of `api.compress`'s summary that the report reads, from a real compression."""
    model = tiny_model("llama")
    adapter = get_adapter(model)
    before = adapter.target_parameter_count()
    windows = random_windows()
    stats = collect_statistics(model, adapter, windows, progress=False)
    if method == "masa":  # the atoms form: it has groups, atom energy and residual ranks to draw
        settings.setdefault("sharing", "atoms")
    outcome = compress_model(
        model,
        adapter,
        stats,
        CompressionSettings(method=method, **settings),
        0.3,
        progress=False,
        windows=windows,
    )
    return {
        "model": "tiny-llama",
        "method": method,
        "ratio_requested": 0.3,
        "target_params_before": before,
        "target_params_after": outcome.plan.params_after(),
        "plan": outcome.plan.to_dict(),
        "report": outcome.report,
        "seconds": {"total": 1.0},
        "out": None,
    }


def _check_png(path, width: int, height: int) -> np.ndarray:
    """A real PNG of the documented size that shows something (not one flat colour)."""
    with Image.open(path) as image:
        assert image.format == "PNG"
        assert image.size == (width, height)
        pixels = np.asarray(image.convert("RGB"), dtype=np.float64)
    assert pixels.std() > 10, f"{path} looks blank"
    # Lines, bars and text: a good share of the picture is not background white.
    assert (pixels.min(axis=2) < 200).mean() > 0.02
    return pixels


def test_run_report_writes_the_summary_and_three_readable_plots(tmp_path):
    summary = _run_summary("masa", groups=3)
    paths = write_run_report(tmp_path / "run", summary)
    names = ["report.json", "grouping.png", "energy.png", "ranks.png", "allocation.png"]
    assert [p.name for p in paths] == names
    saved = json.loads((tmp_path / "run" / "report.json").read_text())
    assert saved["target_params_after"] == summary["target_params_after"]
    assert saved["report"]["grouping"]["groups"] == summary["report"]["grouping"]["groups"]
    width, height = round(RUN_FIGSIZE[0] * DPI), round(RUN_FIGSIZE[1] * DPI)
    for path in paths[1:4]:
        _check_png(path, width, height)
    _check_png(paths[4], width, round((ALLOCATION_EXTRA_INCHES + 4 * ALLOCATION_ROW_INCHES) * DPI))


@pytest.mark.parametrize(
    "settings",
    [{"sharing": "atoms", "groups": 3}, {"sharing": "basis", "basis_layers": 3}, {"method": "svd-llm"}],
)
def test_kept_fractions_account_for_every_stored_number(settings):
    """Σ kept fraction × dense size over the projections + their biases = what the plan stores: shared atoms
    and bases split among their readers, nothing counted twice or left out."""
    summary = _run_summary(settings.pop("method", "masa"), **settings)
    plan = summary["plan"]
    kept = kept_fractions(plan["projections"])
    stored = sum(kept[(pp["layer"], pp["projection"])] * pp["out_features"] * pp["in_features"]
                 for pp in plan["projections"])  # fmt: skip
    biases = sum(pp["bias"] for pp in plan["projections"])
    assert stored + biases == pytest.approx(plan["target_params_after"], rel=1e-12)
    rows = kept_by_type(plan["projections"])
    assert [r["projection"] for r in rows] == ["q_proj", "k_proj", "v_proj", "o_proj"]
    assert all(r["least_kept"] <= r["kept"] <= r["most_kept"] for r in rows)


def test_run_report_of_a_baseline_has_no_grouping_plots(tmp_path):
    paths = write_run_report(tmp_path, _run_summary("svd-llm"))
    assert [p.name for p in paths] == ["report.json", "ranks.png", "allocation.png"]


def test_boundaries_are_drawn_where_the_kl_says(tmp_path):
    # A single boundary in the middle of 9 layers: the red dashed line must sit near the middle column.
    kl = [0.1] * 8
    kl[4] = 1.0
    path = plot_grouping(tmp_path / "g.png", kl, [4], [list(range(5)), list(range(5, 9))], "test")
    pixels = _check_png(path, round(RUN_FIGSIZE[0] * DPI), round(RUN_FIGSIZE[1] * DPI))
    red = (pixels[..., 0] > 180) & (pixels[..., 1] < 80) & (pixels[..., 2] < 80)
    columns = np.nonzero(red.sum(axis=0) > pixels.shape[0] * 0.3)[0]
    assert columns.size, "no vertical red boundary line"
    assert 0.4 < columns.mean() / pixels.shape[1] < 0.65


def test_inspect_plots_have_their_documented_sizes(tmp_path):
    kl = [0.3, 0.05, 0.02, 0.06, 0.4]
    maps = [(2, [[0, 1, 2, 3, 4], [5]]), (3, [[0], [1, 2, 3, 4], [5]])]
    path = plot_grouping(tmp_path / "g.png", kl, [0, 4], maps[1][1], "t", group_maps=maps, highlight=3)
    height = KL_PANEL_INCHES + MAP_EXTRA_INCHES + MAP_ROW_INCHES * len(maps)
    _check_png(path, round(RUN_FIGSIZE[0] * DPI), round(height * DPI))

    eig = torch.tensor([5.0, 3.0, 1.0, 1.0])
    energy = [energy_record(1, [1, 2, 3, 4], p, eig, 1) for p in ("q_proj", "k_proj", "v_proj", "o_proj")]
    inspection = {"highlight": 3, "groupings": [
        {"n_groups": 2, "groups": maps[0][1], "energy": [{**e, "group": 0} for e in energy]},
        {"n_groups": 3, "groups": maps[1][1], "energy": energy},
    ]}  # fmt: skip
    path = plot_inspect_energy(tmp_path / "e.png", inspection, "t")
    _check_png(path, round(INSPECT_ENERGY_FIGSIZE[0] * DPI), round(INSPECT_ENERGY_FIGSIZE[1] * DPI))


def test_energy_record_and_pooling():
    eig = torch.tensor([6.0, 3.0, 1.0])
    rec = energy_record(2, [4, 5, 6], "q_proj", eig, 1)
    assert rec["energy_captured"] == pytest.approx(0.6)
    assert rec["energy_curve"] == pytest.approx([0.6, 0.9, 1.0])
    assert (rec["layers"], rec["first_layer"], rec["last_layer"]) == (3, 4, 6)
    other = energy_record(3, [7, 8], "q_proj", torch.tensor([30.0, 0.0]), 1)
    # Pooled over groups: (6 + 30) / (10 + 30).
    assert pooled_energy([rec, other])["q_proj"] == pytest.approx(36 / 40)
    assert pooled_energy([rec])["k_proj"] is None
