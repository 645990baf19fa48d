"""The library API that the CLI wraps: evaluate a model, compress a model.

Options and their resolution against the recipe are `run_options.py`'s; the setup every run shares (resolution,
texts, windows, output checks) is `session.py`'s; the methods are `methods/`'s. This module orchestrates.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from compressor import __version__
from compressor.api.holding import InMemory
from compressor.api.layerwise import LayerByLayer
from compressor.api.memory_check import check_memory, run_memory
from compressor.api.model_loading import (
    ENGINES,
    LoadedModel,
    ModelSource,
    load_model,
    load_with_llama_cpp,
    resolve_model,
)
from compressor.api.pipeline import (
    CompressionOutcome,
    compress_model,
)
from compressor.api.preview import read_model_config
from compressor.api.run_options import CompressOptions, EvalSettings, resolve_eval_settings
from compressor.api.session import (
    RunSpec,
    calibration_summary,
    check_free_disk,
    check_output_dir,
    default_output_dir,
    evaluation_token_windows,
    peak_rss_gb,
    prepare_run,
    read_texts,
    resolve_run,
)
from compressor.api.time_estimate import time_estimate
from compressor.calibration.sources import TextSource, load_documents
from compressor.checkpoint import read_masa_config, save_compressed
from compressor.evaluation.perplexity import (
    Faithfulness,
    PerplexityResult,
    evaluate_against,
    evaluate_perplexity,
)
from compressor.math.accounting import with_legacy_keys
from compressor.recipes.schema import EvaluationSettings
from compressor.report import write_run_report
from compressor.runtime.errors import UserError, wording
from compressor.runtime.hub import check_hub_model
from compressor.runtime.progress import note

__all__ = ["CompressOptions", "EvalSettings", "compress", "evaluate"]


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
    engine: str = "transformers"

    def to_dict(self) -> dict:
        payload = {
            "model": self.loaded.source.describe(),
            "engine": self.engine,
            "flash_attention": getattr(self.loaded.model, "flash_attention", False),  # llama.cpp's
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
    if source.kind == "gguf":
        return _exported_gguf_source(source)
    if source.kind != "compressed":
        return None, "not a compressed checkpoint: nothing to compare with (pass --against MODEL)"
    recorded = read_masa_config(source.location).get("metadata", {}).get("source") or {}
    for spec in (recorded.get("spec"), recorded.get("location")):
        if not spec:
            continue
        try:
            found = resolve_model(spec)
            check_hub_model(found)  # a hub model without network is not available here either
            return found, f"the checkpoint's source {spec}"
        except UserError:
            continue
    return None, (
        f"the checkpoint's source model ({recorded.get('spec') or 'unrecorded'}) is not available here: "
        + wording("pass --against MODEL to compare", "pass against=MODEL to compare")
    )


def _exported_gguf_source(source: ModelSource) -> tuple[ModelSource | None, str]:
    """The original a GGUF written by `export` records, when it is at hand."""
    import gguf

    from compressor.api.export import SOURCE_KEY

    fields = gguf.GGUFReader(str(Path(source.location) / source.gguf_file)).fields
    spec = fields[SOURCE_KEY].contents() if SOURCE_KEY in fields else ""
    if not spec:
        return None, "a GGUF without a recorded source: nothing to compare with (pass --against MODEL)"
    try:
        found = resolve_model(spec)
        check_hub_model(found)
    except UserError:
        return (
            None,
            f"the GGUF's source model ({spec}) is not available here: pass --against MODEL to compare",
        )
    return found, f"the GGUF's source {spec}"


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
    if settings.engine not in ENGINES:
        raise UserError(f"--engine {settings.engine}: unknown engine: choose one of {', '.join(ENGINES)}")
    if settings.flash_attention and settings.engine != "llama.cpp":
        raise UserError("--flash-attention is llama.cpp's: add --engine llama.cpp (or drop it)")
    source = resolve_model(model)
    evaluation = resolve_eval_settings(settings, source.recipe)
    # Everything the user named is checked before any weights are read: the model first.
    check_hub_model(source)
    documents = load_documents(evaluation.source, split=evaluation.split)
    reference, note = reference_source(source, settings)
    if reference is not None:
        check_hub_model(reference)
    if settings.engine == "llama.cpp":
        loaded = load_with_llama_cpp(source, evaluation.seq_len, progress, settings.flash_attention)
    else:
        loaded = load_model(source, device=device, dtype=dtype, progress=progress)
    windows, text_name = evaluation_token_windows(loaded.tokenizer, evaluation, documents)
    if reference is None:
        result = evaluate_perplexity(loaded.model, windows, batch_size=settings.batch_size, progress=progress)
        result.text, result.split = text_name, evaluation.split
        return Evaluation(result, loaded, evaluation, compare_note=note, engine=settings.engine)
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
    return Evaluation(result, loaded, evaluation, faith, ref, reference.describe(), note, settings.engine)


# ------------------------------------------------------------------------------------------------------
# Compression


@dataclass
class CompressionRun:
    """The result of `compress`: numbers for the summary table and `--json`, and the compressed model."""

    summary: dict
    model: object = None
    tokenizer: object = None
    outcome: CompressionOutcome | None = None


def compress(
    model: str,
    options: CompressOptions,
    device: str = "auto",
    dtype: str = "auto",
    progress: bool = True,
) -> CompressionRun:
    """The main job: calibrate, compress, evaluate before/after, and write the checkpoint. One sequence of steps
    whether the model is held in memory or layer by layer (`--layerwise`): `holding.Holding` does the steps
    that differ."""
    start_all = time.perf_counter()
    run = resolve_run(model, options)
    out = options.out or default_output_dir(
        run.recipe_name or run.source.location, run.compression.method, options.ratio, options.ratio_of
    )
    check_hub_model(run.source)  # a model that cannot be had says so first, then one that cannot fit
    check_memory(run_memory(read_model_config(run.source)[0], run, options, device, dtype))
    held = (LayerByLayer if options.layerwise else InMemory)(run, options, out, progress)
    if options.save:
        check_output_dir(out, options.overwrite)
    calib_text, eval_text = read_texts(run, options.evaluate, options.allow_overlap)
    with held.opened():
        loaded = held.load(device, dtype)
        adapter = held.adapter(loaded)
        prepared = prepare_run(run, options, loaded.model, adapter, loaded.tokenizer, calib_text, eval_text)
        if options.save:
            removed = prepared.ratio * prepared.shape.params_before
            check_free_disk(out, int((prepared.model_params_before - removed) * prepared.element_size))
        held.check_room(loaded, prepared)
        held.evaluate_before(loaded, prepared)
        stats = held.statistics(loaded, calib_text, prepared)
        outcome = compress_model(
            loaded.model, adapter, stats, run.compression, prepared.ratio, progress, windows=prepared.calib_windows,
            size=options.byte_target, **held.compress_arguments(loaded),
        )  # fmt: skip
        held.compressed(stats)
        del stats
        seconds = held.seconds | outcome.seconds
        quality = {}
        if options.evaluate:
            start = time.perf_counter()
            quality = held.evaluate_after(loaded, outcome, prepared, device, dtype)
            quality["evaluation_text"] = prepared.eval_name
            seconds["eval"] = time.perf_counter() - start
        params_before = prepared.model_params_before
        summary = _summary(
            run, options, loaded, outcome, quality, calib_text, prepared.eval_name, params_before
        )
        summary.update(held.summary)
        _finish(run, options, loaded, outcome, summary, out, seconds, start_all, progress,
                held.stored_tensors(loaded, outcome))  # fmt: skip
    return CompressionRun(summary, model=held.model(loaded), tokenizer=loaded.tokenizer, outcome=outcome)


def _finish(run, options, loaded, outcome, summary, out, seconds, start_all, progress, on_disk=None) -> None:
    """Save the checkpoint (when asked), then the timings, peak memory and the run report into `summary`."""
    if options.save:
        t = time.perf_counter()
        summary["out"] = _save(run, loaded, outcome, summary, out, options.overwrite, on_disk)
        summary["checkpoint_bytes"] = sum(
            p.stat().st_size for p in Path(summary["out"]).glob("*.safetensors")
        )
        seconds["save"] = time.perf_counter() - t
        note(f"[green]Wrote[/] {summary['out']}", progress)
    seconds["total"] = time.perf_counter() - start_all
    summary["seconds"] = {k: round(v, 3) for k, v in seconds.items()}
    planned = time_estimate(read_model_config(run.source)[0], run, options, gpu=loaded.device.type == "cuda")
    summary["seconds_planned"] = planned["stages"] | {"total": planned["total"]}  # what `plan` said
    summary["peak_rss_gb"] = round(peak_rss_gb(), 3)
    if summary["out"]:
        # The run report (JSON + plots) sits beside the checkpoint; the checkpoint itself is complete.
        summary["report_files"] = [str(p) for p in write_run_report(Path(summary["out"]), summary)]


def _summary(
    run: RunSpec,
    options: CompressOptions,
    loaded: LoadedModel,
    outcome: CompressionOutcome,
    quality: dict,
    calib_text: TextSource,
    eval_name: str,
    model_params_before: int,
) -> dict:
    """What the run did, for the summary table, `--json` and the checkpoint's metadata."""
    plan = outcome.plan
    element = next(loaded.model.parameters()).element_size()
    model_params_after = sum(p.numel() for p in loaded.model.parameters())
    return with_legacy_keys({
        "tool_version": __version__,
        "model": run.source.describe(),
        "recipe": run.recipe_name,
        "method": run.compression.method,
        "ratio_requested": options.ratio,
        "ratio_of": options.ratio_of,
        "targets_ratio": plan.ratio,
        "targets": run.compression.targets,
        "achieved_ratio": plan.achieved_ratio(),
        "target_params_before": plan.params_before,
        "target_params_after": plan.params_after(),
        "model_params_before": model_params_before,
        "model_params_after": model_params_after,
        # What the weights take at the model's dtype (the written checkpoint's size is added once saved).
        "weights_bytes_before": model_params_before * element,
        "weights_bytes_after": model_params_after * element,
        "ppl_before": quality.get("ppl_before"),
        "ppl_after": quality.get("ppl_after"),
        "split": run.evaluation.split if options.evaluate else None,
        "kl_to_original": quality.get("kl_to_original"),
        "top1_agreement": quality.get("top1_agreement"),
        "quality": quality or None,
        "settings": {
            "calibration": calibration_summary(run, calib_text, loaded.dtype),
            "evaluation": {**run.evaluation.model_dump(), "text": eval_name},
            "compression": run.compression.model_dump(),
        },
        "plan": plan.to_dict(),
        "report": outcome.report,
        "device": str(loaded.device),
        "dtype": str(loaded.dtype).removeprefix("torch."),
        "out": None,
    })  # fmt: skip


def _save(
    run: RunSpec, loaded: LoadedModel, outcome, summary: dict, out: str, overwrite: bool, on_disk=None
) -> str:
    """Write the checkpoint (atomically) with the summary as its metadata; returns its path."""
    metadata = {k: v for k, v in summary.items() if k != "plan"}
    source = run.source
    metadata["source"] = {
        "spec": source.spec,
        "kind": source.kind,
        "location": source.location,
        "revision": source.revision,
    }
    path = save_compressed(
        loaded.model, outcome.plan, out, tokenizer=loaded.tokenizer, metadata=metadata, overwrite=overwrite,
        on_disk=on_disk,
    )  # fmt: skip
    return str(path)
