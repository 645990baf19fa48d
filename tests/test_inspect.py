"""inspect / plan / show / recipes: the plan counts what a real compression stores, inspect groups as a run
does, `--json` and the tables carry the same numbers, and recipes reject unknown keys by name."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import random_windows, tiny_config, tiny_model
from PIL import Image

from compressor.api.inspection import inspect_statistics, parse_group_counts
from compressor.api.pipeline import compress_model
from compressor.api.preview import plan_from_config
from compressor.math.accounting import shared_plan
from compressor.math.grouping import assumed_groups, group_layers
from compressor.methods import ModelShape
from compressor.modeling.adapters import MLP_PROJECTIONS, PROJECTIONS, geometry_from_config, get_adapter
from compressor.recipes.schema import CompressionSettings
from compressor.runtime.errors import UserError
from compressor.statistics.capture import collect_block_means, collect_statistics

COUNT_KEYS = (
    "target_params_before",
    "budget",
    "atoms",
    "coefficients",
    "dense_kept",
    "biases",
    "residual_budget",
)


def _compressed(family: str, ratio: float, n_layers: int = 6, **settings):
    """A compressed tiny model; MASA in its atoms form unless `sharing` is given (plans of KL groups)."""
    if settings.get("method", "masa") in ("masa", "masa-paper"):
        settings.setdefault("sharing", "atoms")
    model = tiny_model(family, num_hidden_layers=n_layers)
    adapter = get_adapter(model)
    before = adapter.target_parameter_count()
    windows = random_windows()
    stats = collect_statistics(model, adapter, windows, progress=False)
    outcome = compress_model(
        model, adapter, stats, CompressionSettings(**settings), ratio, progress=False, windows=windows
    )
    return model, before, outcome


def _cli(capsys, *args: str) -> tuple[int, str, str]:
    from compressor.cli import main

    try:
        main(list(args))
        code = 0
    except SystemExit as exc:
        code = exc.code or 0
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# ------------------------------------------------------------------------------------------------------
# plan


@pytest.mark.parametrize(
    "family,largest,singletons",
    [("llama", None, "keep"), ("llama", 2, "keep"), ("qwen2", None, "keep"), ("qwen2", 2, "compress")],
)
def test_plan_counts_equal_the_real_compression(family, largest, singletons):
    ratio = 0.3
    settings = CompressionSettings(
        sharing="atoms", groups=3, largest_group_bases=largest, singletons=singletons, allocation="paper"
    )
    _, before, outcome = _compressed(family, ratio, **settings.model_dump())
    real = outcome.plan
    planned = plan_from_config(
        tiny_config(family, num_hidden_layers=6), ratio, settings, layout=[len(g.layers) for g in real.groups]
    )
    real_counts = real.to_dict()
    assert planned["target_params_before"] == before
    for key in COUNT_KEYS:
        assert planned[key] == real_counts[key], key
    assert planned["groups"]["layers"] == [g.layers for g in real.groups]
    assert planned["feasible"]
    # With known groups the fixed counts are final; the ranks are Algorithm 1's start, exactly.
    assert all(planned["status"][k] == "final" for k in COUNT_KEYS)
    initial = {(s["layer"], tuple(s["pair"])): s["initial"] for s in outcome.report["algorithm1"]}
    by_layer = {(r["layer"], r["projection"]): r["rank"] for r in planned["ranks"]["per_layer"]}
    for (layer, (a, b)), (r_a, r_b) in initial.items():
        assert (by_layer[(layer, a)], by_layer[(layer, b)]) == (r_a, r_b)
    # Algorithm 1 moves rank within each pair's budget: the real count stays under the plan's bound.
    assert real.params_after() <= planned["target_params_after_max"] <= planned["budget"]
    assert planned["target_params_after"] <= planned["target_params_after_max"]


@pytest.mark.parametrize("method", ["svd-llm", "svd"])
def test_low_rank_plans_are_final_and_exact(method):
    _, _, outcome = _compressed("qwen2", 0.4, method=method)
    planned = plan_from_config(
        tiny_config("qwen2", num_hidden_layers=6), 0.4, CompressionSettings(method=method)
    )
    assert planned["target_params_after"] == outcome.plan.params_after()
    assert planned["achieved_ratio"] == pytest.approx(outcome.plan.achieved_ratio())
    assert set(planned["status"].values()) == {"final"}


@pytest.mark.parametrize(
    "family,overrides",
    [("llama", {}), ("llama", {"attention_bias": True}), ("qwen2", {}), ("gemma", {}), ("mistral", {})],
)
def test_geometry_and_biases_from_the_config_match_the_model(family, overrides):
    model = tiny_model(family, num_hidden_layers=2, **overrides)
    adapter = get_adapter(model)
    # The shapes the config implies are the weights' real shapes, attention and MLP.
    geometry = geometry_from_config(model.config)
    for p in (*PROJECTIONS, *MLP_PROJECTIONS):
        assert tuple(adapter.projection(1, p).weight.shape) == geometry.shape(p)
    real = {
        (layer, p): adapter.projection(layer, p).bias.numel()
        for layer in range(2)
        for p in PROJECTIONS
        if adapter.projection(layer, p).bias is not None
    }
    assert ModelShape.from_config(model.config).biases == real


def test_assumed_groups():
    assert assumed_groups(30, 3, True) == [[0], list(range(1, 29)), [29]]
    assert assumed_groups(30, 2, True) == [[0], list(range(1, 30))]
    assert [len(g) for g in assumed_groups(30, 5, True)] == [1, 9, 10, 9, 1]
    for n_layers in range(4, 13):
        for n in range(1, n_layers - 1):
            groups = assumed_groups(n_layers, n, False)
            assert [layer for g in groups for layer in g] == list(range(n_layers))
            assert len(groups) == n
            if n > 1:
                assert len(groups[0]) > 1 and len(groups[-1]) > 1  # no end boundary
    with pytest.raises(UserError, match="boundaries"):
        assumed_groups(6, 5, False)


def test_infeasible_plan_says_what_fits():
    config = tiny_config("llama", num_hidden_layers=6)
    settings = CompressionSettings(sharing="atoms", groups=3, bases=1, singletons="keep")
    planned = plan_from_config(config, 0.9, settings)
    assert not planned["feasible"] and "infeasible" in planned["reason"]
    assert planned["target_params_after"] is None and planned["residual_budget"] < 0
    assert planned["alternatives"]
    geometry = geometry_from_config(config)
    for alt in planned["alternatives"]:
        assert alt["max_ratio"] >= 0.9
        # Each suggestion really fits: the planner accepts it at the requested ratio.
        shared_plan(
            "masa", 0.9, planned["target_params_before"], geometry, alt["layers"], alt["bases"], None, {}
        )


def test_plan_cli_json_parses_and_matches_the_table(tmp_path, capsys):
    tiny_config("qwen2", num_hidden_layers=6).save_pretrained(tmp_path)
    code, out, _ = _cli(
        capsys,
        "plan",
        str(tmp_path),
        "--ratio",
        "0.3",
        "--sharing",
        "atoms",
        "--allocation",
        "paper",
        "--json",
    )
    assert code == 0
    payload = json.loads(out)
    assert payload["feasible"] is True
    assert payload["groups"]["source"] == "assumed"
    for key in ("target_params_before", "target_params_after"):
        assert isinstance(payload[key], int)
    code, table, _ = _cli(
        capsys, "plan", str(tmp_path), "--ratio", "0.3", "--sharing", "atoms", "--allocation", "paper"
    )
    assert code == 0
    for key in (*COUNT_KEYS, "residual_params", "target_params_after", "target_params_after_max"):
        assert f"{payload[key]:,}" in table, key
    for row in payload["ranks"]["rows"]:
        if row["mode"] != "dense":
            assert all(str(row[p]) in table for p in PROJECTIONS)
    assert "assumed" in table and "feasible: yes" in table


def test_plan_cli_infeasible_exits_1_and_layout_is_checked(tmp_path, capsys):
    tiny_config("llama", num_hidden_layers=6).save_pretrained(tmp_path)
    code, out, _ = _cli(
        capsys, "plan", str(tmp_path), "--ratio", "0.9", "--sharing", "atoms", "--groups", "3", "--json"
    )
    assert code == 1 and json.loads(out)["feasible"] is False
    code, out, _ = _cli(
        capsys, "plan", str(tmp_path), "--ratio", "0.3", "--sharing", "atoms", "--layout", "2,2,2", "--json"
    )
    assert code == 0 and json.loads(out)["groups"]["layers"] == [[0, 1], [2, 3], [4, 5]]
    code, _, err = _cli(
        capsys, "plan", str(tmp_path), "--ratio", "0.3", "--sharing", "atoms", "--layout", "2,2"
    )
    assert code == 2 and "summing to the 6 layers" in err


# ------------------------------------------------------------------------------------------------------
# recipes


@pytest.mark.parametrize("command", ["compress", "plan", "inspect"])
def test_unknown_recipe_key_is_rejected_by_name(tmp_path, capsys, command):
    bad = tmp_path / "mine.yaml"
    bad.write_text("name: mine\nmodel: bundled:smollm2-135m\ncompression:\n  groups: 3\n  grups: 4\n")
    code, _, err = _cli(capsys, command, "smollm2-135m", "--recipe", str(bad))
    assert code == 2
    assert "unknown recipe key 'compression.grups'" in err


def test_recipes_lists_aliases_and_keys_with_defaults(capsys):
    code, out, _ = _cli(capsys, "recipes", "--json")
    assert code == 0
    names = {r["name"] for r in json.loads(out)}
    assert {"smollm2-135m", "smollm2-360m", "qwen2.5-1.5b", "llama-3.2-1b"} <= names
    code, out, _ = _cli(capsys, "recipes", "--keys")
    assert code == 0
    for text in (
        "largest_group_bases",
        "end_boundaries: True",
        "samples: 64",
        "num_hidden_layers: (required)",
    ):
        assert text in out


# ------------------------------------------------------------------------------------------------------
# inspect


def test_inspect_groups_and_energy_equal_those_of_a_run():
    model = tiny_model("llama", num_hidden_layers=6)
    adapter = get_adapter(model)
    stats = collect_statistics(model, adapter, random_windows(), progress=False)
    means, _ = collect_block_means(adapter, random_windows(), batch_size=3, progress=False)
    torch.testing.assert_close(means, stats.block_output_means)
    settings = CompressionSettings(sharing="atoms", groups=3)
    result = inspect_statistics(adapter, means, settings, parse_group_counts("2-4,9"))
    assert [g["n_groups"] for g in result["groupings"]] == [2, 3, 4]
    assert [s["n_groups"] for s in result["skipped"]] == [9]
    outcome = compress_model(model, adapter, stats, settings, 0.3, progress=False, windows=random_windows())
    ran = outcome.report["grouping"]
    chosen = next(g for g in result["groupings"] if g["n_groups"] == 3)
    assert result["highlight"] == 3
    assert result["kl"] == pytest.approx(ran["kl"])
    assert chosen["groups"] == ran["groups"] and chosen["boundaries"] == ran["boundaries"]
    real = {(e["group"], e["projection"]): e["energy_captured"] for e in outcome.report["atom_energy"]}
    mine = {(e["group"], e["projection"]): e["energy_captured"] for e in chosen["energy"]}
    assert mine.keys() == real.keys()
    for key, value in real.items():
        assert mine[key] == pytest.approx(value, rel=1e-9)
    # Every G's groups are those group_layers places.
    kl = torch.tensor(result["kl"])
    for g in result["groupings"]:
        assert g["groups"] == group_layers(kl, g["n_groups"]).groups


def test_parse_group_counts():
    assert parse_group_counts("2-4,6") == (2, 3, 4, 6)
    with pytest.raises(UserError):
        parse_group_counts("two")


@pytest.mark.slow
def test_inspect_cli_on_the_bundled_model(tmp_path, capsys):
    out_dir = tmp_path / "inspect"
    code, out, _ = _cli(
        capsys, "inspect", "smollm2-135m", "--calib-samples", "2", "--seq-len", "64", "--groups", "3,5",
        "--out", str(out_dir), "--json",
    )  # fmt: skip
    assert code == 0
    result = json.loads(out)
    assert result["num_layers"] == 30 and len(result["kl"]) == 29
    assert [g["n_groups"] for g in result["groupings"]] == [3, 5]
    assert all(sum(g["sizes"]) == 30 for g in result["groupings"])
    assert json.loads((out_dir / "inspect.json").read_text())["kl"] == result["kl"]
    for name in ("grouping.png", "energy.png"):
        with Image.open(out_dir / name) as image:
            assert image.format == "PNG" and image.size[0] >= 1000 and image.size[1] >= 450
    # --sharing basis/qkv/auto: one input basis per run of 4 layers vs each matrix's own (shared <= own)
    bases = result["input_bases"]
    assert bases["run_layers"] == 4 and len(bases["rows"]) == 8 * 4
    assert all(0.0 < r["shared"] <= r["own"] + 1e-12 <= 1.0 + 1e-12 for r in bases["rows"])


# ------------------------------------------------------------------------------------------------------
# show


def test_show_describes_a_saved_checkpoint(tmp_path, capsys):
    from compressor.checkpoint import save_compressed

    model, _, outcome = _compressed("llama", 0.3, groups=3)
    metadata = {"model": "tiny-llama", "method": "masa", "report": outcome.report,
                "settings": {"compression": CompressionSettings(sharing="atoms", groups=3).model_dump()}}  # fmt: skip
    path = save_compressed(model, outcome.plan, tmp_path / "ckpt", metadata=metadata)
    code, out, _ = _cli(capsys, "show", str(path), "--json")
    assert code == 0
    info = json.loads(out)
    assert [g["layers"] for g in info["groups"]] == [g.layers for g in outcome.plan.groups]
    assert info["target_params_after"] == outcome.plan.params_after()
    ranks = {(r["layer"], p): r[p] for r in info["ranks"] for p in PROJECTIONS}
    assert all(ranks[(pp.layer, pp.projection)] == pp.rank for pp in outcome.plan.projections)
    code, table, _ = _cli(capsys, "show", str(path))
    assert code == 0 and "tiny-llama" in table and f"{info['target_params_after']:,}" in table
    code, _, err = _cli(capsys, "show", str(tmp_path))
    assert code == 2 and "masa_config.json" in err


def test_show_names_each_shared_input_basis_and_its_readers(tmp_path, capsys):
    from compressor.checkpoint import save_compressed

    model, _, outcome = _compressed("llama", 0.3, sharing="basis", basis_layers=4)
    path = save_compressed(model, outcome.plan, tmp_path / "ckpt", metadata={"method": "masa"})
    code, out, _ = _cli(capsys, "show", str(path), "--json")
    assert code == 0
    expected = {(pp.group, pp.basis): pp.rank for pp in outcome.plan.projections if pp.mode == "basis"}
    shown = json.loads(out)["shared_bases"]
    assert expected and {(b["group"], b["basis"]): b["size"] for b in shown} == expected
    for row in shown:
        readers = [pp for pp in outcome.plan.projections if pp.mode == "basis" and pp.group == row["group"]
                   and pp.basis == row["basis"]]  # fmt: skip
        assert row["layers"] == sorted({pp.layer for pp in readers})
    code, table, _ = _cli(capsys, "show", str(path))
    assert code == 0 and "shared input bases" in table and "◇" in table


def test_plan_with_global_allocation_reports_the_bound(tmp_path, capsys):
    tiny_config("llama", num_hidden_layers=6).save_pretrained(tmp_path)
    code, out, _ = _cli(
        capsys, "plan", str(tmp_path), "--ratio", "0.3", "--allocation", "global-relative", "--json"
    )
    payload = json.loads(out)
    assert code == 0 and payload["status"]["target_params_after"] == "bound"
    assert payload["target_params_after"] == payload["target_params_after_max"] <= payload["budget"]
