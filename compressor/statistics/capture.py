"""Stage 1: calibration capture with hooks that reduce on the fly (never all activations in memory).

Per layer: C_attn = Σ xᵀx / T over the q/k/v input (post input_layernorm), C_o = Σ zᵀz / T over the o_proj
input (T: the calibration tokens), both summed in fp64 (each window's product in fp32, see `add_gram`); and the
token-mean of each block's output per window (for grouping). The decoder runs without the LM head: nothing here
reads the logits (on the bundled model the head is a fifth of a forward pass). With `mlp=True` (for
`--targets mlp`) also C_down over the down_proj input and, unless `gate_input=False` (a method that keeps
gate/up's rows never reads it), C_mlp over the gate/up input. Beside each autocorrelation, its input's token
mean E[x] (fp64 sums; what FLAP's fluctuation Var(x_j) = C_jj − E[x_j]² and its bias compensation read).

The autocorrelations are means over the tokens, not sums: a sum grows with T, and so would every factor built on
its Cholesky factor (|A| as √T: fp16 storage overflowed on long calibrations). Every consumer compares errors by
ratios or minimises them, so the mean changes no choice; the whitened error ‖E S‖² is the mean output error per
token.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import nn

from compressor.modeling.adapters import DecoderAdapter
from compressor.runtime.device import (
    GRAM_BLOCK_COLUMNS,
    add_in_float64,
    autocast_to,
    float64_zeros,
    statistics_device,
)
from compressor.runtime.errors import NumericalError
from compressor.runtime.progress import progress_bar
from compressor.statistics.sensitivity import LossGradients, Sensitivity


@dataclass
class CalibrationStats:
    attn_autocorr: list[torch.Tensor]  # L × (hidden, hidden) fp64: input of q/k/v, the token mean of xᵀx
    o_autocorr: list[torch.Tensor]  # L × (heads*head_dim, same) fp64: input of o_proj
    block_output_means: torch.Tensor  # (L, N, hidden) fp32: token-mean of each block's output per window
    tokens: int  # the calibration tokens each autocorrelation is the mean over
    windows: int
    seconds: float = 0.0
    mlp_autocorr: list[torch.Tensor] | None = None  # L × (hidden, hidden): input of gate/up (mlp=True)
    down_autocorr: list[torch.Tensor] | None = None  # L × (intermediate, same): input of down_proj
    sensitivity: Sensitivity | None = None  # loss sensitivity per projection (--allocation global-loss)
    #: kind -> (L, width) fp64: the token mean of each input (FLAP's fluctuation and bias compensation read them)
    input_means: dict[str, torch.Tensor] | None = None
    #: The dtype the forward passes computed in under autocast (None: the model's own); a loss sensitivity
    #: measured later for these statistics runs the same way.
    autocast: torch.dtype | None = None

    def to(self, device: torch.device) -> CalibrationStats:
        """The statistics where the fp64 work for a model on `device` runs (the CPU for MPS: no fp64 there)."""
        device = statistics_device(device)

        def moved(matrices):
            return None if matrices is None else [c.to(device) for c in matrices]

        return CalibrationStats(
            moved(self.attn_autocorr),
            moved(self.o_autocorr),
            self.block_output_means.to(device),
            self.tokens,
            self.windows,
            self.seconds,
            moved(self.mlp_autocorr),
            moved(self.down_autocorr),
            self.sensitivity,
            None if self.input_means is None else {k: v.to(device) for k, v in self.input_means.items()},
            self.autocast,
        )

    @property
    def has_mlp(self) -> bool:
        """Whether the MLP's statistics were collected: `down_proj`'s input always, gate/up's when read."""
        return self.down_autocorr is not None

    def _by_kind(self) -> dict[str, list[torch.Tensor] | None]:
        """Each input kind's autocorrelations (None: not collected), in forward order."""
        return {
            "attn": self.attn_autocorr,
            "o": self.o_autocorr,
            "mlp": self.mlp_autocorr,
            "down": self.down_autocorr,
        }

    @property
    def inputs(self) -> tuple[str, ...]:
        """The input kinds whose autocorrelations these statistics hold, in forward order."""
        return tuple(kind for kind, matrices in self._by_kind().items() if matrices is not None)

    def autocorr(self, kind: str, layer: int) -> torch.Tensor:
        """The autocorrelation of input `kind` (adapters.INPUT_OF) at `layer`."""
        matrices = self._by_kind()[kind]
        if matrices is None:
            raise ValueError(
                f"the {kind} input autocorrelations were not collected: {not_collected_fix(kind)}"
            )
        return matrices[layer]

    def input_mean(self, kind: str, layer: int) -> torch.Tensor:
        """The token mean of input `kind` at `layer` (fp64)."""
        if self.input_means is None or kind not in self.input_means:
            raise ValueError(f"the {kind} input means were not collected")
        return self.input_means[kind][layer]


