"""masa-compress: training-free compression of LLM weights (`SUMMARY` says how).

The package reads as the pipeline, bottom to top: `runtime/` (device, cache, progress, errors) → `modeling/`
(adapters, compressed modules) → `math/` and `evaluation/` → `statistics/` (calibration) → `quantize/`
(llama.cpp's types) → `checkpoint/`, `report/` → `methods/` → `api/` (one run, and the public entry point
`compressor.api`) → `cli/`.
"""

from __future__ import annotations

__version__ = "0.1.0"

SUMMARY = (
    "Training-free compression of LLM weights: whitened low-rank factors and narrower MLPs under one "
    "loss-aware budget; weights shared across layers (MASA) on request, where it pays: from about half of "
    "the attention removed."
)
