"""`--rounding`: how a GGUF's quantized matrices are rounded into their types.

`nearest` (the default) is llama.cpp's own: every block of every row rounded on its own by ggml's quantizer,
weighing each column by the mean square of its input (the importance matrix). `compensated` rounds the decoder
layers' matrices with GPTQ's error feedback (`compensated.py`), from each input's full autocorrelation over the
calibration windows: the windows run through the model one layer at a time (the hidden states of all windows
kept: N·T·hidden numbers, one layer's autocorrelations at a time), each matrix is rounded once its layer's inputs
are measured, and the file is still exactly llama.cpp's format. A byte budget walks the windows once, for the
allocation's errors, and keeps the autocorrelations on disk for the rounding (`KeptAutocorrelations`). The
embedding (looked up, not multiplied), the output matrix, the value projection (`compensates`) and experts'
stacked matrices keep `nearest`.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from compressor.modeling.adapters import INPUT_OF, MLP_PROJECTIONS, PROJECTIONS, get_adapter
from compressor.quantize.compensated import DAMPING, compensated_quantize, inverse_factor, output_error
from compressor.quantize.ggml_quantize import ggml_block, tensor_category
from compressor.runtime.errors import UserError
from compressor.runtime.progress import note, progress_bar
from compressor.statistics.layer_runner import LayerRunner

ROUNDING_CHOICES = ("nearest", "compensated")
#: Where each layer's statistics come from (`compensated_blocks`'s `stream`).
STREAMS = ("original", "quantized")
#: Types whose rounding error is negligible or not ggml's to make: never compensated.
FLOAT_TYPES = ("F32", "F16", "BF16")


def compensates(tensor_name: str) -> bool:
    """Whether compensation rounds this GGUF matrix. Not the value projection (`attn_v`, or a fused `attn_qkv`
    holding it): measured on the bundled model's validation split, compensating it alone raised the KL to the
    original threefold where every other projection's compensation lowered it (the value of a token most others
    attend to, such as the first of a window, weighs far more in the attention's output than its one share of
    the tokens the autocorrelation counts). It keeps `nearest`."""
    return tensor_category(tensor_name) != "attn_v"


def check_rounding(rounding: str | None, tensor_type: str | None, imatrix: str | None) -> str:
    """The `--rounding` value (default `nearest`), or a one-line error: an unknown name, `compensated` for a float
    `--type`, or without the calibration it reads (`--imatrix none`)."""
    if rounding is None:
        return "nearest"
    if rounding not in ROUNDING_CHOICES:
        raise UserError(f"--rounding {rounding}: unknown: choose {' or '.join(ROUNDING_CHOICES)}")
    if rounding == "compensated" and tensor_type in ("f32", "f16", "bf16"):
        raise UserError(
            f"--rounding compensated: --type {tensor_type} is not rounded into blocks: choose a quantized --type "
            "(q8_0 ... q2_k, the i-quants) or --size"
        )
    if rounding == "compensated" and imatrix == "none":
        raise UserError(
            "--rounding compensated reads the calibration's input statistics: drop --imatrix none"
        )
    return rounding


@dataclass
class RoundingRecord:
    """What `compensated` did: matrices compensated, the damping each needed beyond the default (tensor name →
    relative damping), the windows and tokens its statistics came from, and its seconds."""

    matrices: int = 0
    windows: int = 0
    tokens: int = 0
    seconds: float = 0.0
    damped: dict[str, float] = field(default_factory=dict)
    input_zero: list[str] = field(default_factory=list)
    stream: str = "original"
    #: Whether the statistics were those the allocation's walk kept (`KeptAutocorrelations`), not walked again.
    kept_statistics: bool = False

    def to_dict(self) -> dict:
        return {
            "rounding": "compensated", "matrices": self.matrices, "windows": self.windows, "tokens": self.tokens,
            "seconds": round(self.seconds, 1), "damped": dict(self.damped), "input_zero": list(self.input_zero),
            "stream": self.stream, "kept_statistics": self.kept_statistics,
        }  # fmt: skip


def layer_projections(model: nn.Module) -> dict[str, tuple[int, str]]:
    """Module path → (layer, projection name) of every plain projection of the decoder layers."""
    adapter = get_adapter(model)
    by_id = {}
    for index in range(adapter.num_layers):
        for name in (*PROJECTIONS, *MLP_PROJECTIONS):
            module = adapter.find_projection(index, name)
            if isinstance(module, nn.Linear):
                by_id[id(module)] = (index, name)
    return {path: by_id[id(m)] for path, m in model.named_modules() if id(m) in by_id}


def compensated_blocks(
    model: nn.Module,
    windows: torch.Tensor,
    matrices: list[tuple[str, np.ndarray, str, str]],
    progress: bool = True,
    damping: float = DAMPING,
    stream: str = "original",
    kept: KeptAutocorrelations | None = None,
) -> tuple[dict[str, np.ndarray], RoundingRecord]:
    """ggml's blocks of every decoder-layer matrix of `matrices` (GGUF name, fp32 array as written, module path
    whose input it reads, GGML type) that a quantized type holds, rounded with compensation on the statistics of
    `windows` (N, T); the others are left to `nearest` (absent from the result).

    `stream`: each layer's statistics measured on the inputs the `original` model's earlier layers produce, or on
    those of the earlier layers already `quantized` (so a layer compensates what the ones below it lost: one
    more pass per layer; the model's weights are restored afterwards). `kept`: the original stream's statistics
    an earlier walk over the same windows kept (`layer_autocorrelations`)."""
    if stream not in STREAMS:
        raise ValueError(f"stream must be one of {STREAMS}, got {stream!r}")
    start = time.perf_counter()
    by_layer = _by_layer(model, matrices)
    record = RoundingRecord(windows=len(windows), tokens=int(windows.numel()), stream=stream)
    blocks: dict[str, np.ndarray] = {}
    originals: dict = {}
    try:
        walk = layer_autocorrelations(
            model, windows, by_layer, "Compensated rounding", progress, stream, kept
        )
        for layer, autocorrs, runner in walk:
            record.kept_statistics = runner is None  # read from `kept`, not walked
            decoded = {}
            for projection, tensors in by_layer.get(layer, {}).items():
                decoded |= _round_all(tensors, autocorrs[INPUT_OF[projection]], damping, blocks, record)
            if stream == "quantized":  # the next layer reads what this one's rounded weights produce
                originals |= _install_rounded(runner.adapter, layer, decoded)
                runner.advance(layer)
    finally:
        for module, weight in originals.items():
            module.weight.data = weight
    record.seconds = time.perf_counter() - start
    return blocks, record


class KeptAutocorrelations:
    """The input autocorrelations one walk measured on the original model's stream, kept in `directory` (one file
    per layer) for the next pass over the same windows: `export --size --rounding compensated` walks the
    calibration for the allocation's errors, then rounds the chosen types on the same statistics without walking
    it again (on the 1.5B model a walk is most of the rounding's time: its forward and its autocorrelations)."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.inputs: dict[int, set[str]] = {}  # layer → the inputs whose autocorrelations are kept

    def path(self, layer: int) -> Path:
        return self.directory / f"autocorr-{layer:05d}.safetensors"

    def keep(self, layer: int, autocorrs: dict[str, torch.Tensor]) -> None:
        save_file({name: a.contiguous() for name, a in autocorrs.items()}, str(self.path(layer)))
        self.inputs[layer] = set(autocorrs)

    def covers(self, by_layer: dict[int, dict]) -> bool:
        """Whether every input the projections of `by_layer` read is kept."""
        return all(
            {INPUT_OF[p] for p in projections} <= self.inputs.get(layer, set())
            for layer, projections in by_layer.items()
        )

    def read(self, layer: int) -> dict[str, torch.Tensor]:
        with safe_open(self.path(layer), framework="pt") as f:
            return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)


