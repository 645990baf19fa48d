"""Importance weights for quantization (llama.cpp's "imatrix"), from the tool's own calibration.

llama.cpp's `llama-imatrix` runs text through a model and keeps, for every matrix, the mean over the tokens of the
square of each input column; `llama-quantize --imatrix` hands that vector to `ggml_quantize_chunk`, which then
minimizes each row's error weighted by it. It is the diagonal of the input autocorrelation that the compression's
whitening already reads. Here it is measured on the model being quantized (a compressed model's own inputs, as
`llama-imatrix` would measure them on its GGUF), over the calibration windows, summed in fp64, for every
`nn.Linear` — the output head included: with tied embeddings its vector is the embedding matrix's, which
llama.cpp multiplies the final hidden state by. The untied embedding is a lookup (no input to weigh): none.

Cached under the calibration statistics' cache (keyed by the weights, the text and the windows), so a second
export of the same model skips the forward passes.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from compressor import __version__
from compressor.runtime.cache_root import cache_dir
from compressor.runtime.progress import progress_bar
from compressor.statistics.cache import model_fingerprint

IMPORTANCE_FORMAT = 2  # 2: with the output sensitivities and token shares of `gradient_windows`


@dataclass
class Importance:
    """Per matrix (its module path, e.g. `model.layers.3.mlp.down_proj`), the mean square of each input column;
    with `gradient_windows`, also each matrix's output sensitivity (mean over tokens of ‖∂L/∂y_t‖² / d_out, L the
    summed next-token cross-entropy: `statistics.sensitivity`'s quantity) under `gradients`, the embedding's
    (the gradient at its output) under its path, and each token's share of the calibration tokens."""

    weights: dict[str, torch.Tensor]
    windows: int
    tokens: int
    seconds: float
    note: str = ""  # where they came from: measured, or the cache file
    gradients: dict[str, float] | None = None
    token_share: torch.Tensor | None = None
    gradient_windows: int = 0
    key: str = ""  # the cache key (the weights, the text, the windows): what was measured on

    def of(self, module_path: str) -> torch.Tensor | None:
        return self.weights.get(module_path)


def module_paths_of(model: nn.Module) -> dict[int, str]:
    """id(module) → its path, for the modules whose inputs are weighed (every nn.Linear)."""
    return {id(m): name for name, m in model.named_modules() if isinstance(m, nn.Linear)}


def measure_importance(
    model: nn.Module, windows: torch.Tensor, progress: bool = True, gradient_windows: int = 0
) -> Importance:
    """Run the calibration windows (N, T) through `model` and return every nn.Linear's input mean squares; the
    first `gradient_windows` windows also run backward (no weight is updated) for the output sensitivities."""
    start = time.perf_counter()
    device = next(model.parameters()).device
    sums: dict[str, torch.Tensor] = {}
    gradient_sums: dict[str, float] = {}
    paths = module_paths_of(model)
    embedding = model.get_input_embeddings()
    embedding_path = next(n for n, m in model.named_modules() if m is embedding)
    measured = min(gradient_windows, len(windows))
    state = {"backward": False}

    def on_gradient(name: str, width: int):
        def add(grad: torch.Tensor) -> None:
            gradient_sums[name] = gradient_sums.get(name, 0.0) + float(grad.double().square().sum()) / width

        return add

    def input_hook(module, args):
        x = args[0].detach().reshape(-1, args[0].shape[-1])
        total = x.double().square().sum(0)
        name = paths[id(module)]
        sums[name] = sums[name] + total if name in sums else total

    def output_hook(module, args, output):
        if state["backward"]:
            output.register_hook(on_gradient(paths.get(id(module), embedding_path), output.shape[-1]))

    def embedding_hook(module, args, output):
        if state["backward"]:  # the weights stay frozen: the gradient starts at the embedding's output
            output = output.detach().requires_grad_()
            output.register_hook(on_gradient(embedding_path, output.shape[-1]))
            return output
        return None

    handles = [m.register_forward_pre_hook(input_hook) for m in model.modules() if id(m) in paths]
    handles += [m.register_forward_hook(output_hook) for m in model.modules() if id(m) in paths]
    handles.append(embedding.register_forward_hook(embedding_hook))
    counts = torch.zeros(embedding.weight.shape[0], dtype=torch.float64)
    frozen = [p for p in model.parameters() if p.requires_grad]
    for p in frozen:
        p.requires_grad_(False)
    try:
        with progress_bar("Importance weights", total=len(windows), enabled=progress) as bar:
            for index, window in enumerate(windows):
                ids = window[None].to(device)
                counts += torch.bincount(window.cpu(), minlength=counts.numel()).double()
                state["backward"] = index < measured
                if state["backward"]:
                    with torch.enable_grad():
                        logits = model(input_ids=ids, use_cache=False).logits
                        loss = torch.nn.functional.cross_entropy(
                            logits[0, :-1].float(), ids[0, 1:], reduction="sum"
                        )
                        loss.backward()
                else:
                    with torch.no_grad():
                        model(input_ids=ids, use_cache=False)
                bar.advance(1)
    finally:
        for handle in handles:
            handle.remove()
        for p in frozen:
            p.requires_grad_(True)
    tokens = int(windows.numel())
    weights = _finite({name: (total / tokens).cpu() for name, total in sums.items()})
    _tie_embedding(model, weights)
    gradients = None
    if measured:
        gradient_tokens = measured * windows.shape[1]
        gradients = {name: total / gradient_tokens for name, total in gradient_sums.items()}
    return Importance(
        weights, len(windows), tokens, time.perf_counter() - start, "measured", gradients,
        (counts / counts.sum()).float(), measured,
    )  # fmt: skip


