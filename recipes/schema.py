"""Recipe schema: per-model settings in YAML, validated at the edge (unknown keys are errors)."""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from compressor.runtime.errors import UserError


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class CalibrationSettings(_Strict):
    source: str = Field("wikipedia", description="text source: 'wikipedia', a file/dir, or a datasets name")
    samples: int = Field(64, ge=1, description="number of calibration windows N")
    mlp_samples: int | None = Field(
        None,
        ge=1,
        description="calibration windows when an MLP projection is targeted (None: `samples`): the MLP's refits "
        "read inputs several times wider than the attention's and gain from more tokens. Unset, it follows the "
        "model's shapes: 256 (compressor/api/model_defaults.py; never below `samples`)",
    )
    seq_len: int = Field(512, ge=8, description="tokens per calibration window T")
    seed: int = Field(0, description="seed for window sampling")
    precision: Literal["model", "bfloat16"] = Field(
        "model",
        description="what the calibration's forward passes compute in: model (its dtype) or bfloat16 (autocast; "
        "the statistics still summed in fp64)",
    )


class EvaluationSettings(_Strict):
    source: str = Field("wikipedia", description="held-out text source (never overlaps calibration)")
    split: Literal["validation", "test"] = Field(
        "test", description="held-out part: validation (for choices) or test (for reported numbers)"
    )
    seq_len: int = Field(512, ge=8, description="tokens per non-overlapping evaluation window")
    max_tokens: int | None = Field(None, ge=8, description="cap on evaluated tokens (None: all)")


class CompressionSettings(_Strict):
    method: str = Field("masa", description="masa | masa-paper | svd-llm | svd | shared-mean")
    groups: int = Field(3, ge=1, description="number of groups of consecutive layers G")
    bases: int = Field(1, ge=0, description="shared atoms per group and projection type B")
    largest_group_bases: int | None = Field(
        None, ge=0, description="atoms for the largest group (paper's best: 2); None = same as bases"
    )
    end_boundaries: bool = Field(
        True,
        description="whether the first/last KL transitions may be group boundaries (paper: yes)",
    )
    logit_lens: Literal["final_norm", "raw"] = Field(
        "final_norm", description="apply the final norm before the unembedding (standard logit lens) or not"
    )
    allocation: Literal["paper", "global", "global-relative", "global-loss"] = Field(
        "global-loss",
        description="paper: Algorithm 1 per (Q,K)/(V,O) pair; global: ranks across all matrices by whitened "
        "energy per parameter; global-relative: the same with each matrix's error relative to its output energy; "
        "global-loss: each matrix's error weighted by its loss sensitivity (mean squared loss gradient at its "
        "output, one backward pass over sensitivity_samples calibration windows; the default, chosen on the "
        "bundled model's validation split, see BENCHMARKS.md)",
    )
    sensitivity_samples: int = Field(
        4,
        ge=1,
        description="allocation global-loss: calibration windows (the first ones) of the backward pass that "
        "measures each projection's loss sensitivity (4: on the bundled model's validation split a tie with 16 "
        "for attention 0.2 and the model 20% smaller, at a quarter of the backward passes; BENCHMARKS.md, "
        "section 6)",
    )
    dense_when_cheaper: bool = Field(
        True,
        description="global allocations: a projection whose factors would cost at least its weight is kept whole "
        "(exact, cheaper) and the numbers saved go to the others",
    )
    atoms: Literal["plain", "whitened"] = Field(
        "plain",
        description="plain: Matrix PCA of the weights (paper); whitened: atoms minimizing the group's output "
        "error (group-summed autocorrelation) with coefficients refit per layer",
    )
    statistics: Literal["original", "sequential"] = Field(
        "original",
        description="original: whitening statistics of the original model (paper); sequential: layer l's "
        "statistics collected on the model whose earlier layers are already compressed",
    )
    targets: Literal["attn", "mlp", "attn,mlp"] = Field(
        "attn",
        description="projections compressed and counted by --ratio: attn (q/k/v/o, the paper), mlp (gate/up/down), "
        "or attn,mlp (every linear projection of the decoder layers, as Basis Sharing does)",
    )
    attention: Literal["factors", "heads"] = Field(
        "factors",
        description="how --method masa compresses the attention (targets attn, attn,mlp). factors: whitened "
        "low-rank factors per matrix (shared on request); heads: each layer keeps whole query heads, the same "
        "number per KV head (at least one), k/v whole, o_proj refit by least squares: a plain attention with "
        "fewer heads, the form engines run (llama.cpp's deci layout), its count per layer decided by the global "
        "allocation",
    )
    mlp: Literal["neurons", "lowrank"] = Field(
        "neurons",
        description="how --method masa compresses the MLP (targets mlp, attn,mlp). neurons: each layer keeps a "
        "subset of its intermediate neurons (their gate/up rows and down columns), down_proj refit by least "
        "squares on the calibration statistics: a smaller, plain MLP, its width per layer decided by the global "
        "allocation; lowrank: whitened low-rank factors of gate/up/down like any other projection",
    )
    uniform_mlp: bool = Field(
        False,
        description="mlp neurons: the same width in every layer, so that the MLP is the base architecture's with a "
        "smaller intermediate_size (export-dense then writes a standard checkpoint)",
    )
    width_multiple: int = Field(
        1,
        ge=1,
        description="mlp neurons: every layer's MLP width a multiple of this (e.g. 32: llama.cpp's q8_0/q5_0/q4_0 "
        "pack rows in blocks of 32 values, so that every down_proj of the export is quantized; 256 for its "
        "k-quants); it must divide the MLP's width",
    )
    neuron_order: Literal["greedy", "greedy-block", "energy"] = Field(
        "greedy",
        description="mlp neurons: the order in which each layer keeps its neurons. greedy: each next neuron the one "
        "that explains the most output energy given those kept (chosen on the bundled model's validation split); "
        "greedy-block: the same greedy choosing 32 neurons per step among the 64 best, all gains then updated "
        "at once (matrix-matrix products: much faster on wide MLPs); energy: by each neuron's own output energy, "
        "about 15x cheaper to compute, a little worse. Unset, it follows the MLP's width: greedy-block from 4096 "
        "neurons (compressor/api/model_defaults.py)",
    )
    refit: Literal["calibration", "stream"] = Field(
        "calibration",
        description="--attention heads' o_proj and --mlp neurons' down_proj: calibration: each refit by least "
        "squares on the original model's statistics; stream: then refit again, layer by layer, on the compressed "
        "model's own inputs over the calibration windows, to bring the residual stream back to the original's "
        "(chosen on the bundled model's validation split for --native: benchmarks/experiments/sequential_refit; "
        "in memory only, the original and the compressed layers run side by side). Unset, --native of the "
        "attention and the MLP takes stream where it can run (compressor/api/run_options.native_refit), every "
        "other run calibration",
    )
    auto_groups: bool = Field(
        False,
        description="choose groups G and atoms B (ignoring groups/bases) by a proxy computed before any module is "
        "built: the total relative whitened error left under the budget, the lowest over G ≤ 8 and B ≤ 2",
    )
    sharing: Literal["atoms", "basis", "qkv", "none", "auto"] = Field(
        "none",
        description="how layers share weights (default none: on the bundled model's validation split a shared k/v "
        "basis ties or loses up to 30% of the attention and pays only from about 50%, see BENCHMARKS.md). atoms: the paper's Matrix PCA atoms per KL group + whitened "
        "residuals; basis: k_proj and v_proj of each run of basis_layers consecutive layers share one whitened input "
        "basis per type (per-layer coefficients refit on each layer's statistics), every other projection its own "
        "whitened factors; qkv: one input basis for q, k and v of a run; none: per-matrix whitened factors, nothing "
        "shared; auto: per run and projection type, a shared basis where the proxy says it pays. Every input-basis "
        "form allocates ranks and basis sizes globally (allocation global, global-relative or global-loss)",
    )
    basis_layers: int = Field(
        4,
        ge=2,
        description="basis, qkv, auto: consecutive layers per shared input basis (the last run may be shorter)",
    )
    singletons: Literal["keep", "compress"] = Field(
        "compress",
        description="keep: singleton groups keep their weights (paper); compress: whitened low rank like any "
        "residual (with dense_when_cheaper the allocation still keeps whole what factors would overpay)",
    )


