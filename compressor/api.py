"""The library API that the CLI wraps: evaluate a model, compress a model."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from compressor.calibration.sources import TextSource, load_documents
from compressor.calibration.windows import bos_token_id_for, evaluation_windows, tokenize_documents
from compressor.errors import UserError
from compressor.evaluate import Faithfulness, PerplexityResult, evaluate_against, evaluate_perplexity
from compressor.intervals import paired_difference
from compressor.models import LoadedModel, ModelSource, load_model, resolve_model
from compressor.recipes.schema import EvaluationSettings, Recipe


@dataclass
class EvalSettings:
    text: str | None = None
    split: str | None = None  # validation | test (None: the recipe's, else test)
    seq_len: int | None = None
    max_tokens: int | None = None
    batch_size: int = 1
    compare: bool = True  # score a compressed checkpoint against its source model
    against: str | None = None  # the reference model (default: the checkpoint's recorded source)


def resolve_eval_settings(settings: EvalSettings, recipe: Recipe | None) -> EvaluationSettings:
    """User options override the recipe; the recipe overrides the built-in defaults."""
    base = recipe.evaluation if recipe else EvaluationSettings()
    return _override(
        base,
        source=settings.text,
        split=settings.split,
        seq_len=settings.seq_len,
    ).model_copy(
        update={"max_tokens": settings.max_tokens if settings.max_tokens is not None else base.max_tokens}
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


@dataclass
class Evaluation:
    """What `evaluate` measured: the model's perplexity and, when compared, its faithfulness to a reference."""

    result: PerplexityResult
    loaded: LoadedModel
    evaluation: EvaluationSettings
    faithfulness: Faithfulness | None = None
    reference: PerplexityResult | None = None
    reference_name: str | None = None
    compare_note: str = "not a compressed checkpoint: nothing to compare with"

    def to_dict(self) -> dict:
        payload = {
            "model": self.loaded.source.describe(),
            **self.result.to_dict(),
            "split": self.evaluation.split,
            "device": str(self.loaded.device),
            "dtype": str(self.loaded.dtype).removeprefix("torch."),
            "load_seconds": round(self.loaded.seconds, 3),
            "compared_with": self.reference_name,
            "compare_note": self.compare_note,
        }
        if self.faithfulness is not None:
            payload.update(self.faithfulness.to_dict())
            payload["ppl_original"] = self.reference.ppl
            payload["ppl_original_ci95"] = self.reference.ppl_ci95
        return payload


def reference_source(source: ModelSource, settings: EvalSettings) -> tuple[ModelSource | None, str]:
    """The model to compare with (``--against``, else a checkpoint's recorded source), or why there is none."""
    if settings.against:
        return resolve_model(settings.against), f"--against {settings.against}"
    if not settings.compare:
        return None, "comparison off (--no-compare)"
    if source.kind != "compressed":
        return None, "not a compressed checkpoint: nothing to compare with (pass --against MODEL)"
    from compressor.checkpoint import read_masa_config

    recorded = read_masa_config(source.location).get("metadata", {}).get("source") or {}
    for spec in (recorded.get("spec"), recorded.get("location")):
        if not spec:
            continue
        try:
            return resolve_model(spec), f"the checkpoint's source {spec}"
        except UserError:
            continue
    return None, (
        f"the checkpoint's source model ({recorded.get('spec') or 'unrecorded'}) is not available here: "
        "pass --against MODEL to compare"
    )


def evaluate(
    model: str,
    settings: EvalSettings | None = None,
    device: str = "auto",
    dtype: str = "auto",
    progress: bool = True,
) -> Evaluation:
    """Resolve, load and evaluate a model spec (alias, path, hub id or compressed checkpoint).

    A compressed checkpoint is scored in one pass together with its source model (or ``against``), which
    adds the KL divergence from the original and the top-1 agreement to the perplexity.
    """
    settings = settings or EvalSettings()
    source = resolve_model(model)
    evaluation = resolve_eval_settings(settings, source.recipe)
    # Everything the user named is checked before any weights are read.
    documents = load_documents(evaluation.source, split=evaluation.split)
    reference, note = reference_source(source, settings)
    loaded = load_model(source, device=device, dtype=dtype, progress=progress)
    windows, text_name = evaluation_token_windows(loaded.tokenizer, evaluation, documents)
    if reference is None:
        result = evaluate_perplexity(loaded.model, windows, batch_size=settings.batch_size, progress=progress)
        result.text, result.split = text_name, evaluation.split
        return Evaluation(result, loaded, evaluation, compare_note=note)
    original = load_model(reference, device=device, dtype=dtype, progress=progress)
    if original.tokenizer.get_vocab() != loaded.tokenizer.get_vocab():
        raise UserError(
            f"cannot compare with {reference.describe()}: its tokenizer differs from the model's "
            "(pass --against the model it was compressed from, or --no-compare)"
        )
    ref, scored = evaluate_against(
        original.model, {"model": loaded.model}, windows, settings.batch_size, progress
    )
    result, faith = scored["model"]
    for r in (ref, result):
        r.text, r.split = text_name, evaluation.split
    return Evaluation(result, loaded, evaluation, faith, ref, reference.describe(), note)


