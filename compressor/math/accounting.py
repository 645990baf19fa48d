"""Exact parameter accounting of a compression: what each projection will store. Counts are exact (no
approximation like the paper's eq. 13): atoms (once per group and projection type), per-layer coefficients,
residual factors, shared input bases (once per group and basis), untouched dense weights and biases."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Literal

from compressor.modeling.adapters import PROJECTIONS, ProjectionGeometry
from compressor.runtime.errors import UserError

#: JSON keys renamed once the counts covered the MLP too ("attention" meant the targeted projections); the old
#: names are still written beside the new ones for one release (`with_legacy_keys`) and read from old files.
LEGACY_KEYS = {
    "target_params_before": "attention_params_before",
    "target_params_after": "attention_params_after",
    "target_params_after_max": "attention_params_after_max",
    "non_target_params": "non_attention_params",
}


def with_legacy_keys(record: dict) -> dict:
    """`record` with each renamed key also under its former name (readers of the previous release)."""
    return {**record, **{old: record[new] for new, old in LEGACY_KEYS.items() if new in record}}


def read_count(record: dict, key: str):
    """A count under its current name, or under its former one in a file written before the rename."""
    return record[key] if key in record else record.get(LEGACY_KEYS.get(key, key))


Mode = Literal["dense", "shared", "lowrank", "basis", "neurons", "heads", "rows", "columns"]
#: `rows` / `columns` mode (MoDeGPT): `rank` of the output rows kept (the others zero), or of the input columns read.
#: `neurons` mode: the projection that reads the MLP's neurons (its *input* side is cut); gate/up are cut on
#: their output side. Every projection of one layer's MLP in this mode keeps the same `rank` neurons.
NEURON_READER = "down_proj"
#: `heads` mode: the projection reading the kept heads (its error is the unit's), and the one whose rows are heads.
HEADS_READER, HEADS_ROWS = "o_proj", "q_proj"


@dataclass
class ProjectionPlan:
    layer: int
    projection: str
    out_features: int
    in_features: int
    mode: Mode
    group: int | None = None
    n_atoms: int = 0
    rank: int | None = None  # residual / low-rank rank; None until allocated
    bias: int = 0  # numel of the bias, kept as is
    basis: str | None = None  # `basis` mode: the name of the group's input basis it reads (stored once)
    head_block: int = 0  # `heads` mode: q rows (o columns) of one kept head per KV group: KV heads × head_dim

    @property
    def dense_params(self) -> int:
        return self.out_features * self.in_features

    def params(self) -> int:
        """Numbers stored for this projection, excluding shared atoms and input bases (counted once per group)."""
        if self.mode == "dense":
            return self.dense_params + self.bias
        return self.width_params() + self.fixed_bias() + self.floor_params()

    def fixed_bias(self) -> int:
        """The bias numbers that do not depend on the rank (a kept neuron keeps its own gate/up bias entries, a
        kept head its q bias entries)."""
        rows = self.projection != NEURON_READER if self.mode == "neurons" else self.projection == HEADS_ROWS
        return 0 if (self.mode in ("neurons", "heads") and rows) or self.mode == "rows" else self.bias

    def floor_params(self) -> int:
        """`heads` mode: the numbers of the one head per KV group every layer keeps (rank 1), whatever the rank."""
        return self.head_step() if self.mode == "heads" else 0

    def width_params(self) -> int:
        """The numbers that grow with the rank: low-rank factors, a basis reader's coefficients, or the rows
        (gate/up, with their bias entries) or columns (down) of the neurons kept."""
        rank = self.rank or 0
        if self.mode == "heads":  # the heads beyond the floor's one per KV group
            return max(rank - 1, 0) * self.head_step()
        if self.mode in ("basis", "columns"):
            return rank * self.out_features
        if self.mode == "rows":
            return rank * (self.in_features + (1 if self.bias else 0))
        if self.mode == "neurons":
            if self.projection == NEURON_READER:
                return self.out_features * rank
            return rank * self.in_features + (rank if self.bias else 0)
        return self.n_atoms + rank * (self.out_features + self.in_features)

    def carries_error(self) -> bool:
        """Whether the allocation's tails hold an error of this projection's own: not when kept whole, nor for
        gate/up in `neurons` mode (their MLP's error is measured once, at down_proj's output)."""
        if self.mode == "heads":
            return self.projection == HEADS_READER
        own = self.mode not in ("dense", "rows", "columns")  # rows/columns: sized by MoDeGPT's own rule
        return own and (self.mode != "neurons" or self.projection == NEURON_READER)

    def head_step(self) -> int:
        """`heads` mode: numbers one more kept head per KV group adds (q rows with their bias, or o columns)."""
        if self.projection == HEADS_READER:
            return self.out_features * self.head_block
        return self.head_block * (self.in_features + (1 if self.bias else 0))

    def neuron_step(self) -> int:
        """`neurons` mode: numbers one more kept neuron adds to this projection."""
        if self.projection == NEURON_READER:
            return self.out_features
        return self.in_features + (1 if self.bias else 0)


@dataclass
class GroupPlan:
    index: int
    layers: list[int]
    n_atoms: int  # per projection type; 0 for singletons kept dense

    @property
    def singleton(self) -> bool:
        return len(self.layers) == 1


@dataclass
class CompressionPlan:
    method: str
    ratio: float
    params_before: int
    geometry: ProjectionGeometry
    groups: list[GroupPlan]
    projections: list[ProjectionPlan] = field(default_factory=list)
    # The projection types compressed. "attention" in the counts below means these targets: with
    # `--targets attn,mlp` the budget and the counts cover the MLP projections too.
    targets: tuple[str, ...] = PROJECTIONS
    # `neurons` mode: every layer's MLP keeps the same number of neurons (one allocation unit for all layers)
    uniform_mlp: bool = False
    # `neurons` mode: every MLP width a multiple of this (an allocation step is this many neurons)
    width_multiple: int = 1
    # neurons/heads, once installed: (layer, down_proj/o_proj) -> the original's columns it reads (`layout.kept_mask`)
    kept_inputs: dict[tuple[int, str], list[int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        readers = [pp for pp in self.projections if pp.mode == "neurons" and pp.projection == NEURON_READER]
        for width in sorted({pp.in_features for pp in readers if pp.in_features % self.width_multiple}):
            raise UserError(
                f"--width-multiple {self.width_multiple}: the MLP's width {width} is not a multiple of it: "
                "choose a divisor of it (e.g. 32 or 64)"
            )

    # -- budget --------------------------------------------------------------------------------------
    @property
    def budget(self) -> int:
        """At most (1-ρ)·P_attn numbers may be stored."""
        return math.floor((1.0 - self.ratio) * self.params_before)

    def atom_params(self) -> int:
        """Shared atoms, stored once per group and projection type (singleton groups have none).

        Counted from the projections, since Matrix PCA may return fewer atoms than asked for a
        projection type whose group weights have a lower numerical rank.
        """
        per_group = {(pp.group, pp.projection): pp.n_atoms for pp in self.projections if pp.mode == "shared"}
        return sum(n * math.prod(self.geometry.shape(p)) for (_, p), n in per_group.items())

    def basis_params(self) -> int:
        """Shared input bases (rank × in), stored once per group and basis name."""
        bases = {
            (pp.group, pp.basis): (pp.rank or 0) * pp.in_features
            for pp in self.projections
            if pp.mode == "basis"
        }
        return sum(bases.values())

    def coefficient_params(self) -> int:
        return sum(pp.n_atoms for pp in self.projections if pp.mode == "shared")

    def dense_params(self) -> int:
        return sum(pp.params() for pp in self.projections if pp.mode == "dense")

    def bias_params(self) -> int:
        return sum(pp.fixed_bias() for pp in self.projections if pp.mode != "dense")

    def floor_params(self) -> int:
        """`heads` mode: every layer's one head per KV group (the least a layer keeps)."""
        return sum(pp.floor_params() for pp in self.projections)

    def fixed_params(self) -> int:
        """Everything but the residual / low-rank factors (and the heads beyond the floor)."""
        fixed = self.atom_params() + self.coefficient_params() + self.dense_params() + self.bias_params()
        return fixed + self.floor_params()

    def residual_budget(self) -> int:
        return self.budget - self.fixed_params()

    def factor_params(self) -> int:
        """Low-rank factors: per-projection A and B, and the shared input bases with their per-layer A."""
        per_projection = sum(pp.width_params() - pp.n_atoms for pp in self.projections if pp.mode != "dense")
        return per_projection + self.basis_params()

    def params_after(self) -> int:
        return self.fixed_params() + self.factor_params()

    def achieved_ratio(self) -> float:
        return 1.0 - self.params_after() / self.params_before

    def ranks_allocated(self) -> bool:
        return all(pp.rank is not None for pp in self.projections if pp.mode != "dense")

    def get(self, layer: int, projection: str) -> ProjectionPlan:
        return self._index[(layer, projection)]

    @property
    def _index(self) -> dict[tuple[int, str], ProjectionPlan]:
        return {(pp.layer, pp.projection): pp for pp in self.projections}

    def allocation_units(self) -> dict[tuple, list[ProjectionPlan]]:
        """What the allocation gives one rank each, with the projections that rank applies to: every matrix
        not kept whole, keyed (layer, projection), except the projections reading one shared input basis, which
        share its rank and are keyed ("basis", group, basis name), and the MLP projections in `neurons` mode,
        which share one width per layer, keyed ("mlp", layer), or one for all layers, keyed ("mlp", "all"),
        when `uniform_mlp`; in the order of the projections."""
        units: dict[tuple, list[ProjectionPlan]] = {}
        for pp in self.projections:
            if pp.mode == "basis":
                units.setdefault(("basis", pp.group, pp.basis), []).append(pp)
            elif pp.mode == "neurons":
                units.setdefault(("mlp", "all" if self.uniform_mlp else pp.layer), []).append(pp)
            elif pp.mode == "heads":
                units.setdefault(("heads", pp.layer), []).append(pp)
            elif pp.mode != "dense":
                units[(pp.layer, pp.projection)] = [pp]
        return units

    def check_budget(self) -> None:
        """Raise if the plan stores more than the budget (a bug, never a user error)."""
        after = self.params_after()
        if after > self.budget:
            raise AssertionError(f"plan exceeds its budget: {after} > {self.budget}")

    def to_dict(self) -> dict:
        return with_legacy_keys(
            {
                "method": self.method,
                "ratio_requested": self.ratio,
                "targets": list(self.targets),
                "target_params_before": self.params_before,
                "budget": self.budget,
                "atoms": self.atom_params(),
                "coefficients": self.coefficient_params(),
                "shared_bases": self.basis_params(),
                "dense_kept": self.dense_params(),
                "biases": self.bias_params(),
                "residual_budget": self.residual_budget(),
                "residual_params": self.factor_params() if self.ranks_allocated() else None,
                "target_params_after": self.params_after() if self.ranks_allocated() else None,
                "achieved_ratio": self.achieved_ratio() if self.ranks_allocated() else None,
                "groups": [{"index": g.index, "layers": g.layers, "atoms": g.n_atoms} for g in self.groups],
                "projections": [asdict(pp) for pp in self.projections],
                "uniform_mlp": self.uniform_mlp,
            }
            # only when set: plans (and the checkpoints recording them) written before it read the same
            | ({"width_multiple": self.width_multiple} if self.width_multiple != 1 else {})
        )


