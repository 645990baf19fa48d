"""Loads a masa-compress checkpoint with plain transformers (`from_pretrained(path, trust_remote_code=True)`).

masa-compress copies this file into every checkpoint it writes. It is self-contained on purpose (torch and
transformers only): lm-eval-harness and other tools load checkpoints where masa-compress is not installed.

`Masa<Family>ForCausalLM` is the stock Hugging Face class of the base family whose attention projections are
replaced, at final shapes, by the two modules below; they mirror masa-compress's `compressor/modules.py` and keep
its parameter names, so the same safetensors keys load in both. `config.masa` holds the layout: per layer and
projection its mode (dense / shared / lowrank), group, number of atoms, residual rank and bias.

Shared atoms: the atoms of a group are ONE Parameter, stored once in the checkpoint under
`masa.groups.{group}.{projection}.atoms`, which is a real parameter path here (the `masa` submodule). Every layer
of the group registers that same Parameter under its own name, and `get_expanded_tied_weights_keys` declares
those names tied to the group's key. transformers then neither reports them missing nor initializes them, and
re-ties them after loading: loading replaces Parameters rather than copying into them, which alone would leave
each layer holding its own empty placeholder.

Each family also gets its own config class with model_type `masa_<family>`: without `trust_remote_code` loading
then fails loudly, instead of building the dense base model with randomly initialized attention.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GemmaConfig,
    GemmaForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Olmo2Config,
    Olmo2ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    SmolLM3Config,
    SmolLM3ForCausalLM,
)

ATOMS_KEY = "masa.groups.{group}.{projection}.atoms"
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")  # in `layer.mlp`; the others in `layer.self_attn`


def _block(projection: str) -> str:
    return "mlp" if projection in MLP_PROJECTIONS else "self_attn"


class LowRankLinear(nn.Module):
    """y = (x Bᵀ) Aᵀ + bias, with A (out, r) and B (r, in)."""

    def __init__(self, in_features: int, out_features: int, rank: int, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features, self.rank = in_features, out_features, rank
        self.lowrank_a = nn.Parameter(torch.zeros(out_features, rank), requires_grad=False)
        self.lowrank_b = nn.Parameter(torch.zeros(rank, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = nn.functional.linear(nn.functional.linear(x, self.lowrank_b), self.lowrank_a)
        return y if self.bias is None else y + self.bias


class SharedBasisLinear(nn.Module):
    """y = x (Σ_s c_s D_s)ᵀ + (x Bᵀ) Aᵀ + bias, with the atoms D shared across a group's layers."""

    def __init__(self, atoms: nn.Parameter, rank: int, bias: bool = False):
        super().__init__()
        n_atoms, out_features, in_features = atoms.shape
        self.in_features, self.out_features, self.rank, self.n_atoms = (
            in_features,
            out_features,
            rank,
            n_atoms,
        )
        self.atoms = atoms  # the group's Parameter, registered in every layer of the group
        self.coefficients = nn.Parameter(torch.zeros(n_atoms), requires_grad=False)
        self.lowrank_a = nn.Parameter(torch.zeros(out_features, rank), requires_grad=False)
        self.lowrank_b = nn.Parameter(torch.zeros(rank, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = torch.einsum("s,soi->oi", self.coefficients, self.atoms)  # (out, in)
        tokens = x.numel() // self.in_features
        if (
            self.rank > 0
            and tokens * (self.out_features + self.in_features) > self.out_features * self.in_features
        ):
            # Long inputs (prefill): one transient dense weight costs less than the factors on every token.
            # The same rule and arithmetic as masa-compress's own module, so both loaders give the same logits.
            return nn.functional.linear(x, torch.addmm(weight, self.lowrank_a, self.lowrank_b), self.bias)
        y = nn.functional.linear(x, weight, self.bias)
        if self.rank > 0:
            y = y + nn.functional.linear(nn.functional.linear(x, self.lowrank_b), self.lowrank_a)
        return y


class SharedAtoms(nn.Module):
    """Owner of one group's atoms (n_atoms, out, in), so that they have one checkpoint key."""

    def __init__(self, n_atoms: int, out_features: int, in_features: int):
        super().__init__()
        self.atoms = nn.Parameter(torch.zeros(n_atoms, out_features, in_features), requires_grad=False)


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
        for spec in self.config.masa["projections"]:
            mode, name = spec["mode"], spec["projection"]
            shape = (spec["out_features"], spec["in_features"])
            if mode == "dense":
                continue  # the base family's own nn.Linear
            if mode == "lowrank":
                module = LowRankLinear(shape[1], shape[0], spec["rank"], bias=spec["bias"])
            elif mode == "shared":
                key = str(spec["group"])
                if key not in self.masa.groups:
                    self.masa.groups[key] = nn.ModuleDict()
                group = self.masa.groups[key]
                if name not in group:
                    group[name] = SharedAtoms(spec["n_atoms"], *shape)
                module = SharedBasisLinear(group[name].atoms, spec["rank"], bias=spec["bias"])
            else:
                raise ValueError(f"config.masa: unknown mode {mode!r} for layer {spec['layer']} {name}")
            setattr(getattr(self.model.layers[spec["layer"]], _block(name)), name, module)

    def get_expanded_tied_weights_keys(self, all_submodels: bool = False) -> dict[str, str]:
        tied = super().get_expanded_tied_weights_keys(all_submodels=all_submodels)
        for spec in self.config.masa["projections"]:
            if spec["mode"] == "shared":
                layer_key = (
                    f"model.layers.{spec['layer']}.{_block(spec['projection'])}.{spec['projection']}.atoms"
                )
                tied[layer_key] = ATOMS_KEY.format(group=spec["group"], projection=spec["projection"])
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


# One pair per supported base family; `auto_map` in config.json names the pair of the checkpoint's family.
MasaLlamaConfig, MasaLlamaForCausalLM = _masa_family(LlamaConfig, LlamaForCausalLM)
MasaMistralConfig, MasaMistralForCausalLM = _masa_family(MistralConfig, MistralForCausalLM)
MasaQwen2Config, MasaQwen2ForCausalLM = _masa_family(Qwen2Config, Qwen2ForCausalLM)
MasaQwen3Config, MasaQwen3ForCausalLM = _masa_family(Qwen3Config, Qwen3ForCausalLM)
MasaGemmaConfig, MasaGemmaForCausalLM = _masa_family(GemmaConfig, GemmaForCausalLM)
MasaGemma2Config, MasaGemma2ForCausalLM = _masa_family(Gemma2Config, Gemma2ForCausalLM)
MasaGemma3TextConfig, MasaGemma3ForCausalLM = _masa_family(Gemma3TextConfig, Gemma3ForCausalLM)
MasaSmolLM3Config, MasaSmolLM3ForCausalLM = _masa_family(SmolLM3Config, SmolLM3ForCausalLM)
MasaOlmo2Config, MasaOlmo2ForCausalLM = _masa_family(Olmo2Config, Olmo2ForCausalLM)
