"""What a run is told, and how it meets the recipe: `CompressOptions` / `EvalSettings` (the CLI's and the API's
options; None means "the recipe's value"), resolved into the recipe's validated settings by one rule: an option
the user gave, else the recipe's explicit value, else what follows the model's shapes (`model_defaults`), else
the schema's default; `resolve_settings` says which for every setting.

Every compression setting is an option of the same name (`CompressionSettings`' fields, `CompressOptions`' base
class built from them), so a new setting needs its schema field and its line in `cli/option_sets.py`, nothing
here. Options a method does not read are refused by the method (`Method.refuse_unread`), never silently ignored.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields, make_dataclass
from typing import TYPE_CHECKING

from pydantic import ValidationError

from compressor.api.model_defaults import model_defaults
from compressor.recipes.schema import CalibrationSettings, CompressionSettings, EvaluationSettings, Recipe
from compressor.runtime.errors import UserError, wording

if TYPE_CHECKING:  # the type alone: the methods are imported where a run needs them
    from compressor.methods.masa.byte_structure import SizeTarget

#: Option name -> calibration / evaluation setting (the flags carry a prefix; the settings do not).
CALIBRATION_OPTIONS = {
    "calib": "source",
    "calib_samples": "samples",
    "seq_len": "seq_len",
    "seed": "seed",
    "calib_precision": "precision",
}
EVALUATION_OPTIONS = {"eval_text": "source", "eval_split": "split", "eval_seq_len": "seq_len"}


#: `--ratio` when none is given: a fifth of the targets' parameters.
DEFAULT_RATIO = 0.2


#: One option per compression setting, of the same name (`CompressionSettings`' fields); None: the recipe's value.
#: Built from the schema, so a new setting is not typed here again.
_CompressionSettingOptions = make_dataclass(
    "_CompressionSettingOptions",
    [(name, info.annotation | None, None) for name, info in CompressionSettings.model_fields.items()],
)


@dataclass
class CompressOptions(_CompressionSettingOptions):
    """Everything a compression run (and its `--dry-run` / `plan`) can be told: the compression settings (its base
    class, one field per setting) and what follows; None means "the recipe's value"."""

    ratio: float = DEFAULT_RATIO
    ratio_of: str = "targets"  # targets: the ratio counts the targeted projections; model: every parameter
    # calibration and evaluation text
    calib: str | None = None
    calib_samples: int | None = None
    seq_len: int | None = None
    seed: int | None = None
    calib_precision: str | None = None  # model | bfloat16: what the calibration's forward passes compute in
    eval_text: str | None = None
    eval_seq_len: int | None = None
    eval_max_tokens: int | None = None  # 0: no cap
    eval_split: str | None = None
    # the run
    evaluate: bool = True
    compare: bool = True  # score the compressed model against the original in one pass (KL, top-1)
    allow_overlap: bool = False  # accept the same text for calibration and evaluation (a leak)
    out: str | None = None
    overwrite: bool = False
    save: bool = True
    recipe_file: str | None = None
    batch_size: int = 1
    stats_cache: bool = True
    layerwise: bool = False  # decoder layers on disk, every pass layer by layer (models larger than memory)
    offload_dir: str | None = None  # where --layerwise keeps its intermediate files (default: beside --out)
    # Only the forms engines run (llama.cpp's GGUF layouts): whole heads, narrower MLPs in multiples of 32 (the
    # granularity chosen on the validation split: benchmarks/results/engines.md).
    native: bool = False
    # A GGUF of at most this many bytes (`850MiB`, `1.2GB`) or bits per weight: `compress_to_size` (api/size.py)
    size: str | None = None
    bits_per_weight: float | None = None
    # The types the byte budget's matrices may take (`q4_k,q3_k,q6_k`; None: every candidate type)
    only_types: str | None = None
    # How fast llama.cpp decodes the byte budget's GGUF at least: `any` (None), `mix` or tokens/s (quantize/speed)
    speed: str | None = None
    # How the byte budget's GGUF is rounded: `nearest` (llama.cpp's own; None) or `compensated` (quantize/rounding)
    rounding: str | None = None
    # The byte budget's importance weights from llama.cpp's importance file (None: measured on the calibration)
    imatrix: str | None = None
    # Set by `compress_to_size`, not an option: the byte budget the method allocates the structure under
    byte_target: SizeTarget | None = None

    @classmethod
    def from_values(cls, values: dict) -> CompressOptions:
        """The options among `values` (e.g. a CLI command's `locals()`), ignoring other names; None for an option
        whose default is not None (`--ratio` not given) means that default."""
        defaults = {f.name: f.default for f in fields(cls)}
        return cls(
            **{k: v for k, v in values.items() if k in defaults and (v is not None or defaults[k] is None)}
        )

    def given_compression_settings(self) -> dict[str, object]:
        """The compression settings the user gave explicitly (not None)."""
        return {
            name: getattr(self, name)
            for name in CompressionSettings.model_fields
            if getattr(self, name, None) is not None
        }


#: What `--native` sets (a width multiple the user gives is kept: any multiple is a native width).
NATIVE_FORMS = {"attention": "heads", "mlp": "neurons", "width_multiple": 32, "sharing": "none"}


@dataclass
class EvalSettings:
    """What `evaluate` can be told; None means "the recipe's value"."""

    text: str | None = None
    split: str | None = None  # validation | test (None: the recipe's, else test)
    seq_len: int | None = None
    max_tokens: int | None = None
    batch_size: int = 1
    compare: bool = True  # score a compressed checkpoint against its source model
    against: str | None = None  # the reference model (default: the checkpoint's recorded source)
    engine: str = "transformers"  # or "llama.cpp": a GGUF file run by llama.cpp itself
    flash_attention: bool = False  # llama.cpp's flash attention (faster, not exact: evaluation/llama_cpp.py)


def override(settings, options: dict[str, str] | None = None, **values):
    """A copy of a pydantic settings object with the non-None values replaced (and re-validated). An invalid
    value is named by its option: `options` maps a setting to it where the two differ (`precision` is
    `calib_precision`)."""
    data = settings.model_dump()
    data.update({k: v for k, v in values.items() if v is not None})
    try:
        return type(settings).model_validate(data)
    except ValidationError as err:
        first = err.errors()[0]
        name = (options or {}).get(str(first["loc"][0]), str(first["loc"][0]))
        raise UserError(f"invalid {wording('--' + name.replace('_', '-'), name)}: {first['msg']}") from None


@dataclass
class ResolvedSettings:
    """A run's settings and where each came from: `sources[section][setting]` is `option`, `recipe NAME`,
    `model shapes (REASON)` or `default` (section: calibration, evaluation, compression)."""

    calibration: CalibrationSettings
    evaluation: EvaluationSettings
    compression: CompressionSettings
    sources: dict[str, dict[str, str]] = field(default_factory=dict)


def resolve_run_settings(
    options: CompressOptions, recipe: Recipe | None, shapes: Mapping[str, object] | None = None
) -> tuple[CalibrationSettings, EvaluationSettings, CompressionSettings]:
    """Merge options, recipe and the model's shapes into validated (calibration, evaluation, compression)
    settings (`resolve_settings`)."""
    resolved = resolve_settings(options, recipe, shapes)
    return resolved.calibration, resolved.evaluation, resolved.compression


def resolve_settings(
    options: CompressOptions, recipe: Recipe | None, shapes: Mapping[str, object] | None = None
) -> ResolvedSettings:
    """The run's settings, each from the first of: the option given, the recipe's explicit value, the model's
    shapes (`model_defaults`; `shapes`: the model's, None: the recipe's `shapes` where it has them), the schema's
    default; and where each came from."""
    if shapes is None and recipe is not None and recipe.shapes is not None:
        shapes = recipe.shapes.model_dump()
    bases = {
        "calibration": recipe.calibration if recipe else CalibrationSettings(),
        "evaluation": recipe.evaluation if recipe else EvaluationSettings(),
        "compression": recipe.compression if recipe else CompressionSettings(),
    }
    sources = {
        section: {k: f"recipe {recipe.name}" if recipe and k in base.model_fields_set else "default"
                  for k in type(base).model_fields}
        for section, base in bases.items()
    }  # fmt: skip
    bases = _with_model_defaults(bases, sources, shapes or {})
    given = {
        "calibration": {setting: getattr(options, o) for o, setting in CALIBRATION_OPTIONS.items()},
        "evaluation": {setting: getattr(options, o) for o, setting in EVALUATION_OPTIONS.items()},
        "compression": options.given_compression_settings(),
    }
    calibration = override(
        bases["calibration"], {s: o for o, s in CALIBRATION_OPTIONS.items()}, **given["calibration"]
    )
    evaluation = override(
        bases["evaluation"], {s: o for o, s in EVALUATION_OPTIONS.items()}, **given["evaluation"]
    )
    if options.eval_max_tokens is not None:
        evaluation = evaluation.model_copy(update={"max_tokens": options.eval_max_tokens or None})
        given["evaluation"]["max_tokens"] = options.eval_max_tokens
    compression = override(bases["compression"], **given["compression"])
    for section, values in given.items():
        sources[section].update({k: "option" for k, v in values.items() if v is not None})
    if options.native:
        native = native_settings(compression, options)
        changed = {k for k in NATIVE_FORMS if getattr(native, k) != getattr(compression, k)}
        sources["compression"].update(dict.fromkeys(changed, "option (--native)"))
        compression = native
        if sources["compression"]["refit"] == "default":  # neither the option nor the recipe set it
            refit, reason = native_refit((shapes or {}).get("model_type"), compression.targets)
            compression = compression.model_copy(update={"refit": refit})
            sources["compression"]["refit"] = f"option (--native: {reason})"
    resolved = mlp_calibration(calibration, compression, options)
    if resolved.samples != calibration.samples:
        sources["calibration"]["samples"] = sources["calibration"]["mlp_samples"]
    return ResolvedSettings(resolved, evaluation, compression, sources)


def _with_model_defaults(bases: dict, sources: dict, shapes: Mapping[str, object]) -> dict:
    """The recipe's (or the schema's) settings with what follows the model's shapes where the recipe sets nothing:
    `model_defaults`' values, sources updated. A derived `mlp_samples` never lowers the recipe's `samples`."""
    updates: dict[str, dict] = {"calibration": {}, "compression": {}}
    for name, (value, reason) in model_defaults(shapes).items():
        section = "calibration" if name in CalibrationSettings.model_fields else "compression"
        if sources[section][name] != "default":
            continue  # the recipe's explicit value
        if name == "mlp_samples" and bases["calibration"].samples >= value:
            continue  # as many windows as the recipe's `samples` already: `mlp_samples` stays unset
        updates[section][name] = value
        sources[section][name] = f"model shapes ({reason})"
    return {k: base.model_copy(update=updates[k]) if updates.get(k) else base for k, base in bases.items()}


def mlp_calibration(
    calibration: CalibrationSettings, compression: CompressionSettings, options: CompressOptions
) -> CalibrationSettings:
    """The calibration of a run: with an MLP projection targeted and no `-n` given, `mlp_samples` windows where
    they are set (the recipe's, else the model's: `model_defaults.MLP_CALIBRATION_WINDOWS`); otherwise as it
    was. The MLP's least-squares refits and neuron orders read inputs as wide as the MLP (2.7x the attention's on
    the bundled model) and gain from more tokens (benchmarks/results/choices/calibration-windows-mlp-validation.
    json); a run of the attention alone keeps `samples` (more windows were not measured for it, and they would
    lengthen `make demo`)."""
    from compressor.modeling.adapters import MLP_PROJECTIONS, target_projections

    targets_mlp = set(MLP_PROJECTIONS) & set(target_projections(compression.targets))
    if options.calib_samples is not None or not targets_mlp or calibration.mlp_samples is None:
        return calibration
    return calibration.model_copy(update={"samples": calibration.mlp_samples})


def native_refit(model_type: str | None, targets: str) -> tuple[str, str]:
    """`--native`'s refit where neither the option nor the recipe sets one, and why, in a few words: `stream` where
    it was chosen on the bundled model's validation split, with the MLP targeted (the model 20% smaller, attention
    and MLP: −0.95 [−1.18, −0.74] perplexity against `calibration`, benchmarks/results/choices/sequential-refit-
    validation.json; the MLP alone 20% smaller: −0.53 [−0.62, −0.43], choices/native-refit-mlp-validation.json),
    and where it can run: on a family that adds its blocks' outputs to the stream as they are and has no experts
    (whose MLP the refit does not read), in memory or `--layerwise` (the same checkpoint); else
    `calibration`. The attention alone is `calibration`'s: there `stream` lost, +0.145 [+0.088, +0.207] at 20% of
    the attention (choices/native-refit-attention-validation.json)."""
    from compressor.modeling.adapters import MLP_PROJECTIONS, target_projections
    from compressor.modeling.families import family_of

    family = family_of(model_type)
    targeted = set(target_projections(targets))
    if not set(MLP_PROJECTIONS) & targeted:
        return "calibration", "the attention alone: calibration measured better on validation"
    if family is None:
        return "calibration", "a family the stream refit was not checked on"
    if family.block_output_norm:
        return "calibration", f"{family.title} normalizes its blocks' outputs"
    if family.experts:
        return "calibration", f"{family.title}'s experts are kept whole"
    return "stream", "chosen on validation"


def native_settings(compression: CompressionSettings, options: CompressOptions) -> CompressionSettings:
    """`--native`: the engine forms of whatever is targeted (NATIVE_FORMS); an explicit other form is an error."""
    from compressor.modeling.adapters import MLP_PROJECTIONS, target_projections

    if compression.method != "masa":
        raise UserError(
            f"--native: --method {compression.method} writes factored projections, which engines cannot run: "
            "use --method masa"
        )
    targets = target_projections(compression.targets)
    has_mlp = bool(set(MLP_PROJECTIONS) & set(targets))
    applies = {"attention": "q_proj" in targets, "mlp": has_mlp, "width_multiple": has_mlp, "sharing": True}
    update = {}
    for name, native_value in NATIVE_FORMS.items():
        given = getattr(options, name)
        if not applies[name] or (name == "width_multiple" and given is not None):
            continue
        if given is not None and given != native_value:
            flag = "--" + name.replace("_", "-")
            raise UserError(f"--native takes {flag} {native_value} (engines run no other form): drop {flag}")
        update[name] = native_value
    return compression.model_copy(update=update)


def resolve_eval_settings(settings: EvalSettings, recipe: Recipe | None) -> EvaluationSettings:
    """User options override the recipe; the recipe overrides the built-in defaults."""
    base = recipe.evaluation if recipe else EvaluationSettings()
    resolved = override(base, source=settings.text, split=settings.split, seq_len=settings.seq_len)
    if settings.max_tokens is not None:
        resolved = resolved.model_copy(update={"max_tokens": settings.max_tokens})
    return resolved