def layer_dense_params(geometry: ProjectionGeometry, projections: tuple[str, ...] = PROJECTIONS) -> int:
    return sum(o * i for o, i in (geometry.shape(p) for p in projections))


def atoms_per_group(groups: list[list[int]], bases: int, largest_group_bases: int | None) -> list[int]:
    """The atoms each group gets: singletons none (kept whole or low rank), the largest group (earliest on
    ties) `largest_group_bases` when set, the others `bases`."""
    largest = max(range(len(groups)), key=lambda g: (len(groups[g]), -g))
    special = {largest: largest_group_bases} if largest_group_bases is not None else {}
    return [0 if len(layers) == 1 else special.get(g, bases) for g, layers in enumerate(groups)]


def shared_plan(
    method: str,
    ratio: float,
    params_before: int,
    geometry: ProjectionGeometry,
    groups: list[list[int]],
    bases: int,
    largest_group_bases: int | None,
    biases: dict[tuple[int, str], int],
    compress_singletons: bool = False,
    projections_compressed: tuple[str, ...] = PROJECTIONS,
    check_feasible: bool = True,
    neuron_projections: tuple[str, ...] = (),
    uniform_mlp: bool = False,
    width_multiple: int = 1,
) -> CompressionPlan:
    """MASA layout: singleton groups dense (or low rank); other groups share B atoms per projection type
    plus per-layer residuals; the `neuron_projections` (the MLP's) keep neurons in every layer, whatever its
    group. Refuses a layout whose fixed part exceeds the budget unless `check_feasible` is off (previews show
    such a layout with `infeasibility(plan, ...)` as the reason)."""
    group_plans = []
    projections = []
    for g, (layers, n_atoms) in enumerate(
        zip(groups, atoms_per_group(groups, bases, largest_group_bases), strict=True)
    ):
        if len(layers) > 1 and n_atoms > len(layers):
            raise UserError(
                f"group {g} has {len(layers)} layers but {n_atoms} atoms were requested: use --bases ≤ {len(layers)}"
            )
        group_plans.append(GroupPlan(index=g, layers=layers, n_atoms=n_atoms))
        for layer in layers:
            for p in projections_compressed:
                out, inp = geometry.shape(p)
                if p in neuron_projections:
                    mode: Mode = "neurons"
                elif len(layers) == 1:
                    mode = "lowrank" if compress_singletons else "dense"
                elif n_atoms == 0:
                    mode = "lowrank"
                else:
                    mode = "shared"
                projections.append(
                    ProjectionPlan(
                        layer,
                        p,
                        out,
                        inp,
                        mode,
                        group=g,
                        n_atoms=n_atoms if mode == "shared" else 0,
                        bias=biases.get((layer, p), 0),
                    )
                )
    plan = CompressionPlan(
        method, ratio, params_before, geometry, group_plans, projections, projections_compressed,
        uniform_mlp=uniform_mlp and bool(neuron_projections),
        width_multiple=width_multiple if neuron_projections else 1,
    )  # fmt: skip
    reason = infeasibility(plan, bases)
    if reason and check_feasible:
        raise UserError(reason)
    return plan


