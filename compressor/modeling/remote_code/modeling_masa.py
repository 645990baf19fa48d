"""Loads a masa-compress checkpoint with plain transformers (`from_pretrained(path, trust_remote_code=True)`).

masa-compress copies this file and `masa_modules.py` (the replacement modules, shared with the library) into
every checkpoint it writes. They are self-contained on purpose (torch and transformers only): lm-eval-harness
and other tools load checkpoints where masa-compress is not installed.

`Masa<Family>ForCausalLM` is the stock Hugging Face class of the base family whose attention projections are
replaced, at final shapes, by the modules of `masa_modules.py` (the very file masa-compress itself uses), so the
same safetensors keys load in both. `config.masa` holds the layout: per layer and
projection its mode (dense / shared / lowrank / basis / neurons / heads / rows / columns), group, number of
atoms, rank and bias.

Shared atoms: the atoms of a group are ONE Parameter, stored once in the checkpoint under
`masa.groups.{group}.{projection}.atoms`, which is a real parameter path here (the `masa` submodule). Every layer
of the group registers that same Parameter under its own name, and `get_expanded_tied_weights_keys` declares
those names tied to the group's key. transformers then neither reports them missing nor initializes them, and
re-ties them after loading: loading replaces Parameters rather than copying into them, which alone would leave
each layer holding its own empty placeholder. A shared input basis (`basis` mode) is handled the same way, under
`masa.groups.{group}.{basis}.basis`.

Each family also gets its own config class with model_type `masa_<family>`: without `trust_remote_code` loading
then fails loudly, instead of building the dense base model with randomly initialized attention.

Only the checkpoint's family is imported: `auto_map` names `Masa<Config>` and `Masa<Model>`, which this module
builds on first access (the module-level `__getattr__`) from transformers' classes of that family alone, so a
checkpoint loads under a transformers release that lacks (or cannot import) any other family. `FAMILIES` below is
this file's own copy of the registry's names (`compressor/modeling/families.py`; a test keeps the two equal), as
are the block names `ATTENTION` and `MLP`: the file must run where masa-compress is not installed.

A family whose projections transformers fuses (Phi-3's `qkv_proj`, `gate_up_proj`) is stored split: the layout's
`fused` entry says which fused module holds which projections, and of how many rows; each becomes a
`FusedLinear` of those projections, whose concatenated output the family's own forward reads.
"""

from __future__ import annotations

import torch
import transformers
from torch import nn

from .masa_modules import MLP_PROJECTIONS, FusedLinear, group_tensor, projection_module

#: model_type -> (its transformers config class, its causal-LM class), by name: the families a checkpoint may hold.
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "gemma": ("GemmaConfig", "GemmaForCausalLM"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM"),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
}
#: In every family above: a layer's attention block, and its MLP (gate/up/down).
ATTENTION, MLP = "self_attn", "mlp"


def _block(projection: str) -> str:
    return MLP if projection in MLP_PROJECTIONS else ATTENTION


def _parent(layout: dict, projection: str) -> str:
    """The path of the module holding `projection` in a layer: its block, or the fused module within it."""
    fused = next((name for name, rows in layout.get("fused", {}).items() if projection in rows), None)
    return f"{_block(projection)}.{fused}" if fused else _block(projection)


def _module(root: nn.Module, path: str) -> nn.Module:
    for part in path.split("."):
        root = getattr(root, part)
    return root


class GroupTensors(nn.Module):
    """Owner of a group's shared tensors (atoms, input bases), so that each has one checkpoint key."""


def _own_aligned_memory(model: nn.Module) -> None:
    """Copy the CPU tensors that do not start on a 64-byte boundary into fresh, aligned memory.

    masa-compress writes every tensor whose size allows it 64-byte aligned, so the views of the file mapping
    are aligned; what is left is odd-sized (coefficient vectors) or a file rewritten by another tool. MKL's
    GEMMs round differently on misaligned operands: without this the logits differ from masa-compress's own
    in the last bits.
    """
    for tensor in [*model.parameters(), *model.buffers()]:
        if tensor.device.type == "cpu" and tensor.data_ptr() % 64:
            tensor.data = tensor.data.clone()