#: Each autocorrelation's input kind -> the projection whose input it is (q_proj's is k/v's too, gate's is up's).
ATTN_INPUTS = {"attn": "q_proj", "o": "o_proj"}
MLP_INPUTS = {"mlp": "gate_proj", "down": "down_proj"}


def captured_inputs(mlp: bool, gate_input: bool = True) -> dict[str, str]:
    """The inputs whose autocorrelations a capture sums, kind -> the projection it hooks, in forward order: the
    attention's always; with `mlp`, `down_proj`'s and, unless `gate_input` is False, gate/up's. A method that
    keeps gate/up's rows (neuron selection: MASA's default, FLAP, MoDeGPT) never reads their input's: on the
    bundled model they were 9% of the whole-model capture's time (`Method.reads_gate_input`)."""
    mlp_inputs = {k: v for k, v in MLP_INPUTS.items() if gate_input or k != "mlp"} if mlp else {}
    return {**ATTN_INPUTS, **mlp_inputs}


def not_collected_fix(kind: str) -> str:
    """What a missing input kind's error tells the caller to pass."""
    return "pass mlp=True, gate_input=True" if kind == "mlp" else "pass mlp=True"


class _Accumulator:
    """Owns the hooks; always removes them (also on error)."""

    def __init__(
        self,
        adapter: DecoderAdapter,
        n_windows: int,
        device: torch.device,
        mlp: bool = False,
        autocorrelations: bool = True,
        gate_input: bool = True,
    ):
        self.adapter = adapter
        geometry = adapter.geometry

        def zeros(kind: str) -> list[torch.Tensor]:
            size = geometry.input_size(kind)
            return [float64_zeros(size, size, device=device) for _ in adapter.layers]

        #: kind -> the projection whose input it is, for every autocorrelation summed here.
        self.inputs = captured_inputs(mlp, gate_input) if autocorrelations else {}
        #: kind -> one fp64 accumulator per layer of `Σ xᵀx` over that input.
        self.grams = {kind: zeros(kind) for kind in self.inputs}
        #: kind -> (L, width) fp64 sums of every input over the tokens (the autocorrelations' first moment).
        self.sums = {
            kind: float64_zeros(adapter.num_layers, geometry.input_size(kind), device=device)
            for kind in self.inputs
        }
        self.means = torch.zeros(adapter.num_layers, n_windows, geometry.hidden_size, dtype=torch.float32)
        self.window_offset = 0
        self.handles: list = []

    def _input_into(self, kind: str, layer: int, x: torch.Tensor) -> None:
        add_input(self.grams[kind][layer], self.sums[kind][layer], x)

    def accumulators(self) -> list[torch.Tensor]:
        """Every autocorrelation accumulator the hooks fill."""
        return [gram for grams in self.grams.values() for gram in grams]

    def check_finite(self) -> None:
        """`check_gram` on every accumulator in the order the forward pass fills them, so that the input named is
        where the trouble began (everything after it is non-finite too)."""
        for layer in range(len(self.adapter.layers)):
            for kind, name in self.inputs.items():
                check_gram(self.grams[kind][layer], f"layer {layer} {name}")

    def __enter__(self) -> _Accumulator:
        # One autocorrelation per input: q_proj's input is k/v's too, gate_proj's is up_proj's.
        for i, layer in enumerate(self.adapter.layers):
            for kind, name in self.inputs.items():
                self.handles.append(
                    self.adapter.projection(i, name).register_forward_pre_hook(
                        lambda m, a, i=i, kind=kind: self._input_into(kind, i, a[0])
                    )
                )
            self.handles.append(layer.register_forward_hook(lambda m, a, out, i=i: self._block_mean(i, out)))
        return self

    def _block_mean(self, i: int, output) -> None:
        hidden = (output[0] if isinstance(output, tuple) else output).detach()  # (B, T, H)
        n = hidden.shape[0]
        self.means[i, self.window_offset : self.window_offset + n] = hidden.float().mean(dim=1).cpu()

    def __exit__(self, *exc) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()


#: Tokens per fp32 product in `add_gram`: the rounding error of a product grows with the tokens it sums.
GRAM_CHUNK_TOKENS = 512


