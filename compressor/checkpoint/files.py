"""Writing the files of a checkpoint: every tensor stored once and 64-byte aligned, in shards with a manifest
(dtype, shape, sha256), into a temporary sibling directory renamed into place only when complete.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from compressor.checkpoint.layout import MASA_CONFIG, WEIGHTS_INDEX, WEIGHTS_NAME, _storage_names
from compressor.runtime.cache_root import sha256_of
from compressor.runtime.errors import UserError, wording


@dataclass(frozen=True)
class OnDisk:
    """A tensor the model holds as a meta tensor (`--layerwise`), read from disk only when its bytes are written."""

    dtype: torch.dtype
    shape: torch.Size
    read: Callable[[], torch.Tensor]

    @property
    def nbytes(self) -> int:
        return self.shape.numel() * self.dtype.itemsize


def _stored_tensors(
    model: nn.Module, shared: dict[int, str], on_disk: Mapping[str, torch.Tensor] | None = None
) -> dict[str, torch.Tensor | OnDisk]:
    """{stored key: tensor}, each tensor once, still where the model keeps it (moved to the CPU tensor by tensor);
    a meta tensor is read from `on_disk` (full state-dict name -> tensor) when written."""
    state = model.state_dict(keep_vars=True)
    stored: dict[str, torch.Tensor | OnDisk] = {}
    for key, name in _storage_names(model, shared).items():
        tensor = state[key].detach()
        if tensor.device.type == "meta":
            if on_disk is None:
                raise ValueError(f"{key} is a meta tensor and no store to read it from was given")
            tensor = OnDisk(
                tensor.dtype, tensor.shape, lambda key=key, dtype=tensor.dtype: on_disk[key].to(dtype)
            )
        stored[name] = tensor
    return stored


def _for_writing(tensor: torch.Tensor | OnDisk) -> torch.Tensor:
    """The tensor's bytes on the CPU, contiguous (read from disk first if it is `OnDisk`)."""
    tensor = tensor.read() if isinstance(tensor, OnDisk) else tensor
    return tensor.to("cpu").contiguous()


def _write_weights(
    tensors: dict[str, torch.Tensor], directory: Path, max_shard_bytes: int
) -> tuple[dict[str, dict], dict[str, dict]]:
    """Write safetensors shards (Hugging Face naming and index); returns the file and tensor manifests.

    No timestamp goes into the safetensors metadata, so the same model always gives the same bytes.
    """
    shards: list[list[str]] = [[]]
    size = 0
    for name in sorted(tensors):
        if shards[-1] and size + tensors[name].nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += tensors[name].nbytes
    n = len(shards)
    file_names = [WEIGHTS_NAME] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    files: dict[str, dict] = {}
    manifest: dict[str, dict] = {}
    for file_name, names in zip(file_names, shards, strict=True):
        path = directory / file_name
        _save_aligned({k: tensors[k] for k in names}, path, metadata={"format": "pt"})
        files[file_name] = {"bytes": path.stat().st_size, "sha256": sha256_of(path)}
        with safe_open(path, framework="pt") as f:  # the header's own dtype names, which loading compares
            for k in names:
                manifest[k] = {
                    "file": file_name,
                    "dtype": f.get_slice(k).get_dtype(),
                    "shape": list(tensors[k].shape),
                }
    if n > 1:
        total = sum(t.nbytes for t in tensors.values())
        weight_map = {k: v["file"] for k, v in manifest.items()}
        _write_json(directory / WEIGHTS_INDEX, {"metadata": {"total_size": total}, "weight_map": weight_map})
    return files, manifest


ALIGNMENT = 64  # bytes: a cache line, and what MKL's GEMM kernels take as aligned

# torch dtypes -> safetensors dtype names (those a checkpoint can hold)
_SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}  # fmt: skip


def _save_aligned(tensors: dict[str, torch.Tensor | OnDisk], path: Path, metadata: dict[str, str]) -> None:
    """A standard safetensors file in which every tensor whose byte size is a multiple of 64 starts 64-byte
    aligned (header padded with spaces, as the format allows; those tensors first, the rest after, by name),
    so that memory-mapped loading hands out aligned views. Same tensors, same bytes. The tensors are moved to
    the CPU (or read from disk) one at a time, so writing takes no more memory than the largest one."""
    order = sorted(tensors, key=lambda k: (tensors[k].nbytes % ALIGNMENT != 0, k))
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for name in order:
        t = tensors[name]
        header[name] = {"dtype": _SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + t.nbytes]}  # fmt: skip
        offset += t.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-(8 + len(encoded)) % ALIGNMENT)  # the data then starts on a 64-byte boundary
    with open(path, "wb") as fh:
        fh.write(len(encoded).to_bytes(8, "little"))
        fh.write(encoded)
        for name in order:
            if tensors[name].nbytes:
                data = _for_writing(tensors[name])
                fh.write(data.reshape(-1).view(torch.uint8).numpy())  # buffer protocol: no copy
                del data


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")


@contextmanager
def _atomic_directory(out_dir: Path, overwrite: bool) -> Iterator[Path]:
    """Yield a temporary sibling of `out_dir`, renamed into place only once the body completes.

    On any exception (KeyboardInterrupt included) the temporary directory is removed and `out_dir`, if it
    existed, is left untouched. With `overwrite`, the old directory is moved aside, the new one renamed into
    place, then the old one deleted: `out_dir` holds one complete checkpoint or the other at every moment but
    the instant between the two renames.
    """
    _check_target(out_dir, overwrite)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{uuid.uuid4().hex[:8]}")
    tmp.mkdir()
    try:
        yield tmp
        if out_dir.exists():
            old = out_dir.with_name(f".{out_dir.name}.old-{uuid.uuid4().hex[:8]}")
            os.replace(out_dir, old)
            try:
                os.replace(tmp, out_dir)
            except BaseException:
                os.replace(old, out_dir)
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _check_target(out_dir: Path, overwrite: bool) -> None:
    if not out_dir.exists():
        return
    if not overwrite:
        raise UserError(
            f"{out_dir}: already exists: pass {wording('--overwrite', 'overwrite=True')} or choose another directory"
        )
    if not out_dir.is_dir():
        raise UserError(f"{out_dir}: exists and is not a directory: remove it or choose another directory")
    is_model = (out_dir / MASA_CONFIG).is_file() or (out_dir / "config.json").is_file()
    if not is_model and any(out_dir.iterdir()):
        raise UserError(
            f"{out_dir}: not a model checkpoint, refusing to replace it even with "
            f"{wording('--overwrite', 'overwrite=True')}: choose another directory"
        )