# ------------------------------------------------------------------------------------------------------
# Compression


@dataclass
class CompressOptions:
    """Everything a compression run can be told; None means "the recipe's value"."""

    ratio: float = 0.2
    method: str | None = None
    groups: int | None = None
    bases: int | None = None
    largest_group_bases: int | None = None
    end_boundaries: bool | None = None
    logit_lens: str | None = None
    allocation: str | None = None
    atoms: str | None = None
    singletons: str | None = None
    statistics: str | None = None
    targets: str | None = None
    auto_groups: bool | None = None
    calib: str | None = None
    calib_samples: int | None = None
    seq_len: int | None = None
    seed: int | None = None
    eval_text: str | None = None
    eval_seq_len: int | None = None
    eval_max_tokens: int | None = None
    eval_split: str | None = None
    evaluate: bool = True
    compare: bool = True  # score the compressed model against the original in one pass (KL, top-1)
    allow_overlap: bool = False  # accept the same text for calibration and evaluation (a leak)
    out: str | None = None
    overwrite: bool = False
    save: bool = True
    recipe_file: str | None = None
    batch_size: int = 1
    stats_cache: bool = True


@dataclass
class CompressionRun:
    """The result of `compress`: numbers for the summary table and `--json`, and the compressed model."""

    summary: dict
    model: object = None
    tokenizer: object = None
    outcome: object = None


def _override(settings, **values):
    """A copy of a pydantic settings object with the non-None values replaced (and re-validated)."""
    from pydantic import ValidationError

    from compressor.errors import UserError

    data = settings.model_dump()
    data.update({k: v for k, v in values.items() if v is not None})
    try:
        return type(settings).model_validate(data)
    except ValidationError as err:
        first = err.errors()[0]
        raise UserError(f"invalid --{str(first['loc'][0]).replace('_', '-')}: {first['msg']}") from None


def resolve_run_settings(options: CompressOptions, recipe: Recipe | None):
    """Merge recipe and options into validated (calibration, evaluation, compression) settings."""
    from compressor.recipes.schema import CalibrationSettings, CompressionSettings

    base_cal = recipe.calibration if recipe else CalibrationSettings()
    base_eval = recipe.evaluation if recipe else EvaluationSettings()
    base_comp = recipe.compression if recipe else CompressionSettings()
    calibration = _override(
        base_cal,
        source=options.calib,
        samples=options.calib_samples,
        seq_len=options.seq_len,
        seed=options.seed,
    )
    evaluation = _override(
        base_eval, source=options.eval_text, split=options.eval_split, seq_len=options.eval_seq_len
    )
    if options.eval_max_tokens is not None:
        evaluation = evaluation.model_copy(update={"max_tokens": options.eval_max_tokens or None})
    compression = _override(
        base_comp,
        method=options.method,
        groups=options.groups,
        bases=options.bases,
        largest_group_bases=options.largest_group_bases,
        end_boundaries=options.end_boundaries,
        logit_lens=options.logit_lens,
        allocation=options.allocation,
        atoms=options.atoms,
        singletons=options.singletons,
        statistics=options.statistics,
        targets=options.targets,
        auto_groups=options.auto_groups,
    )
    return calibration, evaluation, compression


def check_no_overlap(calibration, evaluation) -> None:
    """Refuse to evaluate on the calibration text: the perplexity would be measured on what the model was fit to."""
    if calibration.fingerprint == evaluation.fingerprint:
        raise UserError(
            f"the evaluation text ({evaluation.name}) is the calibration text ({calibration.name}): pass "
            "different text to --calib and --eval-text, or --allow-overlap if you really mean it"
        )


def default_output_dir(source_name: str, method: str, ratio: float) -> str:
    import re

    stem = re.sub(r"[^A-Za-z0-9._-]+", "-", source_name.rstrip("/").split("/")[-1]).strip("-") or "model"
    return f"out/{stem}-{method}-r{ratio:g}"


def _existing_parent(out: str) -> Path:
    """The nearest existing folder above `out` (where it will be created): its permissions and disk count."""
    parent = Path(out).resolve().parent
    while not parent.exists():
        parent = parent.parent
    return parent