def gram_blocks(width: int) -> list[slice]:
    """The column blocks of a `width`-wide autocorrelation that `add_gram` fills and `token_mean` mirrors."""
    return [
        slice(start, min(start + GRAM_BLOCK_COLUMNS, width)) for start in range(0, width, GRAM_BLOCK_COLUMNS)
    ]


def add_gram(target: torch.Tensor, x: torch.Tensor) -> None:
    """`target += xᵀx` over the tokens of activations `x (..., T, d)`, one window (the last-but-one axis) at a
    time, on and above the diagonal blocks of `gram_blocks(d)` only: `token_mean` completes the symmetric matrix.
    Nothing is checked here: `check_gram` on the sum, once the windows are in, tells a non-finite activation or an
    fp32 overflow.

    Each window's product is computed in fp32 over at most `GRAM_CHUNK_TOKENS` tokens and added to the fp64
    accumulator (`target`'s device: the CPU for a model on MPS, see `device.float64_zeros`): about half the time
    of fp64 products on a CPU, the sum still fp64 across windows. An entry's error is at most about
    `GRAM_CHUNK_TOKENS`·2⁻²⁴ of Σ|x_i x_j| (fp32 summation over a chunk); tests/test_capture.py bounds it on real
    activations. Chunks follow window boundaries, so the result does not depend on how windows are batched
    (the in-memory and layer-sequential captures agree bit for bit).
    """
    blocks = gram_blocks(x.shape[-1])
    for window in x.reshape(-1, *x.shape[-2:]):
        for chunk in window.split(GRAM_CHUNK_TOKENS):
            chunk = chunk.float()
            for block in blocks:
                product = chunk[:, block].T @ chunk[:, block.start :]  # the block row, from its diagonal on
                add_in_float64(target[block, block.start :], product)


def add_input(gram: torch.Tensor, total: torch.Tensor, x: torch.Tensor) -> None:
    """`gram += xᵀx` and `total += Σ x` over the tokens of an input `x (..., T, d)`: what every capture (in memory and
    layer by layer, so their numbers agree bit for bit) adds of one projection's input."""
    # Detached: the windows that also measure the loss sensitivity run with gradients. One window at a time in
    # float32 (a 16-bit input: one window's copy, not the batch's) for both its products and its sum; the sum
    # in fp32 (an fp64 reduction along the tokens was slow), added in fp64 across windows like the products.
    for window in x.detach().reshape(-1, *x.shape[-2:]):
        window = window.float()
        add_gram(gram, window)
        add_in_float64(total, window.sum(dim=0))


def add_cross(target: torch.Tensor, t: torch.Tensor, x: torch.Tensor) -> None:
    """`target += tᵀx` over the tokens of targets `t (..., T, m)` and inputs `x (..., T, d)`: the least squares'
    cross moments, computed as `add_gram` computes its own (fp32 products over at most `GRAM_CHUNK_TOKENS` tokens of
    one window, summed in fp64), within the same bound (tests/test_capture.py)."""
    for t_window, x_window in zip(t.reshape(-1, *t.shape[-2:]), x.reshape(-1, *x.shape[-2:]), strict=True):
        for t_chunk, x_chunk in zip(
            t_window.split(GRAM_CHUNK_TOKENS), x_window.split(GRAM_CHUNK_TOKENS), strict=True
        ):
            add_in_float64(target, t_chunk.float().T @ x_chunk.float())


def check_gram(total: torch.Tensor, where: str) -> None:
    """Refuse an accumulated `Σ xᵀx` whose diagonal is not finite. A non-finite activation makes its column's Σ x²
    non-finite, as does a product that overflowed fp32 (+inf: squares cannot cancel, and no off-diagonal sum
    exceeds the larger of its two diagonal ones), so the diagonal of the sum tells both, once per capture: a check
    of every product's diagonal cost a tenth of the products' time."""
    if not torch.isfinite(torch.diagonal(total)).all():
        raise NumericalError(
            f"non-finite activations (or an fp32 overflow of their products) at the input of {where} "
            "during calibration"
        )


def token_mean(gram: torch.Tensor, tokens: int) -> torch.Tensor:
    """The autocorrelation as the statistics hold it, in place: the blocks below the diagonal set from those
    above (what `add_gram` left out), then the accumulated `Σ xᵀx` divided by its tokens."""
    if tokens <= 0:
        raise ValueError(f"an autocorrelation needs calibration tokens, got {tokens}")
    blocks = gram_blocks(gram.shape[-1])
    for i, rows in enumerate(blocks):
        for columns in blocks[i + 1 :]:
            gram[columns, rows] = gram[rows, columns].T
    return gram.div_(tokens)


