"""`plan`: the exact parameter accounting of a run from the model config alone (no weights, no statistics).

Nothing here counts parameters or applies a rule of its own: it asks the run's method for its plan
(`Method.plan`) and the run's allocator for its starting ranks, on *assumed* groups where the real ones need
calibration (or on the groups given with `--layout`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from compressor.api.memory_check import memory_estimate
from compressor.api.model_loading import read_config, recipe_config, shapes_recipe
from compressor.api.run_options import CompressOptions
from compressor.api.session import heavy_share_warning, refit_tokens_warning, resolve_run
from compressor.api.time_estimate import time_estimate
from compressor.math.accounting import CompressionPlan, check_ratio, targets_ratio, with_legacy_keys
from compressor.math.grouping import ASSUMED_RULE_ENDS, ASSUMED_RULE_EVEN, assumed_groups, groups_from_layout
from compressor.methods import Method, ModelShape, get_method
from compressor.methods.allocation_policies import PaperAllocator
from compressor.methods.base import COMMON_SETTINGS, bias_projections
from compressor.modeling.adapters import target_projections
from compressor.recipes.schema import CompressionSettings
from compressor.runtime.device import resolve_device
from compressor.runtime.errors import UserError

STATUS_LEGEND = {
    "final": "exact; calibration cannot change it",
    "assumed groups": "exact for the assumed groups; changes only if calibration places the boundaries "
    "elsewhere (pass --layout with the groups `inspect` shows to make it final)",
    "initial ranks": "at Algorithm 1's starting ranks; after calibration each pair (q,k), (o,v) moves rank "
    "along r_a + r_b = const within its pair budget, so the final count lies at most at the bound",
    "bound": "an upper bound: the global allocation decides every rank from the calibration statistics and "
    "spends the residual budget (rounded down to whole ranks)",
}
COUNT_KEYS = ("atoms", "coefficients", "dense_kept", "biases", "residual_budget", "max_ratio")


@dataclass
class RankPreview:
    kind: str
    pair_budgets: list[int] | None
    after_max: int | None  # the most numbers the run can store (None when infeasible)
    status: str  # the status tag of the counts that depend on ranks


def plan_from_config(
    config, ratio: float, settings: CompressionSettings, layout: list[int] | None = None
) -> dict:
    """The exact accounting of compressing a model with this config, without weights or statistics.

    Final: P_attn, the budget, and for the low-rank baselines everything. Given the groups: atoms,
    coefficients, kept singleton weights, biases and the residual budget (final with `layout`, estimates
    with the assumed groups). After calibration: the MASA residual ranks (Algorithm 1 starts from the
    initial ranks reported here and moves rank within each pair along r_a + r_b = const).
    """
    check_ratio(ratio)
    method = get_method(settings.method)
    settings = method.effective_settings(settings)
    shape = ModelShape.from_config(config, target_projections(settings.targets))
    calibrated = method.uses_groups_for(settings)
    groups_of, rule = _preview_groups(method, settings, shape.num_layers, layout)
    try:
        plan, reason = method.plan(shape, settings, ratio, groups_of), None
    except (
        UserError
    ) as err:  # over budget: show the layout anyway, with the reason (atoms > layers stays fatal)
        plan, reason = method.plan(shape, settings, ratio, groups_of, check_feasible=False), str(err)
    allocation = settings.allocation if "allocation" in method.settings_read_for(settings) else None
    preview = _preview_ranks(calibrated, plan, allocation, reason)
    given = "final" if layout or not calibrated else "assumed groups"
    result = {
        "method": method.name,
        "allocation": allocation,
        "ratio_requested": ratio,
        "targets": list(shape.targets),
        "num_layers": shape.num_layers,
        "geometry": asdict(shape.geometry),
        "bias_projections": [p for p in bias_projections(config) if p in shape.targets],
        **_counts(plan, reason, preview, allocated=plan.ranks_allocated() and reason is None),
        "max_ratio": method.largest_ratio(plan, shape),
        "groups": _groups_info(plan, rule, ("layout" if layout else "assumed") if calibrated else "fixed"),
        "ranks": {
            "kind": preview.kind,
            "rows": [] if reason else _rank_rows(plan, preview.pair_budgets),
            "per_layer": _per_layer(plan),
        },  # fmt: skip
        "alternatives": _alternatives(method, shape, settings, ratio) if reason and calibrated else [],
        "notes": _notes(method, settings, plan),
    }
    status = {"target_params_before": "final", "budget": "final", **dict.fromkeys(COUNT_KEYS, given)}
    status |= dict.fromkeys(("residual_params", "target_params_after", "achieved_ratio"), preview.status)
    status["target_params_after_max"] = given
    # Only the numbers shown carry a status.
    result["status"] = {k: v for k, v in status.items() if result.get(k) is not None}
    result["status_legend"] = {k: v for k, v in STATUS_LEGEND.items() if k in result["status"].values()}
    return with_legacy_keys(result)


def _preview_groups(method: Method, settings, n_layers: int, layout: list[int] | None):
    """Groups standing in for the calibrated grouping, and the rule that placed them."""
    if not method.uses_groups_for(settings):
        return None, method.groups_rule(settings)
    if layout:
        groups = groups_from_layout(layout, n_layers)
        return (lambda _n: groups), "given by --layout"
    rule = ASSUMED_RULE_ENDS if settings.end_boundaries else ASSUMED_RULE_EVEN
    if "groups" not in method.settings_read_for(settings):
        rule += "; G: the most groups the budget holds, as the run picks it"
    return (lambda n: assumed_groups(n_layers, n, settings.end_boundaries)), rule


def _preview_ranks(
    calibrated: bool, plan: CompressionPlan, allocation: str | None, reason: str | None
) -> RankPreview:
    """What can be said of the ranks before calibration, by the rule the run's allocator follows (`calibrated`:
    the groups come from calibration, so these are assumed)."""
    given = "assumed groups" if calibrated else "final"
    if reason is not None:
        return RankPreview("none (infeasible)", None, None, given)
    if plan.ranks_allocated():
        kind = ("final given the groups (no residual)" if calibrated
                else "final (the same kept fraction of every matrix; no calibration dependence)")  # fmt: skip
        return RankPreview(kind, None, plan.params_after(), given)
    paper = PaperAllocator()
    split = paper.pair_budgets(plan) if allocation == "paper" else None
    if split is None or not split.layers:
        rule = (f"{allocation} allocation by discarded energy per parameter" if allocation
                else f"{plan.method}'s own search")  # fmt: skip
        return RankPreview(f"after calibration ({rule})", None, plan.budget, "bound")
    ranks = paper.initial_ranks(plan)
    for layer in split.layers:
        for p, r in ranks.items():
            plan.get(layer, p).rank = r
    plan.check_budget()
    kind = "initial ranks (Algorithm 1's start, exact from the budget; calibration moves them)"
    after_max = plan.fixed_params() + len(split.layers) * split.layer_budget
    return RankPreview(kind, list(split.budgets.values()), after_max, "initial ranks")


def _counts(plan: CompressionPlan, reason: str | None, preview: RankPreview, allocated: bool) -> dict:
    counts = plan.to_dict()
    after = plan.params_after() if allocated else None
    if after is None and preview.status == "bound" and reason is None:
        after = preview.after_max
    return {
        "feasible": reason is None,
        "reason": reason,
        "target_params_before": plan.params_before,
        "budget": plan.budget,
        **{k: counts[k] for k in ("atoms", "coefficients", "dense_kept", "biases")},
        "residual_budget": plan.residual_budget(),
        "residual_params": plan.factor_params() if allocated else None,
        "target_params_after": after,
        "target_params_after_max": preview.after_max,
        "achieved_ratio": plan.achieved_ratio() if allocated else None,
    }


def _groups_info(plan: CompressionPlan, rule: str, source: str) -> dict:
    """The plan's groups; `source`: assumed / layout (calibrated groups) or fixed (by a rule of the method)."""
    if not plan.groups:
        return {"source": "none", "rule": rule, "layers": [], "sizes": [], "atoms": []}
    return {
        "source": source,
        "rule": rule,
        "layers": [g.layers for g in plan.groups],
        "sizes": [len(g.layers) for g in plan.groups],
        "atoms": [g.n_atoms for g in plan.groups],
    }


