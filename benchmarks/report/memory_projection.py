"""Projected peak memory of `masa-compress --layerwise` for models too large to measure here.

A model of what the layer-sequential pipeline holds at its peak, read off the code (`compressor/api/layerwise.py`:
`statistics/layer_stream.py`, `modeling/offload.py`, `methods/offloaded_context.py`; `methods/masa/basis.py`,
`math/whitening.py`): every term is computed from the model's
shapes and the run's settings, except the runtime base R0 (Python, torch, transformers, the model's skeleton),
which is taken from the measured scaling run. It is checked against the measured overheads of the scaling
section (`validation_rows`) before it is applied to Llama shapes (`projection_rows`). The section's other
paragraph on memory, the deep model larger than its run's memory, is rendered here too.

Symbols: H hidden, A = heads·head_dim (q's output, o's input), K = kv_heads·head_dim, I intermediate, V vocabulary,
L layers; N×T calibration windows × tokens, S sensitivity windows, B = basis_layers (a run sharing a basis),
C×Tₑ an evaluation chunk (32 windows); d bytes per element of the model dtype (fp32 4, bf16 2); fp64 is 8.
"""

from __future__ import annotations

from dataclasses import replace

from compressor.runtime.memory import (  # noqa: F401  (re-exported: the report and tests read them here)
    EVAL_CHUNK,
    GIB,
    Shape,
    Workload,
    activations,
    block_means,
    cpu_peak,
    device_peak,
    host_peak_with_gpu,
    largest_factored,
    overhead,
    phase_calibration,
    phase_compress,
    phase_evaluation,
    phase_sensitivity,
    phases,
    svd_bytes,
)

#: The issue's bound on the deep model's peak RSS, as a fraction of its weights' size.
LARGER_THAN_MEMORY_BOUND = 0.5
#: The calibration of a model without a packaged recipe in this projection (a typical 2048-token calibration; the CLI's
#: own default without a recipe is 64×512).
NO_RECIPE_CALIBRATION = (128, 2048)

FORMULA = [
    "`peak = R0 + W_emb + W_layer + 4·L·N·H + max(P_cal, P_sens, P_comp, P_eval)`, in bytes, with",
    "",
    "- W_emb = (V·(1 if tied else 2) + 1)·H·d (embeddings, untied LM head, final norm: on the CPU, loading only "
    "maps them from their file and the first pass makes them resident, so they are part of the measured "
    "overhead = peak − R0); "
    "W_layer = (2·H·A + 2·H·K + 3·H·I + 2·H)·d (the one decoder layer onloaded); 4·L·N·H: the fp32 block-output "
    "means every layer adds (what grouping reads);",
    "- P_cal = N·T·H·d (the hidden states of all windows at the current layer) + 8·(H² + A²) [+ 8·(H² + I²) with "
    "MLP] (the layer's fp64 autocorrelations) + act + the hook's fp64 copy of one window's widest input (CPU "
    "16·T·in, GPU 8·T·in + 12·in²);",
    "- P_sens = 2·S·T·H·d (the sensitivity windows' last hidden states and their gradients) + max(T·V·(12 + d) "
    "(one window's logits through the head: logits, their fp32 copy, log-softmax and its gradient), S·T·H·d + "
    "2·act (their spilled inputs read back, one window's backward through a layer));",
    "- P_comp = S·T·H·d (the sensitivity windows stay referenced) + B·W_targets (a run's installed modules before "
    "it is spilled, at most) + 8·Σ in² (the current layer's Cholesky factors) + max(8·(B + 5)·H² (a run's B "
    "stacked attention autocorrelations, their sum, its symmetrized copy, the identity and the factor), "
    "8·4·in_max² (the Cholesky of the widest input; 8·6·I² with the MLP: the neurons' order permutes it and may damp it), SVD(m×n) = 8·(4·m·n + 6·k²), k = min(m, n), of "
    "the largest matrix factored (the run's stacked k/v, B·K×H, q, or with MLP gate/up/down, I×H): the matrix, "
    "its whitened product, `M V` and U, the Gram, its eigenvectors, Vh and dsyevd's workspace, the larger of the "
    "two paths of `whitened_svd`);",
    "- P_eval = S·T·H·d + 2·C·Tₑ·H·d (a chunk of 32 windows' hidden states, at the input and at the current "
    "layer) + act(Tₑ) + Tₑ·V·(12 + d) (the original's and the compressed model's log-probabilities); none "
    "without evaluation (the benchmark's runs);",
    "- act = T·d·(3·H + 2·A + 2·K + 3·I): one window's intermediate tensors inside a layer (a fused attention "
    "kernel assumed: no T×T scores).",
    "",
    "On a GPU (bf16), the weights, hidden states, autocorrelations and fp64 linear algebra are on the device "
    "(peak GPU = W_emb + W_layer + max(P…)); the host keeps R0, the block-output means and the largest copy on "
    "its way to or from disk (a layer's autocorrelations or a window batch being written, a run's factors being "
    "spilled, the largest weight being read).",
]


