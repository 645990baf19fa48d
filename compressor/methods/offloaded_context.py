"""`--layerwise`: the compression of a model whose layers live on disk. The method reads the original weights from
the offloaded model's weight store and the statistics from their files; every layer a method has finished is
written to disk at once and its compressed tensors handed back as meta tensors, so the compressed layers do not
pile up in memory either. The checkpoint is then written tensor by tensor from those files.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from compressor.methods.base import MethodContext
from compressor.modeling.offload import OffloadedModel, trim_heap
from compressor.runtime.errors import NumericalError, all_finite


def projection_prefix(om: OffloadedModel, layer: int, projection: str) -> str:
    """The state-dict prefix of a projection, e.g. `model.layers.3.self_attn.q_proj.`."""
    return f"{om.layer_prefix(layer)}{om.adapter.path_in_layer(projection)}."


class CompressedLayers(Mapping[str, torch.Tensor]):
    """The compressed projections of finished layers, on disk: full state-dict name -> tensor (read on demand).
    A parameter shared by several projections (an input basis, a group's atoms) is stored once and stays one
    (meta) Parameter in the model, so the checkpoint's layout still sees the tie."""

    def __init__(self, directory: Path, om: OffloadedModel, targets: tuple[str, ...]):
        self.directory, self.om, self.targets = directory, om, targets
        self.index: dict[str, tuple[Path, str]] = {}
        self.done: set[int] = set()
        directory.mkdir(parents=True, exist_ok=True)

    def __getitem__(self, name: str) -> torch.Tensor:
        path, stored = self.index[name]
        with safe_open(path, framework="pt") as f:
            return f.get_tensor(stored)

    def __contains__(self, name: object) -> bool:  # Mapping's default would read the tensor to find out
        return name in self.index

    def __iter__(self) -> Iterator[str]:
        return iter(self.index)

    def __len__(self) -> int:
        return len(self.index)

    def check_open(self, layer: int) -> None:
        if layer in self.done:
            raise AssertionError(
                f"layer {layer} was already written to disk: its method installed into it after finishing it"
            )

    def rewrite(self, layer: int, projection: str) -> None:
        """Store again the weight of a finished layer's projection, changed in place while the layer was onloaded
        (`OffloadedModel.onloaded`: the materialised tensor is dropped on exit)."""
        name = projection_prefix(self.om, layer, projection) + "weight"
        if name not in self.index:
            raise AssertionError(f"{name} was rewritten before its layer was finished")
        path = self.directory / f"refit-{layer:05d}-{projection}.safetensors"
        weight = self.om.adapter.projection(layer, projection).weight
        save_file({name: weight.detach().to("cpu").contiguous()}, str(path))
        self.index[name] = (path, name)

    def spill(self, layers: Iterable[int]) -> None:
        """Write the compressed projections of `layers` to one file and replace their tensors by meta ones."""
        layers = sorted(set(layers) - self.done)
        if not layers:
            return
        slots: list[tuple[nn.Module, str, str, nn.Parameter]] = []  # (module, attribute, full name, tensor)
        for layer in layers:
            for p in self.targets:
                module = self.om.adapter.projection(layer, p)
                prefix = projection_prefix(self.om, layer, p)
                for name, sub in module.named_modules(remove_duplicate=False):
                    for attr, param in sub._parameters.items():
                        if param is not None and param.device.type != "meta":
                            slots.append((sub, attr, prefix + (f"{name}.{attr}" if name else attr), param))
        first_name: dict[int, str] = {}
        tensors: dict[str, torch.Tensor] = {}
        for _, _, name, param in slots:
            if id(param) not in first_name:
                first_name[id(param)] = name
                tensors[name] = param.detach().to("cpu").contiguous()
        path = self.directory / f"layers-{layers[0]:05d}-{layers[-1]:05d}.safetensors"
        if tensors:
            save_file(tensors, str(path))
        meta: dict[int, nn.Parameter] = {}
        for sub, attr, name, param in slots:
            self.index[name] = (path, first_name[id(param)])
            if id(param) not in meta:
                meta[id(param)] = nn.Parameter(torch.empty_like(param, device="meta"), requires_grad=False)
            sub._parameters[attr] = meta[id(param)]
        self.done.update(layers)
        del tensors, slots
        trim_heap()


@dataclass
class OffloadedContext(MethodContext):
    """A `MethodContext` over an offloaded model: original weights read from disk, finished layers spilled."""

    offloaded: OffloadedModel | None = None
    compressed: CompressedLayers | None = None

    def weight(self, layer: int, projection: str) -> torch.Tensor:
        name = projection_prefix(self.offloaded, layer, projection) + "weight"
        w = self.offloaded.original(name).to(self.compute_device, torch.float64)
        if not all_finite(w):
            raise NumericalError(f"non-finite weights in {name}: the model file is damaged")
        return w

    def bias(self, layer: int, projection: str) -> torch.Tensor | None:
        name = projection_prefix(self.offloaded, layer, projection) + "bias"
        return self.offloaded.original(name).to(self.model_dtype) if name in self.offloaded.names else None

    def held(self, layer: int, original: nn.Module | None = None) -> AbstractContextManager[nn.Module]:
        if original is None:  # the compressed projections from their files, the rest from the original's
            return self.offloaded.onloaded(layer, self.compressed)
        return self.offloaded.onloaded(layer, None, original)

    def refitted(self, layer: int, projection: str) -> None:
        self.compressed.rewrite(layer, projection)

    def install(self, layer: int, projection: str, module: nn.Module) -> None:
        self.compressed.check_open(layer)
        super().install(layer, projection, module)

    def finished(self, layers: Iterable[int]) -> None:
        self.compressed.spill(layers)