def _per_layer(plan: CompressionPlan) -> list[dict]:
    return [
        {
            "layer": pp.layer,
            "projection": pp.projection,
            "mode": pp.mode,
            "group": pp.group,
            "atoms": pp.n_atoms,
            "rank": pp.rank,
        }  # fmt: skip
        for pp in plan.projections
    ]


def _rank_rows(plan: CompressionPlan, pair_budgets: list[int] | None) -> list[dict]:
    """Per layer: mode, group and the rank of each projection; consecutive identical layers merged."""
    rows: list[dict] = []
    first = plan.targets[0]
    for layer in sorted({pp.layer for pp in plan.projections}):
        pps = {p: plan.get(layer, p) for p in plan.targets}
        # one mode, or each mode the layer's projections use in target order (e.g. basis+lowrank)
        mode = "+".join(dict.fromkeys(pp.mode for pp in pps.values()))
        row = {"layers": [layer], "mode": mode, "group": pps[first].group, "atoms": pps[first].n_atoms,
               **{p: pps[p].rank for p in plan.targets},
               "pair_budgets": pair_budgets if mode != "dense" else None}  # fmt: skip
        last = rows[-1] if rows else None
        same = last and all(last[k] == row[k] for k in ("mode", "group", *plan.targets))
        if same and last["layers"][-1] == layer - 1:
            last["layers"].append(layer)
        else:
            rows.append(row)
    return rows