class MasaMixin:
    """Installs the compressed projections that `config.masa` describes into the base family's model."""

    def post_init(self) -> None:
        # The base class's __init__ calls post_init once its dense modules exist. Replacing them here, before
        # transformers computes the tied-weight mapping and initializes weights, keeps a single construction pass.
        self._install_masa_projections()
        super().post_init()

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        model = super().from_pretrained(*args, **kwargs)
        _own_aligned_memory(model)
        return model

    def _install_masa_projections(self) -> None:
        self.masa = nn.Module()
        self.masa.groups = nn.ModuleDict()

        def group_shared(spec: dict) -> nn.Parameter:
            key, attribute, shape = group_tensor(spec)
            _, _, group, owner = key.split(".")[:4]
            if group not in self.masa.groups:
                self.masa.groups[group] = nn.ModuleDict()
            if owner not in self.masa.groups[group]:
                self.masa.groups[group][owner] = GroupTensors()
            owner = self.masa.groups[group][owner]
            if not hasattr(owner, attribute):
                owner.register_parameter(attribute, nn.Parameter(torch.zeros(shape), requires_grad=False))
            return getattr(owner, attribute)

        layout = self.config.masa
        for fused, rows in layout.get("fused", {}).items():  # the fused modules split, at the base's shapes
            block = _block(next(iter(rows)))
            for layer in self.model.layers:
                parent = getattr(layer, block)
                setattr(parent, fused, FusedLinear.split(getattr(parent, fused), rows))
        for spec in layout["projections"]:
            module = projection_module(spec, group_shared)
            if module is not None:  # `dense` keeps the base family's own nn.Linear
                layer = self.model.layers[spec["layer"]]
                setattr(_module(layer, _parent(layout, spec["projection"])), spec["projection"], module)
        for spec in layout["projections"]:  # `heads` mode: fewer query heads per KV head there
            if spec["mode"] == "heads" and spec["projection"] == "q_proj":
                attention = getattr(self.model.layers[spec["layer"]], ATTENTION)
                attention.num_key_value_groups = (
                    attention.q_proj.out_features // attention.k_proj.out_features
                )

    def get_expanded_tied_weights_keys(self, all_submodels: bool = False) -> dict[str, str]:
        tied = super().get_expanded_tied_weights_keys(all_submodels=all_submodels)
        for spec in self.config.masa["projections"]:
            if spec["mode"] in ("shared", "basis"):
                key, attribute, _ = group_tensor(spec)
                parent = _parent(self.config.masa, spec["projection"])
                tied[f"model.layers.{spec['layer']}.{parent}.{spec['projection']}.{attribute}"] = key
        return tied


def _masa_family(config_class: type, model_class: type) -> tuple[type, type]:
    """The config and model classes of one base family, under model_type `masa_<family>`."""
    config = type(
        f"Masa{config_class.__name__}",
        (config_class,),
        {"model_type": f"masa_{config_class.model_type}", "__module__": __name__},
    )
    model = type(
        f"Masa{model_class.__name__}",
        (MasaMixin, model_class),
        {"config_class": config, "__module__": __name__},
    )
    return config, model


def __getattr__(name: str) -> type:
    """`Masa<Config>` / `Masa<Model>` of one family (what `auto_map` names), built on first access from that
    family's transformers classes only."""
    for base_names in FAMILIES.values():
        if name in (f"Masa{base_names[0]}", f"Masa{base_names[1]}"):
            bases = [
                getattr(transformers, base) for base in base_names
            ]  # imports this family's modules alone
            pair = _masa_family(*bases)
            globals().update({cls.__name__: cls for cls in pair})
            return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