def layer_autocorrelations(
    model: nn.Module,
    windows: torch.Tensor,
    by_layer: dict[int, dict],
    what: str,
    progress: bool,
    stream: str = "original",
    kept: KeptAutocorrelations | None = None,
) -> Iterator[tuple[int, dict[str, torch.Tensor], LayerRunner | None]]:
    """Walk the decoder layers up to the last of `by_layer` (layer → {projection: ...}) with `windows`, yielding
    (layer, {input name: Σ xᵀx / T on the CPU, fp64} of the inputs its projections read, the runner): the
    statistics of the stream advanced past the layer already (`original`), or not yet (`quantized`: the caller
    installs the layer's rounded weights and advances the runner itself). With `kept` (the `original` stream's
    only): read from it where it holds every input wanted (no walk, no runner), else each layer's kept there."""
    if not by_layer:
        return
    if kept is not None and stream != "original":
        raise ValueError("kept autocorrelations are the original stream's")
    if kept is not None and kept.covers(by_layer):
        with progress_bar(f"{what} (kept statistics)", total=len(by_layer), enabled=progress) as bar:
            for layer in sorted(by_layer):
                yield layer, kept.read(layer), None
                bar.advance(1)
        return
    adapter = get_adapter(model)
    runner = LayerRunner(adapter, windows)
    with progress_bar(what, total=max(by_layer) + 1, enabled=progress) as bar:
        for layer in range(max(by_layer) + 1):
            readers = {INPUT_OF[p]: p for p in by_layer.get(layer, {})}
            measured = runner.advance_measuring(layer, readers, advance=stream == "original")
            autocorrs = {name: moments.autocorr.cpu() for name, moments in measured.items()}
            if kept is not None and autocorrs:
                kept.keep(layer, autocorrs)
            yield layer, autocorrs, runner
            bar.advance(1)


