"""How fast ggml rounds on this machine, per type: what `plan --size` prices a byte budget's export at.

Two rates per candidate type, weights a second, measured once on a matrix of a small model's widths (a few
seconds on 2 CPU cores) and cached per CPU, llama.cpp build and threads:
- `errors`: `squared_rounding` with importance weights (quantize, decode, square): what measuring each type's
  rounding error on a matrix's sampled rows costs (`byte_budget.matrix_options`);
- `quantize`: ggml's quantizer alone: what writing a matrix in its chosen type costs.
ggml quantizes on the CPU whatever device the model runs on, so these are CPU rates on every machine.
"""

from __future__ import annotations

import importlib.metadata
import time
from dataclasses import dataclass

import numpy as np
import torch

from compressor.quantize.byte_budget import CANDIDATE_TYPES, squared_rounding
from compressor.quantize.ggml_quantize import quantize_with_llama_cpp
from compressor.runtime.cache_root import CpuShared, measured_once
from compressor.runtime.device import cpu_name

ROUNDING_RATES_FORMAT = 1


@dataclass(frozen=True)
class RoundingRates(CpuShared):
    """Weights a second per type: measuring its rounding error (`errors`) and quantizing alone (`quantize`)."""

    errors: dict[str, float]
    quantize: dict[str, float]
    cpu_share: float = 1.0


def _weights_per_second(weights: int, run, least_seconds: float = 0.05) -> float:
    """`weights` / the seconds of one `run()`, after a warm-up, repeated until `least_seconds` have passed."""
    run()
    count, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < least_seconds or count == 0:
        run()
        count += 1
    return weights * count / elapsed


def measure_rounding_rates(rows: int = 64, row_length: int = 1536) -> RoundingRates:
    """Each candidate type's two rates on a random `rows` × `row_length` matrix with random importance weights
    (ggml's time per weight does not depend on the values, only on the type and the row's blocks)."""
    generator = np.random.default_rng(0)
    array = generator.standard_normal((rows, row_length)).astype(np.float32) * 0.02
    importance = generator.uniform(0.1, 2.0, row_length).astype(np.float32)
    cpu_start, wall_start = time.process_time(), time.perf_counter()
    errors, quantize = {}, {}
    for type_name in CANDIDATE_TYPES:
        errors[type_name] = _weights_per_second(
            array.size, lambda t=type_name: squared_rounding(array, t, importance)
        )
        if type_name != "F16":  # the file's f16 matrices are a cast, not ggml's quantizer
            quantize[type_name] = _weights_per_second(
                array.size, lambda t=type_name: quantize_with_llama_cpp(array, t, importance)
            )
    quantize["F16"] = errors["F16"]
    # ggml's quantizer runs on one thread per call here: the share is of one core, not of torch's threads.
    share = min(1.0, (time.process_time() - cpu_start) / (time.perf_counter() - wall_start))
    return RoundingRates(errors, quantize, share)


def rounding_rates() -> RoundingRates:
    """`measure_rounding_rates` once per machine (its CPU, the llama.cpp build, torch's threads), then from the
    cache; a measurement taken while other work held the CPU prices this estimate only."""
    build = importlib.metadata.version("xllamacpp")
    identity = f"{ROUNDING_RATES_FORMAT}|{cpu_name()}|{build}|{torch.get_num_threads()}"
    return measured_once("rounding-", identity, measure_rounding_rates, RoundingRates)
