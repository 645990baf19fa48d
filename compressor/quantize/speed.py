"""`--speed`: a `--size` file that llama.cpp decodes at least as fast as asked, on this CPU.

The byte budget's allocation (`byte_budget.allocate`) minimizes the predicted loss rise within the bytes; it prices
no time, and at low budgets it favours types llama.cpp decodes slowly on a CPU (i-quants, Q3_K). Here each
matrix's options also carry their decode time, Σ weights × the type's cost per weight measured in llama.cpp on this
CPU (`decode_cost.py`, one thread), and the allocation minimizes loss + λ · time within the bytes: λ = 0 is the
plain allocation, and λ is raised (bisection) to the least that brings the predicted time within the limit. The
limit is `mix`: the predicted time of llama.cpp's own mix of the same bytes (of its mixes, the one whose file
comes nearest the budget), or a number of tokens per second. A Lagrangian solution lies on the convex hull of the loss-time
trade-off: it meets the limit, possibly with time to spare, never over it. Where even the fastest file of those
bytes (λ → ∞) is predicted slower than the limit, the request is refused with the speed it can reach.

The prediction counts the matrices alone: a decoding step's fixed part (sampling, the final norm) comes on top, so
llama.cpp measures somewhat fewer tokens per second than predicted, alike for the mix and for ours."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from compressor.quantize.byte_budget import BytePlan, Option, allocate
from compressor.quantize.ggml_quantize import K_QUANT_MIXES, padded, row_bytes
from compressor.runtime.cache_root import cache_dir
from compressor.runtime.errors import UserError

#: Threads the decode costs (and a `--speed` in tokens per second) are predicted at.
SPEED_THREADS = 1
#: Bisection steps on λ: the limit met to within a part in 2**20 of the λ range.
BISECTION_STEPS = 20
#: What `--speed mix` compares with: llama.cpp's k-quant and i-quant mixes and its files of one type.
REFERENCE_MIXES = (*K_QUANT_MIXES, "q8_0", "q5_0", "q4_0")


@dataclass(frozen=True)
class SpeedTarget:
    """What `--speed` asks: as fast as llama.cpp's mix of the same bytes (`mix`), or `tokens_per_second`."""

    mix: bool = False
    tokens_per_second: float | None = None

    def describe(self) -> str:
        return "mix" if self.mix else f"{self.tokens_per_second:g} tokens/s"


def parse_speed(text: str | None, budget_given: bool = True) -> SpeedTarget | None:
    """`--speed any|mix|N` → the target (None: `any`, no limit), or a one-line error."""
    value = None if text is None else text.strip().lower()
    if value is None or value == "any":
        return None
    if not budget_given:
        raise UserError(f"--speed {text}: the decode speed of a --size file: add --size (or drop --speed)")
    if value == "mix":
        return SpeedTarget(mix=True)
    try:
        tokens = float(value.removesuffix("tok/s").removesuffix("tokens/s"))
    except ValueError:
        tokens = -1.0
    if not tokens > 0 or tokens == float("inf"):
        raise UserError(
            f"--speed {text}: not a speed: write any, mix (no slower than llama.cpp's mix of the same bytes), "
            "or tokens per second (e.g. 40)"
        )
    return SpeedTarget(tokens_per_second=tokens)


def describe_speed(text: str | None) -> str:
    """`--speed` as `plan` and the file's record say it: any, mix, or N tokens/s."""
    target = parse_speed(text)
    return "any" if target is None else target.describe()


#: A llama.cpp mix's stored type for a matrix: (GGUF name, its array, the mix) → the GGML type.
MixTypeOf = Callable[[str, object, str], str]


@dataclass
class SpeedPlan:
    """What the speed limit decided: the limit, the mix it came from, the file's predicted time and λ."""

    target: SpeedTarget
    limit_seconds: float
    mix: str | None
    mix_seconds: float | None
    seconds: float
    unlimited_seconds: float
    penalty: float

    def to_dict(self) -> dict:
        return {
            "speed": self.target.describe(), "threads": SPEED_THREADS, "mix": self.mix,
            "predicted_tokens_per_second": 1 / self.seconds,
            "limit_tokens_per_second": 1 / self.limit_seconds,
            "unlimited_tokens_per_second": 1 / self.unlimited_seconds,
            "mix_tokens_per_second": None if self.mix_seconds is None else 1 / self.mix_seconds,
            "penalty": self.penalty,
        }  # fmt: skip