def _by_layer(model: nn.Module, matrices) -> dict[int, dict[str, list[tuple[str, np.ndarray, str]]]]:
    """The matrices compensation rounds, by layer and by the projection whose input they read."""
    where = layer_projections(model)
    by_layer: dict[int, dict[str, list[tuple[str, np.ndarray, str]]]] = {}
    for tensor_name, array, path, type_name in matrices:
        if path in where and array.ndim == 2 and type_name not in FLOAT_TYPES and compensates(tensor_name):
            if array.shape[1] % ggml_block(type_name) == 0:
                layer, projection = where[path]
                by_layer.setdefault(layer, {}).setdefault(projection, []).append(
                    (tensor_name, array, type_name)
                )
    return by_layer


def _round_all(tensors, autocorr: torch.Tensor, damping: float, blocks: dict, record: RoundingRecord) -> dict:
    """Round `tensors` (name, array, type) on one input's autocorrelation into `blocks`: {array's id: (the
    array, what it decodes to)} of those rounded."""
    factor = inverse_factor(autocorr, damping)
    decoded = {}
    for tensor_name, array, type_name in tensors:
        if factor is None:  # the input is zero at every token: no output error to compensate
            record.input_zero.append(tensor_name)
            continue
        blocks[tensor_name], rounded = compensated_quantize(array, type_name, factor)
        decoded[id(array)] = (array, rounded)
        record.matrices += 1
        if factor.attempts > 1:
            record.damped[tensor_name] = factor.damping
    return decoded


def _install_rounded(adapter, layer: int, decoded: dict) -> dict:
    """Give each projection of `layer` whose rows the rounded arrays hold the rows they decode to (the arrays
    as written may order them otherwise, or hold several projections: rows are found by value, and equal rows
    round alike); {module: its original weight} of those changed. The weight is replaced, not written into:
    the arrays may share its memory."""
    rows = {}
    for array, rounded in decoded.values():
        for index, row in enumerate(array):
            rows[row.tobytes()] = rounded[index]
    changed = {}
    for name in (*PROJECTIONS, *MLP_PROJECTIONS):
        module = adapter.find_projection(layer, name)
        if not isinstance(module, nn.Linear):
            continue
        weight = module.weight.detach().to(torch.float32).cpu().numpy()
        found = [rows.get(row.tobytes()) for row in weight]
        if found and all(r is not None for r in found):
            changed[module] = module.weight.data
            module.weight.data = torch.from_numpy(np.stack(found)).to(module.weight.dtype)
    return changed


def compensated_errors(
    model: nn.Module,
    windows: torch.Tensor,
    matrices: list[tuple[str, np.ndarray, str]],
    types_of: Callable[[np.ndarray], list[str]],
    progress: bool = True,
    damping: float = DAMPING,
    kept: KeptAutocorrelations | None = None,
) -> dict[str, dict[str, float]]:
    """What each decoder-layer matrix of `matrices` (GGUF name, fp32 array, module path) would lose in each of its
    candidate types (`types_of(array)`) if rounded compensated: tr(ΔW H ΔWᵀ), H its input's autocorrelation on
    `windows`, measured on `SAMPLE_ROWS` evenly spaced rows (rows round independently) and scaled to every row;
    a float type rounded as it is stored. The byte budget's allocation prices these in place of `nearest`'s.
    `kept`: where the walk keeps its statistics for the rounding after the allocation."""
    from compressor.quantize.byte_budget import SAMPLE_ROWS, evenly_spaced

    by_layer = _compensated_by_layer(model, matrices)
    errors: dict[str, dict[str, float]] = {}
    for layer, autocorrs, _ in layer_autocorrelations(model, windows, by_layer, "Compensated rounding errors",
                                                      progress, kept=kept):  # fmt: skip
        for projection, tensors in by_layer.get(layer, {}).items():
            autocorr = autocorrs[INPUT_OF[projection]]
            factor = inverse_factor(autocorr, damping)
            for tensor_name, array in tensors:
                rows = array[evenly_spaced(np.arange(len(array)), SAMPLE_ROWS)]
                scale = len(array) / len(rows)
                errors[tensor_name] = {
                    t: scale * output_error(rows, _rounded(rows, t, factor), autocorr)
                    for t in types_of(array)
                }
    return errors


