"""Records shared by the terminal, JSON and pictures: group labels, Matrix PCA energy per group, JSON."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import torch

from compressor.math.accounting import NEURON_READER
from compressor.math.pca import captured_energy_fraction
from compressor.modeling.adapters import MLP_PROJECTIONS, PROJECTIONS

ENERGY_CURVE_MAX_ATOMS = 8


def present_projections(rows: Sequence[dict]) -> list[str]:
    """The projection types named in `rows` (attention first, then MLP): what a run compressed."""
    named = {row["projection"] for row in rows}
    return [p for p in (*PROJECTIONS, *MLP_PROJECTIONS) if p in named]


def group_label(layers: Sequence[int]) -> str:
    """`[3]` for a singleton, `[1–28]` for a range of consecutive layers."""
    return f"[{layers[0]}]" if len(layers) == 1 else f"[{layers[0]}–{layers[-1]}]"


def format_groups(groups: Sequence[Sequence[int]]) -> str:
    return " ".join(group_label(g) for g in groups)


def basis_label(basis: dict) -> str:
    """`[0–3] k/v 320`: a shared input basis's run of layers, the projection types reading it, and its size."""
    readers = "/".join(p.removesuffix("_proj") for p in basis["projections"])
    return f"{group_label(basis['layers'])} {readers} {basis['size']}"


def energy_record(
    group: int, layers: Sequence[int], projection: str, eigenvalues: torch.Tensor, n_atoms: int
) -> dict:
    """One group's Matrix PCA energy for one projection type (the keys of the pipeline's `atom_energy`,
    plus the layer range, the cumulative curve for 1..8 atoms and the total energy `Σ_l ‖W_l‖_F²`)."""
    n_curve = min(len(layers), ENERGY_CURVE_MAX_ATOMS)
    return {
        "group": group,
        "projection": projection,
        "layers": len(layers),
        "first_layer": layers[0],
        "last_layer": layers[-1],
        "atoms": n_atoms,
        "energy_captured": captured_energy_fraction(eigenvalues, n_atoms),
        "energy_curve": [captured_energy_fraction(eigenvalues, b) for b in range(1, n_curve + 1)],
        "energy_total": float(eigenvalues.sum()),
    }


def pooled_energy(energy: Sequence[dict]) -> dict[str, float | None]:
    """Per projection type, the energy captured over all shared groups together (Σ captured / Σ total)."""
    out: dict[str, float | None] = {}
    for p in dict.fromkeys((*PROJECTIONS, *present_projections(energy))):
        rows = [e for e in energy if e["projection"] == p and e["atoms"] > 0]
        total = sum(e["energy_total"] for e in rows)
        out[p] = sum(e["energy_captured"] * e["energy_total"] for e in rows) / total if total > 0 else None
    return out


def kept_fractions(projections: Sequence[dict]) -> dict[tuple[int, str], float]:
    """Per (layer, projection) of a plan's `projections` (`CompressionPlan.to_dict()`), the numbers it stores
    over its dense weight's: 1 kept whole; rank·(out + in) / (out·in) for own factors; for a reader of a shared
    input basis rank·out plus its share of the basis (rank·in over the readers); for shared atoms its
    coefficients, its share of the atoms and its residual factors; for an MLP keeping neurons, the kept share of
    its neurons; for an attention keeping heads, the kept share of its heads; for kept rows or read columns, their
    share. Biases are left out."""
    readers = Counter((pp["group"], pp["basis"]) for pp in projections if pp["mode"] == "basis")
    sharers = Counter((pp["group"], pp["projection"]) for pp in projections if pp["mode"] == "shared")
    out = {}
    for pp in projections:
        o, i, rank = pp["out_features"], pp["in_features"], pp.get("rank") or 0
        if pp["mode"] == "dense":
            stored = o * i
        elif pp["mode"] == "basis":
            stored = rank * o + rank * i / readers[(pp["group"], pp["basis"])]
        elif pp["mode"] == "neurons":  # the kept neurons' columns of down, rows of gate/up
            stored = rank * (o if pp["projection"] == NEURON_READER else i)
        elif pp["mode"] in ("rows", "columns"):  # MoDeGPT: the kept rows, or the columns read
            stored = rank * (i if pp["mode"] == "rows" else o)
        elif pp["mode"] == "heads":  # the kept heads' rows of q, columns of o (rank: heads per KV head)
            stored = rank * pp["head_block"] * (o if pp["projection"] == "o_proj" else i)
        elif pp["mode"] == "shared":
            atoms = pp["n_atoms"]
            stored = atoms + atoms * o * i / sharers[(pp["group"], pp["projection"])] + rank * (o + i)
        else:
            stored = rank * (o + i)
        out[(pp["layer"], pp["projection"])] = stored / (o * i)
    return out


def kept_by_type(projections: Sequence[dict]) -> list[dict]:
    """Per projection type: the kept fraction of its numbers over all layers, and its least and most kept layer."""
    kept = kept_fractions(projections)
    rows = []
    for p in present_projections(projections):
        mine = [pp for pp in projections if pp["projection"] == p]
        total = sum(kept[(pp["layer"], p)] * pp["out_features"] * pp["in_features"] for pp in mine)
        layers = {pp["layer"]: kept[(pp["layer"], p)] for pp in mine}
        low, high = min(layers, key=layers.get), max(layers, key=layers.get)
        rows.append({
            "projection": p, "kept": total / sum(pp["out_features"] * pp["in_features"] for pp in mine),
            "least_kept_layer": low, "least_kept": layers[low], "most_kept_layer": high, "most_kept": layers[high],
        })  # fmt: skip
    return rows


def write_json(path: Path, obj: object) -> Path:
    """Indented JSON; values JSON cannot hold (paths, dtypes) are written as strings."""
    path = Path(path)
    path.write_text(json.dumps(obj, indent=2, default=str) + "\n", encoding="utf-8")
    return path
