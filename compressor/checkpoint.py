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

from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from importlib import resources
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from compressor import __version__
from compressor.adapters import SUPPORTED_MODEL_TYPES, DecoderAdapter, get_adapter
from compressor.errors import CheckpointError, UserError
from compressor.plan import CompressionPlan
from compressor.remote_code.masa_modules import ATOMS_KEY, LowRankLinear, SharedBasisLinear, projection_module

FORMAT_VERSION = 1
MASA_CONFIG = "masa_config.json"
WEIGHTS_NAME = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
#: Copied into every checkpoint: the remote-code model classes and the modules they (and this library) use.
REMOTE_CODE = ("modeling_masa.py", "masa_modules.py")
DEFAULT_MAX_SHARD_BYTES = 4 * 10**9
_REQUIRED_FIELDS = ("format_version", "base_config", "layout", "tensors", "files")


# ------------------------------------------------------------------------------------------------------
# Saving


def save_compressed(
    model: nn.Module,
    plan: CompressionPlan,
    out_dir: str | os.PathLike,
    tokenizer=None,
    metadata: dict | None = None,
    *,
    overwrite: bool = False,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> Path:
    """Write a compressed model as a checkpoint directory (layout in the module docstring); returns its path.

    `plan` supplies the groups and the counts; the installed modules supply the layout, and the two must agree
    (a disagreement is a bug upstream, raised as ValueError before anything is written). `metadata` is
    stored as given (values JSON cannot hold are written as strings).
    """
    out_dir = Path(out_dir)
    adapter = get_adapter(model)
    if adapter.model_type not in SUPPORTED_MODEL_TYPES:
        raise UserError(
            f"cannot save model_type '{adapter.model_type}' as a masa-compress checkpoint: "
            f"supported are {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    layout, atoms = _layout(adapter, plan)
    tensors = _stored_tensors(model, atoms)
    counts = _counts(model, adapter, plan)
    base_config = _base_config(model)
    metadata_json = json.loads(json.dumps(metadata or {}, default=str))

    with _atomic_directory(out_dir, overwrite) as tmp:
        files, manifest = _write_weights(tensors, tmp, max_shard_bytes)
        _write_json(
            tmp / "config.json", _transformers_config(base_config, type(model.config).__name__, layout)
        )
        for name in REMOTE_CODE:
            (tmp / name).write_text(resources.files("compressor.remote_code").joinpath(name).read_text())
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


def _layout(adapter: DecoderAdapter, plan: CompressionPlan) -> tuple[dict, dict[int, str]]:
    """The layout of the installed projections, and {id(atoms Parameter): its checkpoint key}."""
    projections = []
    atoms: dict[int, str] = {}
    owners: dict[str, int] = {}
    for layer in range(adapter.num_layers):
        for name in plan.targets:
            module = adapter.projection(layer, name)
            spec = _projection_spec(layer, name, module, plan)
            if spec["mode"] == "shared":
                key, ident = ATOMS_KEY.format(group=spec["group"], projection=name), id(module.atoms)
                if atoms.setdefault(ident, key) != key or owners.setdefault(key, ident) != ident:
                    raise ValueError(
                        f"layer {layer} {name}: its atoms are not the one Parameter of group {spec['group']} "
                        "(every layer of a group must reference the same atoms, and groups different ones)"
                    )
            projections.append(spec)
    model = adapter.model
    layout = {
        "base_model_type": adapter.model_type,
        "base_architecture": type(model).__name__,
        "atoms_key": ATOMS_KEY,
        "groups": [{"index": g.index, "layers": g.layers, "n_atoms": g.n_atoms} for g in plan.groups],
        "projections": projections,
    }
    return layout, atoms


def _projection_spec(layer: int, name: str, module: nn.Module, plan: CompressionPlan) -> dict:
    if isinstance(module, SharedBasisLinear):
        mode, n_atoms, rank = "shared", module.n_atoms, module.rank
    elif isinstance(module, LowRankLinear):
        mode, n_atoms, rank = "lowrank", 0, module.rank
    elif isinstance(module, nn.Linear):
        mode, n_atoms, rank = "dense", 0, None
    else:
        raise ValueError(f"layer {layer} {name}: cannot save a {type(module).__name__} projection")
    try:
        planned = plan.get(layer, name)
    except KeyError:
        raise ValueError(f"layer {layer} {name}: missing from the compression plan") from None
    if planned.mode != mode or (mode == "shared" and planned.group is None):
        raise ValueError(
            f"layer {layer} {name}: the plan says {planned.mode} but the model holds a {mode} projection"
        )
    return {
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


def _storage_names(model: nn.Module, atoms: dict[int, str]) -> dict[str, str]:
    """{state-dict key: key it is stored under}: a tensor reachable under several names is stored once.

    Shared atoms are stored under their group's key, any other alias (tied embeddings) under its first name.
    Saving and loading both use this, so the two always agree on which keys the files hold.
    """
    first: dict[int, str] = {}
    return {
        key: atoms.get(id(tensor)) or first.setdefault(id(tensor), key)
        for key, tensor in model.state_dict(keep_vars=True).items()
    }


def _stored_tensors(model: nn.Module, atoms: dict[int, str]) -> dict[str, torch.Tensor]:
    """{stored key: tensor}, each tensor once, still where the model keeps it (moved to the CPU shard by shard)."""
    state = model.state_dict(keep_vars=True)
    return {name: state[key].detach() for key, name in _storage_names(model, atoms).items()}


def _for_safetensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """On the CPU, contiguous, each owning its storage: safetensors refuses tensors that share memory (such as
    views of one fused buffer), so those are copied."""
    ready: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in tensors.items():
        tensor = tensor.to("cpu").contiguous()
        storage = tensor.untyped_storage()
        if storage.data_ptr() in seen or storage.nbytes() != tensor.nbytes:
            tensor = tensor.clone()
        seen.add(tensor.untyped_storage().data_ptr())
        ready[name] = tensor
    return ready


def _counts(model: nn.Module, adapter: DecoderAdapter, plan: CompressionPlan) -> dict:
    total = sum(p.numel() for p in model.parameters())
    attention = adapter.attention_parameter_count(plan.targets)
    if plan.ranks_allocated() and plan.attention_params_after() != attention:
        raise ValueError(
            f"the plan counts {plan.attention_params_after():,} parameters in {', '.join(plan.targets)} but the "
            f"model stores {attention:,}: the installed modules do not match the plan"
        )
    # "attention" counts the targeted projections (q/k/v/o unless the run also compressed the MLP).
    return {
        "targets": list(plan.targets),
        "attention_params_before": plan.attention_params_before,
        "attention_params_after": attention,
        "achieved_ratio": 1.0 - attention / plan.attention_params_before,
        "ratio_requested": plan.ratio,
        "non_attention_params": total - attention,
        "total_params": total,
    }


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
        shard = _for_safetensors({k: tensors[k] for k in names})
        _save_aligned(shard, path, metadata={"format": "pt"})
        del shard
        files[file_name] = {"bytes": path.stat().st_size, "sha256": _sha256(path)}
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


def _save_aligned(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    """A standard safetensors file in which every tensor whose byte size is a multiple of 64 starts 64-byte
    aligned (header padded with spaces, as the format allows; those tensors first, the rest after, by name),
    so that memory-mapped loading hands out aligned views. Same tensors, same bytes."""
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
            if tensors[name].numel():
                fh.write(tensors[name].reshape(-1).view(torch.uint8).numpy())  # buffer protocol: no copy


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


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
            f"{out_dir}: already exists: pass overwrite=True (--overwrite) or choose another directory"
        )
    if not out_dir.is_dir():
        raise UserError(f"{out_dir}: exists and is not a directory: remove it or choose another directory")
    is_model = (out_dir / MASA_CONFIG).is_file() or (out_dir / "config.json").is_file()
    if not is_model and any(out_dir.iterdir()):
        raise UserError(
            f"{out_dir}: not a model checkpoint, refusing to replace it even with overwrite: choose another directory"
        )


# ------------------------------------------------------------------------------------------------------
# Loading


def load_compressed(
    path: str | os.PathLike,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    with_tokenizer: bool = False,
    *,
    verify: bool = False,
) -> nn.Module | tuple[nn.Module, object]:
    """Rebuild a compressed model from its checkpoint, in eval mode; with its tokenizer if `with_tokenizer`.

    The skeleton is built with parameters on the meta device (nothing dense is allocated or randomly
    initialized), its projections replaced by the compressed modules at final shapes, a group's atoms being
    one Parameter; the stored tensors are then assigned in place of the meta ones. `dtype` casts floating
    tensors (default: as stored); `verify` also checks every file's sha256 (reads each file once more).
    """
    path = Path(path)
    config = read_masa_config(path)
    config_file = path / MASA_CONFIG
    device = torch.device(device) if device is not None else torch.device("cpu")
    try:
        model, atoms = _build_skeleton(
            config["base_config"], config["layout"], dtype or _stored_dtype(config)
        )
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as err:
        raise CheckpointError(
            f"{config_file}: invalid base config or layout ({type(err).__name__}: {err})"
        ) from err

    names = _storage_names(model, atoms)
    state = model.state_dict(keep_vars=True)
    expected = {stored: tuple(state[key].shape) for key, stored in names.items()}
    if set(config["tensors"]) != set(expected):
        extra = sorted(set(config["tensors"]) ^ set(expected))[0]
        raise CheckpointError(
            f"{config_file}: the tensor list disagrees with the layout (first: '{extra}'): edited?"
        )
    tensors = _read_tensors(path, config, expected, device, dtype, verify)

    parameters = {names[key]: p.requires_grad for key, p in model.named_parameters(remove_duplicate=False)}
    loaded = {
        stored: nn.Parameter(t, requires_grad=parameters[stored] and t.is_floating_point())
        if stored in parameters
        else t
        for stored, t in tensors.items()
    }
    # Every alias receives the same object, so shared atoms and tied embeddings stay one Parameter.
    model.load_state_dict({key: loaded[stored] for key, stored in names.items()}, strict=True, assign=True)
    model.to(device)  # the non-persistent buffers (RoPE frequencies) were built on the CPU
    model.config._name_or_path = str(path)
    if (path / "generation_config.json").is_file():
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(path)
    model.eval()
    if not with_tokenizer:
        return model
    return model, _load_tokenizer(path, config)


def read_masa_config(path: str | os.PathLike) -> dict:
    """masa_config.json of a checkpoint directory, checked for the fields and format version this tool reads."""
    path = Path(path)
    config_file = path / MASA_CONFIG
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint directory")
    if not config_file.is_file():
        raise CheckpointError(f"{config_file}: missing: {path} is not a masa-compress checkpoint")
    try:
        config = json.loads(config_file.read_text())
    except json.JSONDecodeError as err:
        raise CheckpointError(
            f"{config_file}: invalid JSON ({err}): the file is corrupt or was edited"
        ) from err
    except (OSError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{config_file}: unreadable ({err})") from err
    if not isinstance(config, dict):
        raise CheckpointError(f"{config_file}: not a JSON object: the file is corrupt or was edited")
    missing = [k for k in _REQUIRED_FIELDS if k not in config]
    if missing:
        raise CheckpointError(
            f"{config_file}: missing field '{missing[0]}': the file is corrupt or was edited"
        )
    version = config["format_version"]
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise CheckpointError(f"{config_file}: invalid format_version {version!r}")
    if version > FORMAT_VERSION:
        writer = config.get("tool_version", "?")
        raise CheckpointError(
            f"{config_file}: format_version {version} was written by masa-compress {writer}, a newer version: "
            f"upgrade masa-compress (this one, {__version__}, reads format_version {FORMAT_VERSION})"
        )
    return config


def _stored_dtype(config: dict) -> torch.dtype:
    dtype = getattr(torch, str(config["base_config"].get("dtype")), None)
    return dtype if isinstance(dtype, torch.dtype) else torch.float32


@contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Create parameters on the meta device while keeping buffers real, like accelerate's
    `init_empty_weights(include_buffers=False)`: no memory or random init is spent on weights the checkpoint
    replaces, while the non-persistent buffers (RoPE frequencies), which no file restores, are computed."""
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and not param.is_meta:  # a meta one is being tied: keep its identity
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def _build_skeleton(base_config: dict, layout: dict, dtype: torch.dtype) -> tuple[nn.Module, dict[int, str]]:
    """The base architecture with compressed projections at final shapes, parameters on the meta device;
    returns it with {id(atoms Parameter): checkpoint key}."""
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    config = CONFIG_MAPPING[base_config["model_type"]].from_dict(base_config)
    with _parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    adapter = DecoderAdapter(model)
    atoms: dict[str, nn.Parameter] = {}

    def group_atoms(spec: dict) -> nn.Parameter:
        key = ATOMS_KEY.format(group=spec["group"], projection=spec["projection"])
        if key not in atoms:
            shape = (spec["n_atoms"], spec["out_features"], spec["in_features"])
            atoms[key] = nn.Parameter(torch.empty(shape, device="meta", dtype=dtype), requires_grad=False)
        return atoms[key]

    for spec in layout["projections"]:
        module = projection_module(spec, group_atoms, dtype=dtype, device="meta")
        if module is not None:  # `dense` keeps the base architecture's own nn.Linear
            adapter.set_projection(spec["layer"], spec["projection"], module)
    return model, {id(p): key for key, p in atoms.items()}


def _read_tensors(
    path: Path,
    config: dict,
    expected: dict[str, tuple[int, ...]],
    device: torch.device,
    dtype: torch.dtype | None,
    verify: bool,
) -> dict[str, torch.Tensor]:
    """Every expected tensor, checked against the files' headers and the manifest before any data is read."""
    manifest: dict[str, dict] = config["tensors"]
    headers: dict[str, Path] = {}
    for file_name in config["files"]:
        file = path / file_name
        if not file.is_file():
            raise CheckpointError(f"{file}: missing: the checkpoint is incomplete")
        try:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():
                    tensor = f.get_slice(name)
                    _check_tensor(
                        file, name, tuple(tensor.get_shape()), tensor.get_dtype(), expected, manifest
                    )
                    if name in headers:
                        raise CheckpointError(f"{file}: tensor '{name}' is also stored in {headers[name]}")
                    headers[name] = file
        except SafetensorError as err:
            raise CheckpointError(f"{file}: corrupt or truncated safetensors file ({err})") from err
    for name in expected:
        if name not in headers:
            file = path / manifest.get(name, {}).get("file", WEIGHTS_NAME)
            raise CheckpointError(f"{file}: tensor '{name}' is missing: the file is incomplete or was edited")
    # Last, as the least specific: what the headers cannot tell (bytes appended, or changed in place).
    for file_name, recorded in config["files"].items():
        file = path / file_name
        size = file.stat().st_size
        if size != recorded.get("bytes"):
            raise CheckpointError(
                f"{file}: {size:,} bytes where {recorded.get('bytes')} were written: modified"
            )
        if verify and _sha256(file) != recorded.get("sha256"):
            raise CheckpointError(
                f"{file}: sha256 differs from the one recorded at save time: the file was modified"
            )

    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(set(headers.values())):
        try:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():
                    tensor = _aligned(f.get_tensor(name))
                    cast = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
                    tensors[name] = tensor.to(device=device, dtype=cast)
        except SafetensorError as err:
            raise CheckpointError(f"{file}: corrupt or truncated safetensors file ({err})") from err
    return tensors


def _aligned(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor itself when it starts on a 64-byte boundary, else an aligned copy.

    `get_tensor` returns views into the file's mapping (loaded lazily, no second copy in memory). MKL's GEMMs
    round differently on misaligned operands (1.9e-5 on the bundled model's logits), so the files are written
    with every tensor whose size allows it 64-byte aligned (`_save_aligned`); what is left (tiny coefficient
    vectors, files written by other tools) is copied.
    """
    return tensor if tensor.data_ptr() % ALIGNMENT == 0 else tensor.clone()


def _check_tensor(
    file: Path,
    name: str,
    shape: tuple[int, ...],
    dtype: str,
    expected: dict[str, tuple[int, ...]],
    manifest: dict[str, dict],
) -> None:
    if name not in expected:
        raise CheckpointError(f"{file}: unexpected tensor '{name}' (not in the layout of {MASA_CONFIG})")
    if shape != expected[name]:
        raise CheckpointError(
            f"{file}: tensor '{name}' has shape {list(shape)} where the layout expects {list(expected[name])}"
        )
    if dtype != manifest[name].get("dtype"):
        raise CheckpointError(
            f"{file}: tensor '{name}' is {dtype} where {MASA_CONFIG} records {manifest[name].get('dtype')}: edited?"
        )


def _load_tokenizer(path: Path, config: dict):
    if not config.get("tokenizer", False):
        raise CheckpointError(f"{path / MASA_CONFIG}: the checkpoint was saved without a tokenizer")
    from transformers import AutoTokenizer

    try:
        # The tokenizer is standard: no remote code (config.json's auto_map would otherwise make
        # transformers ask on stdin whether to run it).
        return AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{path}: could not load the tokenizer ({str(err).splitlines()[0]})") from err


# ------------------------------------------------------------------------------------------------------
# Dense export


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
