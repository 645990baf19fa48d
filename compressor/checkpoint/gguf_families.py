"""What a GGUF export writes differently per family, so that llama.cpp's own architecture computes transformers'
model: the metadata keys beyond the common ones, the tensors transformed on the way (llama.cpp's conventions,
as its converter `convert_hf_to_gguf.py` writes them), and the configurations llama.cpp cannot run (refused in
one line before anything is written).

The transforms, each checked by llama.cpp's log-probabilities on a tiny model (`tests/test_gguf_export.py`):
- Gemma's RMSNorms multiply by `1 + w` in transformers and by the stored weight in llama.cpp: stored `1 + w`.
- Phi-3's fused projections, split into views when the model is loaded (`FusedLinear`), are fused again
  (`attn_qkv`: q, k, v rows; `ffn_up`: gate rows then up rows, which llama.cpp's swiglu splits in halves).
- A mixture of experts' `gate_up_proj` (experts x 2·width x hidden) becomes `ffn_gate_exps` and `ffn_up_exps`
  (experts x width x hidden each), its `down_proj` `ffn_down_exps`; the router is `ffn_gate_inp`.
- The rope rows are permuted where llama.cpp rotates interleaved pairs (`permute_for_rope`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np

from compressor.modeling.adapters import geometry_from_config
from compressor.modeling.families import EXPERT_PARAMETERS, family_of
from compressor.runtime.errors import UserError

#: llama.cpp architectures whose rope rotates interleaved pairs (transformers rotates halves): Q/K rows permuted.
PERMUTED_ROPE = {"llama", "deci", "smollm3"}
#: Families llama.cpp runs as every GGUF of them runs, a little apart from transformers: what the export says.
#: Each file is llama.cpp's own conversion, tensor for tensor and logit for logit (tests/test_llama_cpp_tools.py,
#: against the vendored `convert_hf_to_gguf.py`); the gap to transformers is the engine's: its GELU goes through a
#: float16 table (on tiny random models with weights far from their init, 1.1e-2 nats per token at most for Gemma,
#: 5.4e-3 for Gemma 2; 1.7e-3 and 4.5e-4 once transformers rounds its GELU as the table does).
_GELU_TABLE = (
    "llama.cpp computes {name}'s GELU through a float16 table, so its log-probabilities differ slightly from "
    "transformers' (the engine's, in every {name} GGUF; the file is llama.cpp's own conversion)"
)
ENGINE_GAP = {
    "gemma": _GELU_TABLE.format(name="Gemma"),
    "gemma2": _GELU_TABLE.format(name="Gemma 2"),
    "gemma3_text": _GELU_TABLE.format(name="Gemma 3"),
}
#: Families whose layers `deci` (llama.cpp's per-layer MLP widths and head counts) computes exactly: plain
#: llama layers (q/k/v biases allowed). The others' per-layer shapes are refused (`per_layer_refusal`).
PER_LAYER_FAMILIES = ("llama", "mistral", "qwen2")
#: Families whose RMSNorm weights transformers applies as `1 + w` (llama.cpp multiplies by the weight itself).
NORM_PLUS_ONE = ("gemma", "gemma2", "gemma3_text")
#: The activation llama.cpp's graph applies per family (transformers' name for it).
ACTIVATION = {"gemma": "gelu_pytorch_tanh", "gemma2": "gelu_pytorch_tanh", "gemma3_text": "gelu_pytorch_tanh"}
#: Families whose llama.cpp graph reads the embedding as the output matrix (it has no `output.weight`).
TIED_OUTPUT = ("gemma", "gemma2")
#: llama.cpp's fixed sliding-window layer patterns (every n-th layer full): Gemma 2 alternates, Gemma 3 has 5:1.
SWA_PATTERN = {"gemma2": 2, "gemma3_text": 6}
#: The number of layers by which llama.cpp recognizes a 27B Gemma (its attention scale differs).
GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3_text": 62}
#: llama.cpp's sliding-window layers of Gemma 3 use this rope base whatever the file says.
GEMMA3_LOCAL_ROPE_BASE = 10000.0
#: SmolLM3 in llama.cpp skips the rope in every 4th layer (`n_no_rope_layer_step`, not read from the file).
SMOLLM3_NO_ROPE_STEP = 4


def per_layer_refusal(model_type: str) -> str | None:
    """Why a model of this family with per-layer MLP widths or head counts has no GGUF form, or None."""
    if model_type in PER_LAYER_FAMILIES:
        return None
    family = family_of(model_type)
    architecture = family.llama_cpp if family else model_type
    return (
        f"model_type '{model_type}' with per-layer MLP widths or head counts: llama.cpp's {architecture} takes one "
        f"width for all layers and its per-layer `deci` runs plain llama layers only: export --format hf, or "
        "compress without --native"
    )


def rope_parameters(config) -> dict:
    """The rope parameters of the full-attention layers (Gemma 3 keeps one set per layer type)."""
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    if isinstance(params.get("full_attention"), dict):
        params = dict(params["full_attention"])
    return params


def rope_theta(config) -> float:
    return float(rope_parameters(config).get("rope_theta", getattr(config, "rope_theta", 10000.0)))


def rope_dimensions(config, head_dim: int) -> int:
    """The rotated dimensions of a head: all of them, or Phi's partial rotary share (as llama.cpp counts it)."""
    share = rope_parameters(config).get(
        "partial_rotary_factor", getattr(config, "partial_rotary_factor", None)
    )
    if share is None or float(share) == 1.0:
        return head_dim
    return int(float(share) * config.hidden_size) // config.num_attention_heads


