"""The model families masa-compress knows: one small description each, and the only place in the library where a
family's module paths are written (`tests/check_structure.py` finds none elsewhere). The adapter
(`adapters.py`) reads them for capture, the methods, offloading and export; the checkpoint's remote code carries
its own copy of the few it needs (`remote_code/modeling_masa.py`: it must run without masa-compress), which a
test keeps equal to this one.

A family says where its decoder layers, attention and MLP blocks and final norm are; how it normalizes queries
and keys (per head, or across all heads at once); which of its projections transformers fuses into one module
(Phi-3's `qkv_proj`, `gate_up_proj`: the adapter splits them into views of q/k/v and gate/up when the model is
loaded); whether its MLP is a mixture of experts; and its llama.cpp architecture and DeciLM layout, if any. From
these, `form_refusal` says which forms it cannot take, in one line naming the form, the family and what works
instead: the refusals are derived, never listed by hand.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Form:
    """A form of compression a family may take (a column of the README's support matrix), as `form_refusal`
    reads it: the method, the attention's form and the targets (projection types); `--layerwise` runs every form
    a family takes (its column: the default form, layer by layer)."""

    key: str
    heading: str
    method: str = "masa"
    attention: str = "factors"
    targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")


_ATTN_MLP = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
#: The forms of the README's support matrix, in its order (`--native` at 20% keeps every head of a tiny model;
#: at 50% of the model whole heads must go).
FORMS = (
    Form("attention", "attention (default)"),
    Form("model", "whole model", targets=_ATTN_MLP),
    Form("native", "`--native`", attention="heads", targets=_ATTN_MLP),
    Form("flap", "`--method flap`", method="flap"),
    Form("modegpt", "`--method modegpt`", method="modegpt"),
    Form("svd-llm", "`--method svd-llm`", method="svd-llm"),
    Form("layerwise", "`--layerwise`"),
)


@dataclass(frozen=True)
class Family:
    """Where a family keeps what the stages read, relative to its causal-LM model (transformers' classes)."""

    model_type: str
    title: str  # how the docs name it
    config_class: str  # transformers' classes, by name (the remote code imports only the checkpoint's)
    model_class: str
    decoder: str = "model"  # the decoder without its LM head
    layers: str = "layers"  # in the decoder: the decoder layers (an nn.ModuleList)
    final_norm: str = "norm"  # in the decoder
    attention: str = "self_attn"  # in a layer: the block holding q/k/v/o
    mlp: str = "mlp"  # in a layer: the block holding gate/up/down (or the experts and their router)
    #: How q and k are normalized before the rotary embedding: `per_head`, one RMSNorm over each head's
    #: `head_dim` (Qwen3, Gemma 3); `across_heads`, one over all heads' dimensions at once (OLMo 2's q_norm/k_norm,
    #: of width heads x head_dim); None: not at all.
    qk_norm: str | None = None
    #: Projections transformers fuses: fused module (in its block) -> the projections it holds, in output order.
    fused: dict[str, tuple[str, ...]] = field(default_factory=dict)
    experts: bool = False  # the MLP is a mixture of experts: a router and experts, kept whole
    llama_cpp: str | None = None  # llama.cpp's architecture for a model of uniform layers (GGUF export)
    deci: bool = False  # the DeciLM / Nemotron-NAS layout holds it (`export --layout deci`, vLLM)
    qkv_bias: bool = False  # q/k/v biases by construction (Qwen2), else as `attention_bias` says
    #: The attention's and the MLP's outputs normalized before they are added to the residual stream (Gemma 2 and
    #: 3, OLMo 2): `--refit stream`'s targets assume they are added as they are (its check on the original
    #: layers refuses such a family), so `--native` keeps `--refit calibration` there.
    block_output_norm: bool = False

    def fused_into(self, projection: str) -> str | None:
        """The fused module holding `projection`, or None where it is a module of its own."""
        return next((name for name, parts in self.fused.items() if projection in parts), None)


FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in (
        Family("llama", "Llama", "LlamaConfig", "LlamaForCausalLM", llama_cpp="llama", deci=True),
        Family("mistral", "Mistral", "MistralConfig", "MistralForCausalLM", llama_cpp="llama", deci=True),
        Family("qwen2", "Qwen2", "Qwen2Config", "Qwen2ForCausalLM", llama_cpp="qwen2", qkv_bias=True),
        Family("qwen3", "Qwen3", "Qwen3Config", "Qwen3ForCausalLM", qk_norm="per_head", llama_cpp="qwen3"),
        Family("gemma", "Gemma", "GemmaConfig", "GemmaForCausalLM", llama_cpp="gemma"),
        Family(
            "gemma2",
            "Gemma 2",
            "Gemma2Config",
            "Gemma2ForCausalLM",
            llama_cpp="gemma2",
            block_output_norm=True,
        ),
        Family(
            "gemma3_text",
            "Gemma 3",
            "Gemma3TextConfig",
            "Gemma3ForCausalLM",
            qk_norm="per_head",
            llama_cpp="gemma3",
            block_output_norm=True,
        ),
        Family("smollm3", "SmolLM3", "SmolLM3Config", "SmolLM3ForCausalLM", llama_cpp="smollm3"),
        Family(
            "olmo2",
            "OLMo 2",
            "Olmo2Config",
            "Olmo2ForCausalLM",
            qk_norm="across_heads",
            llama_cpp="olmo2",
            block_output_norm=True,
        ),
        Family(
            "phi3",
            "Phi-3",
            "Phi3Config",
            "Phi3ForCausalLM",
            fused={"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")},
            llama_cpp="phi3",
        ),  # fmt: skip
        Family("mixtral", "Mixtral", "MixtralConfig", "MixtralForCausalLM", experts=True, llama_cpp="llama"),
        Family(
            "qwen3_moe",
            "Qwen3-MoE",
            "Qwen3MoeConfig",
            "Qwen3MoeForCausalLM",
            qk_norm="per_head",
            experts=True,
            llama_cpp="qwen3moe",
        ),
    )
}
SUPPORTED_MODEL_TYPES = tuple(FAMILIES)
#: The parameters of an MoE's `experts` module (transformers stacks every expert's weights): gate and up fused
#: (experts x 2·width x hidden, gate rows first), and down (experts x hidden x width).
EXPERT_PARAMETERS = ("gate_up_proj", "down_proj")


