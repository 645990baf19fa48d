"""Cached calibration statistics, so a second run with another ratio or method skips calibration.

The cache key covers everything the statistics depend on: the model's weights (hashed), the
calibration text (its fingerprint), the windows (samples, length, seed, BOS), the compute dtype and
the tool version. A cached file is validated on load (key, shapes, finiteness, symmetry) and is
recomputed, never trusted, when anything is off. The loss sensitivity (`--allocation global-loss`) is cached
beside the statistics it was measured with, per number of windows.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from compressor import __version__
from compressor.modeling.adapters import DecoderAdapter
from compressor.runtime.cache_root import cache_dir
from compressor.runtime.errors import all_finite
from compressor.statistics.capture import ATTN_INPUTS, MLP_INPUTS, CalibrationStats, captured_inputs
from compressor.statistics.sensitivity import Sensitivity

#: What the cached numbers mean; part of the key, so a file of another format is never reused. 2: the
#: autocorrelations are token means (format 1 held the sums Σ xᵀx); 3: with every input's token mean (`mean.KIND`);
#: 4: each window's product taken in fp32 (`capture.add_gram`), so a format-3 file would differ in the last digits
#: from what this version computes, and a run would depend on the cache's history; 5: the products by column blocks
#: above the diagonal, mirrored (`capture.gram_blocks`), again different in the last digits; 6: each window's input
#: sums in fp32 (the token means FLAP reads differ in the last digits); 7: the input kinds a file holds named in its
#: metadata (`inputs`): a method that keeps gate/up's rows has their input's autocorrelation left out.
STATS_FORMAT = 7


def model_fingerprint(model: nn.Module) -> str:
    """sha256 over every parameter and buffer name, shape, dtype and bytes (the weights define the statistics)."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        t = tensor.detach().contiguous().cpu()
        digest.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
        digest.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()


def stats_key(
    model_hash: str,
    text_fingerprint: str,
    windows: torch.Tensor,
    dtype: torch.dtype,
    mlp: bool = False,
    autocast: torch.dtype | None = None,
    gate_input: bool = True,
) -> str:
    spec = {
        "format": STATS_FORMAT,
        "tool_version": __version__,
        "model": model_hash,
        "text": text_fingerprint,
        # The windows themselves (ids) capture samples, length, seed and BOS handling exactly.
        "windows": hashlib.sha256(windows.contiguous().numpy().tobytes()).hexdigest(),
        "shape": list(windows.shape),
        "dtype": str(dtype),
    }
    if mlp:  # a different set of statistics (attention-only keys stay what they were)
        spec["inputs"] = list(captured_inputs(mlp, gate_input))
    if autocast is not None:  # forward passes in another dtype (keys of the model's own dtype stay the same)
        spec["autocast"] = str(autocast)
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()


def stats_path(key: str) -> Path:
    return cache_dir() / "stats" / f"{key[:32]}.safetensors"