def runtime_base(run: dict) -> float:
    """R0 in bytes, measured: the loaded state of a measured run (its non-layer weights only mapped, see
    `overhead`)."""
    return run["rss_loaded_gib"] * GIB


# ------------------------------------------------------------------------------------------------------
# The measured runs (validation) and the Llama shapes (projection)

#: Llama shapes (their Hugging Face configs), and the packaged recipe whose calibration each is projected with.
LLAMA = [
    (Shape("Llama-3.2-1B", 2048, 32, 8, 64, 8192, 16, 128256, tied=True), "llama-3.2-1b"),
    (Shape("Llama-3.1-8B", 4096, 32, 8, 128, 14336, 32, 128256, tied=False), "llama-3.1-8b"),
    (Shape("Llama-3.1-70B", 8192, 64, 8, 128, 28672, 80, 128256, tied=False), None),
]


def measured_workload(run: dict) -> Workload:
    """The workload of a measured benchmark run (fp32 on the CPU, no evaluation in the measured process)."""
    settings = run.get("compression_settings", {})
    return Workload(
        run["calibration"]["samples"], run["calibration"]["seq_len"], run["sensitivity_windows"],
        mlp="mlp" in settings.get("targets", "attn"), basis_layers=settings.get("basis_layers", 4),
    )  # fmt: skip


def validation_rows(runs: list[dict], runtime: float) -> list[dict]:
    """Per measured run: its overhead and peak next to the formula's."""
    rows = []
    for run in runs:
        shape, w = Shape.from_width(run["width"], run["layers"]), measured_workload(run)
        parts = phases(shape, w)
        rows.append({
            "layers": run["layers"], "measured_overhead": run["overhead_gib"] * GIB,
            "predicted_overhead": overhead(shape, w), "measured_peak": run["peak_rss_gib"] * GIB,
            "predicted_peak": cpu_peak(shape, w, runtime), "phase": max(parts, key=parts.get),
        })  # fmt: skip
    return rows


def recipe_workload(recipe_name: str | None, mlp: bool) -> tuple[Workload, str]:
    """bf16-on-GPU workload with a recipe's calibration, sensitivity windows, basis runs and evaluation windows
    (128×2048 where no recipe ships), and where those came from."""
    from compressor.recipes.schema import CompressionSettings, EvaluationSettings, builtin_recipe

    recipe = builtin_recipe(recipe_name) if recipe_name else None
    if recipe is None:
        (n, t), compression = NO_RECIPE_CALIBRATION, CompressionSettings()
        evaluation = EvaluationSettings(seq_len=t)  # evaluated on windows as long as the calibration's
        source = "no built-in recipe: 128×2048 assumed"
    else:
        n, t = recipe.calibration.samples, recipe.calibration.seq_len
        compression, evaluation, source = recipe.compression, recipe.evaluation, f"recipe `{recipe_name}`"
    w = Workload(
        n, t, compression.sensitivity_samples, mlp, dtype_bytes=2, gpu=True,
        basis_layers=compression.basis_layers, eval_seq_len=evaluation.seq_len,
    )  # fmt: skip
    return w, source


