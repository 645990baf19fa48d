"""Setting up a run, written once for `compress`, `plan`/`--dry-run`, `inspect` and the benchmarks: the model spec
and recipe resolved, the options merged and checked by the method, the texts read, the token windows cut, and
the output directory checked — everything a user can get wrong is refused here, before any weights are read.
"""

from __future__ import annotations

import os
import re
import resource
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from compressor.api.model_loading import ModelSource, model_shapes, resolve_model
from compressor.api.run_options import CompressOptions, resolve_settings
from compressor.calibration.sources import TextSource, load_documents
from compressor.calibration.windows import (
    bos_token_id_for,
    calibration_windows,
    evaluation_windows,
    tokenize_documents,
)
from compressor.math.accounting import check_ratio, targets_ratio
from compressor.methods import Method, ModelShape, get_method
from compressor.modeling.adapters import MLP_PROJECTIONS, PROJECTIONS, check_family_forms, target_projections
from compressor.recipes.schema import (
    CalibrationSettings,
    CompressionSettings,
    EvaluationSettings,
    Recipe,
    load_recipe_file,
)
from compressor.runtime.device import calibration_autocast, computed_in, emulated_bfloat16_warning
from compressor.runtime.errors import UserError, wording
from compressor.runtime.hub import check_hub_model
from compressor.runtime.progress import note


@dataclass
class RunSpec:
    """A run resolved and checked, before any weights are read."""

    source: ModelSource
    recipe: Recipe | None
    calibration: CalibrationSettings
    evaluation: EvaluationSettings
    compression: CompressionSettings  # the method's effective settings (its preset applied)
    method: Method
    # Where each setting came from: section (calibration, evaluation, compression) -> setting -> `option`,
    # `recipe NAME`, `model shapes (REASON)`, `method NAME` (its preset) or `default` (`run_options.resolve_settings`).
    settings_source: dict[str, dict[str, str]] = field(default_factory=dict)

    @property
    def recipe_name(self) -> str | None:
        return self.recipe.name if self.recipe else None


def resolve_run(model: str, options: CompressOptions) -> RunSpec:
    """Resolve MODEL and the recipe, merge the options (and what follows the model's shapes: its config read, no
    weights), and let the method refuse what it cannot honour (an unknown method, an option it does not read,
    settings it has no rule for)."""
    check_ratio(options.ratio)
    recipe = load_recipe_file(options.recipe_file) if options.recipe_file else None
    source = resolve_model(model, recipe)
    recipe = recipe or source.recipe
    shapes = model_shapes(source)
    resolved = resolve_settings(options, recipe, shapes)
    method = get_method(resolved.compression.method)
    given = options.given_compression_settings()
    method.refuse_unread(given, resolved.compression)
    compression = method.effective_settings(resolved.compression)
    model_type = (shapes or {}).get("model_type")
    check_family_forms(model_type, compression.method, compression.attention, compression.targets)
    sources = resolved.sources
    sources["compression"].update({k: f"method {method.name}" for k in method.preset if k not in given})
    return RunSpec(source, recipe, resolved.calibration, resolved.evaluation, compression, method, sources)


def read_texts(run: RunSpec, evaluate: bool, allow_overlap: bool) -> tuple[TextSource, TextSource | None]:
    """The calibration text and (when evaluating) the evaluation text, read and validated before any model is
    loaded; the same text for both is refused unless `allow_overlap`. A hub model is checked first: without
    network it fails here, in one line naming the model, before any text is fetched."""
    check_hub_model(run.source)
    calibration = load_documents(run.calibration.source, split="calibration")
    evaluation = load_documents(run.evaluation.source, split=run.evaluation.split) if evaluate else None
    if evaluation is not None and not allow_overlap:
        check_no_overlap(calibration, evaluation)
    return calibration, evaluation


def check_no_overlap(calibration: TextSource, evaluation: TextSource) -> None:
    """Refuse to evaluate on the calibration text: the perplexity would be measured on what the model was fit to."""
    if calibration.fingerprint == evaluation.fingerprint:
        raise UserError(
            f"the evaluation text ({evaluation.name}) is the calibration text ({calibration.name}): pass "
            + wording(
                "different text to --calib and --eval-text, or --allow-overlap if you really mean it",
                "different text as calib and eval_text, or allow_overlap=True if you really mean it",
            )
        )


