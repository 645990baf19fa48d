"""How long `compress --size` will take on this machine, stage by stage: what `plan --size` prints and what the
run's summary sets beside the times it took. Priced as `time_estimate` prices a `compress` run (its rates, its
arithmetic, one factor per stage for what the arithmetic leaves out), with the stages a byte budget adds:
- `importance`: the original loaded, then the importance pass (`quantize/importance.py`): the calibration windows
  forward, the head included, and `GRADIENT_WINDOWS` of them backward (a backward pass: twice a forward's products);
- `structure_*`: the `compress` run that builds the structure (`size.structure_run`), `time_estimate`'s stages,
  and in its refit stage the rounding errors its allocation prices the widths by (as the export measures them);
- `export`: what is exported loaded; where a structure is built, the importance pass again on the narrowed model
  (its matrices are new; none is needed where the allocation removes nothing, which only the calibration tells);
  each matrix's rounding error in every candidate type on its sampled rows at ggml's rate for that type
  (`quantize/rounding_rates.py`); every matrix quantized in the candidate type nearest the budget's bits per
  weight; the file written; with `--speed`, llama.cpp's decode cost of each type the chooser asks for that this
  CPU has not measured for the model's layer shape (`decode_cost.measurement_seconds`, priced by one probe timed
  here once). Priced at the original's widths (a narrowed model's are fewer);
- `eval`: the file scored in llama.cpp and the original in transformers, over the evaluation's tokens.
The factors (`SIZE_FACTORS`) were fitted on the bundled model's run (`benchmarks/experiments/plan_time`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from compressor.api.time_estimate import (
    DISK_BYTES_PER_SECOND,
    UNKNOWN_TEXT,
    Rates,
    evaluation_tokens,
    layer_products,
    machine_rates,
    time_estimate,
)
from compressor.quantize.byte_budget import GRADIENT_WINDOWS, LOOKUP_ROWS, SAMPLE_ROWS, candidate_types
from compressor.quantize.decode_cost import LayerShape, measurement_seconds
from compressor.quantize.ggml_quantize import row_bytes
from compressor.quantize.rounding_rates import RoundingRates, rounding_rates
from compressor.quantize.speed import (
    SPEED_THREADS,
    check_reachable,
    config_layer_shape,
    config_matrices,
    mix_of_budget,
    parse_speed,
)
from compressor.runtime.memory import Shape

#: Seconds per stage = SIZE_FACTORS[stage] × its arithmetic at its rate (see the module's docstring); fitted on the
#: bundled model's `--size 90MiB` run (`benchmarks/results/choices/plan-time.json`). The scoring's 2.8: llama.cpp's
#: prebuilt CPU build runs its products slower than torch's fp32 here, and its server starts for each file.
SIZE_FACTORS = {"importance": 1.5, "export": 0.94, "eval": 2.82}


@dataclass(frozen=True)
class SizeWork:
    """What a `compress --size` run does, beyond its structure's `compress` run, that its time depends on."""

    importance_windows: int  # calibration windows of the importance pass
    seq_len: int  # their tokens each
    file_type: str  # the type the file's matrices are priced in: the candidate nearest the budget's bits
    structure: bool  # a structure is built: the export measures the narrowed model's importance again
    eval_tokens: int  # tokens scored (0: no evaluation)
    eval_seq_len: int


def matrices(shape: Shape) -> list[tuple[int, int]]:
    """Every quantized matrix's (rows, row length), as GGUF stores it: a layer's seven, the embedding, the head."""
    h, a, k, i = shape.hidden, shape.attn, shape.kv, shape.intermediate
    layer = [(a, h), (k, h), (k, h), (h, a), (i, h), (i, h), (h, i)]
    return layer * shape.layers + [(shape.vocab, h)] * (1 if shape.tied else 2)


