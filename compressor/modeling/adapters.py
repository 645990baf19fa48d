"""Architecture adapters: the stages ask these for layers, projections, norms and the unembedding.

Adding a model family is one small class. Everything Hugging Face ships as a decoder-only model
whose layers hold `self_attn.{q,k,v,o}_proj` (Llama, Mistral, Qwen2/3, Gemma 1-3, SmolLM) is
covered by `DecoderAdapter`; anything else is refused with a one-line error naming it.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

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


SUPPORTED_MODEL_TYPES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma",
    "gemma2",
    "gemma3_text",
    "smollm3",
    "olmo2",
)

#: How a family normalizes queries and keys before the rotary embedding (transformers' modeling files):
#: `per_head`, one RMSNorm over each head's `head_dim` (Qwen3, Gemma 3); `across_heads`, one RMSNorm over all heads'
#: dimensions at once (OLMo 2's q_norm/k_norm, of width heads x head_dim). Families absent have none.
QK_NORM = {"qwen3": "per_head", "gemma3_text": "per_head", "olmo2": "across_heads"}


def check_family_forms(model_type: str | None, method: str, attention: str, targets: str) -> None:
    """Refuse, in one line and before any weight is read, a form that would silently make another model of this
    family than the method's: the q/k norms rescale what a form keeps.

    - MoDeGPT keeps q/k dimensions inside each head and zero-fills the rest: a q/k RMSNorm then averages over the
      zeros too and rescales the kept dimensions (not the method's model).
    - Whole query heads (`--native`) on a norm across heads: removing a head changes every other head's RMS."""
    scope = QK_NORM.get(model_type or "")
    if scope is None:
        return
    if method == "modegpt":
        raise UserError(
            f"--method modegpt on {model_type}: its q/k RMSNorm ({scope.replace('_', ' ')}) would rescale the q/k "
            "dimensions MoDeGPT keeps; use the default --method masa, or --method flap"
        )
    if attention == "heads" and "q_proj" in target_projections(targets) and scope == "across_heads":
        raise UserError(
            f"--native on {model_type}: its q_norm/k_norm normalize across all heads at once, so removing a query "
            "head changes the others; use --targets mlp --native (the attention whole), or drop --native"
        )


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


class DecoderAdapter:
    """Hugging Face decoder-only models with `model.layers[i].self_attn.{q,k,v,o}_proj`."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.config = model.config
        self.model_type = getattr(self.config, "model_type", type(model).__name__)
        self._check()

    # -- structure -------------------------------------------------------------------------------
    @property
    def decoder(self) -> nn.Module:
        return self.model.model if hasattr(self.model, "model") else self.model

    @property
    def layers(self) -> nn.ModuleList:
        return self.decoder.layers

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def attention(self, layer_index: int) -> nn.Module:
        return self.layers[layer_index].self_attn

    def block_of(self, layer_index: int, name: str) -> nn.Module:
        """The submodule holding projection `name`: self_attn, or mlp for gate/up/down."""
        layer = self.layers[layer_index]
        return layer.mlp if name in MLP_PROJECTIONS else layer.self_attn

    def projection(self, layer_index: int, name: str) -> nn.Module:
        return getattr(self.block_of(layer_index, name), name)

    def projection_path(self, layer_index: int, name: str) -> str:
        """Fully qualified module name, e.g. `model.layers.3.self_attn.q_proj`."""
        for fqn, module in self.model.named_modules():
            if module is self.projection(layer_index, name):
                return fqn
        raise KeyError(name)

    def set_projection(self, layer_index: int, name: str, module: nn.Module) -> None:
        block = self.block_of(layer_index, name)
        setattr(block, name, module)
        if name in ("q_proj", "k_proj"):
            keep_heads_per_kv_head(block)

    @property
    def final_norm(self) -> nn.Module:
        return self.decoder.norm

    @property
    def unembedding(self) -> nn.Module:
        return self.model.get_output_embeddings()

    @property
    def geometry(self) -> ProjectionGeometry:
        return geometry_from_config(self.config)

    def check_mlp(self) -> None:
        """`--targets mlp` needs gated MLPs with separate gate/up/down projections of the config's sizes."""
        g = self.geometry
        for i in range(self.num_layers):
            mlp = getattr(self.layers[i], "mlp", None)
            for name in MLP_PROJECTIONS:
                module = getattr(mlp, name, None)
                if not isinstance(module, nn.Linear) or tuple(module.weight.shape) != g.shape(name):
                    raise UserError(
                        f"--targets mlp: layer {i} has no mlp.{name} of shape {list(g.shape(name))} "
                        f"('{self.model_type}' models are supported for attention only): use --targets attn"
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
        layers = getattr(self.decoder, "layers", None)
        if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
            raise UserError(
                f"unsupported architecture '{arch}' (model_type '{self.model_type}'): no decoder layers "
                f"found; supported: decoder-only models with self_attn.q/k/v/o_proj ({', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        for i, layer in enumerate(layers):
            attn = getattr(layer, "self_attn", None)
            missing = [n for n in PROJECTIONS if attn is None or not hasattr(attn, n)]
            if missing:
                raise UserError(
                    f"unsupported architecture '{arch}' (model_type '{self.model_type}'): layer {i} has no "
                    f"self_attn.{missing[0]}; supported: decoder-only models with separate q/k/v/o projections "
                    f"({', '.join(SUPPORTED_MODEL_TYPES)})"
                )
        if not hasattr(self.decoder, "norm") or self.model.get_output_embeddings() is None:
            raise UserError(
                f"unsupported architecture '{arch}' (model_type '{self.model_type}'): no final norm or "
                "unembedding for the logit lens"
            )


def get_adapter(model: nn.Module) -> DecoderAdapter:
    return DecoderAdapter(model)