def save_stats(stats: CalibrationStats, key: str) -> Path:
    path = stats_path(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {"block_output_means": stats.block_output_means.contiguous().cpu()}
    for kind in stats.inputs:
        for i in range(len(stats.attn_autocorr)):
            tensors[f"{kind}.{i}"] = stats.autocorr(kind, i).contiguous().cpu()
        if stats.input_means is not None:
            tensors[f"mean.{kind}"] = stats.input_means[kind].contiguous().cpu()
    metadata = {
        "key": key,
        "inputs": ",".join(stats.inputs),
        "tokens": str(stats.tokens),
        "windows": str(stats.windows),
        "seconds": str(stats.seconds),
    }
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        save_file(tensors, str(tmp), metadata=metadata)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def load_stats(key: str, adapter: DecoderAdapter) -> tuple[CalibrationStats | None, str]:
    """The cached statistics for `key`, or (None, why not) when absent or invalid."""
    path = stats_path(key)
    if not path.is_file():
        return None, "no cached statistics"
    try:
        with safe_open(str(path), "pt") as f:
            metadata = f.metadata() or {}
            if metadata.get("key") != key:
                return None, f"{path.name} was written for other inputs"
            n = adapter.num_layers
            kinds = metadata.get("inputs", "").split(",")
            if not set(ATTN_INPUTS) <= set(kinds) <= set(ATTN_INPUTS | MLP_INPUTS):
                return None, f"{path.name} names unknown inputs"
            autocorr = {kind: [f.get_tensor(f"{kind}.{i}") for i in range(n)] for kind in kinds}
            means = f.get_tensor("block_output_means")
            input_means = {kind: f.get_tensor(f"mean.{kind}") for kind in kinds}
    except Exception as err:  # a truncated or foreign file: recompute rather than trust it
        return None, f"{path.name} is unreadable ({type(err).__name__})"
    g = adapter.geometry
    for kind, matrices in autocorr.items():
        size = g.input_size(kind)
        mean = input_means[kind]
        if mean.shape != (n, size) or mean.dtype != torch.float64 or not all_finite(mean):
            return None, f"{path.name} holds input means of the wrong shape or non-finite ones"
        for a in matrices:
            if a.shape != (size, size):
                return None, f"{path.name} has the wrong shapes"
            if a.dtype != torch.float64 or not all_finite(a):
                return None, f"{path.name} holds non-finite or non-fp64 statistics"
            if not torch.equal(a, a.T) and (a - a.T).abs().max() > 1e-9 * a.abs().max():
                return None, f"{path.name} holds non-symmetric autocorrelations"
    stats = CalibrationStats(
        autocorr["attn"], autocorr["o"], means, int(metadata["tokens"]), int(metadata["windows"]), 0.0,
        autocorr.get("mlp"), autocorr.get("down"), input_means=input_means,
    )  # fmt: skip
    return stats, f"reused cached statistics {path}"


def sensitivity_path(key: str, windows: int) -> Path:
    return cache_dir() / "stats" / f"{key[:32]}.sensitivity-{windows}.json"


def save_sensitivity(sensitivity: Sensitivity, key: str) -> Path:
    """The loss sensitivity measured on the first `sensitivity.windows` windows of the statistics `key` was
    computed on, beside them (a second run with the same settings skips its backward pass)."""
    path = sensitivity_path(key, sensitivity.windows)
    record = {
        "key": key, "tokens": sensitivity.tokens, "windows": sensitivity.windows, "seconds": sensitivity.seconds,
        "weights": [[layer, p, value] for (layer, p), value in sorted(sensitivity.weights.items())],
    }  # fmt: skip
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(record))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def load_sensitivity(key: str, windows: int, expected: set[tuple[int, str]]) -> Sensitivity | None:
    """The cached sensitivity over `windows` windows for the statistics `key`, when it covers exactly the
    `expected` (layer, projection) pairs with finite values; None otherwise (then it is measured again)."""
    path = sensitivity_path(key, windows)
    try:
        record = json.loads(path.read_text())
        weights = {(int(layer), str(p)): float(value) for layer, p, value in record["weights"]}
        valid = record["key"] == key and int(record["windows"]) == windows
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not valid or set(weights) != expected or not all(math.isfinite(v) for v in weights.values()):
        return None
    return Sensitivity(weights, int(record["tokens"]), windows, 0.0)


def cached_statistics(
    model: nn.Module,
    adapter: DecoderAdapter,
    text_fingerprint: str,
    windows: torch.Tensor,
    dtype: torch.dtype,
    mlp: bool,
    collect: Callable[[], CalibrationStats],
    on_lookup: Callable[[str], None] = lambda note: None,
    autocast: torch.dtype | None = None,
    gate_input: bool = True,
) -> tuple[CalibrationStats, str, str]:
    """The calibration statistics of `model` on `windows`: from the validated cache when it holds them, else
    `collect()`-ed and cached. Returns them, a note saying where they came from, and their cache key (which
    the loss sensitivity measured with them is cached under). `on_lookup` hears the lookup's outcome before a
    long collection starts. `autocast`: the dtype `collect` computes in (`device.calibration_autocast`), part of
    the key, as is which MLP inputs `collect` sums (`mlp`, `gate_input`: `capture.captured_inputs`). What `compress`
    and the benchmark harness both call, so both share one cache."""
    key = stats_key(model_fingerprint(model), text_fingerprint, windows, dtype, mlp, autocast, gate_input)
    stats, note = load_stats(key, adapter)
    if stats is not None:
        stats.autocast = autocast  # the key holds it: cached statistics were computed so
    on_lookup(note)
    if stats is None:
        stats = collect()
        note = f"computed and cached in {save_stats(stats, key)}"
    return stats, note, key


def attach_cached_sensitivity(
    stats: CalibrationStats, key: str, samples: int, num_layers: int, projections: tuple[str, ...]
) -> bool:
    """Put on `stats` the cached loss sensitivity measured with them on their first `samples` windows (capped
    at the windows they have) over `projections` of every layer, when the cache holds it; whether it did. A
    run that then measures it saves it with `save_sensitivity(stats.sensitivity, key)`."""
    expected = {(layer, p) for layer in range(num_layers) for p in projections}
    stats.sensitivity = load_sensitivity(key, min(samples, stats.windows), expected)
    return stats.sensitivity is not None
