"""Looking before paying: `inspect_model` (grouping and atom energy for a range of G, after a short
calibration) and `describe_checkpoint` (what a compressed checkpoint holds). The accounting without weights
(`plan`, `--dry-run`) is `preview.py`'s.

The grouping is `math/grouping.py`'s, the atoms per group `math/accounting.py`'s and the energy `math/pca.py`'s: nothing here
places boundaries or counts atoms by its own rule.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from compressor.api.model_loading import load_model
from compressor.api.run_options import CompressOptions
from compressor.api.session import calibration_token_windows, read_texts, resolve_run
from compressor.checkpoint import read_masa_config
from compressor.math.accounting import atoms_per_group, read_count
from compressor.math.grouping import consecutive_kl, consecutive_runs, group_layers, logit_lens_distributions
from compressor.math.pca import matrix_pca, shared_input_basis_energy
from compressor.modeling.adapters import PROJECTIONS, DecoderAdapter, get_adapter
from compressor.recipes.schema import CompressionSettings
from compressor.report import (
    energy_record,
    format_groups,
    kept_by_type,
    plot_grouping,
    plot_inspect_energy,
    write_json,
)
from compressor.runtime.errors import UserError
from compressor.runtime.progress import progress_bar
from compressor.statistics.capture import collect_block_means

#: `inspect` calibrates on fewer windows than a compression run (the recipe's 64 for smollm2-135m): the
#: grouping and the atom energies need only the block-output means and the weights, and 16 × 512 tokens
#: give a stable KL sequence on the bundled model in a few seconds. `--calib-samples` overrides it.
INSPECT_CALIB_SAMPLES = 16
DEFAULT_GROUP_RANGE = tuple(range(2, 9))

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


def _group_eigenvalues(adapter: DecoderAdapter, groupings, progress: bool) -> dict:
    """Matrix PCA eigenvalues of every distinct multi-layer group's stacked weights, per projection type.
    The same group recurs across G (e.g. [0] and [29]): one eigendecomposition per distinct group."""
    distinct = sorted({tuple(g) for grouping in groupings for g in grouping.groups if len(g) > 1})
    eigenvalues: dict[tuple[tuple[int, ...], str], torch.Tensor] = {}
    with progress_bar("Matrix PCA (groups)", total=len(distinct) * len(PROJECTIONS), enabled=progress) as bar:
        for layers in distinct:
            for proj in PROJECTIONS:
                stacked = torch.stack(
                    [adapter.projection(layer, proj).weight.detach().cpu().double() for layer in layers]
                )
                _, _, eig = matrix_pca(stacked, 0)  # (|g|,) descending; no atoms needed
                eigenvalues[(layers, proj)] = eig.cpu()
                bar.advance()
    return eigenvalues


def input_basis_energy(adapter: DecoderAdapter, run_layers: int) -> dict:
    """For `--sharing basis|qkv|auto`: per run of `run_layers` consecutive layers and projection type, the weight
    energy one shared input basis captures next to each matrix's own basis of the same size (half the rank of
    one matrix), from the weights alone (`pca.shared_input_basis_energy`; the run whitens, and decides by the
    exact whitened errors). A ratio near 1: the layers read a common input subspace, which sharing can use."""
    runs = [r for r in consecutive_runs(adapter.num_layers, run_layers) if len(r) > 1]
    rows = []
    for index, layers in enumerate(runs):
        for proj in PROJECTIONS:
            weights = [adapter.projection(layer, proj).weight for layer in layers]
            size = min(weights[0].shape) // 2
            shared, own = shared_input_basis_energy(weights, size)
            rows.append({"run": index, "layers": layers, "projection": proj, "size": size,
                         "shared": shared, "own": own})  # fmt: skip
    return {"run_layers": run_layers, "rows": rows}


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

    eigenvalues = _group_eigenvalues(adapter, groupings, progress)
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
    input_bases = input_basis_energy(adapter, settings.basis_layers)
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
        "input_bases": input_bases,
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
    options = options or InspectOptions()
    start = time.perf_counter()
    inspected = CompressOptions.from_values(
        {**asdict(options), "calib_samples": options.calib_samples or INSPECT_CALIB_SAMPLES}
    )
    run = resolve_run(model, inspected)
    if run.source.kind == "compressed":
        raise UserError(
            f"'{model}' is a masa-compress checkpoint: inspect the original model, or run `masa-compress show {model}`"
        )
    calibration, settings = run.calibration, run.compression
    text, _ = read_texts(run, evaluate=False, allow_overlap=True)
    t = time.perf_counter()
    loaded = load_model(run.source, device=device, dtype=dtype, progress=progress)
    load_seconds = time.perf_counter() - t
    adapter = get_adapter(loaded.model)
    windows = calibration_token_windows(loaded.tokenizer, calibration, text)
    block_means, calib_seconds = collect_block_means(adapter, windows, options.batch_size, progress)
    result = inspect_statistics(adapter, block_means, settings, options.group_counts, progress)
    result["seconds"] = {
        "load": round(load_seconds, 3),
        "calibration": round(calib_seconds, 3),
        **result["seconds"],
        "total": round(time.perf_counter() - start, 3),
    }
    return {
        "model": run.source.describe(),
        "recipe": run.recipe_name,
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
# show


def _shared_bases(layout: dict) -> list[dict]:
    """Each input basis a run of layers shares: its run, the projection types reading it and its size."""
    bases: dict[tuple, dict] = {}
    for spec in layout.get("projections", []):
        if spec["mode"] == "basis":
            row = bases.setdefault((spec["group"], spec["basis"]), {
                "group": spec["group"], "basis": spec["basis"], "size": spec["rank"], "layers": [], "projections": [],
            })  # fmt: skip
            row["layers"] = sorted(set(row["layers"]) | {spec["layer"]})
            row["projections"] = sorted(set(row["projections"]) | {spec["projection"]})
    return list(bases.values())


def describe_checkpoint(path: str) -> dict:
    """What a compressed checkpoint holds, from its `masa_config.json` (no weights are read)."""
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
        row[f"{spec['projection']}_mode"] = spec["mode"]
        if spec["mode"] != "dense":  # a layer is `dense` only when all its projections are kept whole
            row["mode"] = spec["mode"] if row["mode"] in ("dense", spec["mode"]) else "mixed"
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
        "ratio_requested": counts.get("ratio_requested", plan.get("ratio_requested")),  # of the targets
        # What the user asked for (`--ratio R --ratio-of model`): absent from checkpoints written before it.
        "ratio_of": meta.get("ratio_of"),
        "user_ratio": meta.get("ratio_requested"),
        "achieved_ratio": counts.get("achieved_ratio"),
        "targets": counts.get("targets", list(PROJECTIONS)),  # checkpoints before --targets: attention
        "target_params_before": read_count(counts, "target_params_before"),  # also from checkpoints of 0.1
        "target_params_after": read_count(counts, "target_params_after"),
        "total_params": counts.get("total_params"),
        "groups": layout.get("groups", []),
        "shared_bases": _shared_bases(layout),
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
        "kept_by_type": kept_by_type(plan["projections"]) if plan.get("projections") else [],
    }