def rounding_error_seconds(shape: Shape, rates: RoundingRates) -> float:
    """Measuring each matrix's rounding error in every candidate type (`byte_budget.BudgetChooser`): its sampled
    rows, and the embedding's looked-up rows (the most frequent tokens' and a sample of the others)."""
    seconds = 0.0
    # The layers' matrices and the head (a tied embedding's rows are it); an untied embedding's lookup rows only.
    for rows, row_length in matrices(shape)[: shape.layers * 7] + [(shape.vocab, shape.hidden)]:
        for type_name in candidate_types(row_length, True):
            seconds += min(rows, SAMPLE_ROWS) * row_length / rates.errors[type_name]
    lookup = min(shape.vocab, LOOKUP_ROWS) + min(max(shape.vocab - LOOKUP_ROWS, 0), SAMPLE_ROWS)
    for type_name in candidate_types(shape.hidden, True):
        seconds += lookup * shape.hidden / rates.errors[type_name]
    return seconds


def nearest_type(bits: float, row_length: int) -> str:
    """The candidate type whose bits per weight are nearest `bits`: the one a budget's file is priced in."""
    return min(
        candidate_types(row_length, True), key=lambda t: abs(8 * row_bytes(t, row_length) / row_length - bits)
    )


def decode_cost_seconds(
    config, budget: int, speed: str | None, rounding: RoundingRates, allowed=None
) -> float:
    """Measuring what `--speed` needs of llama.cpp's decode costs and this CPU has not measured for the model's
    layer shape (`speed_types`, within the `allowed` types; 0: no speed asked, or all measured). A type ggml's quantizer rate was not measured
    for (a mix's i-quant) is priced at the slowest rate measured."""
    target = parse_speed(speed)
    if target is None:
        return 0.0
    layer, types = speed_types(config, budget, target.mix, allowed)
    slowest = min(rounding.quantize.values())
    return measurement_seconds(types, layer, SPEED_THREADS, lambda t: rounding.quantize.get(t, slowest))


def check_speed_early(config, wanted, target, allowed, progress: bool) -> None:
    """`speed.check_reachable` at the budget `wanted` (`ByteBudget`) asks of the model `config` describes, on its
    layer shape, its decode costs measured now where this CPU has not (they serve the allocation later): a
    tokens-per-second limit out of reach is refused before the calibration. Nothing to check with no `target`,
    or no `wanted` (none asked, or a checkpoint's: its narrower widths are checked once it is loaded)."""
    from functools import partial

    from compressor.api.preview import model_parameter_count
    from compressor.quantize.decode_cost import decode_costs

    if target is None or wanted is None:
        return
    layer = config_layer_shape(config)
    costs_of = partial(decode_costs, shape=layer, threads=SPEED_THREADS, progress=progress)
    check_reachable(config, layer, wanted.bytes_for(model_parameter_count(config)), target, allowed, costs_of)


def speed_types(config, budget: int, mix: bool, allowed=None) -> tuple[LayerShape, set[str]]:
    """The layer shape `--speed` measures decode costs on (the original's widths) and the types it asks for: every
    candidate type of its row lengths (within `allowed`, `--only-types`; None: all) and, for `mix`, the types of
    the mix nearest the budget."""
    layer = config_layer_shape(config)
    types = {t for _, cols in layer.matrices().values() for t in candidate_types(cols, True)}
    types = types if allowed is None else types & set(allowed)
    if mix:
        types |= set(_mix_types(config, layer, budget).values())
    return layer, types


