"""How long a compression run will take on this machine, stage by stage, from the model's shapes and the run's
settings (no weight read): what `plan` prints beside the memory, and what a run's summary puts beside the stage
times it measured.

Each stage is its arithmetic, in multiply-adds, at the rate of the kind of work it is, three rates measured once
on this machine in a few seconds (`machine_rates`, cached per CPU or GPU, torch version and threads, unless
other work held the CPU meanwhile: `BUSY_SHARE`):
- `gemm`: the model's products (fp32 on a CPU, the model dtype on a GPU) of a forward pass: per token and layer
  2·H·A + 2·H·K + 3·H·I, and T·A twice for the attention's scores and values; V·H for the head;
- `gram`: `capture.add_gram`'s width² per token per input (the autocorrelations, fp32 products summed in fp64);
- `factor`: fp64 Cholesky n³/3 (the whitening, the least-squares refits, the SVDs as n³ of their smaller side).
What the arithmetic leaves out (hooks, Python, memory traffic, the layers moved to and from disk with
`--layerwise`) is one factor per stage, `STAGE_FACTORS`, fitted on the bundled model's run and checked on the
1.5B model's (`benchmarks/results/choices/plan-time.json`). Symbols as in `runtime/memory.py`.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from compressor.runtime.cache_root import CpuShared, measured_once
from compressor.runtime.device import cpu_name
from compressor.runtime.memory import Shape, Workload

RATES_FORMAT = 2  # 2: with the CPU share the measurement had (rates measured under load are not kept)
#: Seconds per stage = STAGE_FACTORS[stage] × (its multiply-adds / their rate); fitted on the bundled model's
#: `--native` run (`benchmarks/experiments/plan_time`): see the module's docstring.
STAGE_FACTORS = {
    "load": 2.6,
    "calibration": 1.28,
    "sensitivity": 0.63,
    "neuron_selection": 1.0,  # its parts' factors: ORDER_FACTORS
    "residual_svd": 3.4,
    "stream_refit": 1.10,
    "eval": 1.11,
    "save": 1.0,  # not fitted: the fitting run saves nothing (its bytes at DISK_BYTES_PER_SECOND)
}
#: The neuron orders' parts (`neuron_seconds`): the greedy's from the bundled model's run (its matrix-vector steps
#: run at a fourteenth of the product rate), the block greedy's and the errors' Cholesky from one MLP of the 1.5B
#: model's widths timed alone (`benchmarks/experiments/plan_time --orders`).
ORDER_FACTORS = {"greedy": 14.2, "greedy-block": 2.61, "tail": 0.79}
#: The stream refit's passes through a layer, in whole layers' products: the original layer, the compressed one up
#: to o_proj's input and again up to down_proj's input (most of it), then down_proj on what that pass kept.
STREAM_PASSES = 2.25
#: Bytes a second the weights are read and written at (load, save): the factor of those stages scales them.
DISK_BYTES_PER_SECOND = 1e9
#: Characters per token of the evaluation text, where a run scores the whole split (its tokens are not counted
#: before the tokenizer is loaded): English Wikipedia under the BPE vocabularies of the supported families.
CHARACTERS_PER_TOKEN = 4.2
#: The text sources read without the network (`calibration/sources.py`); a path is read too.
OFFLINE_TEXTS = ("wikipedia", "shakespeare")


@dataclass(frozen=True)
class Rates(CpuShared):
    """Multiply-adds a second of the three kinds of work (see the module's docstring) on this machine."""

    gemm: float
    gram: float
    factor: float
    device: str
    #: the CPU's share the measurement had (see `BUSY_SHARE`); 1 on a GPU
    cpu_share: float = 1.0


def _best_rate(work: float, run, repeats: int = 3) -> float:
    """work / the fastest of `repeats` timings of `run()` (each repeated until it lasts 0.1 s)."""
    best = float("inf")
    run()  # warm-up: the first call allocates and loads kernels
    for _ in range(repeats):
        count, start = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - start) < 0.1 or count == 0:
            run()
            count += 1
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        best = min(best, elapsed / count)
    return work / best


