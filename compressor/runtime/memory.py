"""What a compression run holds in memory at its peak, from the model's shapes and the run's settings alone (no
weight read): `plan` prints it, and `compress` refuses a run that cannot fit before it loads the model.

Two pipelines. In memory (`in_memory_peak`): the whole model, every layer's fp64 input autocorrelations, and the
largest of the passes (calibration, the loss sensitivity's backward pass, compression, evaluation with the
original reloaded beside the compressed model). `--layerwise` (`cpu_peak`, read off `api/layerwise.py`,
`statistics/layer_stream.py`, `modeling/offload.py`, `methods/offloaded_context.py`): one decoder layer and one
layer's statistics at a time. Every term is computed from shapes and settings; the one constant is the runtime's
base R0 (Python, torch, transformers, the tokenizer), measured. `benchmarks/report/memory_projection.py` checks both
against measured runs and projects them to Llama shapes.

Symbols: H hidden, A = heads·head_dim (q's output, o's input), K = kv_heads·head_dim, I intermediate, V vocabulary,
L layers; N×T calibration windows × tokens, S sensitivity windows, B = basis_layers (a run sharing a basis),
C×Tₑ an evaluation chunk (32 windows); d bytes per element of the model dtype (fp32 4, bf16 2); fp64 is 8.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from compressor.runtime.device import GRAM_BLOCK_COLUMNS

GIB = 1024**3
#: The evaluation's chunk of windows advanced together through the layers (`statistics.layer_stream.evaluate_layerwise`).
EVAL_CHUNK = 32
#: R0: the resident memory of the runtime before the model's weights (Python, torch, transformers, a tokenizer;
#: measured: 0.39-0.46 GiB once the bundled-width scaling runs were loaded, `benchmarks/results/results.json`).
RUNTIME_BASE = int(0.45 * GIB)


@dataclass(frozen=True)
class Shape:
    """A Llama-style decoder's shapes (`A`, `K` derived)."""

    name: str
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    layers: int
    vocab: int
    tied: bool

    @property
    def attn(self) -> int:  # A: q's output width, o's input width
        return self.heads * self.head_dim

    @property
    def kv(self) -> int:  # K: k's and v's output width
        return self.kv_heads * self.head_dim

    @classmethod
    def from_width(cls, width: dict, layers: int, name: str = "", tied: bool = True) -> Shape:
        """A benchmark width (a LlamaConfig's keywords; kv heads and head_dim derived where absent or None) at
        `layers` layers."""
        heads, hidden = width["num_attention_heads"], width["hidden_size"]
        return cls(
            name, hidden, heads, width.get("num_key_value_heads") or heads, width.get("head_dim") or hidden // heads,
            width["intermediate_size"], layers, width["vocab_size"], tied,
        )  # fmt: skip

    @classmethod
    def from_config(cls, config) -> Shape:
        """A transformers config's shapes."""
        return cls.from_width(
            config.to_dict(),
            config.num_hidden_layers,
            name=getattr(config, "model_type", ""),
            tied=bool(getattr(config, "tie_word_embeddings", False)),
        )

    def params(self) -> int:
        """Every parameter: the layers and the embeddings (and the untied head)."""
        return self.layers * self.layer_params() + self.non_layer_params()

    def layer_params(self) -> int:
        h = self.hidden
        return 2 * h * self.attn + 2 * h * self.kv + 3 * h * self.intermediate + 2 * h

    def non_layer_params(self) -> int:
        return (self.vocab * (1 if self.tied else 2) + 1) * self.hidden

    def target_params(self, mlp: bool) -> int:
        """One layer's compressed projections (q/k/v/o, and gate/up/down with MLP)."""
        attn = 2 * self.hidden * self.attn + 2 * self.hidden * self.kv
        return attn + (3 * self.hidden * self.intermediate if mlp else 0)

    def inputs(self, mlp: bool, gate_input: bool = True) -> list[int]:
        """The widths of the inputs whose autocorrelations are collected (q/k/v's, o's [, gate/up's, down's]:
        gate/up's only for a method that reads it, `capture.captured_inputs`)."""
        return (
            [self.hidden, self.attn]
            + ([self.hidden] if mlp and gate_input else [])
            + ([self.intermediate] if mlp else [])
        )