def check_output_dir(out: str, overwrite: bool) -> None:
    """Fail before any heavy work if the output directory cannot be written."""
    import os
    from pathlib import Path

    from compressor.errors import UserError

    path = Path(out)
    if path.exists() and not overwrite:
        raise UserError(f"output directory '{out}' already exists: pass --overwrite or choose another --out")
    if path.exists() and not path.is_dir():
        raise UserError(f"output path '{out}' exists and is not a directory: choose another --out")
    parent = _existing_parent(out)
    if not os.access(parent, os.W_OK):
        raise UserError(
            f"output directory '{out}' cannot be written ({parent} is not writable): choose another --out"
        )


def check_free_disk(out: str, checkpoint_bytes: int) -> None:
    """Refuse to start when the checkpoint cannot fit on the output disk (estimated before any heavy work)."""
    import shutil

    from compressor.errors import UserError

    parent = _existing_parent(out)
    needed = int(checkpoint_bytes * 1.05) + 64 * 2**20  # tensors + headers, tokenizer, report
    free = shutil.disk_usage(parent).free
    if free < needed:
        raise UserError(
            f"not enough free disk for the checkpoint in '{out}': about {needed / 2**30:.2f} GiB needed, "
            f"{free / 2**30:.2f} GiB free on {parent}: free space or choose another --out"
        )


def peak_rss_gb() -> float:
    import resource
    import sys

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (1024**3 if sys.platform == "darwin" else 1024**2)


def _evaluate_after(loaded, source, before, windows, options, device, dtype, progress) -> dict:
    """Perplexity of the compressed model and, with `options.compare`, its faithfulness to the original.

    The original is loaded again (the compressed model was changed in place) and both models see every
    window in one pass: the original's next-token distributions are far too large to keep for a later pass.
    Without comparison, `before` is the perplexity measured before compression.
    """
    if options.compare:
        reference = load_model(source, device=device, dtype=dtype, progress=progress)
        before, scored = evaluate_against(
            reference.model, {"compressed": loaded.model}, windows, options.batch_size, progress
        )
        after, faith = scored["compressed"]
        del reference
    else:
        after = evaluate_perplexity(
            loaded.model, windows, options.batch_size, progress, "Perplexity (compressed)"
        )
        faith = None
    quality = {
        "ppl_before": before.ppl,
        "ppl_before_ci95": before.ppl_ci95,
        "ppl_after": after.ppl,
        "ppl_after_ci95": after.ppl_ci95,
        "tokens": after.tokens,
        "windows": after.windows,
        "seq_len": after.seq_len,
    }
    if faith is not None:
        quality.update(faith.to_dict())
        quality["ppl_rise_ci95"] = list(
            paired_difference(after.window_nll, before.window_nll, after.window_tokens).ci95
        )
    return quality


