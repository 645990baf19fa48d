"""Architecture adapters: the stages ask these for layers, projections, norms and the unembedding.

Adding a model family is one small class. Everything Hugging Face ships as a decoder-only model
whose layers hold `self_attn.{q,k,v,o}_proj` (Llama, Mistral, Qwen2/3, Gemma 1-3, SmolLM) is
covered by `DecoderAdapter`; anything else is refused with a one-line error naming it.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from compressor.errors import UserError

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
# q/k/v read the post-input_layernorm hidden state; o reads the attention output.
ATTN_INPUT_PROJECTIONS = ("q_proj", "k_proj", "v_proj")

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


@dataclass(frozen=True)
class AttentionGeometry:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int

    def shape(self, projection: str) -> tuple[int, int]:
        """(out, in) of a projection weight, in nn.Linear orientation."""
        q_dim = self.num_heads * self.head_dim
        kv_dim = self.num_kv_heads * self.head_dim
        return {
            "q_proj": (q_dim, self.hidden_size),
            "k_proj": (kv_dim, self.hidden_size),
            "v_proj": (kv_dim, self.hidden_size),
            "o_proj": (self.hidden_size, q_dim),
        }[projection]


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

    def projection(self, layer_index: int, name: str) -> nn.Module:
        return getattr(self.attention(layer_index), name)

    def projection_path(self, layer_index: int, name: str) -> str:
        """Fully qualified module name, e.g. `model.layers.3.self_attn.q_proj`."""
        for fqn, module in self.model.named_modules():
            if module is self.projection(layer_index, name):
                return fqn
        raise KeyError(name)

    def set_projection(self, layer_index: int, name: str, module: nn.Module) -> None:
        setattr(self.attention(layer_index), name, module)

    @property
    def final_norm(self) -> nn.Module:
        return self.decoder.norm

    @property
    def unembedding(self) -> nn.Module:
        return self.model.get_output_embeddings()

    @property
    def geometry(self) -> AttentionGeometry:
        cfg = self.config
        heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
        return AttentionGeometry(cfg.hidden_size, heads, kv_heads, head_dim)

    # -- parameter accounting -----------------------------------------------------------------------
    def attention_parameter_count(self) -> int:
        """Numbers stored by all attention projections (weights and biases), counting shared tensors once."""
        seen: set[int] = set()
        total = 0
        for i in range(self.num_layers):
            for name in PROJECTIONS:
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
