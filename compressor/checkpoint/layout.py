"""What a checkpoint says about itself: the file names and format version, the layout of the compressed
projections (mode, group, atoms, rank, bias, shape per layer and projection), the storage name of every
tensor, the parameter counts, and the configs for both loaders.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from torch import nn

from compressor.math.accounting import HEADS_ROWS, NEURON_READER, CompressionPlan, with_legacy_keys
from compressor.modeling.adapters import DecoderAdapter, get_adapter
from compressor.modeling.remote_code.masa_modules import (
    ATOMS_KEY,
    BASIS_KEY,
    ColumnSubsetLinear,
    LowRankLinear,
    RowSubsetLinear,
    SharedBasisLinear,
    SharedInputLinear,
    group_tensor,
)

FORMAT_VERSION = 1
MASA_CONFIG = "masa_config.json"
WEIGHTS_NAME = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
#: Copied into every checkpoint: the remote-code model classes and the modules they (and this library) use.
REMOTE_CODE = ("modeling_masa.py", "masa_modules.py")
DEFAULT_MAX_SHARD_BYTES = 4 * 10**9
REQUIRED_FIELDS = ("format_version", "base_config", "layout", "tensors", "files")


def _layout(adapter: DecoderAdapter, plan: CompressionPlan) -> tuple[dict, dict[int, str]]:
    """The layout of the installed projections, and {id(shared Parameter): its checkpoint key} for the
    groups' atoms and input bases."""
    projections = []
    shared: dict[int, str] = {}
    owners: dict[str, int] = {}
    for layer in range(adapter.num_layers):
        for name in plan.targets:
            module = adapter.projection(layer, name)
            spec = _projection_spec(layer, name, module, plan)
            if spec["mode"] in ("shared", "basis"):
                key, attribute, _ = group_tensor(spec)
                ident = id(getattr(module, attribute))
                if shared.setdefault(ident, key) != key or owners.setdefault(key, ident) != ident:
                    raise ValueError(
                        f"layer {layer} {name}: its {attribute} is not the one Parameter of group {spec['group']} "
                        f"(every module sharing it must reference the same {attribute}, and groups different ones)"
                    )
            projections.append(spec)
    model = adapter.model
    layout = {
        "base_model_type": adapter.model_type,
        "base_architecture": type(model).__name__,
        "atoms_key": ATOMS_KEY,
        **({"basis_key": BASIS_KEY} if any(p["mode"] == "basis" for p in projections) else {}),
        "groups": [{"index": g.index, "layers": g.layers, "n_atoms": g.n_atoms} for g in plan.groups],
        "projections": projections,
        # A family whose projections transformers fuses is stored split (`masa_modules.FusedLinear`): which fused
        # module holds which projections, of how many rows (both loaders split it so before loading).
        **({"fused": adapter.fused_sizes()} if adapter.family.fused else {}),
    }
    return layout, shared


def _projection_spec(layer: int, name: str, module: nn.Module, plan: CompressionPlan) -> dict:
    try:
        planned = plan.get(layer, name)
    except KeyError:
        raise ValueError(f"layer {layer} {name}: missing from the compression plan") from None
    if isinstance(module, SharedBasisLinear):
        mode, n_atoms, rank = "shared", module.n_atoms, module.rank
    elif isinstance(module, SharedInputLinear):
        mode, n_atoms, rank = "basis", 0, module.rank
    elif isinstance(module, LowRankLinear):
        mode, n_atoms, rank = "lowrank", 0, module.rank
    elif isinstance(module, (RowSubsetLinear, ColumnSubsetLinear)):  # MoDeGPT's kept rows / read columns
        mode, n_atoms, rank = "rows" if isinstance(module, RowSubsetLinear) else "columns", 0, module.rank
    elif (
        isinstance(module, nn.Linear) and planned.mode == "neurons"
    ):  # a smaller plain Linear: its kept neurons
        mode, n_atoms = "neurons", 0
        rank = module.in_features if name == NEURON_READER else module.out_features
    elif isinstance(module, nn.Linear) and planned.mode == "heads":  # q rows / o columns of the kept heads
        mode, n_atoms = "heads", 0
        rank = (module.out_features if name == HEADS_ROWS else module.in_features) // planned.head_block
    elif isinstance(module, nn.Linear):
        mode, n_atoms, rank = "dense", 0, None
    else:
        raise ValueError(f"layer {layer} {name}: cannot save a {type(module).__name__} projection")
    if planned.mode != mode or (mode in ("shared", "basis") and planned.group is None):
        raise ValueError(
            f"layer {layer} {name}: the plan says {planned.mode} but the model holds a {mode} projection"
        )
    spec = {
        "layer": layer,
        "projection": name,
        "mode": mode,
        "group": planned.group,
        "n_atoms": n_atoms,
        "rank": rank,
        "bias": module.bias is not None,
        "out_features": module.out_features,
        "in_features": module.in_features,
    }
    if mode == "basis":  # the projection type(s) reading this basis: its checkpoint key's name
        spec["basis"] = planned.basis
    if (layer, name) in plan.kept_inputs and mode in ("neurons", "heads"):
        spec["kept_inputs"] = kept_mask(plan.kept_inputs[(layer, name)], planned.in_features)
    return spec


