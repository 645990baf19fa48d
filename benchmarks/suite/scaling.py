"""Depth scaling of the layer-sequential pipeline (`--layerwise`): random Llama models of one width and several
depths, each compressed in a fresh process whose peak RSS is its own.

Per depth: a builder process writes the random model as a Hugging Face safetensors directory (so the measured
process never holds the whole model); the measured process loads it with its decoder layers on disk
(`offload.load_offloaded`: its RSS then is *the loaded-for-compression state*), collects the statistics and the
loss sensitivity layer by layer, runs the real `compress_model` (masa with the smollm2-135m recipe settings) and
writes the checkpoint tensor by tensor. *Overhead* = peak RSS minus that loaded state. For the shallowest depth
the same model is also compressed in memory (today's path without `--layerwise`) to compare the two checkpoints
byte for byte. `--larger-than-memory` does the same for one deep model, then loads the checkpoint and evaluates it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import tempfile
import time
from pathlib import Path

from benchmarks.suite.common import BUNDLED_WIDTH, GIB, current_rss_gib, log, peak_rss_gib, run_json_child


def _config(width: dict, layers: int, seq_len: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        **width,
        num_hidden_layers=layers,
        max_position_embeddings=max(2048, seq_len),
        tie_word_embeddings=True,
    )


def build(width: dict, layers: int, seq_len: int, directory: str, seed: int = 0) -> dict:
    """Write a random model (fp32 safetensors, sharded like any Hugging Face checkpoint) to `directory`."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_config(width, layers, seq_len))
    model.save_pretrained(directory, max_shard_size="1GB")
    weights = sum(p.stat().st_size for p in Path(directory).glob("*.safetensors"))
    return {"layers": layers, "weights_bytes": weights, "params": sum(p.numel() for p in model.parameters())}


def _windows(width: dict, samples: int, seq_len: int, seed: int = 0):
    import torch

    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, width["vocab_size"], (samples, seq_len), generator=generator)


def _settings(sensitivity_samples: int):
    from compressor.recipes.schema import builtin_recipe

    update = {"method": "masa", "sensitivity_samples": sensitivity_samples}
    return builtin_recipe("smollm2-135m").compression.model_copy(update=update)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    for shard in sorted(path.glob("*.safetensors")):
        with open(shard, "rb") as f:
            while chunk := f.read(1 << 24):
                digest.update(chunk)
    return digest.hexdigest()


def child(
    source: str, width: dict, samples: int, seq_len: int, ratio: float, sensitivity: int, out: str
) -> dict:
    """Compress the model in `source` layer by layer into `out`; the RSS after each stage and the peak."""
    import collections

    import torch

    from compressor.api.pipeline import compress_model
    from compressor.checkpoint import save_compressed
    from compressor.modeling.adapters import PROJECTIONS
    from compressor.modeling.offload import load_offloaded
    from compressor.statistics.layer_stream import collect_sensitivity_layerwise, collect_statistics_layerwise

    rss: dict[str, float] = {"start": current_rss_gib()}
    seconds: dict[str, float] = {}

    def mark(stage: str, started: float) -> None:
        seconds[stage] = time.perf_counter() - started
        rss[stage] = current_rss_gib()

    spill = Path(tempfile.mkdtemp(prefix="masa-bench-spill-"))
    try:
        t = time.perf_counter()
        om = load_offloaded(source, {}, torch.device("cpu"), torch.float32, spill / "offload")
        windows = _windows(width, samples, seq_len)
        mark("load", t)
        loaded_rss = current_rss_gib()
        t = time.perf_counter()
        stats, tail = collect_statistics_layerwise(
            om, windows, spill / "stats", progress=False, sensitivity_windows=sensitivity
        )
        mark("calibration", t)
        t = time.perf_counter()
        stats.sensitivity = collect_sensitivity_layerwise(
            om, tail, spill / "stats", PROJECTIONS, progress=False
        )
        del tail
        mark("sensitivity", t)
        settings = _settings(sensitivity)
        t = time.perf_counter()
        outcome = compress_model(
            om.model, om.adapter, stats, settings, ratio, progress=False, windows=windows,
            offloaded=om, spill_dir=spill,
        )  # fmt: skip
        mark("compress", t)
        t = time.perf_counter()
        on_disk = collections.ChainMap(outcome.compressed, om.weights)
        save_compressed(om.model, outcome.plan, out, metadata={"benchmark": "scaling"}, on_disk=on_disk)
        mark("save", t)
        stats_bytes = sum(p.stat().st_size for p in (spill / "stats").glob("stats-*"))
    finally:
        shutil.rmtree(spill, ignore_errors=True)
    peak = peak_rss_gib()
    return {
        "layers": om.adapter.num_layers,
        "width": width,
        "calibration": {"samples": samples, "seq_len": seq_len, "tokens": samples * seq_len},
        "sensitivity_windows": sensitivity,
        "compression_settings": settings.model_dump(),
        "ratio": ratio,
        "achieved_ratio": outcome.plan.achieved_ratio(),
        "model_params": sum(p.numel() for p in om.model.parameters()),
        "spilled_stats_bytes": stats_bytes,
        "seconds": seconds,
        "compress_seconds": sum(v for k, v in seconds.items() if k != "load"),
        "stage_seconds": outcome.seconds,
        "rss_gib": rss,
        "rss_loaded_gib": loaded_rss,
        "peak_rss_gib": peak,
        "overhead_gib": peak - loaded_rss,
        "checkpoint_sha256": _sha256(Path(out)),
        "checkpoint_bytes": sum(p.stat().st_size for p in Path(out).glob("*.safetensors")),
    }


