"""Looking before paying: `inspect_model` (grouping and atom energy for a range of G, after a short
calibration), `plan_compression` (the exact parameter accounting of a run, from the model config alone),
and `describe_checkpoint` (what a compressed checkpoint holds).

The accounting is `plan.py`'s (`shared_plan`, `lowrank_plan`), the grouping `grouping.py`'s and the
energy `pca.py`'s: nothing here counts parameters or places boundaries by its own rule, except the
*assumed* grouping of `plan`, which exists only because the real one needs calibration statistics.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

import torch

from compressor.adapters import PROJECTIONS, AttentionGeometry, DecoderAdapter, geometry_from_config
from compressor.allocation import _initial_ranks
from compressor.errors import UserError
from compressor.grouping import consecutive_kl, contiguous_groups, group_layers, logit_lens_distributions
from compressor.plan import CompressionPlan, layer_dense_params, lowrank_plan, shared_plan
from compressor.recipes.schema import CompressionSettings
from compressor.report import atoms_per_group, energy_record

#: `inspect` calibrates on fewer windows than a compression run (the recipe's 64 for smollm2-135m): the
#: grouping and the atom energies need only the block-output means and the weights, and 16 × 512 tokens
#: give a stable KL sequence on the bundled model in a few seconds. `--calib-samples` overrides it.
INSPECT_CALIB_SAMPLES = 16
DEFAULT_GROUP_RANGE = tuple(range(2, 9))

STATUS_LEGEND = {
    "final": "exact; calibration cannot change it",
    "assumed groups": "exact for the assumed groups; changes only if calibration places the boundaries "
    "elsewhere (pass --layout with the groups `inspect` shows to make it final)",
    "initial ranks": "at Algorithm 1's starting ranks; after calibration each pair (q,k), (o,v) moves rank "
    "along r_a + r_b = const within its pair budget, so the final count lies at most at the bound",
    "bound": "an upper bound: the global allocation decides every rank from the calibration statistics and "
    "spends the residual budget (rounded down to whole ranks)",
}

ASSUMED_RULE_ENDS = (
    "assumed, not measured (the real groups need calibration: see `masa-compress inspect`): end boundaries "
    "allowed, so the first two boundaries go to the first and last transitions, where the bundled model's KL "
    "peaks (first and last layers kept whole), and the rest split the middle evenly"
)
ASSUMED_RULE_EVEN = (
    "assumed, not measured (the real groups need calibration: see `masa-compress inspect`): end boundaries "
    "excluded, so G nearly equal consecutive groups"
)


# ------------------------------------------------------------------------------------------------------
# inspect


@dataclass
class InspectOptions:
    """What `inspect` can be told; None means "the recipe's value" (calibration samples: 16)."""

    group_counts: tuple[int, ...] = DEFAULT_GROUP_RANGE
    bases: int | None = None
    largest_group_bases: int | None = None
    end_boundaries: bool | None = None
    logit_lens: str | None = None
    calib: str | None = None
    calib_samples: int | None = None
    seq_len: int | None = None
    seed: int | None = None
    recipe_file: str | None = None
    batch_size: int = 1


def parse_group_counts(text: str) -> tuple[int, ...]:
    """'2-8' or '3,4,6' (or a mix, '2-4,6') → sorted unique group counts."""
    counts: set[int] = set()
    try:
        for part in text.replace(" ", "").split(","):
            if "-" in part:
                lo, hi = (int(v) for v in part.split("-", 1))
                counts.update(range(lo, hi + 1))
            elif part:
                counts.add(int(part))
    except ValueError:
        raise UserError(f"--groups '{text}' is not a list of group counts: write e.g. 2-8 or 3,4,6") from None
    if not counts or min(counts) < 1:
        raise UserError(f"--groups '{text}' must name group counts of at least 1: write e.g. 2-8 or 3,4,6")
    return tuple(sorted(counts))


@torch.no_grad()
def collect_block_means(
    adapter: DecoderAdapter, windows: torch.Tensor, batch_size: int = 1, progress: bool = True
) -> tuple[torch.Tensor, float]:
    """The token-mean of every block's output per window, `(L, N, hidden)` fp32, and the seconds taken.

    The same numbers as `capture.collect_statistics(...).block_output_means`, without what grouping does
    not need: the q/k/v and o_proj autocorrelations (fp64 Grams, ~40% of a CPU calibration) and the
    unembedding of every position (the decoder runs without the LM head).
    """
    from compressor.progress import progress_bar

    start = time.perf_counter()
    device = adapter.projection(0, "q_proj").weight.device
    n = windows.shape[0]
    means = torch.zeros(adapter.num_layers, n, adapter.geometry.hidden_size, dtype=torch.float32)
    first = [0]  # the window index of the running batch, read by the hooks

    def hook(i: int):
        def record(module, args, output) -> None:
            hidden = output[0] if isinstance(output, tuple) else output  # (B, T, H)
            means[i, first[0] : first[0] + hidden.shape[0]] = hidden.float().mean(dim=1).cpu()

        return record

    handles = [layer.register_forward_hook(hook(i)) for i, layer in enumerate(adapter.layers)]
    try:
        with progress_bar("Calibration (block outputs)", total=n, enabled=progress) as bar:
            for start_index in range(0, n, batch_size):
                first[0] = start_index
                batch = windows[start_index : start_index + batch_size].to(device)
                adapter.decoder(input_ids=batch, use_cache=False)
                bar.advance(len(batch))
    finally:
        for handle in handles:
            handle.remove()
    return means, time.perf_counter() - start


@torch.no_grad()
def inspect_statistics(
    adapter: DecoderAdapter,
    block_means: torch.Tensor,
    settings: CompressionSettings,
    group_counts: tuple[int, ...] = DEFAULT_GROUP_RANGE,
    progress: bool = False,
) -> dict:
    """From the block-output means `(L, N, hidden)` (see `collect_block_means`): the KL sequence, the groups for every G in `group_counts` (by `grouping.group_layers`, as a
    compression run places them) and, per group and projection type, the weight energy the group's atoms
    capture (Matrix PCA eigenvalues, as `pipeline` computes them). Counts that the model cannot be split
    into (G > layers, or too few allowed transitions) are listed under `skipped` with the reason."""
    from compressor.pca import matrix_pca
    from compressor.progress import progress_bar

    start = time.perf_counter()
    p = logit_lens_distributions(
        block_means,
        adapter.final_norm,
        adapter.unembedding,
        apply_final_norm=settings.logit_lens == "final_norm",
    )
    kl = consecutive_kl(p)
    groupings, skipped = [], []
    for n in group_counts:
        try:
            groupings.append(group_layers(kl, n, end_boundaries=settings.end_boundaries))
        except UserError as err:
            skipped.append({"n_groups": n, "reason": str(err)})
    if not groupings:
        raise UserError(
            f"no requested group count fits this model ({adapter.num_layers} layers): {skipped[0]['reason']}"
        )

    # The same group recurs across G (e.g. [0] and [29]): one eigendecomposition per distinct group.
    distinct = sorted({tuple(g) for grouping in groupings for g in grouping.groups if len(g) > 1})
    eigenvalues: dict[tuple[tuple[int, ...], str], torch.Tensor] = {}
    with progress_bar("Matrix PCA (groups)", total=len(distinct) * len(PROJECTIONS), enabled=progress) as bar:
        for layers in distinct:
            for proj in PROJECTIONS:
                stacked = torch.stack(
                    [adapter.projection(layer, proj).weight.detach().double() for layer in layers]
                )
                _, _, eig = matrix_pca(stacked, 0)  # (|g|,) descending; no atoms needed
                eigenvalues[(layers, proj)] = eig.cpu()
                bar.advance()

    records = []
    for grouping in groupings:
        atoms = atoms_per_group(grouping.groups, settings.bases, settings.largest_group_bases)
        energy = [
            energy_record(g, layers, proj, eigenvalues[(tuple(layers), proj)], min(atoms[g], len(layers)))
            for g, layers in enumerate(grouping.groups)
            if len(layers) > 1
            for proj in PROJECTIONS
        ]
        records.append(
            {
                "n_groups": len(grouping.groups),
                "boundaries": grouping.boundaries,
                "groups": grouping.groups,
                "sizes": grouping.sizes,
                "atoms": atoms,
                "rule": grouping.rule,
                "energy": energy,
            }
        )
    chosen = [r["n_groups"] for r in records]
    return {
        "num_layers": adapter.num_layers,
        "logit_lens": settings.logit_lens,
        "end_boundaries": settings.end_boundaries,
        "bases": settings.bases,
        "largest_group_bases": settings.largest_group_bases,
        "singletons": settings.singletons,
        # The energies are those of plain Matrix PCA (the weights' own energy); with `atoms: whitened` a
        # run picks atoms for the output error instead, which needs the autocorrelations.
        "atoms_method": settings.atoms,
        "kl": kl.tolist(),
        "highlight": settings.groups if settings.groups in chosen else chosen[0],
        "groupings": records,
        "skipped": skipped,
        "seconds": {"grouping_and_pca": round(time.perf_counter() - start, 3)},
    }


def inspect_model(
    model: str,
    options: InspectOptions | None = None,
    device: str = "auto",
    dtype: str = "auto",
    progress: bool = True,
) -> dict:
    """Calibrate MODEL briefly and return `inspect_statistics` with the model and calibration described."""
    from compressor.adapters import get_adapter
    from compressor.api import CompressOptions, resolve_run_settings
    from compressor.calibration.sources import load_documents
    from compressor.calibration.windows import bos_token_id_for, calibration_windows, tokenize_documents
    from compressor.models import load_model, resolve_model
    from compressor.recipes.schema import load_recipe_file

    options = options or InspectOptions()
    start = time.perf_counter()
    recipe = load_recipe_file(options.recipe_file) if options.recipe_file else None
    source = resolve_model(model, recipe)
    recipe = recipe or source.recipe
    if source.kind == "compressed":
        raise UserError(
            f"'{model}' is a masa-compress checkpoint: inspect the original model, or run `masa-compress show {model}`"
        )
    calibration, _, settings = resolve_run_settings(
        CompressOptions(
            bases=options.bases,
            largest_group_bases=options.largest_group_bases,
            end_boundaries=options.end_boundaries,
            logit_lens=options.logit_lens,
            calib=options.calib,
            calib_samples=options.calib_samples or INSPECT_CALIB_SAMPLES,
            seq_len=options.seq_len,
            seed=options.seed,
        ),
        recipe,
    )
    text = load_documents(calibration.source, split="calibration")
    t = time.perf_counter()
    loaded = load_model(source, device=device, dtype=dtype, progress=progress)
    load_seconds = time.perf_counter() - t
    adapter = get_adapter(loaded.model)
    ids = tokenize_documents(loaded.tokenizer, text.documents)
    windows = calibration_windows(
        ids,
        calibration.samples,
        calibration.seq_len,
        calibration.seed,
        bos_id=bos_token_id_for(loaded.tokenizer),
    )
    block_means, calib_seconds = collect_block_means(adapter, windows, options.batch_size, progress)
    result = inspect_statistics(adapter, block_means, settings, options.group_counts, progress)
    result["seconds"] = {
        "load": round(load_seconds, 3),
        "calibration": round(calib_seconds, 3),
        **result["seconds"],
        "total": round(time.perf_counter() - start, 3),
    }
    return {
        "model": source.describe(),
        "recipe": recipe.name if recipe else None,
        "calibration": {
            **calibration.model_dump(),
            "text": text.name,
            "fingerprint": text.fingerprint,
            "tokens": int(windows.numel()),
        },
        "device": str(loaded.device),
        "dtype": str(loaded.dtype).removeprefix("torch."),
        **result,
    }


def write_inspect_outputs(out_dir, inspection: dict) -> list:
    """`inspect.json`, `grouping.png` (KL with the highlighted G's boundaries, and the groups of every G)
    and `energy.png` (energy per group for the highlighted G; pooled energy vs G)."""
    from pathlib import Path

    from compressor.report import format_groups, plot_grouping, plot_inspect_energy, write_json

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    chosen = next(g for g in inspection["groupings"] if g["n_groups"] == inspection["highlight"])
    title = f"{inspection.get('model', '')} · logit lens {inspection['logit_lens']} · G={chosen['n_groups']}: {format_groups(chosen['groups'])}"
    paths = [write_json(out / "inspect.json", inspection)]
    paths.append(
        plot_grouping(
            out / "grouping.png",
            inspection["kl"],
            chosen["boundaries"],
            chosen["groups"],
            title,
            group_maps=[(g["n_groups"], g["groups"]) for g in inspection["groupings"]],
            highlight=inspection["highlight"],
        )
    )
    if any(e["atoms"] > 0 for g in inspection["groupings"] for e in g["energy"]):
        paths.append(plot_inspect_energy(out / "energy.png", inspection, inspection.get("model", "")))
    return paths


# ------------------------------------------------------------------------------------------------------
# plan


@dataclass
class PlanOptions:
    """What `plan` can be told; None means "the recipe's value"."""

    method: str | None = None
    groups: int | None = None
    bases: int | None = None
    largest_group_bases: int | None = None
    end_boundaries: bool | None = None
    allocation: str | None = None
    singletons: str | None = None
    layout: list[int] | None = None  # group sizes, first to last; replaces the assumed groups
    recipe_file: str | None = None


def bias_projections(config) -> tuple[str, ...]:
    """Projections with a bias: Qwen2 has q/k/v biases by construction; the other supported families
    have them on all four exactly when `attention_bias` is set."""
    if getattr(config, "model_type", None) == "qwen2":
        return ("q_proj", "k_proj", "v_proj")
    return PROJECTIONS if getattr(config, "attention_bias", False) else ()


def biases_from_config(config, geometry: AttentionGeometry) -> dict[tuple[int, str], int]:
    return {
        (layer, p): geometry.shape(p)[0]
        for layer in range(config.num_hidden_layers)
        for p in bias_projections(config)
    }


def assumed_groups(n_layers: int, n_groups: int, end_boundaries: bool) -> list[list[int]]:
    """A grouping for planning without statistics (see ASSUMED_RULE_ENDS / ASSUMED_RULE_EVEN)."""
    if not 1 <= n_groups <= n_layers:
        raise UserError(
            f"--groups {n_groups} is impossible for a model with {n_layers} layers: use 1..{n_layers}"
        )
    if n_groups == 1:
        return [list(range(n_layers))]
    if end_boundaries:
        if n_groups == 2:
            return [[0], list(range(1, n_layers))]
        middle = contiguous_groups(n_layers - 2, n_groups - 2)
        return [[0], *([layer + 1 for layer in g] for g in middle), [n_layers - 1]]
    if n_groups - 1 > n_layers - 3:
        raise UserError(
            f"--groups {n_groups} needs {n_groups - 1} boundaries but only {max(0, n_layers - 3)} transitions may "
            "be boundaries (end boundaries excluded): use fewer groups"
        )
    groups = contiguous_groups(n_layers, n_groups)
    if len(groups[0]) > 1 and len(groups[-1]) > 1:
        return groups
    middle = contiguous_groups(n_layers - 4, n_groups - 2)
    return [[0, 1], *([layer + 2 for layer in g] for g in middle), [n_layers - 2, n_layers - 1]]


def groups_from_layout(sizes: list[int], n_layers: int) -> list[list[int]]:
    if any(s < 1 for s in sizes) or sum(sizes) != n_layers:
        raise UserError(
            f"--layout {','.join(map(str, sizes))} must be positive group sizes summing to the {n_layers} layers"
        )
    groups, start = [], 0
    for s in sizes:
        groups.append(list(range(start, start + s)))
        start += s
    return groups


def _shared_counts(
    method, ratio, before, geometry, groups, bases, largest, biases, compress_singletons: bool = False
) -> tuple[CompressionPlan | None, str | None]:
    """`shared_plan` for these groups, also when the ratio is infeasible (then with the reason): the fixed
    counts do not depend on the ratio. None when the atoms requested exceed a group's size."""
    args = (before, geometry, groups, bases, largest, biases)
    try:
        return shared_plan(method, ratio, *args, compress_singletons=compress_singletons), None
    except UserError as err:
        reason = str(err)
    try:
        plan = shared_plan(method, 0.0, *args, compress_singletons=compress_singletons)
    except UserError as err:
        return None, str(err)
    plan.ratio = ratio
    return plan, reason


def initial_pair_ranks(plan: CompressionPlan) -> dict:
    """The start of Algorithm 1, exactly as `pipeline._allocate_paper` computes it from the residual
    budget: the same budget per compressed layer, split between (Q,K) and (O,V) by dense size, and within
    each pair equal budget fractions (`allocation._initial_ranks`)."""
    layers = sorted({pp.layer for pp in plan.projections if pp.mode != "dense"})
    if not layers:
        return {"layers": [], "pairs": {}}
    geometry = plan.geometry
    size = {p: math.prod(geometry.shape(p)) for p in PROJECTIONS}
    layer_budget = plan.residual_budget() // len(layers)
    qk_budget = layer_budget * (size["q_proj"] + size["k_proj"]) // layer_dense_params(geometry)
    pairs = {("q_proj", "k_proj"): qk_budget, ("o_proj", "v_proj"): layer_budget - qk_budget}
    ranks = {}
    for (a, b), budget in pairs.items():
        ranks[a], ranks[b] = _initial_ranks(geometry.shape(a), geometry.shape(b), budget)
    return {
        "layers": layers,
        "layer_budget": layer_budget,
        "pair_budgets": [qk_budget, layer_budget - qk_budget],
        "ranks": ranks,
    }


def _rank_rows(plan: CompressionPlan, pair_budgets: list[int] | None) -> list[dict]:
    """Per layer: mode, group and the rank of each projection; consecutive identical layers merged."""
    rows: list[dict] = []
    for layer in sorted({pp.layer for pp in plan.projections}):
        pps = {p: plan.get(layer, p) for p in PROJECTIONS}
        mode = pps["q_proj"].mode
        row = {
            "layers": [layer],
            "mode": mode,
            "group": pps["q_proj"].group,
            "atoms": pps["q_proj"].n_atoms,
            **{p: pps[p].rank for p in PROJECTIONS},
            "pair_budgets": pair_budgets if mode != "dense" else None,
        }
        last = rows[-1] if rows else None
        if (
            last
            and all(last[k] == row[k] for k in ("mode", "group", *PROJECTIONS))
            and last["layers"][-1] == layer - 1
        ):
            last["layers"].append(layer)
        else:
            rows.append(row)
    return rows


def _alternatives(
    method, ratio, before, geometry, n_layers, biases, want: tuple[int, int, bool], compress_singletons: bool
) -> list[dict]:
    """Group/atom settings whose assumed groups fit the ratio, the closest to the request first."""
    found = []
    for n in range(1, min(n_layers, 8) + 1):
        for bases in (0, 1, 2):
            for ends in (True, False):
                try:
                    groups = assumed_groups(n_layers, n, ends)
                except UserError:
                    continue
                plan, _ = _shared_counts(
                    method, 0.0, before, geometry, groups, bases, None, biases, compress_singletons
                )
                if plan is None:
                    continue
                max_ratio = 1.0 - plan.fixed_params() / before
                if max_ratio >= ratio:
                    found.append(
                        {
                            "groups": n,
                            "bases": bases,
                            "end_boundaries": ends,
                            "max_ratio": max_ratio,
                            "layers": groups,
                        }
                    )
    g0, b0, e0 = want
    found.sort(
        key=lambda a: (a["bases"] != b0, abs(a["groups"] - g0), a["end_boundaries"] != e0, -a["max_ratio"])
    )
    # One suggestion per (bases, end_boundaries) and layout, so the list shows different ways out.
    seen, out = set(), []
    for alt in found:
        key = (alt["bases"], alt["end_boundaries"] if alt["groups"] > 1 else None)
        if key not in seen:
            seen.add(key)
            out.append(alt)
    return out[:4]


def plan_from_config(
    config, ratio: float, settings: CompressionSettings, layout: list[int] | None = None
) -> dict:
    """The exact accounting of compressing a model with this config, without weights or statistics.

    Final: P_attn, the budget, and for the low-rank baselines everything. Given the groups: atoms,
    coefficients, kept singleton weights, biases and the residual budget (final with `layout`, estimates
    with the assumed groups). After calibration: the MASA residual ranks (Algorithm 1 starts from the
    initial ranks reported here and moves rank within each pair along r_a + r_b = const).
    """
    from compressor.pipeline import METHODS, PAPER_SETTINGS

    if settings.method == "masa-paper":
        settings = settings.model_copy(update=PAPER_SETTINGS)
    if not 0.0 < ratio < 1.0:
        raise UserError(
            f"--ratio {ratio:g} is outside (0, 1): it is the fraction of attention parameters removed"
        )
    if settings.method not in METHODS:
        raise UserError(f"unknown --method '{settings.method}': use one of {', '.join(METHODS)}")
    n_layers = config.num_hidden_layers
    geometry = geometry_from_config(config)
    biases = biases_from_config(config, geometry)
    before = n_layers * layer_dense_params(geometry) + sum(biases.values())
    method = settings.method
    notes: list[str] = []
    result: dict = {
        "method": method,
        "allocation": settings.allocation if method in ("masa", "masa-paper") else None,
        "ratio_requested": ratio,
        "num_layers": n_layers,
        "geometry": asdict(geometry),
        "bias_projections": list(bias_projections(config)),
    }
    reason = None
    if method in ("svd-llm", "svd"):
        plan = lowrank_plan(method, ratio, before, geometry, n_layers, biases)
        groups_info = {
            "source": "none",
            "rule": "no groups: every projection low rank",
            "layers": [],
            "sizes": [],
            "atoms": [],
        }
        ranks_kind = "final (the same kept fraction of every matrix; no calibration dependence)"
        rank_rows = _rank_rows(plan, None)
        after_max = plan.attention_params_after()
    else:
        source = "layout" if layout else "assumed"
        if layout:
            groups = groups_from_layout(layout, n_layers)
            rule = "given by --layout"
        elif method == "shared-mean":
            groups = None
            rule = ""
        else:
            groups = assumed_groups(n_layers, settings.groups, settings.end_boundaries)
            rule = ASSUMED_RULE_ENDS if settings.end_boundaries else ASSUMED_RULE_EVEN
        if method == "shared-mean":
            plan, groups, reason = _shared_mean_plan(
                method, ratio, before, geometry, n_layers, biases, groups, settings.end_boundaries
            )
            rule = rule or (
                "assumed, not measured: the most groups the budget holds (as shared-mean picks them), placed "
                + (
                    "with the first and last layers singletons, the rest even"
                    if settings.end_boundaries
                    else "as nearly equal consecutive groups"
                )
            )
            bases, largest = 1, None
        else:
            bases, largest = settings.bases, settings.largest_group_bases
            plan, reason = _shared_counts(
                method,
                ratio,
                before,
                geometry,
                groups,
                bases,
                largest,
                biases,
                settings.singletons == "compress",
            )
        if plan is None:  # more atoms than layers in a group: nothing to count
            raise UserError(reason)
        groups_info = {
            "source": source,
            "rule": rule,
            "layers": groups,
            "sizes": [len(g) for g in groups],
            "atoms": [g.n_atoms for g in plan.groups],
        }
        initial = initial_pair_ranks(plan) if reason is None else {"layers": []}
        after_max = None
        if reason is not None:
            ranks_kind = "none (infeasible)"
            rank_rows = []
        elif method == "shared-mean":
            ranks_kind = "final given the groups (no residual)"
            rank_rows = _rank_rows(plan, None)
            after_max = plan.attention_params_after()
        elif settings.allocation != "paper" or not initial["layers"]:
            ranks_kind = (
                f"after calibration ({settings.allocation} allocation by discarded energy per parameter)"
            )
            rank_rows = _rank_rows(plan, None)
            after_max = plan.budget
        else:
            for layer in initial["layers"]:
                for p, r in initial["ranks"].items():
                    plan.get(layer, p).rank = r
            plan.check_budget()
            ranks_kind = "initial ranks (Algorithm 1's start, exact from the budget; calibration moves them)"
            rank_rows = _rank_rows(plan, initial["pair_budgets"])
            after_max = plan.fixed_params() + len(initial["layers"]) * initial["layer_budget"]
        if method in ("masa", "masa-paper") and bases > 0:
            notes.append(
                "atoms: Matrix PCA returns fewer atoms than asked only for a group whose weights are "
                "linearly dependent (e.g. tied layers); the atom count is otherwise final"
            )
    allocated = plan.ranks_allocated() and reason is None
    counts = plan.to_dict()
    fixed = plan.fixed_params()
    # Short status tags (explained by STATUS_LEGEND): what calibration can still change.
    given = "final" if layout or method in ("svd-llm", "svd") else "assumed groups"
    status = {"attention_params_before": "final", "budget": "final"}
    status |= dict.fromkeys(
        ("atoms", "coefficients", "dense_kept", "biases", "residual_budget", "max_ratio"), given
    )
    global_ranks = method in ("masa", "masa-paper") and settings.allocation != "paper"
    after = "initial ranks" if method in ("masa", "masa-paper") and settings.allocation == "paper" else given
    after = "bound" if global_ranks else after
    status |= dict.fromkeys(("residual_params", "attention_params_after", "achieved_ratio"), after)
    status["attention_params_after_max"] = given
    result |= {
        "feasible": reason is None,
        "reason": reason,
        "attention_params_before": before,
        "budget": plan.budget,
        "atoms": counts["atoms"],
        "coefficients": counts["coefficients"],
        "dense_kept": counts["dense_kept"],
        "biases": counts["biases"],
        "residual_budget": plan.residual_budget(),
        "residual_params": plan.factor_params() if allocated else None,
        "attention_params_after": plan.attention_params_after()
        if allocated
        else (after_max if global_ranks and reason is None else None),
        "attention_params_after_max": after_max if reason is None else None,
        "achieved_ratio": plan.achieved_ratio() if allocated else None,
        "max_ratio": 1.0 - fixed / before,
        "groups": groups_info,
        "ranks": {
            "kind": ranks_kind,
            "rows": rank_rows,
            "per_layer": [
                {
                    "layer": pp.layer,
                    "projection": pp.projection,
                    "mode": pp.mode,
                    "group": pp.group,
                    "atoms": pp.n_atoms,
                    "rank": pp.rank,
                }
                for pp in plan.projections
            ],
        },
        "alternatives": [],
        "notes": notes,
    }
    # Only the numbers shown carry a status.
    result["status"] = {k: v for k, v in status.items() if result.get(k) is not None}
    result["status_legend"] = {k: v for k, v in STATUS_LEGEND.items() if k in result["status"].values()}
    if reason is not None and method in ("masa", "masa-paper"):
        result["alternatives"] = _alternatives(
            method,
            ratio,
            before,
            geometry,
            n_layers,
            biases,
            (settings.groups, settings.bases, settings.end_boundaries),
            settings.singletons == "compress",
        )
    return result


def _shared_mean_plan(method, ratio, before, geometry, n_layers, biases, groups, end_boundaries):
    """`pipeline.compress_shared_mean`'s search (the most groups the budget holds) on assumed groups."""

    def candidate(layers):
        plan, reason = _shared_counts(method, ratio, before, geometry, layers, 1, None, biases)
        if plan is not None:
            for pp in plan.projections:
                if pp.mode == "shared":
                    pp.rank = 0
        return plan, reason

    if groups is not None:
        plan, reason = candidate(groups)
        if reason is None and plan.attention_params_after() > plan.budget:
            reason = f"--ratio {ratio:g} is infeasible for shared-mean with these groups"
        return plan, groups, reason
    for n in range(n_layers, 0, -1):
        try:
            layers = assumed_groups(n_layers, n, end_boundaries)
        except UserError:
            continue
        plan, reason = candidate(layers)
        if reason is None and plan.attention_params_after() <= plan.budget:
            return plan, layers, None
    layers = [list(range(n_layers))]
    plan, _ = candidate(layers)
    return plan, layers, f"--ratio {ratio:g} is infeasible for shared-mean: even one group exceeds the budget"


def read_model_config(source) -> tuple[object, str]:
    """The transformers config of a resolved model, without reading any weights; and where it came from."""
    from compressor.models import read_config

    config, location, kwargs = read_config(source)
    return config, (f"{kwargs['gguf_file']} (GGUF metadata)" if "gguf_file" in kwargs else location)


def plan_compression(model: str, ratio: float, options: PlanOptions | None = None) -> dict:
    """`plan_from_config` for a model spec, with the recipe's settings under the options."""
    from compressor.api import CompressOptions, resolve_run_settings
    from compressor.models import resolve_model
    from compressor.recipes.schema import load_recipe_file

    options = options or PlanOptions()
    if not 0.0 < ratio < 1.0:
        raise UserError(
            f"--ratio {ratio:g} is outside (0, 1): it is the fraction of attention parameters removed"
        )
    recipe = load_recipe_file(options.recipe_file) if options.recipe_file else None
    source = resolve_model(model, recipe)
    recipe = recipe or source.recipe
    groups = options.groups
    if options.layout:
        if groups is not None and groups != len(options.layout):
            raise UserError(
                f"--groups {groups} disagrees with --layout ({len(options.layout)} groups): pass one of them"
            )
        groups = len(options.layout)
    _, _, settings = resolve_run_settings(
        CompressOptions(
            ratio=ratio,
            method=options.method,
            groups=groups,
            bases=options.bases,
            largest_group_bases=options.largest_group_bases,
            end_boundaries=options.end_boundaries,
            allocation=options.allocation,
            singletons=options.singletons,
        ),
        recipe,
    )
    config, where = read_model_config(source)
    result = plan_from_config(config, ratio, settings, options.layout)
    return {
        "model": source.describe(),
        "recipe": recipe.name if recipe else None,
        "config_source": where,
        "settings": settings.model_dump(),
        **result,
    }


# ------------------------------------------------------------------------------------------------------
# show


def describe_checkpoint(path: str) -> dict:
    """What a compressed checkpoint holds, from its `masa_config.json` (no weights are read)."""
    from pathlib import Path

    from compressor.checkpoint import read_masa_config

    config = read_masa_config(path)
    meta = config.get("metadata") or {}
    counts = config.get("counts") or {}
    plan = config.get("plan") or {}
    layout = config["layout"]
    settings = meta.get("settings") or {}
    by_layer: dict[int, dict] = {}
    for spec in layout.get("projections", []):
        row = by_layer.setdefault(
            spec["layer"], {"layer": spec["layer"], "mode": spec["mode"], "group": spec.get("group")}
        )
        row[spec["projection"]] = spec.get("rank")
        row[f"{spec['projection']}_atoms"] = spec.get("n_atoms", 0)
    files = config.get("files") or {}
    grouping = (meta.get("report") or {}).get("grouping") or {}
    return {
        "path": str(Path(path).resolve()),
        "created": config.get("created"),
        "tool": f"{config.get('tool', 'masa-compress')} {config.get('tool_version', '?')}",
        "format_version": config["format_version"],
        "source": meta.get("source") or meta.get("model"),
        "model": meta.get("model"),
        "recipe": meta.get("recipe"),
        "base_architecture": layout.get("base_architecture"),
        "method": meta.get("method") or plan.get("method"),
        "ratio_requested": counts.get("ratio_requested", plan.get("ratio_requested")),
        "achieved_ratio": counts.get("achieved_ratio"),
        "targets": counts.get("targets", list(PROJECTIONS)),  # checkpoints before --targets: attention
        "attention_params_before": counts.get("attention_params_before"),
        "attention_params_after": counts.get("attention_params_after"),
        "total_params": counts.get("total_params"),
        "groups": layout.get("groups", []),
        "grouping_rule": grouping.get("rule"),
        "logit_lens": grouping.get("logit_lens"),
        "ranks": [by_layer[k] for k in sorted(by_layer)],
        "calibration": settings.get("calibration"),
        "compression": settings.get("compression"),
        "ppl_before": meta.get("ppl_before"),
        "ppl_after": meta.get("ppl_after"),
        "device": meta.get("device"),
        "dtype": (config.get("base_config") or {}).get("dtype"),
        "seconds": (meta.get("seconds") or {}).get("total"),
        "files": {name: info.get("bytes") for name, info in files.items()},
        "weights_bytes": sum(info.get("bytes", 0) for info in files.values()),
    }