def kept_mask(kept: list[int], of: int) -> dict:
    """The original's input columns a narrowed down_proj / o_proj reads, as `{"of": width, "mask": hex}`: one bit
    per original column, set where kept (most significant bit first; about 2 KiB for a 1.5B model's MLP). The
    columns are kept in increasing order, so the mask says which and in what order."""
    if any(b <= a for a, b in zip(kept, kept[1:], strict=False)):
        raise ValueError("kept input columns must increase")
    bits = np.zeros(of, dtype=np.uint8)
    bits[kept] = 1
    return {"of": of, "mask": np.packbits(bits).tobytes().hex()}


def kept_columns(model: nn.Module, layout: dict) -> dict[str, tuple[int, np.ndarray]]:
    """Each narrowed matrix of a checkpoint's `layout` that records its kept inputs (`kept_mask`): its module path
    in `model` -> (the original's input width, the original's columns it reads, increasing)."""
    adapter, kept = get_adapter(model), {}
    paths = {id(module): name for name, module in model.named_modules()}
    for spec in layout.get("projections", []):
        if (record := spec.get("kept_inputs")) is not None:
            bits = np.unpackbits(np.frombuffer(bytes.fromhex(record["mask"]), dtype=np.uint8))[: record["of"]]
            path = paths[id(adapter.projection(spec["layer"], spec["projection"]))]
            kept[path] = (record["of"], np.flatnonzero(bits))
    return kept


def _storage_names(model: nn.Module, shared: dict[int, str]) -> dict[str, str]:
    """{state-dict key: key it is stored under}: a tensor reachable under several names is stored once.

    A group's shared atoms or input basis are stored under the group's key, any other alias (tied embeddings)
    under its first name.
    Saving and loading both use this, so the two always agree on which keys the files hold.
    """
    first: dict[int, str] = {}
    return {
        key: shared.get(id(tensor)) or first.setdefault(id(tensor), key)
        for key, tensor in model.state_dict(keep_vars=True).items()
    }


def _counts(model: nn.Module, adapter: DecoderAdapter, plan: CompressionPlan) -> dict:
    """The parameter counts a checkpoint records: the targeted projections' before and after (the run's ratio)
    and the whole model's."""
    total = sum(p.numel() for p in model.parameters())
    stored = adapter.target_parameter_count(plan.targets)
    if plan.ranks_allocated() and plan.params_after() != stored:
        raise ValueError(
            f"the plan counts {plan.params_after():,} parameters in {', '.join(plan.targets)} but the "
            f"model stores {stored:,}: the installed modules do not match the plan"
        )
    return with_legacy_keys({
        "targets": list(plan.targets),
        "target_params_before": plan.params_before,
        "target_params_after": stored,
        "achieved_ratio": 1.0 - stored / plan.params_before,
        "ratio_requested": plan.ratio,
        "non_target_params": total - stored,
        "total_params": total,
    })  # fmt: skip


def _base_config(model: nn.Module) -> dict:
    """The dense model's config, recording the dtype the weights are stored in."""
    config = model.config.to_dict()
    config["architectures"] = [type(model).__name__]
    config["dtype"] = str(model.get_input_embeddings().weight.dtype).removeprefix("torch.")
    return config


def _transformers_config(base_config: dict, config_class: str, layout: dict) -> dict:
    """config.json for plain transformers: the base config under model_type `masa_<family>` (so that loading
    without trust_remote_code fails instead of building dense attention at random), the remote classes and the
    layout they read."""
    config_class = f"Masa{config_class}"
    model_class = f"Masa{layout['base_architecture']}"
    return {
        **base_config,
        "model_type": f"masa_{base_config['model_type']}",
        "architectures": [model_class],
        "auto_map": {
            "AutoConfig": f"{Path(REMOTE_CODE[0]).stem}.{config_class}",
            "AutoModelForCausalLM": f"{Path(REMOTE_CODE[0]).stem}.{model_class}",
        },
        "masa": layout,
    }
