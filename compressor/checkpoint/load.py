"""`load_compressed` and `read_masa_config`: strict loading (a missing, unexpected, reshaped or truncated
tensor, an edited config, or one from a newer format is a `CheckpointError` naming the file).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from compressor import __version__
from compressor.checkpoint.files import ALIGNMENT
from compressor.checkpoint.layout import (
    FORMAT_VERSION,
    MASA_CONFIG,
    REQUIRED_FIELDS,
    WEIGHTS_NAME,
    _storage_names,
)
from compressor.modeling.adapters import DecoderAdapter
from compressor.modeling.remote_code.masa_modules import group_tensor, projection_module
from compressor.runtime.cache_root import sha256_of
from compressor.runtime.errors import CheckpointError


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
        model, shared = _build_skeleton(
            config["base_config"], config["layout"], dtype or _stored_dtype(config)
        )
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as err:
        raise CheckpointError(
            f"{config_file}: invalid base config or layout ({type(err).__name__}: {err})"
        ) from err

    names = _storage_names(model, shared)
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
    missing = [k for k in REQUIRED_FIELDS if k not in config]
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
    returns it with {id(shared Parameter): checkpoint key} (atoms and input bases)."""
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    config = CONFIG_MAPPING[base_config["model_type"]].from_dict(base_config)
    with _parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    adapter = DecoderAdapter(model)
    shared: dict[str, nn.Parameter] = {}

    def group_shared(spec: dict) -> nn.Parameter:
        key, _, shape = group_tensor(spec)
        if key not in shared:
            shared[key] = nn.Parameter(torch.empty(shape, device="meta", dtype=dtype), requires_grad=False)
        return shared[key]

    for spec in layout["projections"]:
        module = projection_module(spec, group_shared, dtype=dtype, device="meta")
        if module is not None:  # `dense` keeps the base architecture's own nn.Linear
            adapter.set_projection(spec["layer"], spec["projection"], module)
    return model, {id(p): key for key, p in shared.items()}


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
        if verify and sha256_of(file) != recorded.get("sha256"):
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
    from transformers.utils import logging as hf_logging

    # AutoTokenizer reads config.json, whose model_type is `masa_<family>`, into a plain config and warns that
    # "a model of type `masa_llama`" instantiates "a model of type ``": true and harmless (only the tokenizer
    # is loaded, and it is the base model's). Handing it the base config instead would change which tokenizer
    # class it picks, so that one logger is quieted for the call.
    config_logger = hf_logging.get_logger("transformers.configuration_utils")
    level = config_logger.level
    config_logger.setLevel(hf_logging.ERROR)
    try:
        # The tokenizer is standard: no remote code (config.json's auto_map would otherwise make
        # transformers ask on stdin whether to run it).
        return AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{path}: could not load the tokenizer ({str(err).splitlines()[0]})") from err
    finally:
        config_logger.setLevel(level)
