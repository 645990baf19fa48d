"""Replacement modules for compressed projections, built at final shapes: ONE file for the library and for
every checkpoint (masa-compress copies it next to `modeling_masa.py`, which imports it relatively; transformers'
remote-code loader copies relative imports along). Pure torch on purpose: it must load where masa-compress is
not installed.

- `SharedBasisLinear`: W_l = Σ_s c_ls D_s + A_l B_l. The atoms D (B, out, in) are ONE `nn.Parameter`
  referenced by every layer of a group, so `model.parameters()` (which deduplicates) counts them once.
- `LowRankLinear`: W ≈ A B (SVD-LLM and plain-SVD baselines, and compressed singleton layers).
- `SharedInputLinear`: W_l ≈ A_l B, the input basis B (r, in) ONE `nn.Parameter` shared by a group's layers
  (and by several projection types when they read the same input), A_l per layer (Basis Sharing).
- An MLP that keeps some of its neurons (`neurons` mode) needs no module of its own: its gate/up/down are plain
  `nn.Linear`s of a smaller width, so the MLP stays a standard one.
- `RowSubsetLinear` / `ColumnSubsetLinear` (`rows` / `columns` mode, MoDeGPT): a projection that stores only
  some of its output rows (the others are zero: q/k dimensions pruned in rotary pairs, v reduced to a rank) or
  reads only some of its input columns (o_proj reading those dimensions); the positions are an int64 buffer
  saved with the weights, so the model keeps the base architecture's shapes.

Both compute y = x Wᵀ + bias without storing a dense per-layer weight for the residual.
`projection_module` builds either from one entry of a checkpoint layout (`config.masa["projections"]`).
"""

from __future__ import annotations

import torch
from torch import nn


class LowRankLinear(nn.Module):
    """y = (x Bᵀ) Aᵀ + bias, with A (out, r) and B (r, in)."""

    def __init__(
        self, in_features: int, out_features: int, rank: int, bias: bool = False, dtype=None, device=None
    ):
        super().__init__()
        self.in_features, self.out_features, self.rank = in_features, out_features, rank
        kw = {"dtype": dtype, "device": device}
        self.lowrank_a = nn.Parameter(torch.zeros(out_features, rank, **kw), requires_grad=False)
        self.lowrank_b = nn.Parameter(torch.zeros(rank, in_features, **kw), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features, **kw), requires_grad=False) if bias else None

    @classmethod
    def from_factors(
        cls, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, dtype, device
    ) -> LowRankLinear:
        module = cls(b.shape[1], a.shape[0], a.shape[1], bias=bias is not None, dtype=dtype, device=device)
        module.lowrank_a.data.copy_(a)
        module.lowrank_b.data.copy_(b)
        if bias is not None:
            module.bias.data.copy_(bias)
        return module

    def dense_weight(self) -> torch.Tensor:
        return self.lowrank_a @ self.lowrank_b

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = nn.functional.linear(nn.functional.linear(x, self.lowrank_b), self.lowrank_a)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (
            f"in={self.in_features}, out={self.out_features}, rank={self.rank}, bias={self.bias is not None}"
        )


class _SubsetLinear(nn.Module):
    """A projection storing `rank` of its rows (`axis` 0) or columns (`axis` 1) and their positions (an int64
    buffer named `positions_name`, saved with the weights)."""

    axis: int
    positions_name: str

    def __init__(
        self, in_features: int, out_features: int, rank: int, bias: bool = False, dtype=None, device=None
    ):
        super().__init__()
        self.in_features, self.out_features, self.rank = in_features, out_features, rank
        kw = {"dtype": dtype, "device": device}
        shape = (rank, in_features) if self.axis == 0 else (out_features, rank)
        self.weight = nn.Parameter(torch.zeros(shape, **kw), requires_grad=False)
        bias_size = rank if self.axis == 0 else out_features
        self.bias = nn.Parameter(torch.zeros(bias_size, **kw), requires_grad=False) if bias else None
        # Beside the weight, but never on the meta device of a skeleton (the loaders replace it from the file).
        where = None if str(device) == "meta" else device
        self.register_buffer(self.positions_name, torch.arange(rank, dtype=torch.long, device=where))

    def dense_weight(self) -> torch.Tensor:
        full = self.weight.new_zeros(self.out_features, self.in_features)
        return full.index_copy(self.axis, getattr(self, self.positions_name).to(full.device), self.weight)

    def extra_repr(self) -> str:
        return (
            f"in={self.in_features}, out={self.out_features}, {self.positions_name}={self.rank}, "
            f"bias={self.bias is not None}"
        )