class ModelShapes(_Strict):
    """The model's architecture as its published config.json gives it: what `plan` needs, so that `plan ALIAS`
    works without fetching the config (offline, exactly). The names are the config's."""

    model_type: str = Field(description="transformers' model_type (llama, mistral, qwen2, ...)")
    num_hidden_layers: int = Field(ge=1)
    hidden_size: int = Field(ge=1)
    num_attention_heads: int = Field(ge=1)
    num_key_value_heads: int = Field(ge=1)
    head_dim: int = Field(ge=1)
    intermediate_size: int = Field(ge=1)
    vocab_size: int = Field(ge=1)
    tie_word_embeddings: bool
    attention_bias: bool = False
    mlp_bias: bool = False


class Recipe(_Strict):
    name: str
    model: str = Field(
        description="hub id, local path, or 'bundled:NAME' (a packaged model: smollm2-135m, qwen2.5-coder-1.5b)"
    )
    revision: str | None = None
    description: str = ""
    shapes: ModelShapes | None = Field(
        None, description="the model's published config values (layers, widths, heads, vocabulary, biases)"
    )
    calibration: CalibrationSettings = CalibrationSettings()
    evaluation: EvaluationSettings = EvaluationSettings()
    compression: CompressionSettings = CompressionSettings()

    @model_validator(mode="after")
    def _check(self) -> Recipe:
        if not self.model.strip():
            raise ValueError("model must not be empty")
        return self


def _format_validation_error(source: str, err: ValidationError) -> str:
    first = err.errors()[0]
    where = ".".join(str(p) for p in first["loc"]) or "(top level)"
    if first["type"] == "extra_forbidden":
        return f"{source}: unknown recipe key '{where}': check its spelling against `masa-compress recipes --keys`"
    return f"{source}: invalid recipe value at '{where}': {first['msg']}"


def parse_recipe(data: object, source: str) -> Recipe:
    if not isinstance(data, dict):
        raise UserError(f"{source}: a recipe must be a YAML mapping of keys to values")
    try:
        return Recipe.model_validate(data)
    except ValidationError as err:
        raise UserError(_format_validation_error(source, err)) from None


def load_recipe_file(path: str | Path) -> Recipe:
    path = Path(path)
    if not path.is_file():
        raise UserError(f"recipe file '{path}' does not exist: pass an existing YAML file to --recipe")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as err:
        raise UserError(f"recipe file '{path}' is not valid YAML: {str(err).splitlines()[0]}") from None
    return parse_recipe(data, str(path))


def builtin_recipe_names() -> list[str]:
    return sorted(
        p.name.removesuffix(".yaml")
        for p in resources.files("compressor.recipes").iterdir()
        if p.name.endswith(".yaml")
    )


def builtin_recipe(name: str) -> Recipe | None:
    """The packaged recipe for an alias, or None when there is no such alias."""
    ref = resources.files("compressor.recipes").joinpath(f"{name}.yaml")
    if not ref.is_file():
        return None
    return parse_recipe(yaml.safe_load(ref.read_text(encoding="utf-8")), f"recipes/{name}.yaml")