@dataclass(frozen=True)
class Workload:
    """What a run does: calibration N×T, S sensitivity windows, the targets, the dtype, the device."""

    windows: int
    seq_len: int
    sensitivity: int
    mlp: bool = False
    dtype_bytes: int = 4
    gpu: bool = False
    basis_layers: int = 4
    eval_seq_len: int = 0  # 0: no evaluation
    gate_input: bool = True  # with `mlp`: whether gate/up's input autocorrelation is collected
    # `--refit stream`: the calibration windows it reads (0: no stream refit)
    stream_refit: int = 0

    def inputs(self, shape: Shape) -> list[int]:
        """The widths of the inputs whose autocorrelations this run collects."""
        return shape.inputs(self.mlp, self.gate_input)


def activations(shape: Shape, seq_len: int, d: int) -> int:
    """One window's intermediate tensors inside one decoder layer (norms, q/k/v, attention output, MLP)."""
    h = shape.hidden
    return seq_len * d * (3 * h + 2 * shape.attn + 2 * shape.kv + 3 * shape.intermediate)


def svd_bytes(m: int, n: int) -> int:
    """fp64 thin SVD of an m×n matrix as `whitening.whitened_svd` runs it, the larger of its two paths: with
    n ≤ m the matrix, its whitened product, `M V` and U (4mn), the Gram, its eigenvectors, Vh and dsyevd's ≈2k²
    workspace and copy (≈6k²); else the matrix, its whitened product, LAPACK's working copy, U, Vh and dgesdd's
    ≈4k² workspace (4mn + 5k²)."""
    k = min(m, n)
    return 8 * (4 * m * n + 6 * k * k)


def _hook_copy(shape: Shape, w: Workload) -> int:
    """`capture.add_gram` on the widest input: two fp64 copies on the CPU; two fp32 copies, one block row of the
    fp32 product and its fp64 copy on a GPU."""
    widest = max(w.inputs(shape))
    if w.gpu:
        return 8 * w.seq_len * widest + 12 * min(widest, GRAM_BLOCK_COLUMNS) * widest
    return 16 * w.seq_len * widest


def phase_calibration(shape: Shape, w: Workload) -> int:
    grams = 8 * sum(n * n for n in w.inputs(shape))
    stream = w.windows * w.seq_len * shape.hidden * w.dtype_bytes
    return stream + grams + activations(shape, w.seq_len, w.dtype_bytes) + _hook_copy(shape, w)


def phase_sensitivity(shape: Shape, w: Workload) -> int:
    d, window = w.dtype_bytes, w.seq_len * shape.hidden * w.dtype_bytes
    head = w.seq_len * shape.vocab * (12 + d)
    per_layer = w.sensitivity * window + 2 * activations(shape, w.seq_len, d)
    return 2 * w.sensitivity * window + max(head, per_layer)


def largest_factored(shape: Shape, w: Workload) -> tuple[int, int]:
    """The largest matrix the basis form factors: a run's stacked k (or v), q, o, or an MLP projection."""
    run = min(w.basis_layers, shape.layers)
    candidates = [(run * shape.kv, shape.hidden), (shape.attn, shape.hidden), (shape.hidden, shape.attn)]
    if w.mlp:
        candidates.append((shape.intermediate, shape.hidden))
    return max(candidates, key=lambda mn: svd_bytes(*mn))


def cholesky_bytes(shape: Shape, w: Workload) -> int:
    """The work on the widest input's fp64 autocorrelation beside that matrix itself (which the layer's statistics
    count): the symmetrized copy that each damped attempt damps on its diagonal and the factor
    (`whitening.whitening_factor`); with the MLP's neurons, the most any step of them holds: 2.5 I×I matrices
    (measured beside the autocorrelation at I = 8960, hidden 1536, in I×I fp64 matrices: `neurons.order_tail`
    2.28 with a damped Cholesky, `neurons.refit_down` 2.47 at 99% of the neurons kept; the greedy-block order 1.50
    at I = 4000, the fp64 copy its float32 one is cast from. Before its matrices were symmetrized and damped in
    place the tail took 7.2, and the 1.5B model's layer 1 needs that damping). torch's profiler at I = 8960 puts
    the live tensors of the three at 1.50, 2.17 and 2.05 on the CPU. On a GPU 4: an H200 held 2.30 GiB beside
    the statistics, the embeddings, the head and one layer in the `--native --layerwise` run at the 1.5B shapes,
    3.85 I×I matrices (`benchmarks/results/gpu-native-layerwise.json`; which step holds the rest there was not
    isolated)."""
    per_input = (4 if w.gpu else 2.5) if w.mlp else 2
    return int(8 * per_input * max(w.inputs(shape)) ** 2)


