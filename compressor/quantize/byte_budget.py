"""A GGUF of at most SIZE bytes: each matrix's quantization type chosen by one loss-aware allocation.

llama.cpp's mixes fix each tensor's type by its name and layer (`ggml_quantize.mix_type`). Here every matrix (the
embedding and the output head included) takes the type, among those its rows fit, that the allocation picks:
minimize the predicted rise of the calibration loss subject to the file's exact bytes.

The prediction is the one `--allocation global-loss` makes for low-rank errors (`statistics/sensitivity.py`): a
matrix's output error e_t = ΔW x_t raises the mean next-token loss by about ½ ḡ² · mean_t ‖e_t‖², ḡ² the mean of
‖∂L/∂y_t‖² / d_out over calibration tokens. Quantization noise is close to uncorrelated across input columns, so
mean_t ‖e_t‖² = tr(ΔW R ΔWᵀ) ≈ Σ_i R_ii ‖ΔW_{:,i}‖², R_ii the importance weights (`quantize/importance.py`) —
and ΔW is measured, not modelled: each candidate type is quantized by ggml's own code with those weights and
decoded again. The embedding's rows are looked up, not multiplied: its error raises the loss by ½ ḡ²_emb ·
Σ_v share_v ‖ΔE_v‖², share_v the token's share of the calibration tokens; a tied matrix carries both terms.

The allocation is a multiple-choice knapsack, solved exactly by dynamic programming over the bytes (in the file's
32-byte alignment units, or coarser units rounded up for large budgets, the rounding's leftover then spent on
the upgrades that buy the most predicted loss per byte).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from compressor.quantize.ggml_quantize import (
    NEEDS_IMATRIX,
    dequantize_with_llama_cpp,
    ggml_block,
    padded,
    quantize_with_llama_cpp,
    row_bytes,
)
from compressor.quantize.gguf_types import type_counts
from compressor.runtime.errors import UserError

#: The types a matrix may take, as llama.cpp runs them on every backend: k-quants and i-quants for rows of 256s,
#: the 32-value types for the others (what llama.cpp's fallbacks use), f16 always.
CANDIDATE_TYPES = (
    "Q2_K", "IQ3_S", "Q3_K", "IQ4_XS", "Q4_K", "Q5_K", "Q6_K", "Q8_0",
    "Q4_0", "Q4_1", "IQ4_NL", "Q5_0", "Q5_1", "F16",
)  # fmt: skip


@dataclass(frozen=True)
class Option:
    type_name: str
    bytes: int
    predicted: float  # predicted rise of the mean next-token loss, nats


@dataclass
class BytePlan:
    """Each matrix's type, the file's predicted bytes and predicted loss rise."""

    types: dict[str, str]
    bytes: int
    predicted: float
    budget: int
    fixed_bytes: int

    def to_dict(self) -> dict:
        return {
            "budget": self.budget,
            "bytes": self.bytes,
            "predicted_loss_rise": self.predicted,
            "type_counts": type_counts(self.types),
            "types": dict(self.types),
        }


def candidate_types(row_length: int, has_importance: bool) -> list[str]:
    """The candidate types whose blocks a row of `row_length` fills (IQ types that need an imatrix only with one)."""
    return [
        t for t in CANDIDATE_TYPES
        if row_length % ggml_block(t) == 0 and (has_importance or t not in NEEDS_IMATRIX)
    ]  # fmt: skip


def parse_only_types(text: str | None, budget_given: bool = True) -> frozenset[str] | None:
    """`--only-types q4_k,q3_k,q6_k` → the candidate types a byte budget may choose from (None: all of them), or
    a one-line error naming what is not a candidate type, or that no budget (`budget_given`) was set."""
    if text is None:
        return None
    if not budget_given:
        raise UserError(
            "--only-types restricts the types a --size file chooses from: add --size (or drop it)"
        )
    names = [name.strip().upper() for name in text.split(",") if name.strip()]
    unknown = [name.lower() for name in names if name not in CANDIDATE_TYPES]
    if unknown or not names:
        raise UserError(
            f"--only-types {text}: {', '.join(unknown) or 'no type'} is not a type a matrix can take: "
            f"choose among {', '.join(t.lower() for t in CANDIDATE_TYPES)}"
        )
    return frozenset(names)


def within(name: str, types: list[str], allowed: frozenset[str] | None) -> list[str]:
    """`types` (a matrix's candidates) less those outside `allowed` (None: all kept), or a one-line error naming
    the matrix when none is left."""
    if allowed is None:
        return types
    kept = [t for t in types if t in allowed]
    if not kept:
        raise UserError(
            f"--only-types {','.join(sorted(allowed)).lower()}: {name} takes none of them (its rows fit "
            f"{', '.join(types).lower()}): add one of those"
        )
    return kept


def squared_rounding(
    array: np.ndarray, type_name: str, importance: np.ndarray | None, chunk_rows: int = 4096
) -> np.ndarray:
    """(ΔW)², in fp64, of `array` stored in `type_name`: quantized by ggml with `importance` and decoded, a chunk
    of rows at a time (ggml quantizes rows independently)."""
    squared = np.empty(array.shape, dtype=np.float64)
    for first in range(0, array.shape[0], chunk_rows):
        part = np.ascontiguousarray(array[first : first + chunk_rows], dtype=np.float32)
        if type_name == "F16":
            decoded = part.astype(np.float16).astype(np.float32)
        else:
            blocks = quantize_with_llama_cpp(part, type_name, importance)
            decoded = dequantize_with_llama_cpp(blocks, type_name, part.shape)
        squared[first : first + len(part)] = np.square((decoded - part).astype(np.float64))
    return squared


def rounding_errors(
    array: np.ndarray, type_name: str, importance: np.ndarray | None, chunk_rows: int = 4096
) -> tuple[np.ndarray, np.ndarray]:
    """(per column i ‖ΔW_{:,i}‖², per row r ‖ΔW_{r,:}‖²) of `array` stored in `type_name` (`squared_rounding`)."""
    squared = squared_rounding(array, type_name, importance, chunk_rows)
    return squared.sum(0), squared.sum(1)


#: Rows of each matrix quantized to measure a type's rounding error (evenly spaced; ggml rounds rows independently,
#: so the sum over all rows is the sample's times rows / sampled). The embedding's rows are looked up by token:
#: its `LOOKUP_ROWS` most frequent calibration tokens are measured exactly, a sample of the others as above.
SAMPLE_ROWS = 512
LOOKUP_ROWS = 2048


def evenly_spaced(indices: np.ndarray, count: int) -> np.ndarray:
    if len(indices) <= count:
        return indices
    return indices[np.linspace(0, len(indices) - 1, count).round().astype(np.int64)]


@dataclass(frozen=True)
class MatrixErrors:
    """One matrix's rounding error in each candidate type, measured on `rows` (evenly spaced): per sampled row its
    importance-weighted error Σ_i R_ii ΔW_ri², per column ‖ΔW_{:,i}‖² scaled from the sample to every row. What a
    part of the matrix (some rows kept, or some columns) would lose follows from them (`methods/masa/byte_structure`)."""

    rows: np.ndarray
    total_rows: int
    by_row: dict[str, np.ndarray]
    by_column: dict[str, np.ndarray]

    def weighted(self, type_name: str) -> float:
        """Σ_i R_ii ‖ΔW_{:,i}‖² over the whole matrix (the sample scaled to every row)."""
        return float(self.by_row[type_name].sum()) * self.total_rows / len(self.rows)


def sampled_errors(
    array: np.ndarray, importance: np.ndarray, sample_rows: int = SAMPLE_ROWS, types: list[str] | None = None
) -> MatrixErrors:
    """Each candidate type's (`types`, default: every type the rows fit) rounding error of `array`, measured on
    `sample_rows` evenly spaced rows with the importance weights `importance`."""
    rows = evenly_spaced(np.arange(array.shape[0]), sample_rows)
    weights = importance.astype(np.float64)
    by_row, by_column = {}, {}
    for type_name in types if types is not None else candidate_types(array.shape[1], True):
        squared = squared_rounding(array[rows], type_name, importance)
        by_row[type_name] = squared @ weights
        by_column[type_name] = squared.sum(0) * array.shape[0] / len(rows)
    return MatrixErrors(rows, array.shape[0], by_row, by_column)


def matrix_options(
    array: np.ndarray,
    importance: np.ndarray | None,
    gradient: float,
    lookup: tuple[float, np.ndarray] | None = None,
    sample_rows: int = SAMPLE_ROWS,
    weighted: dict[str, float] | None = None,
) -> list[Option]:
    """Every candidate type of one matrix with its bytes and predicted loss rise. `importance`: R_ii per column;
    `gradient`: ḡ² at its output (0 for a lookup-only embedding); `lookup`: (ḡ² at the embedding's output, each
    row's token share) when the matrix is also the embedding. Errors are measured on `sample_rows` evenly spaced
    rows, scaled to the whole matrix (and on the lookup's rows by `lookup_error`); `weighted`: the output error
    of each type measured otherwise (`--rounding compensated`: `rounding.compensated_errors`), used instead."""
    rows, row_length = array.shape
    types = candidate_types(row_length, importance is not None)
    if weighted is None and gradient and importance is not None:
        errors = sampled_errors(array, importance.astype(np.float32), sample_rows, types)
        weighted = {t: errors.weighted(t) for t in types}
    options = []
    for type_name in types:
        rise = 0.0 if weighted is None else 0.5 * gradient * weighted[type_name]
        if lookup is not None:
            rise += 0.5 * lookup[0] * lookup_error(array, type_name, importance, lookup[1], sample_rows)
        options.append(Option(type_name, rows * row_bytes(type_name, row_length), rise))
    return options


def lookup_error(
    array: np.ndarray, type_name: str, importance: np.ndarray | None, share: np.ndarray, sample_rows: int
) -> float:
    """Σ_v share_v ‖ΔE_v‖², the mean squared error of the embedding rows the calibration tokens look up: the
    `LOOKUP_ROWS` most frequent tokens' rows exactly, the others' from `sample_rows` of them."""
    order = np.argsort(-share, kind="stable")
    frequent, others = order[:LOOKUP_ROWS], np.sort(order[LOOKUP_ROWS:])
    _, errors = rounding_errors(array[frequent], type_name, importance)
    total = float(errors @ share[frequent].astype(np.float64))
    if len(others):
        _, sample = rounding_errors(array[evenly_spaced(others, sample_rows)], type_name, importance)
        total += float(sample.mean()) * float(share[others].sum())
    return total


def check_fits(smallest: int, budget: int) -> None:
    """A one-line error when the smallest file the model can make (every matrix in its smallest type) exceeds the
    budget, naming that size."""
    if smallest > budget:
        raise UserError(
            f"--size {budget:,} bytes: the smallest file this model can make is {smallest:,} bytes "
            f"({smallest / 2**20:.1f} MiB, every matrix in its smallest type): ask for at least that"
        )


def rows_bytes(
    array: np.ndarray, has_importance: bool, allowed: frozenset[str] | None = None, name: str = "a matrix"
) -> int:
    """The bytes of `array` (called `name` in an error) in the smallest of its candidate types within `allowed`."""
    rows, row_length = array.shape
    types = within(name, candidate_types(row_length, has_importance), allowed)
    return min(rows * row_bytes(t, row_length) for t in types)


def undominated(options: list) -> list:
    """The options no other beats on both bytes and predicted rise, by increasing bytes."""
    frontier: list = []
    for option in sorted(options, key=lambda o: (o.bytes, o.predicted)):
        if not frontier or option.predicted < frontier[-1].predicted:
            frontier.append(option)
    return frontier


def allocate(
    options: dict[str, list[Option]], fixed_bytes: int, budget: int, pad: int = 32, max_units: int = 250_000
) -> BytePlan:
    """Each matrix's type, minimizing the summed predicted rise with Σ padded bytes + `fixed_bytes` ≤ `budget`;
    a one-line error naming the smallest file when even the smallest types do not fit (`choose`)."""
    aligned = {name: [replace(o, bytes=padded(o.bytes, pad)) for o in opts] for name, opts in options.items()}
    choice = choose(aligned, fixed_bytes, budget, pad, max_units)
    return BytePlan(
        types={name: o.type_name for name, o in choice.items()},
        bytes=fixed_bytes + sum(o.bytes for o in choice.values()),
        predicted=sum(o.predicted for o in choice.values()),
        budget=budget,
        fixed_bytes=fixed_bytes,
    )


def choose(
    options: dict[str, list], fixed_bytes: int, budget: int, pad: int = 32, max_units: int = 250_000
) -> dict:
    """One option per unit (anything with `bytes`, already padded, and `predicted`), minimizing Σ predicted with
    Σ bytes + `fixed_bytes` ≤ `budget`: a multiple-choice knapsack.

    Exact dynamic programming over the bytes left, in units of `pad` bytes (a file's alignment) or, for a budget of
    more than `max_units` of them, of the multiple of `pad` that keeps it at `max_units` (each option's bytes
    rounded up to the unit, so the file still fits); the bytes the rounding leaves are then spent on the single
    upgrades that buy the most predicted loss per byte."""
    hulls = {name: undominated(opts) for name, opts in options.items()}
    check_fits(fixed_bytes + sum(opts[0].bytes for opts in hulls.values()), budget)
    free = budget - fixed_bytes
    unit = pad * max(1, -(-free // (pad * max_units)))
    capacity = free // unit
    names = list(hulls)
    best = np.zeros(capacity + 1)  # best[c]: least summed rise of the units so far within c units of bytes
    picks = np.zeros((len(names), capacity + 1), dtype=np.int32)
    for index, name in enumerate(names):
        new = np.full(capacity + 1, np.inf)
        for k, option in enumerate(hulls[name]):
            units = -(-option.bytes // unit)
            if units > capacity:
                break  # the hull is by increasing bytes
            candidate = best[: capacity + 1 - units] + option.predicted
            better = candidate < new[units:]
            new[units:][better] = candidate[better]
            picks[index, units:][better] = k
        best = new
    choice: dict = {}
    left = capacity
    for index in range(len(names) - 1, -1, -1):
        option = hulls[names[index]][picks[index, left]]
        choice[names[index]] = option
        left -= -(-option.bytes // unit)
    choice = {name: choice[name] for name in names}
    spare = budget - fixed_bytes - sum(o.bytes for o in choice.values())
    while True:  # the bytes the units' rounding left: the upgrades that fit, best gain per byte first
        upgrade_found = None
        for name, opts in hulls.items():
            for upgrade in opts[opts.index(choice[name]) + 1 :]:
                cost, gain = upgrade.bytes - choice[name].bytes, choice[name].predicted - upgrade.predicted
                if cost <= spare and gain > 0 and (upgrade_found is None or gain / cost > upgrade_found[0]):
                    upgrade_found = (gain / cost, name, upgrade, cost)
        if upgrade_found is None:
            return choice
        _, name, upgrade, cost = upgrade_found
        choice[name], spare = upgrade, spare - cost


@dataclass(frozen=True)
class ByteBudget:
    """What the user asked the file to fit: bytes (`--size`), or llama.cpp's bits per weight (`--bits-per-weight`),
    which become bytes once the model's parameters are counted."""

    size: int | None = None
    bits_per_weight: float | None = None

    @property
    def flag(self) -> str:
        return "--size" if self.size is not None else "--bits-per-weight"

    def bytes_for(self, parameters: int) -> int:
        """The budget in bytes for a model of `parameters` weights (the file's metadata and tokenizer included)."""
        return self.size if self.size is not None else int(self.bits_per_weight * parameters / 8)


def parse_budget(size: int | str | None, bits_per_weight: float | None) -> ByteBudget | None:
    """`--size` or `--bits-per-weight` (not both) as a budget; None when neither is given; else a one-line error."""
    if bits_per_weight is None:
        if size is None:
            return None
        return ByteBudget(size=parse_size(size) if isinstance(size, str) else int(size))
    if size is not None:
        raise UserError("--bits-per-weight and --size both set the file's bytes: keep one")
    if not 1.0 <= bits_per_weight <= 32.0:
        raise UserError(f"--bits-per-weight {bits_per_weight:g}: must lie between 1 and 32 (16 is f16)")
    return ByteBudget(bits_per_weight=float(bits_per_weight))


def parse_size(text: str) -> int:
    """`850MiB`, `1.2GB`, `90M`, `123456` → bytes (KiB/MiB/GiB are powers of 1024, kB/MB/GB of 1000)."""
    units = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
             "kib": 1024, "mib": 1024**2, "gib": 1024**3}  # fmt: skip
    value = text.strip().lower().replace(" ", "")
    number = value.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = value[len(number) :]
    try:
        amount = float(number)
    except ValueError:
        amount = -1.0
    if unit not in units or amount <= 0:
        raise UserError(
            f"--size {text}: not a size: write bytes or a number with a unit, e.g. 850MiB or 1.2GB"
        )
    return int(amount * units[unit])


#: Calibration windows whose backward pass measures the output sensitivities (`--allocation global-loss`'s
#: `sensitivity_samples` default).
GRADIENT_WINDOWS = 4
