"""A byte budget (`compress --size`): the engine-native structure (each MLP's width, each attention's query heads
per KV group) and every matrix's quantization type chosen by one allocation under the GGUF file's bytes.

A unit is a layer's MLP (gate/up/down at one width) or its attention in heads form (q/o at one head count); its
candidates are (width, one type per matrix), with
- bytes: Σ over its matrices of rows × the type's bytes per row at that width (each tensor padded as the file
  pads it);
- predicted rise of the mean next-token loss: κ · ½ ḡ²_out · tail[width] (the structure's whitened output error,
  exact for the least-squares refit: the neuron or head tail the parameter allocation reads) plus, per matrix,
  ½ ḡ² · its importance-weighted rounding error restricted to the part kept (rows for gate/up/q, columns for
  down/o; measured on the original matrix by ggml's own quantizer, `byte_budget.sampled_errors`). The two add:
  rounding noise is uncorrelated with the structure's error, so E‖e_s + e_q‖² = ‖e_s‖² + E‖e_q‖².
Every other matrix (k/v, the attention when only the MLP is targeted, the embedding and output head) takes types
only, as `export --size` chooses them. One multiple-choice knapsack (`byte_budget.choose`) picks a candidate per
unit, "remove nothing" always among them. κ (`STRUCTURE_WEIGHT`) weighs the structure's predicted rise against
rounding's: chosen on the validation split (benchmarks/experiments/byte_error_model).

The types chosen here are a forecast: `compress --size` writes the checkpoint at the chosen widths, then exports it
with `export --size`, which measures every matrix as written and allocates the types again under the exact bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from compressor.math.accounting import HEADS_READER, HEADS_ROWS, NEURON_READER, CompressionPlan
from compressor.math.heads import HeadTail, head_columns
from compressor.math.neurons import NeuronTail
from compressor.methods.base import MethodContext
from compressor.quantize.byte_budget import (
    SAMPLE_ROWS,
    MatrixErrors,
    candidate_types,
    choose,
    matrix_options,
    sampled_errors,
    undominated,
    within,
)
from compressor.quantize.ggml_quantize import padded, row_bytes
from compressor.runtime.progress import progress_bar

#: κ: the weight of the structure's predicted rise against the rounding's in one objective. 1 (the two predictions
#: taken as they are), chosen on the bundled model's validation split: at 78 MiB, where structure was chosen, κ = 1
#: removed 1.1M parameters and tied types alone with its point estimate better (-0.063 [-0.143, +0.012]
#: perplexity), κ = 0.5 removed 6.7M and lost (+0.168 [+0.052, +0.278]), κ = 2 and 4 removed nothing; at 90 and 84
#: MiB no κ removed anything (benchmarks/results/choices/structure-weight-validation.json).
STRUCTURE_WEIGHT = 1.0
#: The least calibration tokens per input column of a unit's refit (down_proj's input: one column per neuron; o_proj's:
#: one per head dimension) for the structure to be offered: the least-squares refit's error is measured on the tokens
#: it was fitted on, and with few tokens per column that error is far below the error on new text, so the structure
#: would be bought at a price it does not hold. Measured on the validation split, the refit's error on new tokens
#: over its error on the calibration (benchmarks/results/choices/structure-error-*.json): on the bundled model's
#: MLPs (1536 wide, ten layer-widths) 1.5-3.3x at 5 tokens per neuron, 1.2-2.0x at 11, 1.05-1.5x at 21, 0.95-1.13x
#: at 43 and 0.89-1.06x at 85; on the 1.5B model's (8960 wide, its recipe's 1.8 tokens per neuron) 2.5-68x, and
#: the measured loss rise of one MLP narrowed followed the error on new tokens, not the calibration's (structure
#: chosen on the calibration's lost to types alone in llama.cpp: results/size-structure-qwen2.5-coder-1.5b.json).
LEAST_TOKENS_PER_INPUT = 40
#: The least fraction of a unit's neurons (or heads per KV group) a candidate keeps, and the most widths offered
#: per MLP (every multiple of the step from the full width down to that floor).
STRUCTURE_FLOOR = 0.5
MOST_WIDTHS = 24
GATED = ("gate_proj", "up_proj")
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


@dataclass(frozen=True)
class SizeTarget:
    """What a byte budget gives the method: the file's bytes, the bytes no matrix's type changes (metadata,
    tokenizer, 1-D tensors), the original model's importance weights with their output sensitivities, and the
    types a matrix may take (`--only-types`; None: every candidate)."""

    budget: int
    fixed_bytes: int
    importance: object  # quantize.importance.Importance, with gradients
    structure_weight: float = STRUCTURE_WEIGHT
    allowed_types: frozenset[str] | None = None


@dataclass(frozen=True)
class Candidate:
    """One way to store a unit: its width (kept neurons, or heads per KV group; None for a matrix alone), each
    matrix's type, the padded bytes and the predicted rise (`structure`: the part the structure costs)."""

    bytes: int
    predicted: float
    width: int | None
    types: tuple[tuple[str, str], ...]
    structure: float = 0.0


