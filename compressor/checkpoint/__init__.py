"""Compressed checkpoints: write (`save_compressed`), read (`load_compressed`), expand (`export_dense`).

A checkpoint is a directory:

- `model.safetensors` (or `model-0000k-of-0000n.safetensors` shards + `model.safetensors.index.json`): the
  model's state dict with every tensor stored once. A group's atoms go under `masa.groups.{g}.{proj}.atoms`;
  each layer keeps its own `coefficients`, `lowrank_a/b` and `bias` under its module path; tied embeddings
  keep only `model.embed_tokens.weight`.
- `masa_config.json`: format and tool versions, the base model config, the layout that rebuilds the skeleton
  (per layer and projection: mode, group, atoms, rank, bias, shape), the plan and its counts, the caller's
  metadata (source, calibration, grouping report...), and a manifest (per tensor: file, dtype, shape; per
  file: bytes, sha256) that loading checks the files against.
- `config.json` + `modeling_masa.py`: the same model for plain transformers, with
  `AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)` (see `remote_code/modeling_masa.py`).
- the tokenizer files and `generation_config.json`.

Writes go to a temporary sibling directory renamed into place once complete, so a failure never leaves a
half-written checkpoint. Loading is strict: a missing, unexpected, reshaped or truncated tensor, an edited
config or one from a newer format is a `CheckpointError` naming the file.
"""

from compressor.checkpoint.export import DenseExport, export_dense
from compressor.checkpoint.layout import (
    DEFAULT_MAX_SHARD_BYTES,
    FORMAT_VERSION,
    MASA_CONFIG,
    REMOTE_CODE,
    WEIGHTS_INDEX,
    WEIGHTS_NAME,
)
from compressor.checkpoint.load import load_compressed, read_masa_config
from compressor.checkpoint.save import save_compressed
from compressor.modeling.remote_code.masa_modules import ATOMS_KEY, BASIS_KEY

__all__ = [
    "ATOMS_KEY",
    "BASIS_KEY",
    "DEFAULT_MAX_SHARD_BYTES",
    "FORMAT_VERSION",
    "MASA_CONFIG",
    "REMOTE_CODE",
    "WEIGHTS_INDEX",
    "WEIGHTS_NAME",
    "DenseExport",
    "export_dense",
    "load_compressed",
    "read_masa_config",
    "save_compressed",
]