def uniform_rank(out_features: int, in_features: int, bias: int, ratio: float) -> int:
    """The rank keeping (1−ρ) of an (out × in) matrix with its bias, which is stored whole and paid out of the
    matrix's own share: the largest r with r·(out + in) + bias ≤ (1−ρ)(out·in + bias), within [0, min(out, in)]."""
    kept = (1.0 - ratio) * (out_features * in_features + bias) - bias
    return max(0, min(min(out_features, in_features), math.floor(kept / (out_features + in_features))))


def lowrank_plan(
    method: str,
    ratio: float,
    params_before: int,
    geometry: ProjectionGeometry,
    n_layers: int,
    biases: dict[tuple[int, str], int],
    projections_compressed: tuple[str, ...] = PROJECTIONS,
) -> CompressionPlan:
    """SVD baselines: every projection low rank, the same kept fraction of each matrix.

    The kept fraction applies to the matrix *with* its bias, which is stored whole: the bias is paid out of
    its own projection's share, so the budget (which counts biases) holds for models with biases too.
    """
    projections = []
    for layer in range(n_layers):
        for p in projections_compressed:
            out, inp = geometry.shape(p)
            bias = biases.get((layer, p), 0)
            rank = uniform_rank(out, inp, bias, ratio)
            projections.append(ProjectionPlan(layer, p, out, inp, "lowrank", rank=rank, bias=bias))
    plan = CompressionPlan(method, ratio, params_before, geometry, [], projections, projections_compressed)
    plan.check_budget()
    return plan