def rope_type(config) -> str:
    params = rope_parameters(config)
    return str(params.get("rope_type", params.get("type", "default")) or "default")


def check_exportable(config, num_layers: int, budgeted: bool = False) -> None:
    """A one-line error for what llama.cpp's architecture of this family would compute differently (or, for a
    mixture of experts, what the export does not write: a byte budget, whose types are per 2-D matrix)."""
    name = config.model_type
    family = family_of(name)
    if budgeted and family is not None and family.experts:
        raise UserError("a byte budget for a mixture of experts is not implemented: export one --type")
    prefix = f"GGUF export of {name}:"
    act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu")
    if act != ACTIVATION.get(name, "silu"):
        raise UserError(
            f"{prefix} activation '{act}': llama.cpp's graph applies {ACTIVATION.get(name, 'silu')}"
        )
    kind = rope_type(config)
    allowed = {"phi3": ("default", "longrope"), "gemma3_text": ("default", "linear")}.get(name, ("default",))
    if name in ("llama", "mistral"):
        allowed = ("default", "llama3")
    if kind not in allowed:
        raise UserError(f"{prefix} rope scaling '{kind}': written here for {', '.join(allowed)} only")
    if name == "smollm3":
        expected = [int((i + 1) % SMOLLM3_NO_ROPE_STEP != 0) for i in range(num_layers)]
        if list(getattr(config, "no_rope_layers", None) or expected) != expected:
            raise UserError(
                f"{prefix} no_rope_layers {config.no_rope_layers}: llama.cpp skips the rope in every "
                f"{SMOLLM3_NO_ROPE_STEP}th layer exactly"
            )
    if name in TIED_OUTPUT and not getattr(config, "tie_word_embeddings", True):
        raise UserError(
            f"{prefix} tie_word_embeddings false: llama.cpp's {family.llama_cpp} reads the embedding as its "
            "output matrix, so an lm_head of its own has no place: export --format hf"
        )
    if name in SWA_PATTERN:
        _check_gemma(config, num_layers, prefix)
    if name == "qwen3_moe" and not getattr(config, "norm_topk_prob", False):
        raise UserError(
            f"{prefix} norm_topk_prob false: llama.cpp's qwen3moe renormalizes the chosen experts' weights"
        )
    if name == "qwen3_moe":
        if (
            list(getattr(config, "mlp_only_layers", None) or [])
            or getattr(config, "decoder_sparse_step", 1) != 1
        ):
            raise UserError(
                f"{prefix} dense MLP layers among the experts: llama.cpp's qwen3moe has experts in all"
            )
    if getattr(config, "sliding_window", None) and name not in (*SWA_PATTERN, "phi3"):
        if getattr(config, "use_sliding_window", True) is not False and name != "mistral":
            raise UserError(f"{prefix} sliding_window {config.sliding_window}: not written for this family")


