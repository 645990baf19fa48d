"""The public entry point and one run, stage by stage.

`from compressor.api import compress, evaluate, plan, inspect, CompressOptions, EvalSettings, InspectOptions`.

A run: `session.py` resolves it (model, recipe, options merged by `run_options.py`, method) and checks what can
be checked before heavy work; `model_loading.py` resolves and loads the model; `run.py` calibrates (the
`statistics` package), runs the method through `pipeline.py`, evaluates and saves; `layerwise.py` is the same run
with the decoder layers on disk. `preview.py` is `plan` (the exact accounting from the config alone) and
`inspection.py` is `inspect` (grouping and energy before paying for a run).

Names load on first use, so importing one module of this package (`compressor.api.preview` for `plan`) does not
import the whole run.
"""

from __future__ import annotations

import importlib

_PUBLIC = {
    "compress": ("compressor.api.run", "compress"),
    "evaluate": ("compressor.api.run", "evaluate"),
    "CompressionRun": ("compressor.api.run", "CompressionRun"),
    "Evaluation": ("compressor.api.run", "Evaluation"),
    "CompressOptions": ("compressor.api.run_options", "CompressOptions"),
    "EvalSettings": ("compressor.api.run_options", "EvalSettings"),
    "plan": ("compressor.api.preview", "plan_compression"),
    "inspect": ("compressor.api.inspection", "inspect_model"),
    "InspectOptions": ("compressor.api.inspection", "InspectOptions"),
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'compressor.api' has no attribute '{name}'")
    module, attribute = _PUBLIC[name]
    value = getattr(importlib.import_module(module), attribute)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))