def calibration_token_windows(tokenizer, calibration: CalibrationSettings, text: TextSource) -> torch.Tensor:
    """`samples` windows of `seq_len` tokens drawn from the calibration text with the run's seed."""
    ids = tokenize_documents(tokenizer, text.documents)
    return calibration_windows(
        ids, calibration.samples, calibration.seq_len, calibration.seed, bos_id=bos_token_id_for(tokenizer)
    )


def evaluation_token_windows(
    tokenizer, evaluation: EvaluationSettings, source: TextSource | None = None
) -> tuple[torch.Tensor, str]:
    """Held-out text → non-overlapping windows of `seq_len` tokens (BOS only where the tokenizer adds one).

    `source`: the documents when the caller already read them (to check them before loading a model)."""
    source = source or load_documents(evaluation.source, split=evaluation.split)
    ids = tokenize_documents(tokenizer, source.documents)
    windows = evaluation_windows(
        ids, evaluation.seq_len, max_tokens=evaluation.max_tokens, bos_id=bos_token_id_for(tokenizer)
    )
    return windows, source.name


# ------------------------------------------------------------------------------------------------------
# the output directory


@dataclass
class Prepared:
    """What a compression run knows once the model is loaded, before any calibration: the targets' shape, the
    ratio of the targets to remove, and the token windows."""

    shape: ModelShape
    with_mlp: bool
    model_params_before: int
    ratio: float
    calib_windows: torch.Tensor
    eval_windows: torch.Tensor | None
    eval_name: str
    element_size: int  # bytes per weight in the model's dtype
    gate_input: bool = True  # whether the method reads gate/up's input (with_mlp): else the capture skips it


#: `--ratio-of model` warns when the request takes more than this share of the targets: the untargeted rest (the
#: embeddings above all) leaves the whole cut to the layers.
HEAVY_SHARE_OF_TARGETS = 0.4


def heavy_share_warning(
    ratio: float, ratio_of: str, targets_share: float, model_params: int, target_params: int, targets: str
) -> str | None:
    """One line when `--ratio-of model` takes more than `HEAVY_SHARE_OF_TARGETS` of the targeted parameters
    because the rest of the model is not a target; None otherwise (and always with `--ratio-of targets`, where
    the share is the ratio asked for). Where the MLP is not a target, it suggests adding it first."""
    if ratio_of != "model" or targets_share <= HEAVY_SHARE_OF_TARGETS:
        return None
    rest = 1.0 - target_params / model_params
    widen = "target the MLP too (--targets attn,mlp), " if "mlp" not in targets.split(",") else ""
    return (
        f"--ratio {ratio:g} --ratio-of model takes {targets_share:.0%} of the targeted parameters, because "
        f"{rest:.0%} of the model (the embeddings, norms and what is not targeted) is not cut: expect a large "
        f"quality loss; {widen}lower --ratio, or use --ratio-of targets to set the targets' share directly"
    )


def refit_tokens_warning(compression, shape: ModelShape, windows: int, seq_len: int) -> str | None:
    """The line `byte_structure.few_tokens_warning` gives for the least-squares refits this run makes (MASA's
    `neurons` MLP refits down_proj, its `heads` attention o_proj) on `windows` of `seq_len` tokens, None where
    there are none or they read enough tokens."""
    from compressor.methods.masa.byte_structure import few_tokens_warning

    if compression.method != "masa":
        return None
    widths = {}
    if set(shape.targets) & set(MLP_PROJECTIONS) and compression.mlp == "neurons":
        widths["mlp"] = shape.geometry.input_size("down")
    if compression.attention == "heads" and set(shape.targets) & set(PROJECTIONS):
        widths["attn"] = shape.geometry.input_size("o")
    return few_tokens_warning(widths, windows, seq_len)