def _notes(method: Method, settings, plan: CompressionPlan) -> list[str]:
    if "bases" in method.settings_read_for(settings) and any(g.n_atoms for g in plan.groups):
        return [
            "atoms: Matrix PCA returns fewer atoms than asked only for a group whose weights are "
            "linearly dependent (e.g. tied layers); the atom count is otherwise final"
        ]
    return []


def _alternatives(method: Method, shape: ModelShape, settings, ratio: float) -> list[dict]:
    """Group/atom settings whose assumed groups fit the ratio, the closest to the request first."""
    found = []
    for n in range(1, min(shape.num_layers, 8) + 1):
        for bases in (0, 1, 2):
            for ends in (True, False):
                try:
                    groups = assumed_groups(shape.num_layers, n, ends)
                    changed = settings.model_copy(
                        update={
                            "groups": n,
                            "bases": bases,
                            "largest_group_bases": None,
                            "end_boundaries": ends,
                        }
                    )
                    plan = method.plan(shape, changed, ratio, lambda _n, g=groups: g, check_feasible=False)
                except UserError:
                    continue
                max_ratio = method.largest_ratio(plan, shape)
                if max_ratio >= ratio:
                    found.append({"groups": n, "bases": bases, "end_boundaries": ends, "max_ratio": max_ratio,
                                  "layers": groups})  # fmt: skip
    want = (settings.groups, settings.bases, settings.end_boundaries)
    found.sort(
        key=lambda a: (
            a["bases"] != want[1],
            abs(a["groups"] - want[0]),
            a["end_boundaries"] != want[2],
            -a["max_ratio"],
        )  # fmt: skip
    )
    # One suggestion per (bases, end_boundaries) and layout, so the list shows different ways out.
    seen, out = set(), []
    for alt in found:
        key = (alt["bases"], alt["end_boundaries"] if alt["groups"] > 1 else None)
        if key not in seen:
            seen.add(key)
            out.append(alt)
    return out[:4]


def read_model_config(source) -> tuple[object, str]:
    """The transformers config of a resolved model, without reading any weights; and where it came from. A hub
    model whose recipe carries its shapes (the published config values) is planned from those: no network."""
    recipe = shapes_recipe(source)
    if recipe is not None and source.kind == "bundled":
        return recipe_config(
            recipe
        ), f"recipe {recipe.name} (its model's shapes; the model is fetched on first use)"
    if recipe is not None:
        return recipe_config(recipe), f"recipe {recipe.name} (the shapes of {recipe.model}'s config.json)"
    config, location, kwargs = read_config(source)
    return config, (f"{kwargs['gguf_file']} (GGUF metadata)" if "gguf_file" in kwargs else location)