def matrix_seconds(matrices: list[tuple], costs: dict[str, float], tied: bool) -> dict[str, dict[str, float]]:
    """Per matrix (GGUF name → type → predicted seconds per decoded token): weights × ns per weight. An untied
    embedding is a row lookup in decode and costs nothing; a tied one is also the output product."""
    seconds = {}
    for name, array, _ in matrices:
        lookup_only = name == "token_embd.weight" and not tied
        seconds[name] = {t: 0.0 if lookup_only else array.size * ns * 1e-9 for t, ns in costs.items()}
    return seconds


def mix_of_budget(
    matrices: list[tuple], fixed_bytes: int, budget: int, mix_type_of: MixTypeOf
) -> tuple[str, dict[str, str]]:
    """The llama.cpp mix of these bytes, the one whose file comes nearest `budget` (a budget copied from a mix's
    file is that mix, whatever the tool's own metadata adds), with each matrix's stored type."""
    sized = []
    for mix in REFERENCE_MIXES:
        types = {name: mix_type_of(name, array, mix) for name, array, _ in matrices}
        total = fixed_bytes + sum(
            padded(array.shape[0] * row_bytes(types[name], array.shape[1])) for name, array, _ in matrices
        )
        sized.append((total, mix, types))
    _, mix, types = min(sized, key=lambda entry: abs(entry[0] - budget))
    return mix, types


def plan_seconds(types: dict[str, str], seconds: dict[str, dict[str, float]]) -> float:
    return sum(seconds[name][type_name] for name, type_name in types.items())


def _penalized(options: dict[str, list[Option]], seconds, penalty: float) -> dict[str, list[Option]]:
    return {
        name: [replace(o, predicted=o.predicted + penalty * seconds[name][o.type_name]) for o in opts]
        for name, opts in options.items()
    }


def _allocate_at(options, seconds, fixed_bytes: int, budget: int, penalty: float) -> BytePlan:
    """The allocation minimizing loss + `penalty` × time, its `predicted` the loss alone."""
    return _with_loss(allocate(_penalized(options, seconds, penalty), fixed_bytes, budget), options)


def _with_loss(plan: BytePlan, options: dict[str, list[Option]]) -> BytePlan:
    """`plan` (allocated on other prices), its `predicted` set to the loss rise of its types."""
    loss = {name: {o.type_name: o.predicted for o in opts} for name, opts in options.items()}
    plan.predicted = sum(loss[name][t] for name, t in plan.types.items())
    return plan


def fastest_within(options, seconds, fixed_bytes: int, budget: int, limit_seconds: float) -> BytePlan:
    """The fastest file of these bytes (each option priced by its time alone), or a one-line error where even it is
    predicted slower than `limit_seconds`, naming the speed it reaches."""
    timed = {n: [replace(o, predicted=seconds[n][o.type_name]) for o in opts] for n, opts in options.items()}
    fastest = allocate(timed, fixed_bytes, budget)
    if fastest.predicted > limit_seconds:
        raise UserError(
            f"--speed: the fastest file of these bytes is predicted at {1 / fastest.predicted:.1f} tokens/s on "
            f"this CPU ({SPEED_THREADS} thread), short of the {1 / limit_seconds:.1f} asked: ask for at most that, "
            "or for more bytes"
        )
    return fastest


def config_layer_shape(config):
    """The layer shape of the model `config` describes (`decode_cost.LayerShape`, its widths before any
    structure): what its decode costs are measured on."""
    from compressor.modeling.adapters import geometry_from_config
    from compressor.modeling.families import family_of
    from compressor.quantize.decode_cost import LayerShape

    family = family_of(config.model_type)
    if family is not None and family.experts:  # as `decode_cost.matrices_layer_shape` refuses a file's
        raise UserError("--speed: a mixture of experts' decode cost is not measured: drop --speed")
    g = geometry_from_config(config)
    return LayerShape(g.hidden_size, g.num_heads, g.num_kv_heads, g.head_dim, g.intermediate_size)


def config_matrices(config, layer) -> list[tuple]:
    """(GGUF name, a weightless array of its shape, None) for every matrix of the model `config` describes, its
    layers all like `layer` (`decode_cost.LayerShape`): what a file's types are chosen over, known before any
    weight is read."""
    import numpy as np

    shapes = {
        f"blk.{i}.{n}.weight": rc
        for i in range(config.num_hidden_layers)
        for n, rc in layer.matrices().items()
    }
    shapes["token_embd.weight"] = (config.vocab_size, layer.hidden)
    if not getattr(config, "tie_word_embeddings", False):
        shapes["output.weight"] = (config.vocab_size, layer.hidden)
    return [(name, np.broadcast_to(np.float32(0), rows_cols), None) for name, rows_cols in shapes.items()]