def prepare_run(
    run: RunSpec, options: CompressOptions, model, adapter, tokenizer, calib_text, eval_text
) -> Prepared:
    """The checks and numbers every compression run derives from the loaded model (in memory or `--layerwise`,
    whose layers are meta tensors: only shapes are read): the ratio converted (`--ratio-of`), the method's
    feasibility check before calibration, the calibration and evaluation windows."""
    shape = ModelShape.from_adapter(adapter, target_projections(run.compression.targets))
    with_mlp = bool(set(shape.targets) & set(MLP_PROJECTIONS))
    if with_mlp:
        adapter.check_mlp()
    params = sum(p.numel() for p in model.parameters())
    ratio = targets_ratio(
        options.ratio, options.ratio_of, params, shape.params_before, run.compression.targets
    )
    if warning := heavy_share_warning(
        options.ratio, options.ratio_of, ratio, params, shape.params_before, run.compression.targets
    ):
        note(f"[yellow]warning:[/] {warning}")  # before calibrating: the user can stop and ask otherwise
    run.method.check_before_calibration(shape, run.compression, ratio)
    calib_windows = calibration_token_windows(tokenizer, run.calibration, calib_text)
    if warning := refit_tokens_warning(run.compression, shape, *calib_windows.shape):
        note(f"[yellow]warning:[/] {warning}")
    eval_windows, eval_name = (
        evaluation_token_windows(tokenizer, run.evaluation, eval_text) if eval_text else (None, "")
    )
    element = next(model.parameters()).element_size()
    gate_input = with_mlp and run.method.reads_gate_input(run.compression)
    return Prepared(
        shape, with_mlp, params, ratio, calib_windows, eval_windows, eval_name, element, gate_input
    )


def calibration_autocast_of(
    run: RunSpec, model_dtype: torch.dtype, device, progress: bool
) -> torch.dtype | None:
    """What the run's calibration computes in (`--calib-precision`; None: the model's dtype), said in one line
    where the CPU only emulates bfloat16."""
    autocast = calibration_autocast(run.calibration.precision, model_dtype)
    warning = emulated_bfloat16_warning(autocast, device)
    if warning:
        note(f"[yellow]{warning}[/]", progress)
    return autocast


def calibration_summary(run: RunSpec, text: TextSource, model_dtype: torch.dtype) -> dict:
    """The run's calibration as its summary and checkpoint record it: the settings, the text read, and what
    `--calib-precision` meant for this model (`computed_in`)."""
    return {
        **run.calibration.model_dump(),
        "text": text.name,
        "fingerprint": text.fingerprint,
        "computed_in": computed_in(run.calibration.precision, model_dtype),
    }


def default_output_dir(source_name: str, method: str, ratio: float, ratio_of: str = "targets") -> str:
    stem = re.sub(r"[^A-Za-z0-9._-]+", "-", source_name.rstrip("/").split("/")[-1]).strip("-") or "model"
    return f"out/{stem}-{method}-r{ratio:g}" + ("-model" if ratio_of == "model" else "")


def _existing_parent(out: str) -> Path:
    """The nearest existing folder above `out` (where it will be created): its permissions and disk count."""
    parent = Path(out).resolve().parent
    while not parent.exists():
        parent = parent.parent
    return parent


def _another_out() -> str:
    return wording("choose another --out", "choose another out")


def check_output_dir(out: str, overwrite: bool) -> None:
    """Fail before any heavy work if the output directory cannot be written. The message names the fix in the
    caller's words (`errors.wording`): `--overwrite` on the command line, `overwrite=True` in Python."""
    path = Path(out)
    if path.exists() and not overwrite:
        raise UserError(
            f"output directory '{out}' already exists: pass {wording('--overwrite', 'overwrite=True')} or "
            + _another_out()
        )
    if path.exists() and not path.is_dir():
        raise UserError(f"output path '{out}' exists and is not a directory: {_another_out()}")
    parent = _existing_parent(out)
    if not os.access(parent, os.W_OK):
        raise UserError(
            f"output directory '{out}' cannot be written ({parent} is not writable): {_another_out()}"
        )


def check_free_disk(out: str, checkpoint_bytes: int) -> None:
    """Refuse to start when the checkpoint cannot fit on the output disk (estimated before any heavy work)."""
    parent = _existing_parent(out)
    needed = int(checkpoint_bytes * 1.05) + 64 * 2**20  # tensors + headers, tokenizer, report
    free = shutil.disk_usage(parent).free
    if free < needed:
        raise UserError(
            f"not enough free disk for the checkpoint in '{out}': about {needed / 2**30:.2f} GiB needed, "
            f"{free / 2**30:.2f} GiB free on {parent}: free space or {_another_out()}"
        )


def peak_rss_gb() -> float:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (1024**3 if sys.platform == "darwin" else 1024**2)