def check_feasible_before_calibration(
    ratio: float,
    params_before: int,
    geometry: ProjectionGeometry,
    n_layers: int,
    groups: int,
    bases: int,
    largest_group_bases: int | None,
    compress_singletons: bool,
    projections_compressed: tuple[str, ...] = PROJECTIONS,
) -> None:
    """Fail before any heavy work when no grouping into `groups` groups can meet the budget.

    The grouping needs calibration, but every group costs at least one layer's worth of numbers when it
    holds atoms (B ≥ 1) or is a singleton kept whole: the cheapest layout gives a lower bound.
    """
    budget = math.floor((1.0 - ratio) * params_before)
    per_layer = layer_dense_params(geometry, projections_compressed)
    fewest_atoms = min(bases, largest_group_bases if largest_group_bases is not None else bases)
    singleton_cost = 0 if compress_singletons else per_layer
    shared_cost = fewest_atoms * per_layer
    if groups >= n_layers:
        lower_bound = n_layers * singleton_cost
    else:  # at least one group holds several layers and shares atoms
        lower_bound = (groups - 1) * min(singleton_cost, shared_cost) + shared_cost
    if lower_bound > budget:
        fitting = budget // per_layer
        raise UserError(
            f"--ratio {ratio:g} is infeasible with {groups} groups and {bases} atom(s): their atoms or whole "
            f"layers alone need at least {lower_bound:,} of the {budget:,} numbers allowed; use --groups ≤ "
            f"{max(fitting, 1)}, --bases 0, or --ratio ≤ {1 - lower_bound / params_before:.3f}"
        )


