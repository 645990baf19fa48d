"""`save_compressed`: a compressed model written as a checkpoint directory (see the package docstring)."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from datetime import datetime, timezone
from importlib import resources
from pathlib import Path

import torch
from torch import nn

from compressor import __version__
from compressor.checkpoint.files import _atomic_directory, _stored_tensors, _write_json, _write_weights
from compressor.checkpoint.layout import (
    DEFAULT_MAX_SHARD_BYTES,
    FORMAT_VERSION,
    MASA_CONFIG,
    REMOTE_CODE,
    _base_config,
    _counts,
    _layout,
    _transformers_config,
)
from compressor.math.accounting import CompressionPlan
from compressor.modeling.adapters import SUPPORTED_MODEL_TYPES, get_adapter
from compressor.runtime.errors import UserError


def save_compressed(
    model: nn.Module,
    plan: CompressionPlan,
    out_dir: str | os.PathLike,
    tokenizer=None,
    metadata: dict | None = None,
    *,
    overwrite: bool = False,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    on_disk: Mapping[str, torch.Tensor] | None = None,
) -> Path:
    """Write a compressed model as a checkpoint directory (layout in the module docstring); returns its path.

    `plan` supplies the groups and the counts; the installed modules supply the layout, and the two must agree
    (a disagreement is a bug upstream, raised as ValueError before anything is written). `metadata` is
    stored as given (values JSON cannot hold are written as strings). `on_disk` (full state-dict name -> tensor)
    supplies the tensors the model holds as meta tensors (`--layerwise`), read one at a time while writing.
    """
    out_dir = Path(out_dir)
    adapter = get_adapter(model)
    if adapter.model_type not in SUPPORTED_MODEL_TYPES:
        raise UserError(
            f"cannot save model_type '{adapter.model_type}' as a masa-compress checkpoint: "
            f"supported are {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    layout, shared = _layout(adapter, plan)
    tensors = _stored_tensors(model, shared, on_disk)
    counts = _counts(model, adapter, plan)
    base_config = _base_config(model)
    metadata_json = json.loads(json.dumps(metadata or {}, default=str))

    with _atomic_directory(out_dir, overwrite) as tmp:
        files, manifest = _write_weights(tensors, tmp, max_shard_bytes)
        _write_json(
            tmp / "config.json", _transformers_config(base_config, type(model.config).__name__, layout)
        )
        for name in REMOTE_CODE:
            (tmp / name).write_text(
                resources.files("compressor.modeling.remote_code").joinpath(name).read_text()
            )
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(tmp)
        _write_json(
            tmp / MASA_CONFIG,
            {
                "format_version": FORMAT_VERSION,
                "tool": "masa-compress",
                "tool_version": __version__,
                "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                "base_config": base_config,
                "layout": layout,
                "counts": counts,
                "plan": plan.to_dict(),
                "metadata": metadata_json,
                "tokenizer": tokenizer is not None,
                "files": files,
                "tensors": manifest,
            },
        )
    return out_dir
