"""Models larger than memory: the decoder layers stay on disk, in the safetensors files they were loaded from,
and one layer at a time is brought onto the execution device when a pass needs it (`--layerwise`).

The loading is transformers' and accelerate's own: `from_pretrained` with a `device_map` that sends every
decoder layer to "disk" builds the model with those layers on the meta device and an accelerate
`OffloadedWeightsLoader` whose index points into the original safetensors files (nothing is copied; other
formats are re-saved once into the offload folder). We keep that loader as the model's weight store and drop
accelerate's per-module hooks, because a pass here runs *every* calibration window through one layer before
the next (one onload per layer instead of one per window), and because the compressed layers hold modules the
hooks' weight maps do not know. `onloaded` puts a layer's tensors on the device with accelerate's
`set_module_tensor_to_device` and gives the meta tensors back afterwards, so the layer (and the ties between
its parameters, a shared basis referenced by several projections) is exactly as before.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from compressor.modeling.adapters import DecoderAdapter, get_adapter
from compressor.runtime.device import weight_loading
from compressor.runtime.errors import UserError


@dataclass
class OffloadedModel:
    """A causal LM whose decoder layers live on disk; everything else (embeddings, final norm, LM head, rotary
    tables) on the execution device."""

    model: nn.Module
    adapter: DecoderAdapter
    weights: Mapping[str, torch.Tensor]  # full parameter name -> the tensor as stored (read from disk)
    device: torch.device
    names: frozenset[str] = frozenset()  # the names `weights` holds
    seconds: float = 0.0

    def layer_prefix(self, index: int) -> str:
        """The state-dict prefix of decoder layer `index`, e.g. `model.layers.3.`."""
        return _module_names(self.model)[id(self.adapter.layers[index])] + "."

    def original(self, name: str) -> torch.Tensor:
        """A tensor of the original model by its full name, read from disk (a fresh CPU tensor)."""
        return self.weights[name]

    @contextmanager
    def onloaded(
        self, index: int, replaced: Mapping[str, torch.Tensor] | None = None, layer: nn.Module | None = None
    ) -> Iterator[nn.Module]:
        """Layer `index` with every meta tensor materialised on the device: from `replaced` (full name -> tensor:
        a compressed layer's spilled factors) when it holds the name, else from the original weights. On exit
        the very same meta tensors are put back (ties included), so memory returns to what it was. `layer`: a
        copy of the layer made before anything was installed into it, materialised instead of the model's own."""
        layer = self.adapter.layers[index] if layer is None else layer
        prefix = self.layer_prefix(index)
        restore: list[tuple[nn.Module, str, str, torch.Tensor]] = []
        try:
            for module_name, module in layer.named_modules(remove_duplicate=False):
                for kind in ("_parameters", "_buffers"):
                    for attr, tensor in list(getattr(module, kind).items()):
                        if tensor is None or tensor.device.type != "meta":
                            continue
                        key = prefix + (f"{module_name}.{attr}" if module_name else attr)
                        value = (
                            replaced[key] if replaced is not None and key in replaced else self.weights[key]
                        )
                        restore.append((module, kind, attr, tensor))
                        getattr(module, kind)[attr] = _materialised(tensor, value, self.device)
            yield layer
        finally:
            for module, kind, attr, tensor in reversed(restore):
                getattr(module, kind)[attr] = tensor


def _materialised(meta: torch.Tensor, value: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`value` on `device` in the meta tensor's dtype, as the same kind of tensor (Parameter or buffer)."""
    from accelerate.utils import set_module_tensor_to_device

    holder = nn.Module()
    if isinstance(meta, nn.Parameter):
        holder.register_parameter(
            "t", nn.Parameter(torch.empty_like(meta, device="meta"), requires_grad=False)
        )
    else:
        holder.register_buffer("t", torch.empty_like(meta, device="meta"))
    if tuple(value.shape) != tuple(meta.shape):
        raise ValueError(
            f"stored tensor of shape {tuple(value.shape)} for a slot of shape {tuple(meta.shape)}"
        )
    set_module_tensor_to_device(holder, "t", device, value=value, dtype=meta.dtype)
    return holder.t


@functools.cache
def _malloc_trim():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc (macOS, musl): its allocator returns memory its own way
        return None


def trim_heap() -> None:
    """Give the C heap's freed pages back to the system (glibc's `malloc_trim`), once a layer is done with.

    Each layer allocates and frees the same large tensors (activations, fp64 statistics, SVD workspaces); glibc
    serves them from its heap once its mmap threshold has risen, and keeps what was freed there, fragmented, so
    a run's resident memory crept up with depth (measured: +1.5 GiB over 256 layers). Trimming after each layer
    keeps it flat."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def _module_names(model: nn.Module) -> dict[int, str]:
    return {id(module): name for name, module in model.named_modules()}


def layer_device_map(skeleton: nn.Module, device: torch.device) -> dict[str, str]:
    """Every decoder layer on "disk", every other top-level part of the model on `device`."""
    adapter = get_adapter(skeleton)
    names = _module_names(skeleton)
    # accelerate's device maps name a CUDA device with its index ("cuda:0"), not as bare "cuda".
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    placed = str(device)
    layers_name = names[id(adapter.layers)]
    device_map: dict[str, str] = {}

    def place(prefix: str, module: nn.Module) -> None:
        for child_name, child in module.named_children():
            name = f"{prefix}{child_name}"
            if child is adapter.layers:
                device_map.update({f"{layers_name}.{i}": "disk" for i in range(adapter.num_layers)})
            elif layers_name.startswith(name + "."):
                place(name + ".", child)
            else:
                device_map[name] = placed
        for param_name, _ in module.named_parameters(recurse=False):
            device_map[f"{prefix}{param_name}"] = placed

    place("", skeleton)
    return device_map


def load_offloaded(
    location: str, kwargs: dict, device: torch.device, dtype: torch.dtype, offload_dir: Path
) -> OffloadedModel:
    """Load a model with its decoder layers kept on disk (see the module docstring)."""
    from accelerate import init_empty_weights
    from accelerate.hooks import remove_hook_from_submodules
    from transformers import AutoConfig, AutoModelForCausalLM

    start = time.perf_counter()
    config = AutoConfig.from_pretrained(location, **kwargs)
    with init_empty_weights():
        skeleton = AutoModelForCausalLM.from_config(config)
    device_map = layer_device_map(skeleton, device)
    del skeleton
    try:
        model = AutoModelForCausalLM.from_pretrained(
            location,
            **kwargs,
            **weight_loading(dtype),
            device_map=device_map,
            offload_folder=str(offload_dir),
        )
    except OSError as err:
        raise UserError(f"could not load the model from '{location}': {str(err).splitlines()[0]}") from err
    adapter = get_adapter(model)  # a fused projection's parts split (meta), under names of their own
    weights = FusedParts(_offloaded_weights(model), adapter.fused_sizes())
    remove_hook_from_submodules(model)
    model.eval()
    return OffloadedModel(model, adapter, weights, device, frozenset(weights), time.perf_counter() - start)


class FusedParts(Mapping[str, torch.Tensor]):
    """The weight store as the adapter's model names its tensors: each part of a fused projection (Phi-3's
    `qkv_proj`) under its own name (`qkv_proj.q_proj.weight`), its rows of the fused tensor in the file, as
    `FusedLinear.split` cuts them in memory; the fused tensor's own name is gone, as from the model."""

    def __init__(self, store: Mapping[str, torch.Tensor], fused_sizes: dict[str, dict[str, int]]):
        self.store = store
        # part's name -> (fused tensor's name, its first row, its rows)
        self.parts: dict[str, tuple[str, int, int]] = {}
        for name in store:
            for fused, sizes in fused_sizes.items():
                for kind in ("weight", "bias"):
                    if not name.endswith(f".{fused}.{kind}"):
                        continue
                    start, module = 0, name[: -len(kind)]
                    for part, rows in sizes.items():
                        self.parts[f"{module}{part}.{kind}"] = (name, start, rows)
                        start += rows
        self.fused = {name for name, _, _ in self.parts.values()}

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self.parts:
            fused, start, rows = self.parts[name]
            return self.store[fused][start : start + rows]
        if name in self.fused:
            raise KeyError(name)
        return self.store[name]

    def __iter__(self) -> Iterator[str]:
        yield from (name for name in self.store if name not in self.fused)
        yield from self.parts

    def __len__(self) -> int:
        return len(self.store) - len(self.fused) + len(self.parts)


def _offloaded_weights(model: nn.Module) -> Mapping[str, torch.Tensor]:
    """accelerate's weight store behind the offloaded modules (one `OffloadedWeightsLoader` for the model)."""
    for module in model.modules():
        hook = getattr(module, "_hf_hook", None)
        weights_map = getattr(hook, "weights_map", None)
        if weights_map is not None:
            return getattr(weights_map, "dataset", weights_map)
    raise RuntimeError("the model was loaded without offloaded layers: nothing to read from disk")