def family_of(model_type: str | None) -> Family | None:
    return FAMILIES.get(model_type or "")


def get_path(root, path: str):
    """The submodule at a dotted path (`self_attn.qkv_proj`)."""
    for part in path.split("."):
        root = getattr(root, part)
    return root


def form_refusal(model_type: str | None, method: str, attention: str, targets: tuple[str, ...]) -> str | None:
    """Why `model_type` cannot take this form (one line naming the form, the family and what works instead), or
    None. `targets` are projection names (`adapters.target_projections`).

    - An MoE's MLP is its experts: only the attention is compressed.
    - MoDeGPT keeps q/k dimensions inside each head and zero-fills the rest: a q/k RMSNorm then averages over the
      zeros too and rescales the kept dimensions (not the method's model).
    - Whole query heads (`--native`, FLAP) on a norm across heads: removing a head changes every other head's RMS;
      in a fused qkv_proj: transformers splits its output by the config's head count."""
    family = family_of(model_type)
    if family is None:
        return None
    name = family.model_type
    if family.experts and any(p in targets for p in ("gate_proj", "up_proj", "down_proj")):
        asked = "attn,mlp" if "q_proj" in targets else "mlp"
        return (
            f"--targets {asked} on {name}: its MLP is a mixture of experts, kept whole (router and experts): "
            "use --targets attn"
        )
    if method == "modegpt" and family.qk_norm:
        flap = ", or --method flap" if family.qk_norm == "per_head" else ""  # FLAP removes whole heads
        return (
            f"--method modegpt on {name}: its q/k RMSNorm ({family.qk_norm.replace('_', ' ')}) would rescale the "
            f"q/k dimensions MoDeGPT keeps; use the default --method masa{flap}"
        )
    removes_heads = "q_proj" in targets and (attention == "heads" or method == "flap")
    form = "--method flap" if method == "flap" else "--native"
    instead = (
        "use --method flap --targets mlp, or the default --method masa"
        if method == "flap"
        else "use --targets mlp --native (the attention whole), or drop --native"
    )
    if removes_heads and family.qk_norm == "across_heads":
        return (
            f"{form} on {name}: its q_norm/k_norm normalize across all heads at once, so removing a query head "
            f"changes the others; {instead}"
        )
    if removes_heads and family.fused_into("q_proj"):
        return (
            f"{form} on {name}: its fused {family.fused_into('q_proj')} is split by the config's head count, so "
            f"every layer keeps all its query heads; {instead}"
        )
    return None


def refusal_of(model_type: str, form: Form) -> str | None:
    """`form_refusal` for one of `FORMS`."""
    return form_refusal(model_type, form.method, form.attention, form.targets)