def stream_refit_bytes(shape: Shape, w: Workload, copied_layers: int | None = None) -> int:
    """`--refit stream`: the copy of the original decoder layers (`copied_layers`, all of them in memory; with
    `--layerwise` the one onloaded beside the compressed layer), the two streams and the
    layer's outputs on the original one (four N×T×H tensors over the windows it reads), with MLP targets what
    down_proj's refit keeps to advance the stream without another pass (the stream after the attention and
    down_proj's input, N×T×(H + I)), one window's activations, and the widest refit input's fp64 moments (x xᵀ and
    t xᵀ). Measured on an H200 at the 1.5B shapes before down_proj's inputs were kept: its run's peak allocated
    was 2.43 GiB above the default's, about the copy's 2.44 (`benchmarks/results/gpu-native-stream.json`,
    `gpu.json`; the native run without it was not measured there)."""
    if not w.stream_refit:
        return 0
    copy = (shape.layers if copied_layers is None else copied_layers) * shape.layer_params() * w.dtype_bytes
    tokens = w.stream_refit * w.seq_len
    streams = 4 * tokens * shape.hidden * w.dtype_bytes
    kept = tokens * (shape.hidden + shape.intermediate) * w.dtype_bytes if w.mlp else 0
    widest = shape.intermediate if w.mlp else shape.attn
    moments = 8 * widest * (widest + shape.hidden)
    return copy + streams + kept + activations(shape, w.seq_len, w.dtype_bytes) + moments


def phase_compress(shape: Shape, w: Workload) -> int:
    inputs = w.inputs(shape)
    run = min(w.basis_layers, shape.layers)
    held = w.sensitivity * w.seq_len * shape.hidden * w.dtype_bytes
    held += run * shape.target_params(w.mlp) * w.dtype_bytes + 8 * sum(n * n for n in inputs)
    work = max(
        8 * (run + 5) * shape.hidden**2, cholesky_bytes(shape, w), svd_bytes(*largest_factored(shape, w))
    )
    return held + work


def phase_evaluation(shape: Shape, w: Workload) -> int:
    if not w.eval_seq_len:
        return 0
    d, t = w.dtype_bytes, w.eval_seq_len
    held = w.sensitivity * w.seq_len * shape.hidden * d
    return (
        held + 2 * EVAL_CHUNK * t * shape.hidden * d + activations(shape, t, d) + t * shape.vocab * (12 + d)
    )


def phases(shape: Shape, w: Workload) -> dict[str, int]:
    return {
        "calibration": phase_calibration(shape, w),
        "sensitivity": phase_sensitivity(shape, w),
        "compress": phase_compress(shape, w),
        "evaluation": phase_evaluation(shape, w),
        "stream_refit": stream_refit_bytes(shape, w, copied_layers=1),
    }


def block_means(shape: Shape, w: Workload) -> int:
    return 4 * shape.layers * w.windows * shape.hidden


def overhead(shape: Shape, w: Workload) -> int:
    """On the CPU: the peak minus the loaded state (R0). The non-layer weights count here: loading maps them
    from the safetensors file, and they become resident at the first pass (measured: the loaded state of the
    bundled width is within 20 MiB of the narrow one's, whose embeddings weigh nothing)."""
    held = (shape.non_layer_params() + shape.layer_params()) * w.dtype_bytes + block_means(shape, w)
    return held + max(phases(shape, w).values())


def device_peak(shape: Shape, w: Workload) -> int:
    """On a GPU: the device's peak (allocated tensors; the CUDA context and the allocator's cache come on top)."""
    held = (shape.non_layer_params() + shape.layer_params()) * w.dtype_bytes
    return held + max(phases(shape, w).values())


def host_peak_with_gpu(shape: Shape, w: Workload, runtime: float) -> float:
    """On a GPU: the host's peak: R0, the means, and the largest tensor on its way to or from disk."""
    d, run = w.dtype_bytes, min(w.basis_layers, shape.layers)
    transit = [
        8 * sum(n * n for n in w.inputs(shape)),  # a layer's autocorrelations being written
        w.sensitivity * w.seq_len * shape.hidden * d,  # the sensitivity windows' inputs being written
        run * shape.target_params(w.mlp) * d,  # a run's factors being spilled
        max(m * n for m, n in [(shape.intermediate, shape.hidden), (shape.attn, shape.hidden)]) * d,
        EVAL_CHUNK * w.eval_seq_len * shape.hidden * d,  # the original's outputs of a chunk being written
    ]
    return runtime + block_means(shape, w) + max(transit)


