"""`masa-compress MODEL --layerwise`: the main job for a model larger than memory. The same resolution, checks,
method, summary and checkpoint as `api.compress`, with the decoder layers left on disk (`modeling/offload.py`:
transformers' / accelerate's disk offload, one layer materialised at a time), every pass layer by layer
(`statistics/layer_stream.py`: the statistics and the loss sensitivity; `statistics/layer_evaluation.py`: the
evaluation), the finished layers spilled (`methods/offloaded_context.py`: the method's context over an offloaded
model) and the checkpoint written tensor by tensor; memory stays flat in depth.
Intermediate files go to a temporary folder (`--offload-dir`, default: beside the output) removed at the end,
also on failure. The result is the checkpoint in-memory compression writes, bit for bit (tests/test_layerwise.py).
"""

from __future__ import annotations

import collections
import math
import shutil
import tempfile
import time
from pathlib import Path

from compressor.api.model_loading import LoadedModel, bundled_model_dir, read_config
from compressor.api.pipeline import compress_model, reads_loss_sensitivity
from compressor.api.run_options import CompressOptions
from compressor.api.session import (
    RunSpec,
    calibration_autocast_of,
    check_free_disk,
    check_output_dir,
    prepare_run,
    read_texts,
)
from compressor.evaluation.perplexity import quality_summary
from compressor.methods import ModelShape
from compressor.modeling.adapters import MLP_PROJECTIONS, PROJECTIONS
from compressor.modeling.offload import OffloadedModel, load_offloaded
from compressor.runtime.errors import UserError, wording
from compressor.runtime.progress import note
from compressor.statistics.capture import captured_inputs
from compressor.statistics.layer_evaluation import evaluate_layerwise, spill_original_outputs
from compressor.statistics.layer_stream import collect_sensitivity_layerwise, collect_statistics_layerwise
from compressor.statistics.partly_compressed import STREAM_MATRICES


def check_layerwise(run: RunSpec, options: CompressOptions) -> None:
    """What the layer-by-layer pipeline cannot do, refused before any weights are read."""
    if run.source.kind == "compressed":
        raise UserError(
            f"'{run.source.spec}' is already a masa-compress checkpoint: compress the original model"
        )


def spill_directory(options: CompressOptions, out: str) -> Path:
    """A fresh temporary folder for the run's intermediate files: under `--offload-dir`, else beside `out`."""
    parent = Path(options.offload_dir) if options.offload_dir else Path(out).resolve().parent
    parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=".masa-layerwise-", dir=parent))


def load_layerwise(run: RunSpec, device: str, dtype: str, spill: Path, progress: bool) -> LoadedModel:
    """The model with its decoder layers on disk, and its tokenizer, as a `LoadedModel` (`.offloaded` set)."""
    from transformers import AutoTokenizer

    from compressor.runtime.device import resolve_device, resolve_dtype

    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    if run.source.kind == "bundled":
        bundled_model_dir(run.source, progress)
    _, location, kwargs = read_config(run.source)
    om = load_offloaded(location, kwargs, torch_device, torch_dtype, spill / "offload")
    tokenizer = AutoTokenizer.from_pretrained(location, **kwargs)
    return LoadedModel(om.model, tokenizer, run.source, torch_device, torch_dtype, om.seconds, offloaded=om)


def compress_layerwise(
    run: RunSpec, options: CompressOptions, out: str, device: str, dtype: str, progress: bool
):
    """Everything `api.compress` does after resolving the run, layer by layer; returns (loaded, outcome,
    quality, seconds, texts, the model's parameters before) for `api` to summarise and save, and the temporary
    folder, which the caller removes once the checkpoint is written."""
    check_layerwise(run, options)
    if options.save:
        check_output_dir(out, options.overwrite)
    calib_text, eval_text = read_texts(run, options.evaluate, options.allow_overlap)
    spill = spill_directory(options, out)
    try:
        return _run(run, options, out, device, dtype, progress, spill, calib_text, eval_text) + (spill,)
    except BaseException:
        shutil.rmtree(spill, ignore_errors=True)
        raise