def projection_rows(runtime: float) -> list[dict]:
    """Per Llama shape and targets: the peaks on a GPU in bf16 (device, host) and on the CPU in fp32 (host)."""
    rows = []
    for shape, recipe_name in LLAMA:
        for mlp in (False, True):
            gpu, source = recipe_workload(recipe_name, mlp)
            cpu = replace(gpu, dtype_bytes=4, gpu=False)
            parts = phases(shape, gpu)
            rows.append({
                "model": shape.name, "targets": "attn,mlp" if mlp else "attn", "workload": gpu, "source": source,
                "weights_bf16": shape.params() * 2, "gpu_device": device_peak(shape, gpu),
                "gpu_host": host_peak_with_gpu(shape, gpu, runtime), "cpu_host": cpu_peak(shape, cpu, runtime),
                "phase": max(parts, key=parts.get),
            })  # fmt: skip
    return rows


# ------------------------------------------------------------------------------------------------------
# The subsection of BENCHMARKS.md


def _gib(value: float) -> str:
    return f"{value / GIB:,.2f}"


def _validation_lines(rows: list[dict]) -> list[str]:
    lines = [
        "| layers | measured overhead (MiB) | formula (MiB) | formula / measured | measured peak (GiB) | formula "
        "(GiB) | largest phase (formula) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = (
            r["predicted_overhead"] / r["measured_overhead"] if r["measured_overhead"] > 0 else float("nan")
        )
        lines.append(
            f"| {r['layers']} | {r['measured_overhead'] / 2**20:,.0f} | {r['predicted_overhead'] / 2**20:,.0f} | "
            f"{ratio:.2f}x | {_gib(r['measured_peak'])} | {_gib(r['predicted_peak'])} | {r['phase']} |"
        )
    return lines


def _verdict_on_fit(rows: list[dict], depths: int) -> str:
    """How far the formula is from the measured overheads (`rows`: `validation_rows`), and how both grow over
    the first `depths` rows (the scaling runs, shallowest first), in words (never hard-coded)."""
    ratios = [r["predicted_overhead"] / r["measured_overhead"] for r in rows if r["measured_overhead"] > 0]
    if not ratios:
        return "No measured overhead to check the formula against."
    low, high = min(ratios), max(ratios)
    worst = max(abs(1 - low), abs(high - 1))
    quality = "within 25%" if worst <= 0.25 else f"**off by up to {100 * worst:.0f}%**"
    first, last = rows[0], rows[depths - 1]
    predicted, measured = (last[k] / first[k] if first[k] > 0 else float("nan")
                           for k in ("predicted_overhead", "measured_overhead"))  # fmt: skip
    return (
        f"The formula gives {low:.2f}x–{high:.2f}x the measured overheads ({quality}): RSS also counts the C "
        "allocator's freed-but-kept heap and the libraries' lazily allocated buffers, which the formula does not "
        f"model. From {first['layers']} to {last['layers']} layers the formula's overhead grows {predicted:.3f}x "
        f"(only the block-output means grow with depth), the measured one {measured:.3f}x."
    )


