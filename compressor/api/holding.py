"""How a compression run holds the model: the whole model in memory (`InMemory`), or its decoder layers on disk, one
materialised at a time (`--layerwise`: `api/layerwise.LayerByLayer`). `api.compress` is one sequence of steps for
both (load, the windows, the disk, the original's evaluation, the statistics, the method, the evaluation after,
the checkpoint); each step that depends on how the layers are held is a method of `Holding`, and nothing else
does. Both write the same checkpoint, bit for bit (tests/test_layerwise.py).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

from compressor.api.model_loading import LoadedModel, load_model
from compressor.api.pipeline import reads_loss_sensitivity, sensitivity_projections
from compressor.api.run_options import CompressOptions
from compressor.api.session import Prepared, RunSpec, calibration_autocast_of
from compressor.calibration.sources import TextSource
from compressor.evaluation.perplexity import evaluate_against, evaluate_perplexity, quality_summary
from compressor.methods import get_method
from compressor.modeling.adapters import get_adapter
from compressor.runtime.progress import note
from compressor.statistics.cache import attach_cached_sensitivity, cached_statistics, save_sensitivity
from compressor.statistics.capture import CalibrationStats, collect_statistics


class Holding:
    """The steps of `api.compress` that depend on how the model is held. `seconds`: the stage times, which the
    steps add to; `summary`: what the run's summary says of it."""

    def __init__(self, run: RunSpec, options: CompressOptions, out: str, progress: bool):
        self.run, self.options, self.out, self.progress = run, options, out, progress
        self.seconds: dict[str, float] = {}
        self.summary: dict[str, object] = {}

    @contextlib.contextmanager
    def opened(self) -> Iterator[None]:
        """For the whole run: what it needs beside the model (temporary files), removed at the end, also on
        failure."""
        yield

    def load(self, device: str, dtype: str) -> LoadedModel:
        raise NotImplementedError

    def adapter(self, loaded: LoadedModel):
        raise NotImplementedError

    def check_room(self, loaded: LoadedModel, prepared: Prepared) -> None:
        """Refuse to start when what the run writes beside the checkpoint cannot fit."""

    def evaluate_before(self, loaded: LoadedModel, prepared: Prepared) -> None:
        """What the evaluation needs of the original before the method changes it."""

    def statistics(self, loaded: LoadedModel, text: TextSource, prepared: Prepared) -> CalibrationStats:
        raise NotImplementedError

    def compress_arguments(self, loaded: LoadedModel) -> dict:
        """`compress_model`'s arguments that say how the model is held."""
        return {}

    def compressed(self, stats: CalibrationStats) -> None:
        """The method has run on `stats`."""

    def evaluate_after(
        self, loaded: LoadedModel, outcome, prepared: Prepared, device: str, dtype: str
    ) -> dict:
        raise NotImplementedError

    def stored_tensors(self, loaded: LoadedModel, outcome):
        """Where the checkpoint writer reads the tensors the model holds only as meta (None: all in memory)."""
        return None

    def model(self, loaded: LoadedModel):
        """The compressed model the run returns (None: it is on disk only, in the checkpoint)."""
        return loaded.model


