"""`export_dense`: a standard dense Hugging Face checkpoint with each projection's effective weight, for
runtimes that cannot run remote code (it is NOT smaller).
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from compressor.adapters import get_adapter
from compressor.checkpoint.files import _atomic_directory
from compressor.checkpoint.layout import DEFAULT_MAX_SHARD_BYTES
from compressor.checkpoint.load import _load_tokenizer, load_compressed, read_masa_config
from compressor.errors import UserError


@dataclass(frozen=True)
class DenseExport:
    """Where a dense export went and what it weighs next to the compressed checkpoint (it is NOT smaller)."""

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
) -> DenseExport:
    """Write a standard dense Hugging Face checkpoint holding each projection's effective weight.

    For tools that cannot run remote code: it loads with plain `AutoModelForCausalLM.from_pretrained` and
    computes the same logits, but stores every projection at full size again.
    """
    path, out_dir = Path(path), Path(out_dir)
    if out_dir.resolve() == path.resolve():
        raise UserError(f"{out_dir}: is the compressed checkpoint itself: choose another directory")
    config = read_masa_config(path)
    model = load_compressed(path)
    compressed_params = sum(p.numel() for p in model.parameters())
    adapter = get_adapter(model)
    for spec in config["layout"]["projections"]:
        module = adapter.projection(spec["layer"], spec["projection"])
        if not isinstance(module, nn.Linear):
            adapter.set_projection(spec["layer"], spec["projection"], _dense_linear(module))
    with _atomic_directory(out_dir, overwrite) as tmp:
        model.save_pretrained(tmp, max_shard_size=max_shard_bytes)
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
    dtype = module.lowrank_a.dtype
    weight = copy.deepcopy(module).float().dense_weight().to(dtype)  # copies one projection's atoms at most
    linear = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None, device="meta")
    linear.weight = nn.Parameter(weight)
    if module.bias is not None:
        linear.bias = nn.Parameter(module.bias.detach().clone())
    return linear


def _weights_bytes(directory: Path) -> int:
    return sum(f.stat().st_size for f in directory.glob("*.safetensors"))