def _rounded(rows: np.ndarray, type_name: str, factor) -> np.ndarray:
    """What `rows` decode to in `type_name`, rounded compensated (a float type: as stored; an input that is zero
    at every token: unchanged, nothing is lost)."""
    if factor is None:
        return rows
    if type_name in FLOAT_TYPES:
        return rows.astype(np.float16).astype(np.float32) if type_name == "F16" else rows
    return compensated_quantize(rows, type_name, factor)[1]


#: `write_gguf`'s `rounding`: the matrices (GGUF name, array, module path, type) → blocks of those it rounded.
Rounder = Callable[[list[tuple[str, np.ndarray, str, str]]], dict[str, np.ndarray]]


def _compensated_by_layer(model: nn.Module, matrices) -> dict[int, dict[str, list[tuple[str, np.ndarray]]]]:
    """The decoder-layer matrices of `matrices` (GGUF name, array, module path, ...) that compensation prices, as
    layer → projection → [(name, array)]."""
    where = layer_projections(model)
    by_layer: dict[int, dict[str, list[tuple[str, np.ndarray]]]] = {}
    for tensor_name, array, path, *_ in matrices:
        if path in where and array.ndim == 2 and compensates(tensor_name):
            layer, projection = where[path]
            by_layer.setdefault(layer, {}).setdefault(projection, []).append((tensor_name, array))
    return by_layer


def autocorrelation_bytes(model: nn.Module, matrices) -> int:
    """The bytes of the fp64 input autocorrelations (one per layer and input) that `compensated_errors` reads for
    `matrices` (GGUF name, array, module path, ...): what its walk keeps in `KeptAutocorrelations`."""
    widths = {
        (layer, INPUT_OF[projection]): tensors[0][1].shape[1]
        for layer, projections in _compensated_by_layer(model, matrices).items()
        for projection, tensors in projections.items()
    }
    return sum(8 * width * width for width in widths.values())


class CompensatedRounder:
    """`write_gguf`'s `rounding` for `--rounding compensated`, on the calibration `windows`, its statistics from the
    `stream` of `compensated_blocks`; `record` says what it did.

    A context: with a byte budget, the allocation's walk (`errors`) keeps the original stream's autocorrelations
    in a temporary folder beside the output (`KeptAutocorrelations`), and the rounding after it reads
    them instead of walking the calibration again; the folder is removed on exit, also after a failure. Where
    they would not fit on that disk, the rounding walks again, and says so."""

    def __init__(self, model: nn.Module, windows: torch.Tensor, progress: bool, stream: str, out: Path):
        self.model, self.windows, self.progress, self.stream, self.out = model, windows, progress, stream, out
        self.record: RoundingRecord | None = None
        self.kept: KeptAutocorrelations | None = None

    def __enter__(self) -> CompensatedRounder:
        return self

    def __exit__(self, *exc) -> None:
        if self.kept is not None:
            shutil.rmtree(self.kept.directory, ignore_errors=True)
            self.kept = None

    def __call__(self, matrices):
        blocks, self.record = compensated_blocks(
            self.model, self.windows, matrices, self.progress, stream=self.stream, kept=self.kept
        )
        return blocks

    def errors(self, matrices, types_of):
        """Each decoder-layer matrix's output error per candidate type, rounded compensated (the allocation's)."""
        if self.stream == "original" and self.kept is None:
            self.kept = self._keeping(matrices)
        return compensated_errors(self.model, self.windows, matrices, types_of, self.progress, kept=self.kept)

    def _keeping(self, matrices):
        """A temporary folder beside the output for the walk's statistics, or None (noted) where the inputs'
        autocorrelations (fp64, one per input a matrix reads) would not fit on its disk."""
        parent = self.out.resolve().parent
        needed, free = autocorrelation_bytes(self.model, matrices), shutil.disk_usage(parent).free
        if needed > free // 2:  # half the free disk at most: the GGUF itself is written beside them next
            note(
                f"[dim]compensated rounding: the allocation's statistics ({needed / 2**30:.1f} GiB) would not fit "
                f"beside the output ({free / 2**30:.1f} GiB free), so the rounding measures them again[/]",
                self.progress,
            )
            return None
        return KeptAutocorrelations(Path(tempfile.mkdtemp(prefix=".masa-rounding-", dir=parent)))