def compress(
    model: str,
    options: CompressOptions,
    device: str = "auto",
    dtype: str = "auto",
    progress: bool = True,
) -> CompressionRun:
    """The main job: calibrate, compress, evaluate before/after, and write the checkpoint."""
    import time

    from compressor import __version__
    from compressor.adapters import MLP_PROJECTIONS, get_adapter, target_projections
    from compressor.calibration.windows import calibration_windows
    from compressor.capture import collect_statistics
    from compressor.errors import UserError
    from compressor.pipeline import METHODS, check_targets, compress_model
    from compressor.plan import check_feasible_before_calibration
    from compressor.progress import note
    from compressor.recipes.schema import load_recipe_file

    start_all = time.perf_counter()
    seconds: dict[str, float] = {}
    if not 0.0 < options.ratio < 1.0:
        raise UserError(
            f"--ratio {options.ratio:g} is outside (0, 1): it is the fraction of attention parameters removed"
        )
    recipe = load_recipe_file(options.recipe_file) if options.recipe_file else None
    source = resolve_model(model, recipe)
    recipe = recipe or source.recipe
    calibration, evaluation, compression = resolve_run_settings(options, recipe)
    if compression.method not in METHODS:
        raise UserError(f"unknown --method '{compression.method}': use one of {', '.join(METHODS)}")
    check_targets(compression)
    out = options.out or default_output_dir(
        recipe.name if recipe else source.location, compression.method, options.ratio
    )
    if options.save:
        check_output_dir(out, options.overwrite)
    # Text sources are read (and validated) before the model is loaded.
    calib_text = load_documents(calibration.source, split="calibration")
    eval_text = load_documents(evaluation.source, split=evaluation.split) if options.evaluate else None
    if options.evaluate and not options.allow_overlap:
        check_no_overlap(calib_text, eval_text)

    t = time.perf_counter()
    loaded = load_model(source, device=device, dtype=dtype, progress=progress)
    seconds["load"] = time.perf_counter() - t
    adapter = get_adapter(loaded.model)
    targets = target_projections(compression.targets)
    with_mlp = bool(set(targets) & set(MLP_PROJECTIONS))
    if with_mlp:
        adapter.check_mlp()
    if compression.method.startswith("masa") and not compression.auto_groups:
        check_feasible_before_calibration(
            options.ratio,
            adapter.attention_parameter_count(targets),
            adapter.geometry,
            adapter.num_layers,
            compression.groups,
            compression.bases,
            compression.largest_group_bases,
            compression.singletons == "compress",
            targets,
        )
    bos = bos_token_id_for(loaded.tokenizer)
    calib_ids = tokenize_documents(loaded.tokenizer, calib_text.documents)
    calib_windows = calibration_windows(
        calib_ids, calibration.samples, calibration.seq_len, calibration.seed, bos_id=bos
    )
    eval_windows, eval_name = (
        evaluation_token_windows(loaded.tokenizer, evaluation, eval_text) if options.evaluate else (None, "")
    )

    model_params_before = sum(p.numel() for p in loaded.model.parameters())
    attention_before = adapter.attention_parameter_count(targets)
    if options.save:
        element = next(loaded.model.parameters()).element_size()
        check_free_disk(out, int((model_params_before - options.ratio * attention_before) * element))
    before = None
    if options.evaluate and not options.compare:
        before = evaluate_perplexity(
            loaded.model, eval_windows, options.batch_size, progress, "Perplexity (original)"
        )
        seconds["eval_before"] = before.seconds

    stats, cache_note = None, "statistics cache off"
    if options.stats_cache:
        from compressor.stats_cache import load_stats, model_fingerprint, save_stats, stats_key

        key = stats_key(
            model_fingerprint(loaded.model), calib_text.fingerprint, calib_windows, loaded.dtype, with_mlp
        )
        stats, cache_note = load_stats(key, adapter)
        note(f"[dim]calibration: {cache_note}[/]", progress)
    if stats is None:
        stats = collect_statistics(
            loaded.model, adapter, calib_windows, options.batch_size, progress, mlp=with_mlp
        )
        if options.stats_cache:
            cache_note = f"computed and cached in {save_stats(stats, key)}"
    seconds["calibration"] = stats.seconds
    outcome = compress_model(
        loaded.model, adapter, stats, compression, options.ratio, progress, windows=calib_windows
    )
    seconds.update(outcome.seconds)
    del stats
    plan = outcome.plan

    quality = {}
    if options.evaluate:
        t = time.perf_counter()
        quality = _evaluate_after(loaded, source, before, eval_windows, options, device, dtype, progress)
        seconds["eval"] = time.perf_counter() - t
        quality["evaluation_text"] = eval_name
    summary = {
        "tool_version": __version__,
        "model": source.describe(),
        "recipe": recipe.name if recipe else None,
        "method": compression.method,
        "ratio_requested": options.ratio,
        "targets": compression.targets,
        "achieved_ratio": plan.achieved_ratio(),
        "attention_params_before": attention_before,
        "attention_params_after": plan.attention_params_after(),
        "model_params_before": model_params_before,
        "model_params_after": sum(p.numel() for p in loaded.model.parameters()),
        "ppl_before": quality.get("ppl_before"),
        "ppl_after": quality.get("ppl_after"),
        "split": evaluation.split if options.evaluate else None,
        "kl_to_original": quality.get("kl_to_original"),
        "top1_agreement": quality.get("top1_agreement"),
        "quality": quality or None,
        "settings": {
            "calibration": {
                **calibration.model_dump(),
                "text": calib_text.name,
                "fingerprint": calib_text.fingerprint,
            },
            "evaluation": {**evaluation.model_dump(), "text": eval_name},
            "compression": compression.model_dump(),
        },
        "plan": plan.to_dict(),
        "report": outcome.report,
        "calibration_cache": cache_note,
        "device": str(loaded.device),
        "dtype": str(loaded.dtype).removeprefix("torch."),
        "out": None,
    }
    if options.save:
        from compressor.checkpoint import save_compressed

        t = time.perf_counter()
        metadata = {k: v for k, v in summary.items() if k not in ("plan",)}
        metadata["source"] = {
            "spec": source.spec,
            "kind": source.kind,
            "location": source.location,
            "revision": source.revision,
        }
        path = save_compressed(
            loaded.model,
            plan,
            out,
            tokenizer=loaded.tokenizer,
            metadata=metadata,
            overwrite=options.overwrite,
        )
        seconds["save"] = time.perf_counter() - t
        summary["out"] = str(path)
        note(f"[green]Wrote[/] {path}", progress)
    seconds["total"] = time.perf_counter() - start_all
    summary["seconds"] = {k: round(v, 3) for k, v in seconds.items()}
    summary["peak_rss_gb"] = round(peak_rss_gb(), 3)
    if summary["out"]:
        from compressor.report import write_run_report

        # The run report (JSON + plots) sits beside the checkpoint; the checkpoint itself is complete.
        summary["report_files"] = [str(p) for p in write_run_report(Path(summary["out"]), summary)]
    return CompressionRun(summary=summary, model=loaded.model, tokenizer=loaded.tokenizer, outcome=outcome)