class InMemory(Holding):
    """The whole model loaded: the statistics from the cache when it holds them, evaluation in one pass beside the
    original loaded again."""

    def load(self, device: str, dtype: str) -> LoadedModel:
        start = time.perf_counter()
        loaded = load_model(self.run.source, device=device, dtype=dtype, progress=self.progress)
        self.seconds["load"] = time.perf_counter() - start
        return loaded

    def adapter(self, loaded: LoadedModel):
        return get_adapter(loaded.model)

    def evaluate_before(self, loaded: LoadedModel, prepared: Prepared) -> None:
        """Without comparison, the original's perplexity now (with it, both models are scored after)."""
        self.before = None
        options = self.options
        if options.evaluate and not options.compare:
            self.before = evaluate_perplexity(
                loaded.model,
                prepared.eval_windows,
                options.batch_size,
                self.progress,
                "Perplexity (original)",
            )
            self.seconds["eval_before"] = self.before.seconds

    def statistics(self, loaded: LoadedModel, text: TextSource, prepared: Prepared) -> CalibrationStats:
        """The calibration statistics (forward passes in the run's calibration dtype), from the validated cache
        when it holds them for this model, text and windows. Collected afresh for a run that weighs by the loss
        sensitivity, they carry it (measured on the first windows); else the cache's is attached where it has
        one for the same windows."""
        run, options, progress, settings = self.run, self.options, self.progress, self.run.compression
        adapter = self.adapter(loaded)
        autocast = calibration_autocast_of(run, loaded.dtype, loaded.device, progress)
        loss_weighted = reads_loss_sensitivity(get_method(settings.method).effective_settings(settings))
        windows, with_mlp, gate_input = prepared.calib_windows, prepared.with_mlp, prepared.gate_input

        def collect() -> CalibrationStats:
            return collect_statistics(
                loaded.model, adapter, windows, options.batch_size, progress, mlp=with_mlp,
                sensitivity_projections=sensitivity_projections(with_mlp) if loss_weighted else (),
                sensitivity_windows=settings.sensitivity_samples, autocast=autocast, gate_input=gate_input,
            )  # fmt: skip

        if not options.stats_cache:
            stats, self.summary["calibration_cache"], self.key = collect(), "statistics cache off", None
        else:
            stats, self.summary["calibration_cache"], self.key = cached_statistics(
                loaded.model, adapter, text.fingerprint, windows, loaded.dtype, with_mlp, collect,
                lambda lookup: note(f"[dim]calibration: {lookup}[/]", progress), autocast, gate_input,
            )  # fmt: skip
        self.seconds["calibration"] = stats.seconds
        # Measured during a fresh capture (its first windows' forward passes shared), else perhaps cached.
        self.cached_sensitivity = stats.sensitivity is None and self._cached_sensitivity(
            stats, adapter, with_mlp
        )
        return stats

    def _cached_sensitivity(self, stats: CalibrationStats, adapter, with_mlp: bool) -> bool:
        """Put the cached loss sensitivity of these statistics on `stats` when the run reads one and the cache
        holds it for the same number of windows; whether it did."""
        settings = self.run.compression
        if self.key is None or not reads_loss_sensitivity(
            get_method(settings.method).effective_settings(settings)
        ):
            return False
        projections = sensitivity_projections(with_mlp)
        return attach_cached_sensitivity(
            stats, self.key, settings.sensitivity_samples, adapter.num_layers, projections
        )

    def compressed(self, stats: CalibrationStats) -> None:
        """A loss sensitivity measured afresh goes to the cache beside its statistics."""
        if self.key is not None and stats.sensitivity is not None and not self.cached_sensitivity:
            save_sensitivity(stats.sensitivity, self.key)

    def evaluate_after(
        self, loaded: LoadedModel, outcome, prepared: Prepared, device: str, dtype: str
    ) -> dict:
        """Perplexity of the compressed model and, with `options.compare`, its faithfulness to the original.

        The original is loaded again (the compressed model was changed in place) and both models see every
        window in one pass: the original's next-token distributions are far too large to keep for a later pass.
        Without comparison, the perplexity measured before compression is the original's."""
        options, progress, windows = self.options, self.progress, prepared.eval_windows
        if options.compare:
            reference = load_model(self.run.source, device=device, dtype=dtype, progress=progress)
            before, scored = evaluate_against(
                reference.model, {"compressed": loaded.model}, windows, options.batch_size, progress
            )
            after, faith = scored["compressed"]
            del reference
            return quality_summary(before, after, faith)
        after = evaluate_perplexity(
            loaded.model, windows, options.batch_size, progress, "Perplexity (compressed)"
        )
        return quality_summary(self.before, after, None)
