"""`masa-compress MODEL --layerwise`: the main job for a model larger than memory. The same steps as `api.compress`
in memory (`LayerByLayer`, one way of `holding.Holding` the model), with the decoder layers left on disk
(`modeling/offload.py`: transformers' / accelerate's disk offload, one layer materialised at a time), every pass
layer by layer (`statistics/layer_stream.py`: the statistics and the loss sensitivity;
`statistics/layer_evaluation.py`: the evaluation), the finished layers spilled (`methods/offloaded_context.py`: the method's context over an offloaded
model) and the checkpoint written tensor by tensor; memory stays flat in depth.
Intermediate files go to a temporary folder (`--offload-dir`, default: beside the output) removed at the end,
also on failure. The result is the checkpoint in-memory compression writes, bit for bit (tests/test_layerwise.py).
"""

from __future__ import annotations

import collections
import contextlib
import math
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from compressor.api.holding import Holding
from compressor.api.model_loading import LoadedModel, bundled_model_dir, read_config
from compressor.api.pipeline import reads_loss_sensitivity
from compressor.api.run_options import CompressOptions
from compressor.api.session import Prepared, RunSpec, calibration_autocast_of
from compressor.calibration.sources import TextSource
from compressor.evaluation.perplexity import quality_summary
from compressor.methods import ModelShape
from compressor.modeling.adapters import MLP_PROJECTIONS, PROJECTIONS
from compressor.modeling.offload import OffloadedModel, load_offloaded
from compressor.runtime.errors import UserError, wording
from compressor.runtime.progress import note
from compressor.statistics.capture import CalibrationStats, captured_inputs
from compressor.statistics.layer_evaluation import evaluate_layerwise, spill_original_outputs
from compressor.statistics.layer_stream import collect_sensitivity_layerwise, collect_statistics_layerwise
from compressor.statistics.partly_compressed import STREAM_MATRICES


class LayerByLayer(Holding):
    """`--layerwise`: the decoder layers on disk, every pass layer by layer, the finished layers spilled; the
    intermediate files in a temporary folder (`--offload-dir`, default: beside the output)."""

    @contextlib.contextmanager
    def opened(self) -> Iterator[None]:
        self.spill = spill_directory(self.options, self.out)
        try:
            yield
        finally:
            shutil.rmtree(self.spill, ignore_errors=True)

    def load(self, device: str, dtype: str) -> LoadedModel:
        loaded = load_layerwise(self.run, device, dtype, self.spill, self.progress)
        self.om: OffloadedModel = loaded.offloaded
        self.seconds["load"] = loaded.seconds
        self.summary["layerwise"] = True
        return loaded

    def adapter(self, loaded: LoadedModel):
        return loaded.offloaded.adapter

    def check_room(self, loaded: LoadedModel, prepared: Prepared) -> None:
        """The temporary files' disk (`spill_disk_needed`)."""
        # the sensitivity windows' inputs, at every layer
        per_layer_tokens = self._sensitivity_windows(prepared) * prepared.calib_windows.shape[1]
        # ...and the original's last hidden states on the evaluation windows, once.
        eval_windows = prepared.eval_windows
        final_tokens = eval_windows.numel() if eval_windows is not None else 0
        inputs = captured_inputs(prepared.with_mlp, prepared.gate_input)
        stream_refit = self.run.compression.refit == "stream"
        needed = spill_disk_needed(
            self.om, prepared.shape, prepared.element_size, per_layer_tokens, final_tokens, tuple(inputs),
            stream_refit,
        )  # fmt: skip
        check_spill_disk(self.spill, needed)

    def evaluate_before(self, loaded: LoadedModel, prepared: Prepared) -> None:
        """The original's outputs, spilled before its layers hold the compressed modules."""
        if self.options.evaluate:
            start = time.perf_counter()
            spill_original_outputs(
                self.om,
                prepared.eval_windows,
                self.spill / "eval",
                self.options.batch_size,
                progress=self.progress,
            )
            self.seconds["eval_before"] = time.perf_counter() - start

    def statistics(self, loaded: LoadedModel, text: TextSource, prepared: Prepared) -> CalibrationStats:
        """Every layer's statistics, spilled per layer, and the loss sensitivity from the hidden states the
        calibration kept of its first windows; never cached."""
        om, progress, spill = self.om, self.progress, self.spill
        autocast = calibration_autocast_of(self.run, loaded.dtype, om.device, progress)
        stats, tail = collect_statistics_layerwise(
            om, prepared.calib_windows, spill / "stats", self.options.batch_size, progress, prepared.with_mlp,
            self._sensitivity_windows(prepared), autocast, prepared.gate_input,
        )  # fmt: skip
        note(
            "[dim]calibration: statistics cache not used with --layerwise (the statistics are spilled per layer)[/]",
            progress,
        )
        self.seconds["calibration"] = stats.seconds
        self.summary["calibration_cache"] = "not used with --layerwise"
        if tail is not None:
            projections = PROJECTIONS + (MLP_PROJECTIONS if prepared.with_mlp else ())
            stats.sensitivity = collect_sensitivity_layerwise(
                om, tail, spill / "stats", projections, progress, autocast
            )
        return stats

    def _sensitivity_windows(self, prepared: Prepared) -> int:
        """The calibration windows whose hidden states the loss sensitivity's backward passes start from."""
        settings = self.run.compression
        samples = settings.sensitivity_samples if reads_loss_sensitivity(settings) else 0
        return min(samples, len(prepared.calib_windows))

    def compress_arguments(self, loaded: LoadedModel) -> dict:
        return {"offloaded": self.om, "spill_dir": self.spill}

    def evaluate_after(
        self, loaded: LoadedModel, outcome, prepared: Prepared, device: str, dtype: str
    ) -> dict:
        before, after, faith = evaluate_layerwise(
            self.om, prepared.eval_windows, outcome.compressed, self.spill / "eval", self.options.batch_size,
            progress=self.progress,
        )  # fmt: skip
        return quality_summary(before, after, faith if self.options.compare else None)

    def stored_tensors(self, loaded: LoadedModel, outcome) -> collections.ChainMap:
        """The compressed layers' files, then the original's."""
        return collections.ChainMap(outcome.compressed, loaded.offloaded.weights)

    def model(self, loaded: LoadedModel) -> None:
        return None


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