def plan_compression(model: str, options: CompressOptions, layout: list[int] | None = None) -> dict:
    """`plan_from_config` for a model spec, with the options resolved against the recipe exactly as a run
    resolves them (`session.resolve_run`): the same settings, the same refusals, no weights read."""
    if layout:
        probe = resolve_run(model, options)
        if not probe.method.uses_groups_for(probe.compression):
            raise UserError(
                f"--layout gives the sizes of KL groups, which {probe.method.describe(probe.compression)} does "
                "not use: drop --layout, or use --sharing atoms"
            )
        if options.groups is not None and options.groups != len(layout):
            raise UserError(
                f"--groups {options.groups} disagrees with --layout ({len(layout)} groups): pass one of them"
            )
        options = replace(options, groups=len(layout))
    run = resolve_run(model, options)
    if run.compression.auto_groups:
        raise UserError(
            "cannot plan with --auto-groups: G and B are chosen from calibration statistics; "
            "drop --auto-groups (or pass --groups/--bases) to see a plan"
        )
    config, where = read_model_config(run.source)
    model_params = model_parameter_count(config)
    shape = ModelShape.from_config(config, target_projections(run.compression.targets))
    target_params = shape.params_before
    ratio = targets_ratio(
        options.ratio, options.ratio_of, model_params, target_params, run.compression.targets
    )
    result = plan_from_config(config, ratio, run.compression, layout)
    after = result["target_params_after"]
    result["status"] |= {"model_params_before": "final"}
    if after is not None:
        result["status"]["model_params_after"] = result["status"]["target_params_after"]
    return {
        "model": run.source.describe(),
        "recipe": run.recipe_name,
        "config_source": where,
        "settings": run.compression.model_dump(),
        "calibration": run.calibration.model_dump(),
        # Where each setting came from (`option`, `recipe NAME`, `model shapes (REASON)`, `method NAME`, `default`),
        # and the compression settings this method reads with them (the human output shows those).
        "settings_source": {k: run.settings_source[k] for k in ("calibration", "compression")},
        "settings_read": sorted(run.method.settings_read_for(run.compression) | COMMON_SETTINGS),
        **result,
        "ratio_requested": options.ratio,
        "ratio_of": options.ratio_of,
        "targets_ratio": ratio,
        "warning": heavy_share_warning(
            options.ratio, options.ratio_of, ratio, model_params, target_params, run.compression.targets
        ),
        # The run's least-squares refits on fewer calibration tokens per input than they need (None: enough).
        "refit_warning": refit_tokens_warning(
            run.compression, shape, run.calibration.samples, run.calibration.seq_len
        ),
        "model_params_before": model_params,
        # The targets' numbers change, nothing else does (an upper bound where the ranks are).
        "model_params_after": None if after is None else model_params - target_params + after,
        # What the run needs at its peak (fp32 on the CPU, bf16 on a GPU: `--dtype auto`), and what is free now.
        "memory": (
            memory := memory_estimate(config, run, options, gpu=resolve_device("auto").type == "cuda")
        ),
        # How long, stage by stage, on this machine (its rates measured once, cached): of the run that fits.
        "time": planned_time(model, config, run, options, memory),
    }


def planned_time(model: str, config, run, options: CompressOptions, memory: dict) -> dict:
    """`time_estimate` of the run `compress` would make: layer by layer where only that fits in the memory free
    now, said in the estimate (`layerwise`)."""
    gpu = resolve_device("auto").type == "cuda"
    available = memory.get("available_bytes")
    if options.layerwise or available is None or memory["in_memory_bytes"] <= available:
        return time_estimate(config, run, options, gpu=gpu) | {"layerwise": options.layerwise}
    layerwise = replace(options, layerwise=True)
    return time_estimate(config, resolve_run(model, layerwise), layerwise, gpu=gpu) | {"layerwise": True}


def model_parameter_count(config) -> int:
    """The parameters of a model built from `config` (tied embeddings counted once), built on the meta device:
    no memory, no weights."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())