def in_memory_child(
    source: str, width: dict, samples: int, seq_len: int, ratio: float, sensitivity: int
) -> dict:
    """The same compression without `--layerwise` (the whole model and all statistics in memory)."""
    import torch
    from transformers import AutoModelForCausalLM

    from compressor.api.pipeline import compress_model
    from compressor.checkpoint import save_compressed
    from compressor.modeling.adapters import get_adapter
    from compressor.statistics.capture import collect_statistics

    t = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    loaded_rss = current_rss_gib()
    adapter = get_adapter(model)
    windows = _windows(width, samples, seq_len)
    stats = collect_statistics(model, adapter, windows, progress=False)
    outcome = compress_model(
        model, adapter, stats, _settings(sensitivity), ratio, progress=False, windows=windows
    )
    out = Path(tempfile.mkdtemp(prefix="masa-bench-inmemory-")) / "ckpt"
    try:
        save_compressed(model, outcome.plan, out, metadata={"benchmark": "scaling"})
        sha = _sha256(out)
    finally:
        shutil.rmtree(out.parent, ignore_errors=True)
    peak = peak_rss_gib()
    return {
        "checkpoint_sha256": sha,
        "rss_loaded_gib": loaded_rss,
        "peak_rss_gib": peak,
        "overhead_gib": peak - loaded_rss,
        "seconds": time.perf_counter() - t,
    }


def evaluate_child(checkpoint: str, width: dict, samples: int, seq_len: int) -> dict:
    """Load a written checkpoint with the library's loader and measure its perplexity on random windows."""
    from compressor.checkpoint import load_compressed
    from compressor.evaluation.perplexity import evaluate_perplexity

    t = time.perf_counter()
    model = load_compressed(checkpoint)
    load_seconds = time.perf_counter() - t
    result = evaluate_perplexity(model, _windows(width, samples, seq_len, seed=1), progress=False)
    return {
        "ppl": result.ppl,
        "tokens": result.tokens,
        "load_seconds": load_seconds,
        "eval_seconds": result.seconds,
    }


def _measured(
    width, layers, samples, seq_len, ratio, sensitivity, work: Path, in_memory: bool = False
) -> dict:
    """Build a model of `layers` layers in `work`, compress it layer by layer (and in memory too)."""
    source, out = work / f"model-{layers}", work / f"ckpt-{layers}"
    common = ["--width", json.dumps(width), "--samples", str(samples), "--seq-len", str(seq_len)]
    built = run_json_child(
        ["-m", "benchmarks.suite.scaling", "--build", str(source), "--layers", str(layers), *common], "build"
    )
    args = [*common, "--ratio", str(ratio), "--sensitivity", str(sensitivity)]
    run = run_json_child(
        ["-m", "benchmarks.suite.scaling", "--child", str(source), "--out", str(out), *args],
        f"layerwise {layers}",
    )
    run["weights_bytes"] = built["weights_bytes"]
    log(
        f"  {layers} layers ({built['weights_bytes'] / GIB:.2f} GiB of weights): {run['compress_seconds']:.1f} s, "
        f"peak RSS {run['peak_rss_gib']:.3f} GiB (loaded {run['rss_loaded_gib']:.3f}, overhead "
        f"{run['overhead_gib']:.3f})"
    )
    if in_memory:
        run["in_memory"] = run_json_child(
            ["-m", "benchmarks.suite.scaling", "--in-memory", str(source), *args], f"in memory {layers}"
        )
    return run