def _check_gemma(config, num_layers: int, prefix: str) -> None:
    name = config.model_type
    pattern = SWA_PATTERN[name]
    expected = [
        "full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(num_layers)
    ]
    layer_types = list(getattr(config, "layer_types", None) or expected)
    if getattr(config, "sliding_window", None) and layer_types != expected:
        raise UserError(
            f"{prefix} layer_types {layer_types}: llama.cpp's sliding layers are all but every {pattern}th"
        )
    head_dim = config.head_dim
    big = num_layers == GEMMA_27B_LAYERS[name]
    scale = config.hidden_size // config.num_attention_heads if big else head_dim
    if float(config.query_pre_attn_scalar) != float(scale):
        raise UserError(
            f"{prefix} query_pre_attn_scalar {config.query_pre_attn_scalar}: llama.cpp scales the queries by "
            f"1/sqrt({scale}) for this shape"
        )
    if name == "gemma3_text":
        if getattr(config, "attn_logit_softcapping", None):
            raise UserError(f"{prefix} attn_logit_softcapping: llama.cpp's gemma3 has none")
        params = getattr(config, "rope_parameters", None) or {}
        local = params.get("sliding_attention", {}) if isinstance(params, dict) else {}
        base = float(local.get("rope_theta", getattr(config, "rope_local_base_freq", GEMMA3_LOCAL_ROPE_BASE)))
        if base != GEMMA3_LOCAL_ROPE_BASE or local.get("rope_type", "default") != "default":
            raise UserError(
                f"{prefix} sliding layers' rope (base {base:g}, {local.get('rope_type', 'default')}): llama.cpp's are "
                f"fixed at base {GEMMA3_LOCAL_ROPE_BASE:g}, unscaled"
            )


def write_family_fields(writer, config, architecture: str, experts: tuple[int, int] | None) -> None:
    """The metadata keys this family's llama.cpp architecture reads beyond the common ones (`_write_header`)."""
    import gguf

    name = config.model_type
    if experts is not None:
        writer.add_expert_count(experts[0])
        writer.add_expert_used_count(experts[1])
    if name == "qwen3_moe":
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
        writer.add_expert_weights_norm(bool(getattr(config, "norm_topk_prob", False)))
    if name in SWA_PATTERN:
        if getattr(config, "attn_logit_softcapping", None):
            writer.add_attn_logit_softcapping(float(config.attn_logit_softcapping))
        if getattr(config, "final_logit_softcapping", None):
            writer.add_final_logit_softcapping(float(config.final_logit_softcapping))
        if getattr(config, "sliding_window", None):
            writer.add_sliding_window(int(config.sliding_window))
    if name == "gemma3_text" and getattr(config, "sliding_window", None):
        writer.add_rope_freq_base_swa(GEMMA3_LOCAL_ROPE_BASE)  # as llama.cpp's converter writes it
    if name == "gemma3_text" and rope_type(config) == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(rope_parameters(config)["factor"]))
    if name == "phi3":
        params = rope_parameters(config)
        original = int(
            params.get("original_max_position_embeddings", config.original_max_position_embeddings)
        )
        writer.add_rope_scaling_orig_ctx_len(original)
        writer.add_sliding_window(int(getattr(config, "sliding_window", None) or 0))
        scale = config.max_position_embeddings / original
        if rope_type(config) == "longrope":
            factor = params.get("attention_factor")
            if factor is None:
                factor = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1.0 else 1.0
            writer.add_rope_scaling_attn_factors(float(factor))