def _finite(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    for name, vector in weights.items():
        if not torch.isfinite(vector).all():
            raise FloatingPointError(f"importance weights of {name}: not finite (the model overflowed)")
    return weights


def _tie_embedding(model: nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """With tied embeddings the output head's vector is also the embedding's (one matrix in the GGUF)."""
    output, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    if output is None or embedding is None or output.weight is not embedding.weight:
        return
    names = {id(m): n for n, m in model.named_modules()}
    if names.get(id(output)) in weights:
        weights[names[id(embedding)]] = weights[names[id(output)]].clone()  # one file key each


def importance_key(
    model: nn.Module, text_fingerprint: str, windows: torch.Tensor, gradient_windows: int = 0
) -> str:
    spec = {
        "gradient_windows": gradient_windows,
        "format": IMPORTANCE_FORMAT,
        "tool_version": __version__,
        "model": model_fingerprint(model),
        "text": text_fingerprint,
        "windows": hashlib.sha256(windows.contiguous().numpy().tobytes()).hexdigest(),
        "shape": list(windows.shape),
    }
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()


def importance_path(key: str) -> Path:
    return cache_dir() / "importance" / f"{key[:32]}.safetensors"


def cached_importance(
    model: nn.Module,
    text_fingerprint: str,
    windows: torch.Tensor,
    progress: bool = True,
    gradient_windows: int = 0,
) -> Importance:
    """The importance weights of `model` on `windows` (with the output sensitivities of `gradient_windows`): from
    the cache when a valid file holds them (its key, every vector's width and finiteness checked), else measured
    and cached (written atomically)."""
    key = importance_key(model, text_fingerprint, windows, gradient_windows)
    path = importance_path(key)
    cached = _read_cached(path, model, windows, gradient_windows)
    if cached is not None:
        cached.key = key
        return cached
    measured = measure_importance(model, windows, progress, gradient_windows)
    tensors = {f"input.{n}": v.contiguous() for n, v in measured.weights.items()}
    if measured.gradients is not None:
        tensors |= {
            f"gradient.{n}": torch.tensor([g], dtype=torch.float64) for n, g in measured.gradients.items()
        }
    tensors["token_share"] = measured.token_share
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        save_file(tensors, str(tmp), metadata={"key": key})
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    measured.note, measured.key = f"measured and cached in {path}", key
    return measured


def _read_cached(
    path: Path, model: nn.Module, windows: torch.Tensor, gradient_windows: int
) -> Importance | None:
    """The cached file's contents when they are whole (every matrix's vector at its width, finite), else None."""
    if not path.is_file():
        return None
    try:
        tensors = load_file(str(path))
    except Exception:  # noqa: BLE001 - an unreadable cache file is measured again, never trusted
        return None
    weights = {k.removeprefix("input."): v for k, v in tensors.items() if k.startswith("input.")}
    gradients = {
        k.removeprefix("gradient."): float(v) for k, v in tensors.items() if k.startswith("gradient.")
    }
    expected = {name: m.in_features for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    if any(weights.get(n) is None or weights[n].shape != (w,) for n, w in expected.items()):
        return None
    if not all(torch.isfinite(v).all() for v in tensors.values()) or (gradient_windows and not gradients):
        return None
    return Importance(
        weights, len(windows), int(windows.numel()), 0.0, f"cached in {path}", gradients or None,
        tensors.get("token_share"), min(gradient_windows, len(windows)),
    )  # fmt: skip
