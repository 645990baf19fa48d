"""Architecture adapters: the stages ask these for layers, projections, norms and the unembedding.

Where a family keeps them is its entry in the registry (`families.py`), the one place module paths are written;
`DecoderAdapter` reads it. A family that transformers builds with fused projections (Phi-3's `qkv_proj`) gets
them split into views of q/k/v and gate/up when the adapter is made (`masa_modules.FusedLinear`: the same
outputs, concatenated); anything outside the registry is refused with a one-line error naming it.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from compressor.modeling.families import (
    FAMILIES,
    SUPPORTED_MODEL_TYPES,
    Family,
    family_of,
    form_refusal,
    get_path,
)
from compressor.modeling.remote_code.masa_modules import FusedLinear
from compressor.runtime.errors import UserError

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
# q/k/v read the post-input_layernorm hidden state; o reads the attention output.
ATTN_INPUT_PROJECTIONS = ("q_proj", "k_proj", "v_proj")
# `--targets mlp`: gate/up read the post-attention-norm hidden state; down reads the gated activation.
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
TARGETS = {"attn": PROJECTIONS, "mlp": MLP_PROJECTIONS}
# Which input (and so which autocorrelation and whitening) each projection reads.
INPUT_OF = {
    **dict.fromkeys(ATTN_INPUT_PROJECTIONS, "attn"),
    "o_proj": "o",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "down",
}


def target_projections(targets: str) -> tuple[str, ...]:
    """'attn', 'mlp' or 'attn,mlp' -> projection names, attention first."""
    names = [t.strip() for t in targets.split(",") if t.strip()]
    unknown = [t for t in names if t not in TARGETS]
    if not names or unknown:
        raise UserError(f"unknown target '{(unknown or [targets])[0]}': use --targets attn, mlp or attn,mlp")
    return tuple(p for t in TARGETS if t in names for p in TARGETS[t])


__all__ = [
    "FAMILIES",
    "SUPPORTED_MODEL_TYPES",
    "QK_NORM",
    "DecoderAdapter",
    "check_family_forms",
    "get_adapter",
]

#: How each family normalizes queries and keys (`families.Family.qk_norm`); families absent have no q/k norm.
QK_NORM = {name: f.qk_norm for name, f in FAMILIES.items() if f.qk_norm}


def check_family_forms(model_type: str | None, method: str, attention: str, targets: str) -> None:
    """Refuse, in one line and before any weight is read, a form this family cannot take
    (`families.form_refusal`: a form that would silently make another model than the method's, or that the
    family's modules cannot hold)."""
    reason = form_refusal(model_type, method, attention, target_projections(targets))
    if reason:
        raise UserError(reason)


@dataclass(frozen=True)
class ProjectionGeometry:
    """Shapes of a layer's projections (the MLP's too, when `intermediate_size` is known)."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int = 0

    def shape(self, projection: str) -> tuple[int, int]:
        """(out, in) of a projection weight, in nn.Linear orientation."""
        q_dim = self.num_heads * self.head_dim
        kv_dim = self.num_kv_heads * self.head_dim
        return {
            "q_proj": (q_dim, self.hidden_size),
            "k_proj": (kv_dim, self.hidden_size),
            "v_proj": (kv_dim, self.hidden_size),
            "o_proj": (self.hidden_size, q_dim),
            "gate_proj": (self.intermediate_size, self.hidden_size),
            "up_proj": (self.intermediate_size, self.hidden_size),
            "down_proj": (self.hidden_size, self.intermediate_size),
        }[projection]

    def input_size(self, kind: str) -> int:
        """Width of an input kind of INPUT_OF (the size of its autocorrelation)."""
        return {
            "attn": self.hidden_size,
            "o": self.num_heads * self.head_dim,
            "mlp": self.hidden_size,
            "down": self.intermediate_size,
        }[kind]


def geometry_from_config(config) -> ProjectionGeometry:
    """The projection shapes from a transformers config (no model needed: `plan` and `inspect` use it too)."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    intermediate = getattr(config, "intermediate_size", None) or 0
    return ProjectionGeometry(config.hidden_size, heads, kv_heads, head_dim, intermediate)


def keep_heads_per_kv_head(attention: nn.Module) -> None:
    """The query heads each KV head serves, from the projections' sizes (`--attention heads` keeps fewer query
    heads in some layers; transformers' attention reads `num_key_value_groups` to repeat the keys and values)."""
    q, k = getattr(attention, "q_proj", None), getattr(attention, "k_proj", None)
    if (
        hasattr(attention, "num_key_value_groups")
        and hasattr(q, "out_features")
        and hasattr(k, "out_features")
    ):
        attention.num_key_value_groups = q.out_features // k.out_features


#: The description of a model outside the registry: the common layout, so that `_check` names what is missing.
GENERIC = Family("", "", "", "")


class DecoderAdapter:
    """Hugging Face decoder-only models of a registered family (`families.FAMILIES`)."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.config = model.config
        self.model_type = getattr(self.config, "model_type", type(model).__name__)
        self.family = family_of(self.model_type) or GENERIC
        self._check()

    # -- structure -------------------------------------------------------------------------------
    @property
    def decoder(self) -> nn.Module:
        """The decoder without its LM head (the model itself where it is given without one)."""
        return getattr(self.model, self.family.decoder, self.model)

    @property
    def layers(self) -> nn.ModuleList:
        return getattr(self.decoder, self.family.layers)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def attention(self, layer_index: int) -> nn.Module:
        return get_path(self.layers[layer_index], self.family.attention)

    def mlp(self, layer_index: int) -> nn.Module | None:
        """The layer's MLP block (an MoE's: its router and experts)."""
        return getattr(self.layers[layer_index], self.family.mlp, None)

    def path_in_layer(self, name: str) -> str:
        """Where projection `name` is inside a decoder layer, e.g. `self_attn.q_proj` (`self_attn.qkv_proj.q_proj`
        where it is fused)."""
        block = self.family.mlp if name in MLP_PROJECTIONS else self.family.attention
        fused = self.family.fused_into(name)
        return f"{block}.{fused}.{name}" if fused else f"{block}.{name}"

    def block_of(self, layer_index: int, name: str) -> nn.Module:
        """The submodule holding projection `name`: the attention block, the MLP for gate/up/down, or the view of
        a fused projection that holds it."""
        return get_path(self.layers[layer_index], self.path_in_layer(name).rpartition(".")[0])

    def projection(self, layer_index: int, name: str) -> nn.Module:
        return getattr(self.block_of(layer_index, name), name)

    def find_projection(self, layer_index: int, name: str) -> nn.Module | None:
        """The projection, or None where the layer has none of that name (an MoE's MLP)."""
        try:
            return self.projection(layer_index, name)
        except AttributeError:
            return None

    def projection_path(self, layer_index: int, name: str) -> str:
        """Fully qualified module name, e.g. `model.layers.3.self_attn.q_proj`."""
        for fqn, module in self.model.named_modules():
            if module is self.projection(layer_index, name):
                return fqn
        raise KeyError(name)

    def set_projection(self, layer_index: int, name: str, module: nn.Module) -> None:
        setattr(self.block_of(layer_index, name), name, module)
        if name in ("q_proj", "k_proj"):
            keep_heads_per_kv_head(self.attention(layer_index))

    @property
    def final_norm(self) -> nn.Module:
        return getattr(self.decoder, self.family.final_norm)

    @property
    def unembedding(self) -> nn.Module:
        return self.model.get_output_embeddings()

    @property
    def geometry(self) -> ProjectionGeometry:
        return geometry_from_config(self.config)

    def fused_sizes(self) -> dict[str, dict[str, int]]:
        """Fused module -> {projection: output rows} of the base architecture (what `_split_fused` cuts)."""
        g = self.geometry
        return {fused: {p: g.shape(p)[0] for p in parts} for fused, parts in self.family.fused.items()}

    def _split_fused(self) -> None:
        """Each fused projection of a layer as a `FusedLinear` of plain projections (once: a view already split
        stays as it is)."""
        for fused, sizes in self.fused_sizes().items():
            block_name = self.path_in_layer(next(iter(sizes))).split(".")[0]
            for layer in self.layers:
                block = get_path(layer, block_name)
                module = getattr(block, fused, None)
                if isinstance(module, nn.Linear):
                    setattr(block, fused, FusedLinear.split(module, sizes))

    def check_mlp(self) -> None:
        """`--targets mlp` needs gated MLPs with separate gate/up/down projections of the config's sizes."""
        g = self.geometry
        for i in range(self.num_layers):
            for name in MLP_PROJECTIONS:
                module = self.find_projection(i, name)
                if not isinstance(module, nn.Linear) or tuple(module.weight.shape) != g.shape(name):
                    raise UserError(
                        f"--targets mlp: layer {i} has no {self.path_in_layer(name)} of shape "
                        f"{list(g.shape(name))} ('{self.model_type}' models are supported for attention only): "
                        "use --targets attn"
                    )

    # -- parameter accounting -----------------------------------------------------------------------
    def target_parameter_count(self, projections: tuple[str, ...] = PROJECTIONS) -> int:
        """Numbers stored by the targeted projections (weights and biases; by default the attention's),
        counting shared tensors once."""
        seen: set[int] = set()
        total = 0
        for i in range(self.num_layers):
            for name in projections:
                for p in self.projection(i, name).parameters():
                    if id(p) not in seen:
                        seen.add(id(p))
                        total += p.numel()
        return total

    # -- validation -----------------------------------------------------------------------------------
    def _check(self) -> None:
        arch = type(self.model).__name__
        try:
            layers = self.layers
        except AttributeError:
            layers = None
        if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
            raise UserError(
                f"unsupported architecture '{arch}' (model_type '{self.model_type}'): no decoder layers "
                f"found; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        self._split_fused()
        for i in range(len(layers)):
            missing = [n for n in PROJECTIONS if self.find_projection(i, n) is None]
            if missing:
                raise UserError(
                    f"unsupported architecture '{arch}' (model_type '{self.model_type}'): layer {i} has no "
                    f"{self.path_in_layer(missing[0])}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
                )
        try:
            has_norm = self.final_norm is not None
        except AttributeError:
            has_norm = False
        if not has_norm or self.model.get_output_embeddings() is None:
            raise UserError(
                f"unsupported architecture '{arch}' (model_type '{self.model_type}'): no final norm or "
                "unembedding for the logit lens"
            )


def get_adapter(model: nn.Module) -> DecoderAdapter:
    return DecoderAdapter(model)