def rope_tensors(config, head_dim: int) -> Iterator[tuple[str, np.ndarray, str]]:
    """Phi-3's longrope factors: `rope_factors_long` / `rope_factors_short` (llama.cpp picks by context)."""
    import gguf

    if config.model_type != "phi3" or rope_type(config) != "longrope":
        return
    params = rope_parameters(config)
    half = rope_dimensions(config, head_dim) // 2
    for key, tensor in (("long_factor", gguf.MODEL_TENSOR.ROPE_FACTORS_LONG),
                        ("short_factor", gguf.MODEL_TENSOR.ROPE_FACTORS_SHORT)):  # fmt: skip
        factors = np.asarray(params[key], dtype=np.float32)
        if factors.shape != (half,):
            raise UserError(f"rope scaling longrope: {key} has {factors.size} values, {half} expected")
        yield gguf.TENSOR_NAMES[tensor] + ".weight", factors, ""


def family_state(state: dict, model_type: str) -> Iterator[tuple[str, str, np.ndarray, str]]:
    """(module path, parameter name, fp32 array, importance path) of every tensor, in transformers' order, with
    this family's transforms: norms shifted by one, fused parts concatenated again (under the fused module's
    path; importance from its first part, which reads the same input), experts' `gate_up_proj` split."""
    import torch

    family = family_of(model_type)
    fused = family.fused if family else {}
    pending: dict[str, dict[str, np.ndarray]] = {}
    for key, tensor in state.items():
        base, _, suffix = key.rpartition(".")
        array = tensor.detach().to(torch.float32).cpu().numpy()
        parent, _, part = base.rpartition(".")
        owner = parent.rpartition(".")[2]
        if owner in fused and part in fused[owner]:
            parts = pending.setdefault(f"{parent}.{suffix}", {})
            parts[part] = array
            if len(parts) == len(fused[owner]):
                whole = np.concatenate([parts[p] for p in fused[owner]], axis=0)
                yield parent, suffix, whole, f"{parent}.{fused[owner][0]}"
            continue
        if family and family.experts and base.endswith(".experts"):
            if suffix == EXPERT_PARAMETERS[0]:
                gate, up = np.split(array, 2, axis=1)
                yield base, "gate_exps", np.ascontiguousarray(gate), base
                yield base, "up_exps", np.ascontiguousarray(up), base
                continue
            if suffix == EXPERT_PARAMETERS[1]:
                yield base, "down_exps", array, base
                continue
        if model_type in NORM_PLUS_ONE and base.endswith("norm") and array.ndim == 1:
            array = array + 1.0
        yield base, suffix, array, base


#: GGUF tensor names of the experts (`family_state`'s parameter names for them).
EXPERT_TENSORS = {"gate_exps": "FFN_GATE_EXP", "up_exps": "FFN_UP_EXP", "down_exps": "FFN_DOWN_EXP"}


def expert_tensor_name(suffix: str, layer: int) -> str:
    import gguf

    return gguf.TENSOR_NAMES[getattr(gguf.MODEL_TENSOR, EXPERT_TENSORS[suffix])].format(bid=layer) + ".weight"


def permute_for_rope(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Reorder the rows of a Q or K projection (or its bias) from transformers' rotate-half layout to llama.cpp's
    interleaved pairs: within each head, row i of the first half and row i of the second half become
    neighbours (the same permutation as llama.cpp's converter)."""
    shape = weight.shape
    return weight.reshape(n_heads, 2, shape[0] // n_heads // 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def llama3_rope_factors(config) -> np.ndarray | None:
    """The per-frequency factors llama.cpp reads from `rope_freqs.weight` for Llama 3's rope scaling; None for
    the default rope. Any other scaling is a one-line error (its GGUF keys are not written here)."""
    params = rope_parameters(config)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type in (None, "default") or config.model_type not in ("llama", "mistral"):
        return None  # (other families' scalings: `write_family_fields`)
    if rope_type != "llama3":
        raise UserError(f"rope scaling '{rope_type}': GGUF export writes the default rope and Llama 3's only")
    base = float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
    dim = geometry_from_config(config).head_dim
    factor = float(params.get("factor", 8.0))
    low_freq_factor = float(params.get("low_freq_factor", 1.0))
    high_freq_factor = float(params.get("high_freq_factor", 4.0))
    old_context = int(params.get("original_max_position_embeddings", 8192))
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            factors.append(1.0)
        elif wavelen > low_freq_wavelen:
            factors.append(factor)
        else:
            smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            factors.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.asarray(factors, dtype=np.float32)