@torch.no_grad()
def collect_statistics(
    model: nn.Module,
    adapter: DecoderAdapter,
    windows: torch.Tensor,
    batch_size: int = 1,
    progress: bool = True,
    mlp: bool = False,
    sensitivity_projections: tuple[str, ...] = (),
    sensitivity_windows: int = 0,
    autocast: torch.dtype | None = None,
    gate_input: bool = True,
) -> CalibrationStats:
    """Run the calibration windows (N, T) through the original model and reduce the statistics
    (with `mlp`, also the MLP inputs' autocorrelations: gate/up's only with `gate_input`); with `autocast`, the
    forward (and backward) passes compute in that dtype (`device.calibration_autocast`), the statistics still
    summed in fp64.

    With `sensitivity_projections`, the first `sensitivity_windows` windows also measure the loss sensitivity
    of those projections (`sensitivity.LossGradients`, on `stats.sensitivity`): their forward pass, with the LM
    head and gradients, is the capture's, then one backward pass; the other windows run the decoder alone.
    `stats.sensitivity.seconds` is what the measurement added (the backward passes), `stats.seconds` the rest."""
    device = next(model.parameters()).device
    start = time.perf_counter()
    n = windows.shape[0]
    measured = min(sensitivity_windows, n) if sensitivity_projections else 0
    if mlp:
        adapter.check_mlp()
    sensitivity, backward_seconds = None, 0.0
    with (
        autocast_to(device, autocast),
        _Accumulator(adapter, n, device, mlp, gate_input=gate_input) as acc,
        progress_bar("Calibration", total=n, enabled=progress) as bar,
    ):
        if measured:
            with LossGradients(model, adapter, sensitivity_projections) as gradients, torch.enable_grad():
                for first in range(0, measured, batch_size):
                    batch = windows[first : min(first + batch_size, measured)].to(device)
                    acc.window_offset = first
                    logits = model(input_ids=batch, use_cache=False).logits
                    t = time.perf_counter()
                    gradients.backward(batch, logits)
                    del logits
                    backward_seconds += time.perf_counter() - t
                    bar.advance(len(batch))
            sensitivity = gradients.result(backward_seconds)
        for first in range(measured, n, batch_size):
            batch = windows[first : first + batch_size].to(device)
            acc.window_offset = first
            adapter.decoder(input_ids=batch, use_cache=False)  # no LM head: nothing here reads the logits
            bar.advance(len(batch))
    tokens = int(windows.numel())  # every position of every window reaches every projection's input
    acc.check_finite()
    for gram in acc.accumulators():
        token_mean(gram, tokens)
    for sums in acc.sums.values():
        sums.div_(tokens)
    return CalibrationStats(
        attn_autocorr=acc.grams["attn"],
        o_autocorr=acc.grams["o"],
        block_output_means=acc.means,
        tokens=tokens,
        windows=n,
        seconds=time.perf_counter() - start - backward_seconds,
        mlp_autocorr=acc.grams.get("mlp"),
        down_autocorr=acc.grams.get("down"),
        sensitivity=sensitivity,
        input_means=acc.sums,
        autocast=autocast,
    )


@torch.no_grad()
def collect_block_means(
    adapter: DecoderAdapter, windows: torch.Tensor, batch_size: int = 1, progress: bool = True
) -> tuple[torch.Tensor, float]:
    """The token-mean of every block's output per window, `(L, N, hidden)` fp32, and the seconds taken.

    `collect_statistics(...).block_output_means` by the same hooks, without what grouping does not need: the
    autocorrelations (fp64 Grams, ~40% of a CPU calibration) and the unembedding of every position (the decoder
    runs without the LM head). `inspect` uses it.
    """
    device = adapter.projection(0, "q_proj").weight.device
    start = time.perf_counter()
    n = windows.shape[0]
    with (
        _Accumulator(adapter, n, device, autocorrelations=False) as acc,
        progress_bar("Calibration (block outputs)", total=n, enabled=progress) as bar,
    ):
        for first in range(0, n, batch_size):
            acc.window_offset = first
            batch = windows[first : first + batch_size].to(device)
            adapter.decoder(input_ids=batch, use_cache=False)
            bar.advance(len(batch))
    return acc.means, time.perf_counter() - start
