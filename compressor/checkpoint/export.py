"""`export_dense`: a standard dense Hugging Face checkpoint with each projection's effective weight, for
runtimes that cannot run remote code. The attention is expanded to full matrices (not smaller); an MLP that kept
some of its neurons stays narrow: with the same width in every layer (`--uniform-mlp`) the export is the base
architecture with a smaller `intermediate_size`, so it IS smaller and faster; with widths per layer every MLP is
padded to the widest with zero neurons (exact: a zero neuron adds nothing); a layer that kept fewer query heads
(`--attention heads`) gets the others back as zero heads (exact: their o_proj columns are zero).

`layout="deci"` keeps each layer's MLP width instead and writes the DeciLM / Nemotron-NAS layout
(`DeciLMForCausalLM`, one `block_configs` entry per layer, its configuration class shipped beside it), which vLLM
runs: the smaller model, per-layer widths and all. Its query heads are padded back as above: the engines' DeciLM
varies the KV heads of a layer, not its query heads.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from compressor.checkpoint.files import _atomic_directory
from compressor.checkpoint.layout import DEFAULT_MAX_SHARD_BYTES
from compressor.checkpoint.load import _load_tokenizer, load_compressed, read_masa_config
from compressor.math.heads import head_columns
from compressor.modeling import remote_code
from compressor.modeling.adapters import MLP_PROJECTIONS, get_adapter
from compressor.modeling.families import FAMILIES
from compressor.modeling.remote_code.masa_modules import FusedLinear
from compressor.runtime.errors import UserError

LAYOUTS = ("padded", "deci")
DECI_CONFIG_FILE = "configuration_decilm.py"
DECI_FAMILIES = tuple(name for name, family in FAMILIES.items() if family.deci)


@dataclass(frozen=True)
class DenseExport:
    """Where a dense export went and what it weighs next to the compressed checkpoint (never below it)."""

    path: Path
    compressed_bytes: int
    dense_bytes: int
    compressed_params: int
    dense_params: int


def export_dense(
    path: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    overwrite: bool = False,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    layout: str = "padded",
) -> DenseExport:
    """Write a standard dense Hugging Face checkpoint holding each projection's effective weight.

    For tools that cannot run remote code: it loads with plain `AutoModelForCausalLM.from_pretrained` and
    computes the same logits, but stores every attention projection at full size again (the MLP at the width
    of its widest layer; `layout="deci"`: at each layer's own width, in the DeciLM layout).
    """
    if layout not in LAYOUTS:
        raise UserError(f"--layout {layout}: unknown layout: choose one of {', '.join(LAYOUTS)}")
    path, out_dir = Path(path), Path(out_dir)
    if out_dir.resolve() == path.resolve():
        raise UserError(f"{out_dir}: is the compressed checkpoint itself: choose another directory")
    config = read_masa_config(path)
    family = config["base_config"].get("model_type")
    if layout == "deci" and family not in DECI_FAMILIES:  # before any weight is read
        raise UserError(
            f"--layout deci: the DeciLM layout is Llama's (no attention biases); a {family} model has no form "
            "in it: use --layout padded"
        )
    model = load_compressed(path)
    compressed_params = sum(p.numel() for p in model.parameters())
    adapter = get_adapter(model)
    for spec in config["layout"]["projections"]:
        module = adapter.projection(spec["layer"], spec["projection"])
        if not isinstance(module, nn.Linear):
            adapter.set_projection(spec["layer"], spec["projection"], _dense_linear(module))
    if layout == "padded":
        _one_mlp_width(adapter)
    _every_head(adapter)
    _join_fused(adapter)
    with _atomic_directory(out_dir, overwrite) as tmp:
        model.save_pretrained(tmp, max_shard_size=max_shard_bytes)
        if layout == "deci":
            _write_deci_config(tmp, adapter)
        if config.get("tokenizer", False):
            _load_tokenizer(path, config).save_pretrained(tmp)
    return DenseExport(
        path=out_dir,
        compressed_bytes=_weights_bytes(path),
        dense_bytes=_weights_bytes(out_dir),
        compressed_params=compressed_params,
        dense_params=sum(p.numel() for p in model.parameters()),
    )


@torch.no_grad()
def _dense_linear(module: nn.Module) -> nn.Linear:
    """An nn.Linear holding the module's effective weight, summed in float32 (a bf16 sum would round twice)."""
    dtype = next(module.parameters()).dtype
    weight = copy.deepcopy(module).float().dense_weight().to(dtype)  # copies one projection's atoms at most
    linear = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None, device="meta")
    linear.weight = nn.Parameter(weight)
    if module.bias is not None:  # a module keeping some rows holds their bias entries only
        bias = module.dense_bias() if hasattr(module, "dense_bias") else module.bias
        linear.bias = nn.Parameter(bias.detach().clone())
    return linear


def _weights_bytes(directory: Path) -> int:
    return sum(f.stat().st_size for f in directory.glob("*.safetensors"))


