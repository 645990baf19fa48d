"""Depth scaling of a compression run: random Llama models of one width and 1x, 2x... the layers.

Each configuration runs in a fresh process (`python -m benchmarks.scaling --child ...`), so its peak RSS is
its own: build the random model, collect the calibration statistics on the same random token windows, run
the real `compress_model` (method masa, the smollm2-135m recipe settings) and `save_compressed` to a
temporary directory. The child reports the time of each stage, its RSS after each stage and its peak RSS
(VmHWM), so the parent can separate the model itself (which grows with depth by construction) from the
memory the compression adds on top of it.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time

from benchmarks.common import GIB, current_rss_gib, log, peak_rss_gib, run_json_child

#: The bundled SmolLM2-135M's width (its depth is 30 layers).
BUNDLED_WIDTH = {
    "hidden_size": 576,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "intermediate_size": 1536,
    "vocab_size": 49152,
}
#: A narrow model for the quick mode.
NARROW_WIDTH = {
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "vocab_size": 256,
}


def _tensor_gib(tensors) -> float:
    return sum(t.numel() * t.element_size() for t in tensors) / GIB


def child(width: dict, layers: int, samples: int, seq_len: int, ratio: float, seed: int = 0) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from compressor.adapters import get_adapter
    from compressor.capture import collect_statistics
    from compressor.checkpoint import save_compressed
    from compressor.pipeline import compress_model
    from compressor.recipes.schema import builtin_recipe

    rss: dict[str, float] = {"start": current_rss_gib()}
    peak: dict[str, float] = {"start": peak_rss_gib()}
    seconds: dict[str, float] = {}

    def mark(stage: str, started: float) -> None:
        seconds[stage] = time.perf_counter() - started
        rss[stage], peak[stage] = current_rss_gib(), peak_rss_gib()

    t = time.perf_counter()
    torch.manual_seed(seed)
    config = LlamaConfig(
        **width,
        num_hidden_layers=layers,
        max_position_embeddings=max(2048, seq_len),
        tie_word_embeddings=True,
    )
    model = AutoModelForCausalLM.from_config(config).eval()
    generator = torch.Generator().manual_seed(seed)
    windows = torch.randint(0, width["vocab_size"], (samples, seq_len), generator=generator)
    model_gib = _tensor_gib(model.parameters())
    mark("build", t)

    adapter = get_adapter(model)
    t = time.perf_counter()
    stats = collect_statistics(model, adapter, windows, progress=False)
    mark("calibration", t)
    stats_gib = _tensor_gib([*stats.attn_autocorr, *stats.o_autocorr, stats.block_output_means])

    t = time.perf_counter()
    settings = builtin_recipe("smollm2-135m").compression.model_copy(update={"method": "masa"})
    outcome = compress_model(model, adapter, stats, settings, ratio, progress=False, windows=windows)
    mark("compress", t)
    del stats

    out = tempfile.mkdtemp(prefix="masa-bench-scaling-")
    try:
        t = time.perf_counter()
        save_compressed(model, outcome.plan, f"{out}/ckpt", metadata={"benchmark": "scaling"})
        mark("save", t)
    finally:
        shutil.rmtree(out, ignore_errors=True)
    compress_seconds = seconds["calibration"] + seconds["compress"] + seconds["save"]
    # compress_model caches one fp64 Cholesky factor per compressed layer and input (hidden x hidden for
    # q/k/v, q_out x q_out for o) until it returns: computed here from the plan, not measured.
    compressed_layers = {pp.layer for pp in outcome.plan.projections if pp.mode != "dense"}
    q_out = adapter.geometry.shape("q_proj")[0]
    cholesky_gib = len(compressed_layers) * (width["hidden_size"] ** 2 + q_out**2) * 8 / GIB
    return {
        "layers": layers,
        "width": width,
        "calibration": {"samples": samples, "seq_len": seq_len, "tokens": samples * seq_len},
        "compression_settings": settings.model_dump(),
        "ratio": ratio,
        "achieved_ratio": outcome.plan.achieved_ratio(),
        "groups": outcome.report.get("grouping", {}).get("groups"),
        "model_params": sum(p.numel() for p in model.parameters()),
        "model_gib": model_gib,
        "stats_gib": stats_gib,
        "cholesky_gib": cholesky_gib,
        "seconds": seconds,
        "stage_seconds": outcome.seconds,
        "compress_seconds": compress_seconds,
        "rss_gib": rss,
        "peak_gib_after": peak,
        "peak_rss_gib": peak_rss_gib(),
        "rss_after_model_gib": rss["build"],
        "overhead_gib": peak_rss_gib() - rss["build"],
    }


def run_scaling(width: dict, layer_counts: list[int], samples: int, seq_len: int, ratio: float) -> dict:
    """One fresh process per depth; ratios of the deeper runs to the first (shallowest) one."""
    runs = []
    for layers in layer_counts:
        log(f"scaling: {layers} layers, {samples}x{seq_len} random calibration tokens (fresh process)")
        args = ["-m", "benchmarks.scaling", "--child", "--layers", str(layers), "--samples", str(samples)]
        args += ["--seq-len", str(seq_len), "--ratio", str(ratio), "--width", json.dumps(width)]
        run = run_json_child(args, f"scaling child ({layers} layers)")
        log(
            f"  {layers} layers: {run['compress_seconds']:.1f} s, peak RSS {run['peak_rss_gib']:.3f} GiB "
            f"(model loaded: {run['rss_after_model_gib']:.3f} GiB, overhead {run['overhead_gib']:.3f} GiB)"
        )
        runs.append(run)
    base, deep = runs[0], runs[-1]
    return {
        "runs": runs,
        "depths": [r["layers"] for r in runs],
        "depth_factor": deep["layers"] / base["layers"],
        "time_ratio": deep["compress_seconds"] / base["compress_seconds"],
        "peak_ratio": deep["peak_rss_gib"] / base["peak_rss_gib"],
        "overhead_ratio": deep["overhead_gib"] / base["overhead_gib"],
        "model_ratio": deep["model_gib"] / base["model_gib"],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--child", action="store_true", help="run one configuration and print its JSON")
    parser.add_argument("--layers", type=int, nargs="+", default=[15, 30])
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--ratio", type=float, default=0.2)
    parser.add_argument("--width", type=json.loads, default=BUNDLED_WIDTH, help="JSON of LlamaConfig widths")
    args = parser.parse_args(argv)
    if args.child:
        result = child(args.width, args.layers[0], args.samples, args.seq_len, args.ratio)
    else:
        result = run_scaling(args.width, args.layers, args.samples, args.seq_len, args.ratio)
    print("\n" + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