def _run(run, options, out, device, dtype, progress, spill, calib_text, eval_text):
    loaded = load_layerwise(run, device, dtype, spill, progress)
    om: OffloadedModel = loaded.offloaded
    seconds = {"load": loaded.seconds}
    prepared = prepare_run(run, options, om.model, om.adapter, loaded.tokenizer, calib_text, eval_text)
    shape, ratio, with_mlp = prepared.shape, prepared.ratio, prepared.with_mlp
    model_params_before = prepared.model_params_before
    calib_windows, eval_windows, eval_name = prepared.calib_windows, prepared.eval_windows, prepared.eval_name
    element = prepared.element_size
    if options.save:
        check_free_disk(out, int((model_params_before - ratio * shape.params_before) * element))
    samples = run.compression.sensitivity_samples if reads_loss_sensitivity(run.compression) else 0
    samples = min(samples, len(calib_windows))
    per_layer_tokens = samples * calib_windows.shape[1]  # the sensitivity windows' inputs, at every layer
    # ...and the original's last hidden states on the evaluation windows, once.
    final_tokens = eval_windows.numel() if eval_windows is not None else 0
    inputs = captured_inputs(with_mlp, prepared.gate_input)
    stream_refit = run.compression.refit == "stream"
    needed = spill_disk_needed(
        om, shape, element, per_layer_tokens, final_tokens, tuple(inputs), stream_refit
    )
    check_spill_disk(spill, needed)
    if options.evaluate:  # the original's outputs, before its layers hold the compressed modules
        t = time.perf_counter()
        spill_original_outputs(om, eval_windows, spill / "eval", options.batch_size, progress=progress)
        seconds["eval_before"] = time.perf_counter() - t
    autocast = calibration_autocast_of(run, loaded.dtype, om.device, progress)
    stats, tail = collect_statistics_layerwise(
        om, calib_windows, spill / "stats", options.batch_size, progress, with_mlp, samples, autocast,
        prepared.gate_input,
    )  # fmt: skip
    note(
        "[dim]calibration: statistics cache not used with --layerwise (the statistics are spilled per layer)[/]",
        progress,
    )
    seconds["calibration"] = stats.seconds
    if tail is not None:
        projections = PROJECTIONS + (MLP_PROJECTIONS if with_mlp else ())
        stats.sensitivity = collect_sensitivity_layerwise(
            om, tail, spill / "stats", projections, progress, autocast
        )
    outcome = compress_model(
        om.model, om.adapter, stats, run.compression, ratio, progress, windows=calib_windows,
        offloaded=om, spill_dir=spill, size=options.byte_target,
    )  # fmt: skip
    seconds.update(outcome.seconds)
    quality = {}
    if options.evaluate:
        t = time.perf_counter()
        before, after, faith = evaluate_layerwise(
            om, eval_windows, outcome.compressed, spill / "eval", options.batch_size, progress=progress
        )
        quality = quality_summary(before, after, faith if options.compare else None)
        quality["evaluation_text"] = eval_name
        seconds["eval"] = time.perf_counter() - t
    return loaded, outcome, quality, seconds, (calib_text, eval_name), model_params_before


def spill_disk_needed(
    om: OffloadedModel,
    shape: ModelShape,
    element: int,
    per_layer: int,
    final: int,
    kinds: tuple[str, ...],
    stream_refit: bool = False,
) -> int:
    """Bytes of the run's temporary files: every layer's fp64 statistics, the compressed projections (at most the
    targeted weights), the sensitivity windows' hidden states at every layer (`per_layer` tokens), the original's
    last hidden states on the evaluation windows (`final` tokens) and, with `stream_refit`, the refitted o_proj
    and down_proj written again (at most their whole size); `kinds`: the inputs whose statistics are spilled
    (`capture.captured_inputs`). 5% and 64 MiB on top."""
    geometry, layers = om.adapter.geometry, om.adapter.num_layers
    stats = layers * sum(8 * geometry.input_size(kind) ** 2 for kind in kinds)
    hidden = (layers * per_layer + final) * geometry.hidden_size * element
    refits = (
        layers * sum(math.prod(geometry.shape(p)) for p in STREAM_MATRICES) * element if stream_refit else 0
    )
    return int(1.05 * (stats + shape.params_before * element + hidden + refits)) + 64 * 2**20


def check_spill_disk(spill: Path, needed: int) -> None:
    """Refuse to start when `needed` bytes of temporary files (`spill_disk_needed`) cannot fit on `spill`'s disk."""
    free = shutil.disk_usage(spill).free
    if free < needed:
        raise UserError(
            f"not enough free disk for the layer-by-layer run's temporary files in {spill.parent}: about "
            f"{needed / 2**30:.2f} GiB needed, {free / 2**30:.2f} GiB free: pass "
            + wording("--offload-dir on a larger disk", "an offload_dir on a larger disk")
        )


def stored_tensors(loaded: LoadedModel, outcome) -> collections.ChainMap:
    """Where the checkpoint's meta tensors are read from: the compressed layers' files, then the original's."""
    return collections.ChainMap(outcome.compressed, loaded.offloaded.weights)