def cpu_peak(shape: Shape, w: Workload, runtime: float) -> float:
    """`--layerwise` on the CPU: the runtime, then what the layer-by-layer pipeline holds at its peak."""
    return runtime + overhead(shape, w)


def grams_all_layers(shape: Shape, w: Workload) -> int:
    """In memory: every layer's fp64 input autocorrelations, held from the calibration to the end of compression."""
    return 8 * shape.layers * sum(n * n for n in w.inputs(shape))


def attention_scores(shape: Shape, seq_len: int, d: int) -> int:
    """One window's attention probabilities in one layer (kept for the backward pass)."""
    return shape.heads * seq_len * seq_len * d


def in_memory_phases(shape: Shape, w: Workload) -> dict[str, int]:
    """In memory, on top of the runtime, the weights and every layer's autocorrelations: each pass's own peak.

    - calibration: one window through one layer at a time, plus the hook's copies of its input;
    - sensitivity: one window's backward pass through the whole model (every layer's activations and attention
      probabilities kept for it) and its logits through the head;
    - compress: the largest factorization (SVD or Cholesky of the widest input, fp64);
    - evaluation: the original reloaded beside the compressed model, both models' log-probabilities of a window.
    """
    d, t = w.dtype_bytes, w.seq_len
    act = activations(shape, t, d)
    head = t * shape.vocab * (12 + d)
    parts = {
        "calibration": act + _hook_copy(shape, w),
        "sensitivity": (shape.layers * (act + attention_scores(shape, t, d)) + head) if w.sensitivity else 0,
        "compress": max(cholesky_bytes(shape, w), svd_bytes(*largest_factored(shape, w))),
        "evaluation": 0,
        "stream_refit": stream_refit_bytes(shape, w),
    }
    if w.eval_seq_len:
        te = w.eval_seq_len
        parts["evaluation"] = shape.params() * d + 2 * te * shape.vocab * (12 + d) + activations(shape, te, d)
    return parts


def in_memory_peak(shape: Shape, w: Workload, runtime: float = RUNTIME_BASE) -> float:
    """In memory on the CPU: R0 + the weights + every layer's autocorrelations + the largest pass."""
    held = shape.params() * w.dtype_bytes + grams_all_layers(shape, w)
    return runtime + held + max(in_memory_phases(shape, w).values())


def conversion_peak(shape: Shape, gguf_bytes: int, runtime: float = RUNTIME_BASE) -> float:
    """A packaged model's one-time conversion to safetensors (`api.model_loading.bundled_model_dir`), before its
    first run: transformers dequantizes the whole memory-mapped GGUF into an fp32 model, one tensor passing
    through a dequantization buffer of its own size (the largest is the vocabulary's). Measured: 1.16 GiB for the
    bundled 135M model (this gives 1.15); at least 8.7 GiB for the 1.5B one (this gives 9.0)."""
    return runtime + 4 * shape.params() + gguf_bytes + 4 * shape.vocab * shape.hidden


#: A container's memory limit, use, and statistics (cgroup v2, then v1; the key of its reclaimable page cache):
#: /proc/meminfo shows the host's memory there.
CGROUP_FILES = (
    ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current", "/sys/fs/cgroup/memory.stat", "inactive_file"),
    ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes",
     "/sys/fs/cgroup/memory/memory.stat", "total_inactive_file"),
)  # fmt: skip


def _field(path: str, key: str) -> int | None:
    """The number after `key` on its line of a `key value [unit]` file (/proc/meminfo, a cgroup's memory.stat),
    or None where the file or the key is absent."""
    try:
        with open(path) as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 2 and parts[0] == key:
                    return int(parts[1])
    except (OSError, ValueError):
        pass
    return None


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):  # absent, or "max": no limit
        return None


def available_memory() -> int | None:
    """Bytes this process can still take without swapping: Linux's `MemAvailable`, lowered to what a container's
    memory limit leaves; elsewhere the physical memory; None where nothing can be read."""
    available_kib = _field("/proc/meminfo", "MemAvailable:")
    available = None if available_kib is None else available_kib * 1024
    for limit_file, usage_file, stat_file, reclaimable in CGROUP_FILES:
        limit, usage = _read_int(limit_file), _read_int(usage_file)
        if limit is not None and usage is not None and limit < 2**60:  # v1 writes "no limit" as ~2^63
            left = max(limit - usage + (_field(stat_file, reclaimable) or 0), 0)
            available = left if available is None else min(available, left)
            break
    if available is not None:
        return available
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