def check_reachable(
    config, layer, budget: int, target: SpeedTarget | None, allowed, costs_of: Callable
) -> None:
    """A tokens-per-second limit no file of `budget` bytes reaches, refused from the config before any statistic
    is measured: the fastest plan over every candidate type of each matrix (within `allowed`), the file's metadata
    left out, so what is refused here the allocation would refuse too (`mix`'s limit is a file of those bytes)."""
    from compressor.quantize.byte_budget import candidate_types, within

    if target is None or target.mix:
        return
    matrices = config_matrices(config, layer)
    options = {
        name: [Option(t, padded(array.shape[0] * row_bytes(t, array.shape[1])), 0.0)
               for t in within(name, candidate_types(array.shape[1], True), allowed)]
        for name, array, _ in matrices
    }  # fmt: skip
    types = sorted({o.type_name for opts in options.values() for o in opts})
    tied = bool(getattr(config, "tie_word_embeddings", False))
    fastest_within(
        options, matrix_seconds(matrices, costs_of(types), tied), 0, budget, 1 / target.tokens_per_second
    )


def allocate_within_time(
    options: dict[str, list[Option]],
    seconds: dict[str, dict[str, float]],
    fixed_bytes: int,
    budget: int,
    limit_seconds: float,
    plan: BytePlan | None = None,
) -> tuple[BytePlan, float]:
    """(the plan of least predicted loss among those the bisection on λ visits whose predicted time is within
    `limit_seconds`, its λ), or a one-line error with the fastest speed these bytes reach. `plan`: the plain
    allocation (λ = 0), if already made."""
    plan = plan or allocate(options, fixed_bytes, budget)
    if plan_seconds(plan.types, seconds) <= limit_seconds:
        return plan, 0.0
    fastest = fastest_within(options, seconds, fixed_bytes, budget, limit_seconds)
    span = max(max(o.predicted for o in opts) for opts in options.values()) or 1.0
    quickest = min(s for by_type in seconds.values() for s in by_type.values() if s > 0)
    high = span / quickest  # the loss of a whole matrix's worst type against its quickest time
    # λ up until a plan meets the limit: the fastest does, and λ · time comes to outweigh any loss
    for _ in range(40):
        fast = _allocate_at(options, seconds, fixed_bytes, budget, high)
        if plan_seconds(fast.types, seconds) <= limit_seconds:
            break
        high *= 4
    else:  # a limit of exactly the fastest time, kept just out of reach by rounding in the sums: the fastest
        return _with_loss(fastest, options), float("inf")
    low = 0.0
    for _ in range(BISECTION_STEPS):
        middle = (low + high) / 2
        candidate = _allocate_at(options, seconds, fixed_bytes, budget, middle)
        if plan_seconds(candidate.types, seconds) <= limit_seconds:
            fast, high = candidate, middle
        else:
            low = middle
    return fast, high


def speed_plan(
    target: SpeedTarget,
    options: dict[str, list[Option]],
    matrices: list[tuple],
    costs_of: Callable,
    fixed_bytes: int,
    budget: int,
    tied: bool,
    mix_type_of: MixTypeOf,
) -> tuple[BytePlan, SpeedPlan]:
    """The byte budget's plan within the decode time `target` asks, and what decided it. `costs_of`: the types →
    their ns per weight on this CPU (`decode_cost.decode_costs`), asked for every option's type and the mix's."""
    needed = {o.type_name for opts in options.values() for o in opts}
    mix = mix_types = None
    if target.mix:
        mix, mix_types = mix_of_budget(matrices, fixed_bytes, budget, mix_type_of)
        needed |= set(mix_types.values())
    costs = costs_of(sorted(needed))
    unmeasured = sorted(t for t, ns in costs.items() if not ns > 0)
    if unmeasured:  # a difference of two timings the machine's noise outweighed: no cost to allocate by
        raise UserError(
            f"--speed: the decode cost of {', '.join(unmeasured)} came out at or below zero on this CPU (its "
            f"timings drifted): remove {cache_dir() / 'decode-cost'} to measure again on a quieter machine"
        )
    seconds = matrix_seconds(matrices, costs, tied)
    mix_seconds = None if mix_types is None else plan_seconds(mix_types, seconds)
    limit = mix_seconds if mix_seconds is not None else 1 / target.tokens_per_second
    unlimited = allocate(options, fixed_bytes, budget)
    plan, penalty = allocate_within_time(options, seconds, fixed_bytes, budget, limit, unlimited)
    return plan, SpeedPlan(
        target, limit, mix, mix_seconds, plan_seconds(plan.types, seconds),
        plan_seconds(unlimited.types, seconds), penalty,
    )  # fmt: skip