def _projection_lines(runtime: float) -> list[str]:
    lines = [
        "| model | targets | calibration (N×T, S sensitivity, from) | weights in bf16 (GiB) | GPU bf16: peak GPU "
        "memory (GiB) | GPU bf16: peak host RAM (GiB) | CPU fp32: peak host RAM (GiB) | largest phase |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in projection_rows(runtime):
        w = r["workload"]
        lines.append(
            f"| {r['model']} | {r['targets']} | {w.windows}×{w.seq_len}, S={w.sensitivity} ({r['source']}) | "
            f"{_gib(r['weights_bf16'])} | {_gib(r['gpu_device'])} | {_gib(r['gpu_host'])} | "
            f"{_gib(r['cpu_host'])} | {r['phase']} |"
        )
    return lines


def projection_section(runs: list[dict], deep: dict | None = None) -> list[str]:
    """ "Projected memory for larger models": the formula, its check against the scaling `runs` and the `deep`
    model's run, the Llama projection."""
    if not runs:
        return []
    runtime = runtime_base(runs[0])
    rows = validation_rows(runs + ([deep] if deep else []), runtime)
    return [
        "### Projected memory for larger models",
        "",
        "What `--layerwise` holds at its peak, read off the code (`compressor/api/layerwise.py`: `statistics/layer_stream.py`, "
        "`modeling/offload.py`, `methods/offloaded_context.py`; `methods/masa/basis.py`, `math/whitening.py`; symbols: H hidden, A = heads·head_dim, "
        "K = kv_heads·head_dim, I intermediate, V vocabulary, L layers, N×T calibration windows × tokens, S "
        "sensitivity windows, B basis layers per run, Tₑ evaluation tokens per window, d bytes per element of "
        "the model dtype; fp64 is 8 bytes):",
        "",
        *FORMULA,
        "",
        f"Every term is computed from the shapes and settings; the one measured constant is R0 = "
        f"{runtime / GIB:.3f} GiB, the {runs[0]['layers']}-layer run's RSS once loaded (Python, torch, "
        "transformers and the model's skeleton, its non-layer weights then only mapped). The byte counts of each buffer "
        "(e.g. 12 + d per logit) are read off the code, not fitted. Check against the measured runs above "
        "(fp32, CPU, no evaluation):",
        "",
        *_validation_lines(rows),
        "",
        _verdict_on_fit(rows, len(runs)),
        "",
        "Projection (Llama shapes from their configs; calibration, sensitivity windows and basis runs of each "
        f"model's recipe, the evaluation in chunks of {EVAL_CHUNK} windows of the recipe's length; the GPU "
        "columns leave out the CUDA context and the caching allocator's reserve, and the host column on a GPU "
        "uses the CPU-measured R0, without the CUDA libraries' own host memory):",
        "",
        *_projection_lines(runtime),
        "",
    ]


def larger_than_memory_section(deep: dict) -> list[str]:
    """The deep model's paragraph: its peak RSS against its weights' size, its checkpoint reloaded and run."""
    run, ev = deep["run"], deep["evaluation"]
    ratio = deep["peak_rss_bytes"] / deep["weights_bytes"]
    verdict = "met" if ratio < LARGER_THAN_MEMORY_BOUND else "**missed**"
    stages = ", ".join(f"{k} {v:.0f} s" for k, v in run["seconds"].items())
    windows = run["sensitivity_windows"]
    return [
        "### Larger than memory",
        "",
        f"One model of {deep['layers']} layers ({run['model_params'] / 1e6:,.0f} M parameters, "
        f"{deep['weights_bytes'] / GIB:.2f} GiB of fp32 weights on disk), compressed the same way with "
        f"{run['calibration']['samples']}×{run['calibration']['seq_len']} calibration tokens and {windows} "
        f"sensitivity window{'s' if windows != 1 else ''}: **peak RSS {deep['peak_rss_bytes'] / GIB:.2f} GiB = "
        f"{ratio:.2f}x its weights** (target < {LARGER_THAN_MEMORY_BOUND:g}x: {verdict}; loaded "
        f"{run['rss_loaded_gib']:.2f} GiB, overhead {run['overhead_gib']:.2f} GiB; {stages}). Its checkpoint "
        f"({run['checkpoint_bytes'] / GIB:.2f} GiB) was then loaded with `load_compressed` in a fresh process "
        f"({ev['load_seconds']:.1f} s) and evaluated on {ev['tokens']:,} random tokens ({ev['eval_seconds']:.1f} "
        f"s): perplexity {deep['ppl']:,.1f} (random weights and tokens, so the number only shows that the "
        f"checkpoint loads and runs; a uniform guess would score {run['width']['vocab_size']:,}).",
        "",
    ]
