"""Forward-pass timings, each measured in a fresh process.

- `forward`: one plain forward pass (no hooks, batch size 1, no KV cache) over the same calibration windows
  a compression run uses: the unavoidable part of calibration, the denominator of `compress_over_forward`.
- `latency`: the original model vs a compressed checkpoint reloaded with `load_compressed`, in one process,
  measured alternately: prefill of P real tokens (median of several runs after warm-up) and D greedy decoded
  tokens with a KV cache; plus the time spent inside the attention projections, the MLPs and the output head
  (hooks, separate runs).
- `memory`: one model alone in a process: RSS after loading and peak RSS over a prefill + decode.

Run as `python -m benchmarks.suite.speed {forward,latency,memory} ...`; each prints one JSON object on stdout.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from benchmarks.suite.common import GIB, current_rss_gib, log, peak_rss_gib


def _load_original(spec: str, device: str = "cpu"):
    from compressor.api.model_loading import load_model, resolve_model

    loaded = load_model(resolve_model(spec), device=device, dtype="auto", progress=False)
    return loaded.model, loaded.tokenizer


def _load(spec_or_checkpoint: str):
    """A recipe alias / model path through `load_model`, or a compressed checkpoint through `load_compressed`."""
    from compressor.checkpoint import MASA_CONFIG, load_compressed

    if (Path(spec_or_checkpoint) / MASA_CONFIG).is_file():
        return load_compressed(spec_or_checkpoint, with_tokenizer=True)
    return _load_original(spec_or_checkpoint)


def model_size(model: torch.nn.Module) -> dict:
    """Stored parameters, each shared tensor counted once (`parameters()` deduplicates)."""
    from compressor.modeling.adapters import get_adapter

    params = list(model.parameters())
    layers = {id(p): p for layer in get_adapter(model).layers for p in layer.parameters()}
    return {
        "params": sum(p.numel() for p in params),
        "layer_params": sum(p.numel() for p in layers.values()),  # the decoder layers' (what is compressed)
        "param_gib": sum(p.numel() * p.element_size() for p in params) / GIB,
    }


def checkpoint_bytes(directory: str | Path) -> int:
    return sum(f.stat().st_size for f in Path(directory).glob("*.safetensors"))


def calibration_token_windows(
    spec: str, tokenizer, samples: int | None, seq_len: int | None, targets: str | None = None
) -> torch.Tensor:
    """Exactly the windows `compressor.api.compress` builds for this model and targets (recipe settings +
    overrides: with the MLP targeted, the recipe's `mlp_samples`)."""
    from compressor.api.run_options import CompressOptions
    from compressor.api.session import resolve_run
    from compressor.calibration.sources import load_documents
    from compressor.calibration.windows import bos_token_id_for, calibration_windows, tokenize_documents

    options = CompressOptions(calib_samples=samples, seq_len=seq_len, targets=targets)
    calibration = resolve_run(spec, options).calibration
    text = load_documents(calibration.source, split="calibration")
    ids = tokenize_documents(tokenizer, text.documents)
    return calibration_windows(
        ids, calibration.samples, calibration.seq_len, calibration.seed, bos_id=bos_token_id_for(tokenizer)
    )


def prompt_tokens(tokenizer, n_tokens: int) -> torch.Tensor:
    """The first `n_tokens`-token window of the held-out evaluation text, shape (1, n_tokens)."""
    from compressor.api.session import evaluation_token_windows
    from compressor.recipes.schema import EvaluationSettings

    windows, _ = evaluation_token_windows(
        tokenizer, EvaluationSettings(seq_len=n_tokens, max_tokens=2 * n_tokens)
    )
    return windows[:1]


# ------------------------------------------------------------------------------------------------------
# Measurements


@torch.no_grad()
def plain_forward_seconds(model: torch.nn.Module, windows: torch.Tensor, batch_size: int = 1) -> float:
    """One forward pass over all windows, as `collect_statistics` runs them but without its hooks."""
    device = next(model.parameters()).device
    model(input_ids=windows[:1, : min(64, windows.shape[1])].to(device), use_cache=False)  # warm-up
    start = time.perf_counter()
    for first in range(0, windows.shape[0], batch_size):
        model(input_ids=windows[first : first + batch_size].to(device), use_cache=False)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


@torch.no_grad()
def prefill_seconds(model: torch.nn.Module, prompt: torch.Tensor) -> float:
    """A prefill as `generate` runs it: the whole prompt, a KV cache built, logits of the last token only."""
    start = time.perf_counter()
    model(input_ids=prompt, use_cache=True, logits_to_keep=1)
    return time.perf_counter() - start


@torch.no_grad()
def decode_seconds(model: torch.nn.Module, prompt: torch.Tensor, n_tokens: int) -> tuple[float, list[int]]:
    """Greedy decoding of `n_tokens` single-token steps after an (untimed) prefill, reusing the KV cache."""
    out = model(input_ids=prompt, use_cache=True, logits_to_keep=1)
    cache, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
    tokens = []
    start = time.perf_counter()
    for _ in range(n_tokens):
        out = model(input_ids=token, past_key_values=cache, use_cache=True, logits_to_keep=1)
        cache, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        tokens.append(int(token))
    return time.perf_counter() - start, tokens


PARTS, PHASES = ("projection", "mlp", "lm_head"), ("prefill", "decode")


def timed_parts(model: torch.nn.Module) -> dict[str, list[torch.nn.Module]]:
    """The modules that read the weights, by kind: the attention projections, the MLPs, the output head."""
    from compressor.modeling.adapters import PROJECTIONS, get_adapter

    adapter = get_adapter(model)
    layers = range(adapter.num_layers)
    return {
        "projection": [adapter.projection(layer, name) for layer in layers for name in PROJECTIONS],
        "mlp": [adapter.layers[layer].mlp for layer in layers],
        "lm_head": [model.get_output_embeddings()],
    }


@contextmanager
def module_timer(modules: list[torch.nn.Module]) -> Iterator[list[float]]:
    """Seconds spent inside `modules` while the model runs (hooks around each)."""
    spent, started, handles = [0.0], {}, []

    def enter(module, args):
        started[module] = time.perf_counter()

    def leave(module, args, output):
        spent[0] += time.perf_counter() - started[module]

    for module in modules:
        handles += [module.register_forward_pre_hook(enter), module.register_forward_hook(leave)]
    try:
        yield spent
    finally:
        for handle in handles:
            handle.remove()


@torch.no_grad()
def time_split(model: torch.nn.Module, modules: list[torch.nn.Module], prompt: torch.Tensor, decode: int):
    """Time inside `modules` during one prefill, and during one decode of `decode` tokens (separate, untimed
    runs: the hooks cost a little)."""
    with module_timer(modules) as spent:
        prefill_seconds(model, prompt)
    prefill = spent[0]
    out = model(input_ids=prompt, use_cache=True, logits_to_keep=1)
    cache, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
    with module_timer(modules) as spent:
        for _ in range(decode):
            out = model(input_ids=token, past_key_values=cache, use_cache=True, logits_to_keep=1)
            cache, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
    return prefill, spent[0]


def measure_latency(original: str, checkpoint: str, prefill: int, decode: int, repeats: int) -> dict:
    """The original vs `checkpoint` (a compressed checkpoint, or any model directory: an export), measured
    alternately in one process."""
    models = {"original": _load(original), "compressed": _load(checkpoint)}
    prompt = prompt_tokens(models["original"][1], prefill)
    runs: dict[str, dict[str, list]] = {
        name: {"prefill": [], "decode": [], **{f"{kind}_{phase}": [] for kind in PARTS for phase in PHASES}}
        for name in models
    }
    tokens: dict[str, list[int]] = {}
    for model, _ in models.values():  # warm-up: one prefill and a short decode each
        prefill_seconds(model, prompt)
        decode_seconds(model, prompt, 2)
    for r in range(repeats):
        order = list(models) if r % 2 == 0 else list(models)[::-1]  # alternate, so drift hits both
        for name in order:
            model = models[name][0]
            runs[name]["prefill"].append(prefill_seconds(model, prompt))
        for name in order:
            seconds, tokens[name] = decode_seconds(models[name][0], prompt, decode)
            runs[name]["decode"].append(seconds)
    for _ in range(min(repeats, 3)):
        for name, (model, _) in models.items():
            for kind, modules in timed_parts(model).items():
                in_prefill, in_decode = time_split(model, modules, prompt, decode)
                runs[name][f"{kind}_prefill"].append(in_prefill)
                runs[name][f"{kind}_decode"].append(in_decode)
    result: dict = {
        "prefill_tokens": int(prompt.shape[1]),
        "decode_tokens": decode,
        "repeats": repeats,
        "torch_threads": torch.get_num_threads(),
    }
    for name, (model, _) in models.items():
        result[name] = {
            "prefill_ms": 1e3 * statistics.median(runs[name]["prefill"]),
            "prefill_ms_runs": [1e3 * s for s in runs[name]["prefill"]],
            # Time inside the attention projections, the MLPs and the output head (hooks, separate runs): what
            # reads the weights; the rest of a decode step (norms, rotary, attention over the cache, Python) does
            # not shrink with the weights.
            **{
                f"{phase}_{kind}_ms": 1e3 * statistics.median(runs[name][f"{kind}_{phase}"])
                for kind in PARTS
                for phase in PHASES
            },
            "decode_ms": 1e3 * statistics.median(runs[name]["decode"]),
            "decode_ms_per_token": 1e3 * statistics.median(runs[name]["decode"]) / decode,
            "decode_ms_runs": [1e3 * s for s in runs[name]["decode"]],
            **model_size(model),
        }
    agree = sum(a == b for a, b in zip(tokens["original"], tokens["compressed"], strict=True))
    result["decoded_tokens_equal_to_original"] = agree
    result["prefill_ratio"] = result["compressed"]["prefill_ms"] / result["original"]["prefill_ms"]
    result["decode_ratio"] = result["compressed"]["decode_ms"] / result["original"]["decode_ms"]
    return result


def measure_memory(spec_or_checkpoint: str, prefill: int, decode: int) -> dict:
    before = current_rss_gib()
    model, tokenizer = _load(spec_or_checkpoint)
    loaded = current_rss_gib()
    prompt = prompt_tokens(tokenizer, prefill)
    prefill_seconds(model, prompt)
    decode_seconds(model, prompt, decode)
    return {
        "rss_before_load_gib": before,
        "rss_after_load_gib": loaded,
        "peak_rss_gib": peak_rss_gib(),
        "torch_threads": torch.get_num_threads(),
        **model_size(model),
    }


def measure_forward(
    spec: str, samples: int | None, seq_len: int | None, batch_size: int, targets: str | None = None
) -> dict:
    # The device the compression run picks (`auto`), so that the two times compare.
    model, tokenizer = _load_original(spec, device="auto")
    windows = calibration_token_windows(spec, tokenizer, samples, seq_len, targets)
    seconds = plain_forward_seconds(model, windows, batch_size)
    return {
        "seconds": seconds,
        "windows": int(windows.shape[0]),
        "seq_len": int(windows.shape[1]),
        "tokens": int(windows.numel()),
        "batch_size": batch_size,
        "torch_threads": torch.get_num_threads(),
        "device": str(next(model.parameters()).device),
        "peak_rss_gib": peak_rss_gib(),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="what", required=True)
    forward = sub.add_parser("forward")
    forward.add_argument("--model", default="smollm2-135m")
    forward.add_argument("--calib-samples", type=int)
    forward.add_argument("--seq-len", type=int)
    forward.add_argument("--batch-size", type=int, default=1)
    forward.add_argument(
        "--targets", help="the compression run's targets (the MLP's take the recipe's mlp_samples)"
    )
    latency = sub.add_parser("latency")
    latency.add_argument("--model", default="smollm2-135m")
    latency.add_argument("--checkpoint", required=True)
    latency.add_argument("--prefill", type=int, default=512)
    latency.add_argument("--decode", type=int, default=64)
    latency.add_argument("--repeats", type=int, default=7)
    memory = sub.add_parser("memory")
    memory.add_argument("--model", required=True, help="recipe alias, model path or compressed checkpoint")
    memory.add_argument("--prefill", type=int, default=512)
    memory.add_argument("--decode", type=int, default=64)
    args = parser.parse_args(argv)

    from compressor.api.model_loading import _quiet_transformers

    _quiet_transformers()
    if args.what == "forward":
        result = measure_forward(args.model, args.calib_samples, args.seq_len, args.batch_size, args.targets)
        log(f"plain forward over {result['windows']}x{result['seq_len']} tokens: {result['seconds']:.1f} s")
    elif args.what == "latency":
        result = measure_latency(args.model, args.checkpoint, args.prefill, args.decode, args.repeats)
    else:
        result = measure_memory(args.model, args.prefill, args.decode)
    print("\n" + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