#: What a byte budget may narrow, by `--targets` name, as its lines name it.
UNIT_NAMES = {"mlp": "MLP widths", "attn": "query heads"}


def windows_for_enough_tokens(width: int, seq_len: int) -> int:
    """The calibration windows of `seq_len` tokens that give a refit of `width` inputs LEAST_TOKENS_PER_INPUT
    tokens per input."""
    return -(-LEAST_TOKENS_PER_INPUT * width // seq_len)


def few_tokens_warning(input_widths: dict[str, int], windows: int, seq_len: int) -> str | None:
    """One line where a run's refits (`input_widths`: `attn` -> o_proj's input when heads are removed, `mlp` ->
    down_proj's when neurons are) read fewer than LEAST_TOKENS_PER_INPUT calibration tokens per input, None
    otherwise: what it costs and the `--calib-samples` that gives enough."""
    tokens = windows * seq_len
    short = {t: w for t, w in input_widths.items() if tokens < LEAST_TOKENS_PER_INPUT * w}
    if not short:
        return None
    widest = max(short.values())
    parts = ", ".join(f"{tokens / w:.1f} {REFIT_NAMES[t]}" for t, w in short.items())
    return (
        f"the least-squares refits read few calibration tokens per input ({parts}; {tokens:,} tokens in all): "
        f"fitted that closely to the calibration text, their error on new text exceeds what the allocation "
        f"predicts, so expect a larger quality loss than with {LEAST_TOKENS_PER_INPUT} per input "
        f"(--calib-samples {windows_for_enough_tokens(widest, seq_len)}: windows of {seq_len} tokens)"
    )


#: The refits a unit's structure reads, as the warning names them.
REFIT_NAMES = {"mlp": "per neuron for down_proj", "attn": "per head dimension for o_proj"}


def trusted_targets(targets: str, input_widths: dict[str, int], windows_for) -> tuple[str | None, list[str]]:
    """The part of `targets` (`attn`, `mlp` or both) whose refits read at least LEAST_TOKENS_PER_INPUT
    calibration tokens per input column (`input_widths`: `attn` -> o_proj's input, `mlp` -> down_proj's;
    `windows_for(targets)`: the calibration windows and their length a run of those targets reads), None where
    no part does, and a line for each part left out."""
    kept, lines = [t for t in ("attn", "mlp") if t in {part.strip() for part in targets.split(",")}], []
    while kept:
        windows, seq_len = windows_for(",".join(kept))
        tokens = windows * seq_len
        short = [t for t in kept if tokens < LEAST_TOKENS_PER_INPUT * input_widths[t]]
        if not short:
            break
        for t in short:
            width = input_widths[t]
            lines.append(
                f"{UNIT_NAMES[t]} not offered: {tokens:,} calibration tokens for {width:,} inputs per refit "
                f"({tokens / width:.1f} per input) price the structure at a fraction of its loss on new text; "
                f"{LEAST_TOKENS_PER_INPUT} per input (--calib-samples {windows_for_enough_tokens(width, seq_len)}: "
                f"windows of {seq_len} tokens) let it compete"
            )
        kept = [t for t in kept if t not in short]
    return (",".join(kept) or None), lines


def candidate_widths(
    full: int, multiple: int, floor: float = STRUCTURE_FLOOR, most: int = MOST_WIDTHS
) -> list[int]:
    """The widths offered for an MLP of `full` neurons: multiples of a step (`multiple`, doubled until at most `most`
    widths reach down to `floor` of the full width), the full width first."""
    step = multiple
    while (full - floor * full) / step > most:
        step *= 2
    return [full - k * step for k in range(int((full - floor * full) // step) + 1)]


def smallest_matrices(
    geometry,
    num_layers: int,
    vocab: int,
    tied: bool,
    targets: str | None,
    width_multiple: int,
    allowed: frozenset[str] | None = None,
) -> int:
    """The bytes of every matrix in its smallest candidate type (within `allowed`), each unit the allocation may
    narrow (`targets`: `mlp`, `attn`, both, or None) at its narrowest candidate: the smallest file less its
    metadata, from shapes."""

    def least(rows: int, row_length: int) -> int:
        types = within(f"a matrix with rows of {row_length}", candidate_types(row_length, True), allowed)
        return padded(rows * min(row_bytes(t, row_length) for t in types))

    hidden, head_dim = geometry.hidden_size, geometry.head_dim
    width = geometry.intermediate_size
    if targets and "mlp" in targets:
        width = candidate_widths(width, width_multiple)[-1]
    per_group = geometry.num_heads // geometry.num_kv_heads
    heads = geometry.num_kv_heads * (-(-per_group // 2) if targets and "attn" in targets else per_group)
    kv = geometry.num_kv_heads * head_dim
    layer = 2 * least(width, hidden) + least(hidden, width) + least(heads * head_dim, hidden)
    layer += 2 * least(kv, hidden) + least(hidden, heads * head_dim)
    return num_layers * layer + least(vocab, hidden) * (1 if tied else 2)


def pareto(options: list[tuple[int, float, tuple]]) -> list[tuple[int, float, tuple]]:
    """The (bytes, predicted, types) no other beats on both bytes and predicted, by increasing bytes."""
    frontier: list[tuple[int, float, tuple]] = []
    for option in sorted(options, key=lambda o: (o[0], o[1])):
        if not frontier or option[1] < frontier[-1][1]:
            frontier.append(option)
    return frontier


def combine(parts: list[list[tuple[int, float, tuple]]]) -> list[tuple[int, float, tuple]]:
    """The Pareto set of one option from each part, bytes, predicted rises and types summed."""
    combined = [(0, 0.0, ())]
    for part in parts:
        combined = pareto([(b + c, p + q, t + u) for b, p, t in combined for c, q, u in part])
    return combined


def rows_kept(
    errors: MatrixErrors,
    path: str,
    kept: np.ndarray,
    row_length: int,
    gradient: float,
    allowed: frozenset[str] | None = None,
) -> list:
    """(bytes, predicted, types) of a matrix keeping the rows `kept`, in every type its rows fit (within `allowed`)."""
    sampled = np.isin(errors.rows, kept)
    options = []
    for type_name in within(path, candidate_types(row_length, True), allowed):
        per_row = errors.by_row[type_name][sampled] if sampled.any() else errors.by_row[type_name]
        rise = 0.5 * gradient * len(kept) * float(per_row.mean())
        options.append((padded(len(kept) * row_bytes(type_name, row_length)), rise, ((path, type_name),)))
    return options


def columns_kept(
    errors: MatrixErrors,
    path: str,
    kept: np.ndarray,
    importance: np.ndarray,
    gradient: float,
    allowed: frozenset[str] | None = None,
) -> list:
    """(bytes, predicted, types) of a matrix keeping the columns `kept` (its rows that long), in every type they fit
    (within `allowed`)."""
    options = []
    for type_name in within(path, candidate_types(len(kept), True), allowed):
        if type_name not in errors.by_column:  # a block that fits the kept width but not the full one
            continue
        rise = 0.5 * gradient * float(errors.by_column[type_name][kept] @ importance[kept])
        options.append(
            (padded(errors.total_rows * row_bytes(type_name, len(kept))), rise, ((path, type_name),))
        )
    return options


#: Each original matrix's rounding errors by (importance key, module path): further budgets for the same model
#: and calibration in one process (a benchmark's ladder) measure nothing again.
_ERRORS: dict[tuple[str, str], MatrixErrors] = {}
_OUTSIDE: dict[tuple[str, str], list] = {}


class SizeAllocation:
    """The candidates of every unit and matrix of one model, then the knapsack (`allocate`)."""

    def __init__(self, ctx: MethodContext, target: SizeTarget):
        self.ctx, self.target = ctx, target
        self.paths = {id(m): n for n, m in ctx.model.named_modules()}
        self.importance, self.allowed = target.importance, target.allowed_types

    def path(self, layer: int, projection: str) -> str:
        return self.paths[id(self.ctx.adapter.projection(layer, projection))]

    def gradient(self, path: str) -> float:
        return float(self.importance.gradients.get(path, 0.0))

    def vector(self, path: str) -> np.ndarray:
        return self.importance.weights[path].numpy().astype(np.float64)

    def matrix_errors(self, layer: int, projection: str) -> tuple[str, MatrixErrors]:
        path = self.path(layer, projection)
        memo = (self.importance.key, path)
        if memo not in _ERRORS or not self.importance.key:
            array = self.ctx.weight(layer, projection).cpu().numpy().astype(np.float32)
            _ERRORS[memo] = sampled_errors(array, self.vector(path).astype(np.float32), SAMPLE_ROWS)
        return path, _ERRORS[memo]

    def alone(self, layer: int, projection: str) -> list[Candidate]:
        """A matrix that keeps its shape: its types only."""
        path, errors = self.matrix_errors(layer, projection)
        rows, row_length = self.ctx.adapter.projection(layer, projection).weight.shape
        options = rows_kept(errors, path, np.arange(rows), row_length, self.gradient(path), self.allowed)
        return [Candidate(b, p, None, t) for b, p, t in pareto(options)]

    def mlp(self, layer: int, found: NeuronTail) -> list[Candidate]:
        """The layer's MLP at every candidate width, each matrix in each type."""
        full, hidden = len(found.order), self.ctx.shape.geometry.hidden_size
        gated = [self.matrix_errors(layer, p) for p in GATED]
        down_path, down = self.matrix_errors(layer, NEURON_READER)
        down_importance, down_gradient = self.vector(down_path), self.gradient(down_path)
        candidates = []
        for width in candidate_widths(full, self.ctx.settings.width_multiple or 1):
            kept = found.kept(width).numpy()
            parts = [rows_kept(e, path, kept, hidden, self.gradient(path), self.allowed) for path, e in gated]
            parts.append(columns_kept(down, down_path, kept, down_importance, down_gradient, self.allowed))
            # Measured from the full width's (a refit's damping leaves a hair there): whole, the MLP is the original.
            lost = float(found.tail[width] - found.tail[full])
            structure = self.target.structure_weight * 0.5 * down_gradient * lost
            candidates += [Candidate(b, p + structure, width, t, structure) for b, p, t in combine(parts)]
        return undominated(candidates)

    def heads(self, layer: int, found: HeadTail) -> list[Candidate]:
        """The layer's q/o at every candidate count of query heads per KV group, each in each type."""
        geometry = self.ctx.shape.geometry
        per_group_full = geometry.num_heads // geometry.num_kv_heads
        q_path, q = self.matrix_errors(layer, HEADS_ROWS)
        o_path, o = self.matrix_errors(layer, HEADS_READER)
        o_importance, o_gradient = self.vector(o_path), self.gradient(o_path)
        candidates = []
        for per_group in range(per_group_full, -(-per_group_full // 2) - 1, -1):
            kept = head_columns(found.kept(per_group), geometry.head_dim).numpy()
            parts = [
                rows_kept(q, q_path, kept, geometry.hidden_size, self.gradient(q_path), self.allowed),
                columns_kept(o, o_path, kept, o_importance, o_gradient, self.allowed),
            ]
            lost = float(found.tail[per_group - 1] - found.tail[per_group_full - 1])
            structure = self.target.structure_weight * 0.5 * o_gradient * lost
            candidates += [Candidate(b, p + structure, per_group, t, structure) for b, p, t in combine(parts)]
        return undominated(candidates)

    def outside_layers(self) -> dict[str, list[Candidate]]:
        """The embedding (with the output head when tied) and an untied head: types only, as `export --size`."""
        memo = (self.importance.key, "outside the layers")
        if memo not in _OUTSIDE or not self.importance.key:
            _OUTSIDE[memo] = self._outside_layers()
        units = dict(_OUTSIDE[memo])
        if self.allowed is not None:  # measured for every type (kept for other budgets), chosen among these
            for name, candidates in units.items():
                kept = within(name, [c.types[0][1] for c in candidates], self.allowed)
                units[name] = [c for c in candidates if c.types[0][1] in kept]
        return units

    def _outside_layers(self) -> dict[str, list[Candidate]]:
        model = self.ctx.model
        embedding, output = model.get_input_embeddings(), model.get_output_embeddings()
        embedding_path = self.paths[id(embedding)]
        tied = output is not None and output.weight is embedding.weight
        head_path = self.paths.get(id(output)) if output is not None else None
        imp = self.importance
        units = {}
        vector = imp.weights.get(embedding_path)
        lookup = (self.gradient(embedding_path), imp.token_share.numpy())
        options = matrix_options(
            embedding.weight.detach().float().cpu().numpy(),
            None if vector is None else vector.numpy().astype(np.float32),
            self.gradient(head_path) if tied else 0.0,
            lookup,
        )
        units[embedding_path] = [Candidate(padded(o.bytes), o.predicted, None, ((embedding_path, o.type_name),))
                                 for o in options]  # fmt: skip
        if output is not None and not tied:
            options = matrix_options(
                output.weight.detach().float().cpu().numpy(),
                imp.weights[head_path].numpy().astype(np.float32),
                self.gradient(head_path),
            )
            units[head_path] = [Candidate(padded(o.bytes), o.predicted, None, ((head_path, o.type_name),))
                                for o in options]  # fmt: skip
        return units


def allocate_to_size(
    ctx: MethodContext, plan: CompressionPlan, neurons: dict[int, NeuronTail], heads: dict[int, HeadTail]
) -> dict:
    """Every unit's width and every matrix's type under `ctx.size`'s bytes: sets the plan's widths and head counts
    (a unit at its full width is kept whole), its ratio to what the structure removed; returns the report."""
    target: SizeTarget = ctx.size
    allocation = SizeAllocation(ctx, target)
    shape = ctx.shape
    units: dict[str, list[Candidate]] = {}
    with progress_bar("Structure and types by bytes", total=shape.num_layers, enabled=ctx.progress) as bar:
        for layer in range(shape.num_layers):
            covered: set[str] = set()
            if layer in neurons:
                units[f"{layer}.mlp"] = allocation.mlp(layer, neurons[layer])
                covered |= {*GATED, NEURON_READER}
            if layer in heads:
                units[f"{layer}.heads"] = allocation.heads(layer, heads[layer])
                covered |= {HEADS_ROWS, HEADS_READER}
            for p in ATTENTION + (*GATED, NEURON_READER):
                if p not in covered and ctx.adapter.find_projection(layer, p) is not None:
                    units[f"{layer}.{p}"] = allocation.alone(layer, p)
            bar.advance()
    units.update(allocation.outside_layers())
    choice = choose(units, target.fixed_bytes, target.budget)
    widths, head_counts = {}, {}
    for name, candidate in choice.items():
        layer, _, kind = name.partition(".")
        if kind == "mlp":
            widths[int(layer)] = candidate.width
        elif kind == "heads":
            head_counts[int(layer)] = candidate.width
    _set_structure(plan, widths, head_counts)
    types = dict(pair for candidate in choice.values() for pair in candidate.types)
    structure = sum(c.structure for c in choice.values())
    predicted = sum(c.predicted for c in choice.values())
    return {
        "budget": target.budget,
        "predicted_bytes": target.fixed_bytes + sum(c.bytes for c in choice.values()),
        "predicted_loss_rise": predicted,
        "structure_loss_rise": structure,
        "quantization_loss_rise": predicted - structure,
        "structure_weight": target.structure_weight,
        "mlp_widths": [widths.get(layer) for layer in range(shape.num_layers)] if widths else [],
        "heads_per_kv_group": [head_counts.get(layer) for layer in range(shape.num_layers)]
        if head_counts
        else [],
        "forecast_types": types,
    }


def _set_structure(plan: CompressionPlan, widths: dict[int, int], head_counts: dict[int, int]) -> None:
    """The plan at the chosen widths and head counts (a unit at its full size kept whole); its ratio becomes what
    the structure removed, the budget a byte budget left to it."""
    for pp in plan.projections:
        chosen = {"neurons": widths, "heads": head_counts}.get(pp.mode, {}).get(pp.layer)
        if chosen is None:
            continue
        full = pp.in_features if pp.projection in (NEURON_READER, HEADS_READER) else pp.out_features
        full = full if pp.mode == "neurons" else full // pp.head_block
        if chosen >= full:
            pp.mode, pp.n_atoms, pp.rank, pp.basis = "dense", 0, None, None
        else:
            pp.rank = chosen
    # The budget is in bytes: the parameters the structure keeps are its plan's, exactly (a hair below, so that
    # the plan's floor of (1 - ratio) x the parameters is never under them).
    plan.ratio = max(0.0, plan.achieved_ratio() - 1e-9)