class RowSubsetLinear(_SubsetLinear):
    """y[..., rows] = x Wᵀ + bias, every other output 0: W (rank, in) holds the kept rows of an (out, in) weight."""

    axis, positions_name = 0, "rows"

    def dense_bias(self) -> torch.Tensor:
        """The (out,) bias: the kept rows' entries, zero elsewhere (requires a bias)."""
        return self.bias.new_zeros(self.out_features).index_copy(0, self.rows.to(self.bias.device), self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kept = nn.functional.linear(x, self.weight, self.bias)
        return kept.new_zeros(*kept.shape[:-1], self.out_features).index_copy(-1, self.rows, kept)


class ColumnSubsetLinear(_SubsetLinear):
    """y = x[..., columns] Wᵀ + bias: W (out, rank) holds the columns of an (out, in) weight that are read."""

    axis, positions_name = 1, "columns"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x.index_select(-1, self.columns), self.weight, self.bias)


def subset_linear(
    kind: str,
    weight: torch.Tensor,
    positions: torch.Tensor,
    bias: torch.Tensor | None,
    out_features: int,
    in_features: int,
    dtype,
    device,
) -> nn.Module:
    """A `rows` (kind "rows": `weight` the kept rows) or `columns` module from its kept weight and positions."""
    cls = RowSubsetLinear if kind == "rows" else ColumnSubsetLinear
    rank = weight.shape[0] if kind == "rows" else weight.shape[1]
    module = cls(in_features, out_features, rank, bias=bias is not None, dtype=dtype, device=device)
    module.weight.data.copy_(weight)
    getattr(module, kind).copy_(positions.to(torch.long))
    if bias is not None:
        module.bias.data.copy_(bias)
    return module


class SharedBasisLinear(nn.Module):
    """y = x (Σ_s c_s D_s)ᵀ + (x Bᵀ) Aᵀ + bias, with the atoms D shared across a group's layers."""

    def __init__(
        self,
        atoms: nn.Parameter,
        rank: int,
        bias: bool = False,
        dtype=None,
        device=None,
    ):
        super().__init__()
        n_atoms, out_features, in_features = atoms.shape
        self.in_features, self.out_features, self.rank, self.n_atoms = (
            in_features,
            out_features,
            rank,
            n_atoms,
        )
        kw = {"dtype": dtype, "device": device}
        self.atoms = atoms  # shared Parameter: registered here and in every other layer of the group
        self.coefficients = nn.Parameter(torch.zeros(n_atoms, **kw), requires_grad=False)
        self.lowrank_a = nn.Parameter(torch.zeros(out_features, rank, **kw), requires_grad=False)
        self.lowrank_b = nn.Parameter(torch.zeros(rank, in_features, **kw), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features, **kw), requires_grad=False) if bias else None

    def shared_weight(self) -> torch.Tensor:
        # (B,) · (B, out, in) -> (out, in); B is 1 or 2, so this costs less than the matmul it feeds.
        return torch.einsum("s,soi->oi", self.coefficients, self.atoms)

    def dense_weight(self) -> torch.Tensor:
        return self.shared_weight() + self.lowrank_a @ self.lowrank_b

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.numel() // self.in_features
        if (
            self.rank > 0
            and tokens * (self.out_features + self.in_features) > self.out_features * self.in_features
        ):
            # Long inputs (prefill): building W = Σ c D + A B once costs out·in·r, less than applying the
            # factors to every token (tokens·r·(out+in)). The weight is transient, never stored.
            return nn.functional.linear(
                x, torch.addmm(self.shared_weight(), self.lowrank_a, self.lowrank_b), self.bias
            )
        y = nn.functional.linear(x, self.shared_weight(), self.bias)
        if self.rank > 0:
            y = y + nn.functional.linear(nn.functional.linear(x, self.lowrank_b), self.lowrank_a)
        return y

    def extra_repr(self) -> str:
        return (
            f"in={self.in_features}, out={self.out_features}, atoms={self.n_atoms} (shared), "
            f"rank={self.rank}, bias={self.bias is not None}"
        )


class SharedInputLinear(nn.Module):
    """y = (x Bᵀ) Aᵀ + bias, with the input basis B (r, in) shared across a group's layers, A (out, r) own."""

    def __init__(self, basis: nn.Parameter, out_features: int, bias: bool = False, dtype=None, device=None):
        super().__init__()
        self.rank, self.in_features = basis.shape
        self.out_features = out_features
        kw = {"dtype": dtype, "device": device}
        self.basis = basis  # shared Parameter: registered here and in every other module that reads it
        self.lowrank_a = nn.Parameter(torch.zeros(out_features, self.rank, **kw), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features, **kw), requires_grad=False) if bias else None

    @staticmethod
    def shared_basis(basis: torch.Tensor, dtype, device) -> nn.Parameter:
        """The Parameter every module of a group receives (so that it is stored and counted once). Contiguous, as
        it is stored: a transposed layout would round differently in GEMMs than the reloaded checkpoint."""
        return nn.Parameter(basis.to(device=device, dtype=dtype).contiguous(), requires_grad=False)

    @classmethod
    def from_factors(
        cls, basis: nn.Parameter, a: torch.Tensor, bias: torch.Tensor | None, dtype, device
    ) -> SharedInputLinear:
        module = cls(basis, a.shape[0], bias=bias is not None, dtype=dtype, device=device)
        module.lowrank_a.data.copy_(a)
        if bias is not None:
            module.bias.data.copy_(bias)
        return module

    def dense_weight(self) -> torch.Tensor:
        return self.lowrank_a @ self.basis

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = nn.functional.linear(nn.functional.linear(x, self.basis), self.lowrank_a)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (
            f"in={self.in_features}, out={self.out_features}, rank={self.rank} (shared basis), "
            f"bias={self.bias is not None}"
        )