@torch.no_grad()
def _one_mlp_width(adapter) -> None:
    """Give every layer's MLP the width of the widest (zero neurons appended: gate/up rows and down columns of
    zeros contribute nothing, whatever the activation), and write that width into the config."""
    layers = range(adapter.num_layers)
    if not all(isinstance(adapter.find_projection(i, "down_proj"), nn.Linear) for i in layers):
        return  # not a gated MLP of plain projections (an MoE's experts): nothing of it was compressed
    widths = [adapter.projection(i, "down_proj").in_features for i in layers]
    width = max(widths)
    for i, own in zip(layers, widths, strict=True):
        if own == width:
            continue
        for name in ("gate_proj", "up_proj", "down_proj"):
            padded = _padded(adapter.projection(i, name), width, rows=name != "down_proj")
            setattr(adapter.block_of(i, name), name, padded)
    adapter.config.intermediate_size = width


@torch.no_grad()
def _every_head(adapter) -> None:
    """Give every layer that kept fewer query heads (`--attention heads`) all of them again, the missing ones
    zero: q rows of zeros and o columns of zeros, so a missing head's output (a mean of the values) is read by
    nothing. Per KV group, its kept heads first: query head i still reads KV head i // (heads per KV head)."""
    geometry = adapter.geometry
    per_group, d = geometry.num_heads // geometry.num_kv_heads, geometry.head_dim
    for i in range(adapter.num_layers):
        q_proj, o_proj = adapter.projection(i, "q_proj"), adapter.projection(i, "o_proj")
        kept = q_proj.out_features // (geometry.num_kv_heads * d)
        if kept == per_group:
            continue
        rows = head_columns([g * per_group + h for g in range(geometry.num_kv_heads) for h in range(kept)], d)
        adapter.block_of(i, "q_proj").q_proj = _scattered(q_proj, rows, geometry.num_heads * d, True)
        adapter.block_of(i, "o_proj").o_proj = _scattered(o_proj, rows, geometry.num_heads * d, False)
        adapter.attention(i).num_key_value_groups = per_group


@torch.no_grad()
def _join_fused(adapter) -> None:
    """Give a family whose projections transformers fuses (Phi-3) its fused modules back, so that the plain
    architecture loads the export: one nn.Linear of the parts' rows, in order."""
    for i in range(adapter.num_layers):
        for fused, parts in adapter.family.fused.items():
            view = adapter.block_of(i, parts[0])
            if not isinstance(view, FusedLinear):
                continue
            modules = [getattr(view, name) for name in view.parts]
            weight = torch.cat([m.weight for m in modules])
            joined = nn.Linear(
                weight.shape[1], weight.shape[0], bias=modules[0].bias is not None, device="meta"
            )
            joined.weight = nn.Parameter(weight)
            if joined.bias is not None:
                joined.bias = nn.Parameter(torch.cat([m.bias for m in modules]))
            block = adapter.mlp(i) if parts[0] in MLP_PROJECTIONS else adapter.attention(i)
            setattr(block, fused, joined)


def _scattered(linear: nn.Linear, index: torch.Tensor, size: int, rows_axis: bool) -> nn.Linear:
    """`linear` grown to `size` rows (or columns), its own at `index`, zeros elsewhere."""
    weight = linear.weight
    shape = (size, weight.shape[1]) if rows_axis else (weight.shape[0], size)
    grown = nn.Linear(
        shape[1], shape[0], bias=linear.bias is not None, dtype=weight.dtype, device=weight.device
    )
    grown.weight.zero_()
    if rows_axis:
        grown.weight[index] = weight
    else:
        grown.weight[:, index] = weight
    if linear.bias is not None:
        grown.bias.zero_()
        if rows_axis:
            grown.bias[index] = linear.bias
        else:
            grown.bias.copy_(linear.bias)
    return grown


def _padded(linear: nn.Linear, width: int, rows: bool) -> nn.Linear:
    """`linear` with zero rows (outputs) or zero columns (inputs) appended up to `width`."""
    own = linear.weight.shape[0] if rows else linear.weight.shape[1]
    return _scattered(linear, torch.arange(own), width, rows_axis=rows)


def _write_deci_config(directory: Path, adapter) -> None:
    """Turn the saved config.json into the DeciLM layout's and ship its configuration class beside it."""
    path = directory / "config.json"
    config = json.loads(path.read_text())
    for key in ("masa", "auto_map", "intermediate_size"):
        config.pop(key, None)
    geometry = adapter.geometry
    widths = [adapter.projection(i, "down_proj").in_features for i in range(adapter.num_layers)]
    config.update(
        architectures=["DeciLMForCausalLM"],
        model_type="nemotron-nas",
        auto_map={"AutoConfig": f"{Path(DECI_CONFIG_FILE).stem}.DeciLMConfig"},
        block_configs=[
            {
                "attention": {
                    "no_op": False,
                    "replace_with_linear": False,
                    "n_heads_in_group": geometry.num_heads // geometry.num_kv_heads,
                },
                "ffn": {"no_op": False, "replace_with_linear": False, "intermediate_size": width},
            }  # fmt: skip
            for width in widths
        ],
    )
    path.write_text(json.dumps(config, indent=2) + "\n")
    shutil.copyfile(Path(remote_code.__file__).with_name(DECI_CONFIG_FILE), directory / DECI_CONFIG_FILE)