def measure_rates(device: torch.device, dtype: torch.dtype = torch.float32) -> Rates:
    """The three rates on `device`, at widths like a 1B model's (about two seconds on 2 CPU cores)."""
    from compressor.runtime.device import float64_zeros
    from compressor.statistics.capture import add_gram

    cpu_start, wall_start = time.process_time(), time.perf_counter()
    generator = torch.Generator().manual_seed(0)
    tokens, width, out = 512, 1024, 2816
    x = torch.randn(tokens, width, generator=generator).to(device, dtype)
    w = torch.randn(width, out, generator=generator).to(device, dtype)
    gemm = _best_rate(tokens * width * out, lambda: x @ w)
    total = float64_zeros(width, width, device=device)
    gram = _best_rate(tokens * width * width, lambda: add_gram(total, x[None].float()))
    n = 1024
    a = torch.randn(n, n, generator=generator, dtype=torch.float64)
    spd = (a @ a.T / n + torch.eye(n, dtype=torch.float64)).to(device)
    factor = _best_rate(n**3 / 3, lambda: torch.linalg.cholesky(spd))
    share = 1.0
    if device.type == "cpu":
        cores = (time.perf_counter() - wall_start) * torch.get_num_threads()
        share = min(1.0, (time.process_time() - cpu_start) / cores)
    return Rates(gemm=gemm, gram=gram, factor=factor, device=device.type, cpu_share=share)


def machine_rates(device: torch.device) -> Rates:
    """`measure_rates` once per machine (its CPU or GPU, torch version and threads), then from the cache; a
    measurement taken while other work held the CPU (`BUSY_SHARE`) prices this estimate only."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()
    identity = f"{RATES_FORMAT}|{name}|{torch.__version__}|{torch.get_num_threads()}|{device.type}"
    return measured_once("", identity, lambda: measure_rates(device), Rates)


def layer_products(shape: Shape, seq_len: int) -> float:
    """One token's multiply-adds in one decoder layer (projections, and the attention over `seq_len` tokens)."""
    h = shape.hidden
    return 2 * h * shape.attn + 2 * h * shape.kv + 3 * h * shape.intermediate + 2 * seq_len * shape.attn


@dataclass(frozen=True)
class RunWork:
    """What a run does, beyond `Workload`, that its time depends on."""

    neurons: bool  # the MLP narrowed by neuron selection (`--mlp neurons`)
    neuron_order: str  # its order (`--neuron-order`, resolved)
    attention_factors: bool  # the attention's projections factored (an SVD each; not whole heads)
    mlp_factors: bool  # the MLP's projections factored (`--mlp lowrank`)
    stream_windows: int  # windows the stream refit reads (0: none)
    eval_tokens: int  # tokens scored (0: no evaluation)
    eval_passes: int  # models scored over them (the original and the compressed)
    weights_bytes: int  # what is loaded
    saved_bytes: int  # what is written (0: nothing)


def stage_seconds(shape: Shape, work: Workload, run: RunWork, rates: Rates) -> dict[str, float]:
    """Each stage's seconds (`STAGE_FACTORS` applied), the stages this run has only."""
    layers, tokens = shape.layers, work.windows * work.seq_len
    head = shape.vocab * shape.hidden
    forward = layers * layer_products(shape, work.seq_len)
    grams = layers * sum(width**2 for width in work.inputs(shape))
    arithmetic = {
        "load": run.weights_bytes / DISK_BYTES_PER_SECOND,
        "calibration": tokens * forward / rates.gemm + tokens * grams / rates.gram,
    }
    if work.sensitivity:
        arithmetic["sensitivity"] = 3 * work.sensitivity * work.seq_len * (forward + head) / rates.gemm
    if run.neurons:
        arithmetic["neuron_selection"] = layers * neuron_seconds(shape, run.neuron_order, rates)
    inputs = [shape.hidden, shape.attn] + ([shape.intermediate] if work.mlp else [])
    refits = layers * sum(width**3 / 3 for width in inputs)
    sides = []  # an SVD of each factored projection, as n³ of its smaller side (fp64)
    if run.attention_factors:
        sides += [min(shape.hidden, shape.attn)] * 2 + [min(shape.hidden, shape.kv)] * 2
    if run.mlp_factors:
        sides += [min(shape.hidden, shape.intermediate)] * 3
    refits += layers * sum(4 * side**3 for side in sides)
    arithmetic["residual_svd"] = refits / rates.factor
    if run.stream_windows:
        stream_tokens = run.stream_windows * work.seq_len
        refit_grams = layers * (shape.attn**2 + (shape.intermediate**2 if work.mlp else 0))
        arithmetic["stream_refit"] = (
            STREAM_PASSES * stream_tokens * forward / rates.gemm + stream_tokens * refit_grams / rates.gram
        )
    if run.eval_tokens:
        scoring = layers * layer_products(shape, work.eval_seq_len) + head
        arithmetic["eval"] = run.eval_passes * run.eval_tokens * scoring / rates.gemm
    if run.saved_bytes:
        arithmetic["save"] = run.saved_bytes / DISK_BYTES_PER_SECOND
    return {stage: STAGE_FACTORS[stage] * value for stage, value in arithmetic.items()}