def run_scaling(
    width: dict, layer_counts: list[int], samples: int, seq_len: int, ratio: float, sensitivity: int = 16
) -> dict:
    """One fresh process per depth; ratios of the deeper runs to the shallowest; the byte-for-byte comparison
    with the in-memory path at the shallowest depth."""
    work = Path(tempfile.mkdtemp(prefix="masa-bench-scaling-"))
    try:
        runs = []
        for i, layers in enumerate(layer_counts):
            log(f"scaling (layerwise): {layers} layers, {samples}x{seq_len} random calibration tokens")
            runs.append(
                _measured(width, layers, samples, seq_len, ratio, sensitivity, work, in_memory=i == 0)
            )
            shutil.rmtree(work, ignore_errors=True)
            work.mkdir()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    by_depth = {r["layers"]: r for r in runs}
    base = runs[0]
    double = by_depth.get(2 * base["layers"], runs[-1])
    same = base["in_memory"]["checkpoint_sha256"] == base["checkpoint_sha256"]
    return {
        "mode": "layerwise",
        "runs": runs,
        "depths": [r["layers"] for r in runs],
        "peak_ratio": double["peak_rss_gib"] / base["peak_rss_gib"],
        "peak_ratio_depths": [base["layers"], double["layers"]],
        "overhead_growth": runs[-1]["overhead_gib"] / base["overhead_gib"],
        "overhead_growth_depths": [base["layers"], runs[-1]["layers"]],
        "time_ratio": runs[-1]["compress_seconds"] / base["compress_seconds"],
        "same_checkpoint": {"layers": base["layers"], "identical": same},
    }


def run_larger_than_memory(
    width: dict, layers: int, samples: int, seq_len: int, ratio: float, sensitivity: int, eval_samples: int
) -> dict:
    """One deep model compressed layer by layer; then its checkpoint loaded and evaluated (fresh processes)."""
    work = Path(tempfile.mkdtemp(prefix="masa-bench-deep-"))
    try:
        log(f"larger than memory: {layers} layers, {samples}x{seq_len} random calibration tokens")
        run = _measured(width, layers, samples, seq_len, ratio, sensitivity, work)
        log("  loading and evaluating the checkpoint")
        args = ["--evaluate", str(work / f"ckpt-{layers}"), "--width", json.dumps(width)]
        args += ["--samples", str(eval_samples), "--seq-len", str(seq_len)]
        evaluation = run_json_child(["-m", "benchmarks.suite.scaling", *args], "evaluate")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {
        "layers": layers,
        "weights_bytes": run["weights_bytes"],
        "peak_rss_bytes": int(run["peak_rss_gib"] * GIB),
        "peak_over_weights": run["peak_rss_gib"] * GIB / run["weights_bytes"],
        "ppl": evaluation["ppl"],
        "evaluation": evaluation,
        "run": run,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--build", metavar="DIR", help="write a random model to DIR and print its size")
    parser.add_argument("--child", metavar="DIR", help="compress the model in DIR layer by layer (--out)")
    parser.add_argument("--in-memory", metavar="DIR", help="compress the model in DIR in memory")
    parser.add_argument("--evaluate", metavar="CKPT", help="load a checkpoint and evaluate it")
    parser.add_argument("--out", help="checkpoint directory of --child")
    parser.add_argument("--layers", type=int, nargs="+", default=[15, 30, 60])
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--ratio", type=float, default=0.2)
    parser.add_argument("--sensitivity", type=int, default=16, help="loss-sensitivity windows")
    parser.add_argument("--width", type=json.loads, default=BUNDLED_WIDTH, help="JSON of LlamaConfig widths")
    parser.add_argument("--larger-than-memory", action="store_true", help="one deep model (--layers N)")
    parser.add_argument("--eval-samples", type=int, default=4)
    args = parser.parse_args(argv)
    common = (args.width, args.samples, args.seq_len)
    if args.build:
        result = build(args.width, args.layers[0], args.seq_len, args.build)
    elif args.child:
        result = child(args.child, *common, args.ratio, args.sensitivity, args.out)
    elif args.in_memory:
        result = in_memory_child(args.in_memory, *common, args.ratio, args.sensitivity)
    elif args.evaluate:
        result = evaluate_child(args.evaluate, args.width, args.samples, args.seq_len)
    elif args.larger_than_memory:
        result = run_larger_than_memory(*common[:1], args.layers[0], *common[1:], args.ratio, args.sensitivity,
                                        args.eval_samples)  # fmt: skip
    else:
        result = run_scaling(
            args.width, args.layers, args.samples, args.seq_len, args.ratio, args.sensitivity
        )
    print("\n" + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