def infeasibility(plan: CompressionPlan, bases: int) -> str | None:
    """Why a layout cannot meet its budget (its fixed part alone is too large), or None when it can."""
    if plan.residual_budget() >= 0:
        return None
    fixed = plan.fixed_params()
    max_ratio = 1.0 - fixed / plan.params_before
    whole = sorted({pp.layer for pp in plan.projections if pp.mode == "dense"})
    return (
        f"--ratio {plan.ratio:g} is infeasible with {len(plan.groups)} groups ({len(whole)} singleton layers kept "
        f"whole) and {bases} atom(s): atoms, coefficients and whole layers alone need {fixed:,} of the "
        f"{plan.budget:,} numbers allowed; use --ratio ≤ {max_ratio:.3f}, fewer atoms (--bases 0/1), or "
        "groups without singletons (--no-end-boundaries)"
    )


def targets_ratio(ratio: float, ratio_of: str, model_params: int, target_params: int, targets: str) -> float:
    """The fraction of the targeted parameters to remove so that `ratio` of the `ratio_of` parameters go:
    `targets` (the ratio itself) or `model` (every parameter of the model, embeddings included, counted once
    when tied; only the targets shrink, so they lose `ratio · model / targets` of theirs)."""
    check_ratio(ratio)
    if ratio_of == "targets":
        return ratio
    if ratio_of != "model":
        raise UserError(f"--ratio-of {ratio_of!r} is not one of: targets, model")
    removed = ratio * model_params
    if removed >= target_params:
        raise UserError(
            f"--ratio {ratio:g} --ratio-of model removes {removed:,.0f} of the model's {model_params:,} parameters, "
            f"but the targeted projections ({targets}) hold only {target_params:,}: lower --ratio (at most "
            f"{target_params / model_params:.3f}) or target more (--targets attn,mlp)"
        )
    return removed / target_params


def check_ratio(ratio: float) -> None:
    """The one check of `--ratio` (every entry point calls it before anything else)."""
    if not 0.0 < ratio < 1.0:
        raise UserError(
            f"--ratio {ratio:g} is outside (0, 1): it is the fraction of attention parameters removed"
        )