def neuron_seconds(shape: Shape, order: str, rates: Rates) -> float:
    """One MLP's neuron order and its errors at every width (`math/neurons.py`), each part at its own factor: the
    greedy's ~I matrix-vector steps, I²·(I/3 + H) multiply-adds bound by memory and per-step overhead; the block
    greedy's rank-32 updates, I³/3 + I²·H/2 in products; `energy`/`leverage`, one product; then `order_tail`'s
    fp64 Cholesky in that order, I³/3."""
    i, h = shape.intermediate, shape.hidden
    work = {"greedy": i * i * (i / 3 + h), "greedy-block": i**3 / 3 + i * i * h / 2}.get(order, i * i * h)
    return ORDER_FACTORS.get(order, 1.0) * work / rates.gemm + ORDER_FACTORS["tail"] * i**3 / 3 / rates.factor


def time_estimate(config, run, options, gpu: bool = False) -> dict:
    """`plan`'s time: each stage's seconds for this run on this machine (`stage_seconds`), their total, and the
    rates they were priced at. The calibration is counted in full: a run that finds its statistics in the cache
    skips it (and its sensitivity, measured in the same pass)."""
    from compressor.api.memory_check import run_workload
    from compressor.modeling.adapters import MLP_PROJECTIONS, target_projections
    from compressor.runtime.device import resolve_device
    from compressor.statistics.partly_compressed import stream_refit_window_count

    shape, work = Shape.from_config(config), run_workload(run, options, gpu)
    settings = run.compression
    mlp = bool(set(target_projections(settings.targets)) & set(MLP_PROJECTIONS))
    stream = settings.refit == "stream"
    params, element = shape.params(), work.dtype_bytes
    done = RunWork(
        neurons=mlp and settings.mlp == "neurons",
        neuron_order=settings.neuron_order,
        attention_factors=settings.attention == "factors"
        and "q_proj" in target_projections(settings.targets),
        mlp_factors=mlp and settings.mlp == "lowrank",
        stream_windows=stream_refit_window_count(work.windows) if stream else 0,
        eval_tokens=(evaluation_tokens(run.evaluation) or 0) if options.evaluate else 0,
        eval_passes=2,  # the original and the compressed model (in one pass, or the original's first)
        weights_bytes=params * element,
        saved_bytes=params * element if options.save else 0,
    )
    rates = machine_rates(resolve_device("cuda" if gpu else "cpu"))
    stages = stage_seconds(shape, work, done, rates)
    unpriced = [UNKNOWN_TEXT] if options.evaluate and not done.eval_tokens else []
    return {"stages": {k: round(v, 1) for k, v in stages.items()}, "total": round(sum(stages.values()), 1),
            "unpriced": unpriced, "rates": asdict(rates), "busy": rates.busy}  # fmt: skip


#: What `plan` says of an evaluation it cannot price.
UNKNOWN_TEXT = "eval not counted (a hub text's length is unknown offline)"


def evaluation_tokens(evaluation) -> int | None:
    """The tokens an evaluation (`EvaluationSettings`) scores: its `max_tokens`, else the whole split's, from its
    characters. A hub text's length is not known before it is downloaded (and `plan` stays offline): None, the
    evaluation left unpriced, unless `max_tokens` bounds it."""
    from compressor.calibration.sources import load_documents

    spec = (evaluation.source or "wikipedia").strip()
    if spec.lower() not in OFFLINE_TEXTS and not Path(spec).expanduser().exists():
        return evaluation.max_tokens or None
    text = load_documents(spec, split=evaluation.split)
    whole = int(text.n_chars / CHARACTERS_PER_TOKEN)
    return min(whole, evaluation.max_tokens) if evaluation.max_tokens else whole