class FusedLinear(nn.Module):
    """Projections that transformers fuses into one module (Phi-3's `qkv_proj`, `gate_up_proj`) held apart: each
    part is a projection of its own (plain or compressed, under its own name: `qkv_proj.q_proj`), and the output
    is theirs concatenated, as the fused module's was, so the family's own forward reads it unchanged."""

    def __init__(self, parts: dict[str, nn.Module]):
        super().__init__()
        self.parts = tuple(parts)
        for name, module in parts.items():
            setattr(self, name, module)

    @classmethod
    def split(cls, linear: nn.Linear, sizes: dict[str, int]) -> FusedLinear:
        """The fused `linear` cut into plain projections of `sizes` output rows each, in output order."""
        parts, start = {}, 0
        for name, rows in sizes.items():
            part = nn.Linear(
                linear.in_features,
                rows,
                bias=linear.bias is not None,
                dtype=linear.weight.dtype,
                device="meta",
            )
            part.weight = nn.Parameter(
                linear.weight.detach()[start : start + rows].clone(), linear.weight.requires_grad
            )
            if linear.bias is not None:
                part.bias = nn.Parameter(
                    linear.bias.detach()[start : start + rows].clone(), linear.bias.requires_grad
                )
            parts[name], start = part, start + rows
        if start != linear.out_features:
            raise ValueError(f"parts of {start} rows for a fused projection of {linear.out_features}")
        return cls(parts)

    @property
    def in_features(self) -> int:
        return getattr(self, self.parts[0]).in_features

    @property
    def out_features(self) -> int:
        return sum(getattr(self, name).out_features for name in self.parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([getattr(self, name)(x) for name in self.parts], dim=-1)


def dense_weight(module: nn.Module) -> torch.Tensor:
    """The effective (out, in) weight of any projection module."""
    if isinstance(module, nn.Linear):
        return module.weight
    return module.dense_weight()


#: Checkpoint key of a group's atoms (one tensor per group and projection type).
ATOMS_KEY = "masa.groups.{group}.{projection}.atoms"
#: Checkpoint key of a group's shared input basis; `basis` names the projection type(s) sharing it.
BASIS_KEY = "masa.groups.{group}.{basis}.basis"
#: In `layer.mlp`; the other projections live in `layer.self_attn`.
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def group_tensor(spec: dict) -> tuple[str, str, tuple[int, ...]]:
    """(checkpoint key, attribute name, shape) of the tensor a `shared` or `basis` layout entry shares."""
    if spec["mode"] == "shared":
        key = ATOMS_KEY.format(group=spec["group"], projection=spec["projection"])
        return key, "atoms", (spec["n_atoms"], spec["out_features"], spec["in_features"])
    key = BASIS_KEY.format(group=spec["group"], basis=spec["basis"])
    return key, "basis", (spec["rank"], spec["in_features"])


def projection_module(spec: dict, group_shared, dtype=None, device=None) -> nn.Module | None:
    """The module one layout entry describes (None for `dense`: the base model's own nn.Linear stays).

    `group_shared(spec)` returns the Parameter the entry shares (`group_tensor` says which: a group's atoms
    or input basis), created on first request, so that every module sharing it gets the same object.
    """
    mode, shape = spec["mode"], (spec["out_features"], spec["in_features"])
    if mode == "dense":
        return None
    if mode in (
        "neurons",
        "heads",
    ):  # a plain, smaller nn.Linear: an MLP's kept neurons, an attention's kept heads
        return nn.Linear(shape[1], shape[0], bias=spec["bias"], dtype=dtype, device=device)
    if mode in ("rows", "columns"):
        cls = RowSubsetLinear if mode == "rows" else ColumnSubsetLinear
        return cls(shape[1], shape[0], spec["rank"], bias=spec["bias"], dtype=dtype, device=device)
    if mode == "lowrank":
        return LowRankLinear(shape[1], shape[0], spec["rank"], bias=spec["bias"], dtype=dtype, device=device)
    if mode == "shared":
        return SharedBasisLinear(
            group_shared(spec), spec["rank"], bias=spec["bias"], dtype=dtype, device=device
        )
    if mode == "basis":
        return SharedInputLinear(
            group_shared(spec), spec["out_features"], bias=spec["bias"], dtype=dtype, device=device
        )
    raise ValueError(f"unknown mode {mode!r} for layer {spec['layer']} {spec['projection']}")