def _mix_types(config, layer: LayerShape, budget: int) -> dict[str, str]:
    """The stored type of each matrix in the llama.cpp mix `--speed mix` holds a file of `budget` bytes to, from
    the config's shapes (`speed.mix_of_budget` on weightless arrays; the file's metadata left out)."""
    from functools import partial

    from compressor.checkpoint.gguf_export import mix_stored_type

    tied = bool(getattr(config, "tie_word_embeddings", False))
    context = {"gqa": layer.heads // max(layer.kv_heads, 1), "has_imatrix": True, "n_expert": 1}
    mix_type_of = partial(mix_stored_type, config.num_hidden_layers, not tied, context)
    return mix_of_budget(config_matrices(config, layer), 0, budget, mix_type_of)[1]


def size_stage_seconds(
    shape: Shape, work: SizeWork, rates: Rates, rounding: RoundingRates
) -> dict[str, float]:
    """The stages a byte budget adds to its structure's run, in seconds (`SIZE_FACTORS` applied)."""
    head = shape.vocab * shape.hidden
    forward = shape.layers * layer_products(shape, work.seq_len) + head
    weights = shape.params() * 4  # loaded in fp32
    importance = (work.importance_windows + 2 * GRADIENT_WINDOWS) * work.seq_len * forward / rates.gemm
    load = weights / DISK_BYTES_PER_SECOND
    stored = sum(rows * row_length for rows, row_length in matrices(shape))
    arithmetic = {
        "importance": load + importance,
        "export": rounding_error_seconds(shape, rounding) + load + stored / rounding.quantize[work.file_type]
        + stored / DISK_BYTES_PER_SECOND,
    }  # fmt: skip
    if work.eval_tokens:
        scoring = shape.layers * layer_products(shape, work.eval_seq_len) + head
        arithmetic["eval"] = 2 * work.eval_tokens * scoring / rates.gemm
    seconds = {stage: SIZE_FACTORS[stage] * value for stage, value in arithmetic.items()}
    if work.structure:  # the narrowed model's new matrices: its importance pass, at that stage's factor
        seconds["export"] += SIZE_FACTORS["importance"] * importance
    return seconds


def size_time_estimate(
    config,
    importance,
    evaluation,
    budget: int,
    structure=None,
    gpu: bool = False,
    compensated: bool = False,
    speed: str | None = None,
    allowed: frozenset[str] | None = None,
) -> dict:
    """`plan --size`'s time: each stage's seconds on this machine, their total and the rates they were priced at.
    `importance`: the importance pass's calibration (`CalibrationSettings`); `evaluation`: the scoring's settings
    (`EvaluationSettings`; None: no evaluation); `structure`: (its resolved run, its options) where a structure is
    built; `compensated`: `--rounding compensated` (its passes are not priced: said); `speed`: `--speed`, whose
    decode costs not yet measured on this CPU (of the `allowed` types, `--only-types`) join the export's time
    (`decode_cost` says how many seconds). Cached
    importance weights and rounding errors make a run shorter (the estimate counts them in full)."""
    from compressor.runtime.device import resolve_device

    shape = Shape.from_config(config)
    tokens = (evaluation_tokens(evaluation) or 0) if evaluation is not None else 0
    work = SizeWork(
        importance_windows=importance.samples, seq_len=importance.seq_len,
        file_type=nearest_type(8 * budget / shape.params(), shape.hidden), structure=structure is not None,
        eval_tokens=tokens, eval_seq_len=evaluation.seq_len if evaluation is not None else 0,
    )  # fmt: skip
    rates = machine_rates(resolve_device("cuda" if gpu else "cpu"))
    unpriced = [UNKNOWN_TEXT] if evaluation is not None and not tokens else []
    if compensated:
        unpriced.append("--rounding compensated's passes not counted (nearest's priced)")
    rounding = rounding_rates()
    added = size_stage_seconds(shape, work, rates, rounding)
    decode_cost = decode_cost_seconds(config, budget, speed, rounding, allowed)
    added["export"] += decode_cost
    stages = {"importance": added.pop("importance")}  # the stages in the order the run takes them
    if structure is not None:
        planned = time_estimate(config, structure[0], structure[1], gpu=gpu)
        stages |= {f"structure_{stage}": seconds for stage, seconds in planned["stages"].items()}
        # The structure's allocation (in its run's refit stage) prices each width by the rounding errors of every
        # matrix in every type (`byte_structure.matrix_errors`): the export's measurement, once more.
        stages["structure_residual_svd"] += SIZE_FACTORS["export"] * rounding_error_seconds(shape, rounding)
    stages = {stage: round(seconds, 1) for stage, seconds in (stages | added).items()}
    return {"stages": stages, "total": round(sum(stages.values()), 1), "unpriced": unpriced,
            "rates": asdict(rates) | {"cpu_share": min(rates.cpu_share, rounding.cpu_share)},
            "busy": rates.busy or rounding.busy, "file_type": work.file_type, "decode_cost": round(decode_cost, 1),
            "cached": "less the importance weights, statistics and rounding errors found in the cache"}  # fmt: skip
