"""What each GGML type costs llama.cpp to decode on this CPU, measured in llama.cpp itself, and the decode time a
file's types predict.

Decoding one token multiplies every matrix (the embedding excepted: a row lookup) by one activation vector, so a
step's time is a fixed part plus, per layer, the layer's own overhead (norms, attention over a short context, the
graph's dispatch) and each matrix's weights times its type's cost. The probe measures that in the installed
llama.cpp, through its whole CPU backend (repacked layouts, thread pool and all): llama-architecture GGUFs with the
model's own layer shape (`LayerShape`, from its file) and random weights, deep enough to stream from memory as a
model's matrices do (`probe_depths`). `BASE_TYPE` (F16) is timed at two depths, the slope its time per layer; every
other type is timed against `BASE_TYPE` at one depth, the difference over the weights it fills its cost beyond
F16's (a type that does not fill a matrix's rows, k-quants on 576-wide rows, leaves that matrix F16 in both). Each
type's cost is thus its layer time per weight, the layer's overhead spread over its weights, so that Σ weights ×
cost over a file's matrices is its per-layer time whatever mix of types its layers hold: what the ratio of two
files of one model needs. The step's fixed part (sampling over the vocabulary, the embedding) is the same for two
files of one model and left out.

Timings on a shared machine drift by more than the differences between types, so every measurement is a difference
between files timed in turns (`fastest_in_turns`), over `PROBE_ROUNDS` fresh loads of which the median is kept
(`timed_in_turns`). Tens of seconds per type on the bundled model's shape at one thread, measured once and cached
per CPU, llama.cpp build, layer shape and thread count (`~/.cache/masa-compress/decode-cost/`)."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import os
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from compressor.runtime.cache_root import CpuShared, atomic_write_bytes, cache_dir, measured_once
from compressor.runtime.device import cpu_name
from compressor.runtime.errors import UserError

COST_FORMAT = 5
#: The bytes of matrices the shallower probe holds at least: beyond the CPU's caches, as a model's are.
PROBE_BYTES = 64 << 20
#: Tokens decoded per timed call, and the calls of which the fastest is kept.
PROBE_TOKENS = 64
PROBE_REPEATS = 7
#: Rounds of loading and timing each measurement's probes afresh, of which the median is kept.
PROBE_ROUNDS = 3
#: What the probes decode from (byte tokens).
PROMPT = [65, 66, 67, 68]
#: The type that fills every row (its block is one value): the probe's matrices another type cannot fill.
BASE_TYPE = "F16"


@dataclass(frozen=True)
class LayerShape:
    """One decoder layer's matrices, as llama.cpp stores them (rows = outputs)."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int

    def matrices(self) -> dict[str, tuple[int, int]]:
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return {
            "attn_q": (q, self.hidden), "attn_k": (kv, self.hidden), "attn_v": (kv, self.hidden),
            "attn_output": (self.hidden, q), "ffn_gate": (self.intermediate, self.hidden),
            "ffn_up": (self.intermediate, self.hidden), "ffn_down": (self.hidden, self.intermediate),
        }  # fmt: skip

    @property
    def weights(self) -> int:
        return sum(rows * cols for rows, cols in self.matrices().values())

    def fits(self, type_name: str) -> dict[str, bool]:
        """Which matrices `type_name`'s blocks fill row by row."""
        import gguf

        block = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]][0]
        return {name: cols % block == 0 for name, (_, cols) in self.matrices().items()}


def _library_origin() -> str:
    spec = importlib.util.find_spec("xllamacpp.xllamacpp")
    if spec is None or spec.origin is None:
        raise UserError("decode costs are measured in llama.cpp: pip install 'masa-compress[gguf]'")
    return spec.origin


def cost_key(origin: str, shape: LayerShape, threads: int) -> str:
    """This CPU, llama.cpp build, layer shape and thread count: what the measured costs belong to."""
    stat = os.stat(origin)
    spec = f"{COST_FORMAT}:{cpu_name()}:{origin}:{stat.st_size}:{stat.st_mtime_ns}:{asdict(shape)}:{threads}"
    return hashlib.sha256(spec.encode()).hexdigest()[:32]


def _blocks(shape: LayerShape, type_name: str) -> dict[str, tuple[str, np.ndarray]]:
    """One layer's matrices, random, in `type_name` where its blocks fill the rows (else `BASE_TYPE`)."""
    from compressor.quantize.ggml_quantize import quantize_with_llama_cpp

    rng = np.random.default_rng(0)
    fits = shape.fits(type_name)
    layer = {}
    for name, (rows, cols) in shape.matrices().items():
        array = (rng.standard_normal((rows, cols)) / math.sqrt(cols)).astype(np.float32)
        stored = type_name if fits[name] else BASE_TYPE
        if stored == "F32":
            layer[name] = (stored, array)
        elif stored == "F16":
            layer[name] = (stored, array.astype(np.float16))
        elif stored == "BF16":  # an original's own type, which ggml's quantizer does not write
            from gguf import GGMLQuantizationType, quants

            layer[name] = (stored, quants.quantize(array, GGMLQuantizationType.BF16))
        else:
            layer[name] = (stored, quantize_with_llama_cpp(array, stored, np.ones(cols, np.float32)))
    return layer


def write_probe(path: Path, shape: LayerShape, layer: dict[str, tuple[str, np.ndarray]], depth: int) -> None:
    """A llama GGUF of `depth` layers holding `layer`'s blocks each, a 256-token byte vocabulary, no output product
    to speak of: what llama.cpp decodes for the probe."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(PROBE_TOKENS + 16)
    writer.add_embedding_length(shape.hidden)
    writer.add_block_count(depth)
    writer.add_feed_forward_length(shape.intermediate)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_key_length(shape.head_dim)
    writer.add_value_length(shape.head_dim)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("llama")
    writer.add_token_list([f"<0x{i:02X}>" for i in range(256)])
    writer.add_token_types([6] * 256)  # byte tokens
    writer.add_token_scores([0.0] * 256)
    writer.add_add_bos_token(False)
    rng = np.random.default_rng(1)
    writer.add_tensor("token_embd.weight", rng.standard_normal((256, shape.hidden)).astype(np.float32))
    writer.add_tensor("output_norm.weight", np.ones(shape.hidden, np.float32))
    writer.add_tensor("output.weight", (rng.standard_normal((256, shape.hidden)) * 0.02).astype(np.float32))
    for index in range(depth):
        writer.add_tensor(f"blk.{index}.attn_norm.weight", np.ones(shape.hidden, np.float32))
        writer.add_tensor(f"blk.{index}.ffn_norm.weight", np.ones(shape.hidden, np.float32))
        for name, (stored, blocks) in layer.items():
            raw = None if stored in ("F16", "F32") else gguf.GGMLQuantizationType[stored]
            writer.add_tensor(f"blk.{index}.{name}.weight", blocks, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


class _Probe:
    """A probe file loaded in llama.cpp, written into `work` and removed on close."""

    def __init__(self, work: Path, shape: LayerShape, layer: dict, depth: int, threads: int):
        from compressor.evaluation.llama_cpp import LlamaCppServer

        self.depth = depth
        self.path = work / f"probe-{id(layer)}-{depth}.gguf"  # one file per layer's blocks and depth
        write_probe(self.path, shape, layer, depth)
        self.server = LlamaCppServer(self.path, PROBE_TOKENS + 16, threads=threads, embedding=False)
        self.server.complete(PROMPT, 4)  # warm-up: the first call pages the weights in

    def time(self) -> float:
        """Seconds per decoded token of one greedy call of `PROBE_TOKENS`."""
        return 1.0 / self.server.complete(PROMPT, PROBE_TOKENS)["timings"]["predicted_per_second"]

    def close(self) -> None:
        self.server.close()
        self.path.unlink(missing_ok=True)


def fastest_in_turns(probes: list[_Probe]) -> list[float]:
    """Each probe's fastest of `PROBE_REPEATS` calls, the probes called in turns: a slow spell of the machine falls
    on all of them alike, and the fastest call is the one it touched least."""
    times = [[] for _ in probes]
    for _ in range(PROBE_REPEATS):
        for index, probe in enumerate(probes):
            times[index].append(probe.time())
    return [min(t) for t in times]


def probe_depths(layer_bytes: int) -> tuple[int, int]:
    """Two depths, the shallower holding at least `PROBE_BYTES` of matrices, the deeper twice as many layers."""
    shallow = max(2, math.ceil(PROBE_BYTES / layer_bytes))
    return shallow, 2 * shallow


def layer_bytes(shape: LayerShape, type_name: str) -> int:
    """The bytes of one probe layer's matrices in `type_name` (`BASE_TYPE` where its blocks do not fill the rows):
    what `_blocks` holds, known without quantizing."""
    from compressor.quantize.ggml_quantize import row_bytes

    fits = shape.fits(type_name)
    return sum(
        rows * row_bytes(type_name if fits[name] else BASE_TYPE, cols)
        for name, (rows, cols) in shape.matrices().items()
    )


def timed_in_turns(work: Path, shape: LayerShape, layers_and_depths: list[tuple[dict, int]], threads: int):
    """Each probe's seconds per token: `PROBE_ROUNDS` rounds, each loading the probes afresh and keeping their
    fastest calls in turns (`fastest_in_turns`), and the median round per probe: a file that loaded into slow
    memory, or a minute the machine ran slow, moves one round, not the cost."""
    rounds = []
    for _ in range(PROBE_ROUNDS):
        probes = []
        try:
            for layer, depth in layers_and_depths:
                probes.append(_Probe(work, shape, layer, depth, threads))
            rounds.append(fastest_in_turns(probes))
        finally:
            for probe in probes:
                probe.close()
    return [float(np.median(times)) for times in zip(*rounds, strict=True)]


def measure_costs(
    shape: LayerShape, type_names, threads: int = 1, base_ns: float | None = None
) -> dict[str, float]:
    """Nanoseconds per weight of each of `type_names` in a layer of `shape`, its overhead spread over its weights.

    `BASE_TYPE`'s from the slope between two depths (or `base_ns`, measured before: every type's cost then stands on
    the same base); every other type's from the difference between its probe and `BASE_TYPE`'s at one depth, timed
    in turns (deep enough that both stream from memory), over the weights it fills: the matrices it does not fill
    are `BASE_TYPE` in both, and cancel."""
    types = [t for t in dict.fromkeys(type_names) if t != BASE_TYPE]
    fitted = {t: sum(r * c for n, (r, c) in shape.matrices().items() if shape.fits(t)[n]) for t in types}
    for type_name, weights in fitted.items():
        if not weights:
            raise UserError(f"{type_name} fills no matrix of this model's layers (rows of {shape.hidden})")
    with tempfile.TemporaryDirectory(prefix="masa-decode-cost-") as folder:
        work = Path(folder)
        base = _blocks(shape, BASE_TYPE)
        if base_ns is None:
            shallow, deep = probe_depths(layer_bytes(shape, BASE_TYPE))
            on_shallow, on_deep = timed_in_turns(work, shape, [(base, shallow), (base, deep)], threads)
            base_ns = (on_deep - on_shallow) / (deep - shallow) / shape.weights * 1e9
        base_cost = base_ns * 1e-9
        costs = {BASE_TYPE: base_ns}
        for type_name in types:
            layer = _blocks(shape, type_name)
            depth = probe_depths(layer_bytes(shape, type_name))[0]
            on_base, on_type = timed_in_turns(work, shape, [(base, depth), (layer, depth)], threads)
            costs[type_name] = (base_cost + (on_type - on_base) / depth / fitted[type_name]) * 1e9
    return costs


def decode_costs(type_names, shape: LayerShape, threads: int = 1, progress: bool = True) -> dict[str, float]:
    """Nanoseconds per weight for each of `type_names` in layers of `shape` on this CPU (measured once, then from
    the cache)."""
    from compressor.runtime.progress import note, progress_bar

    path = _cost_path(shape, threads)
    known = _read_json(path)
    missing = sorted(set(type_names) - set(known))
    if missing:
        note(f"Measuring llama.cpp's decode cost of {', '.join(missing)} on this CPU (once)", progress)
    with progress_bar("Decode cost per type", total=len(missing), enabled=progress and bool(missing)) as bar:
        for type_name in missing:  # each kept as measured: an interrupted run loses only the type it was on
            known |= measure_costs(shape, [type_name], threads, known.get(BASE_TYPE))  # on the cached base
            atomic_write_bytes(path, json.dumps(known, indent=1, sort_keys=True).encode())
            bar.advance(1)
    return {name: known[name] for name in type_names}


def _cost_path(shape: LayerShape, threads: int) -> Path:
    return cache_dir() / "decode-cost" / f"{cost_key(_library_origin(), shape, threads)}.json"


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def unmeasured_types(type_names, shape: LayerShape, threads: int = 1) -> list[str]:
    """Those of `type_names` whose cost this CPU has not measured for `shape` (what `decode_costs` would measure),
    `BASE_TYPE` first where it is among them or the others need it."""
    known = _read_json(_cost_path(shape, threads))
    missing = set(type_names) - set(known)
    if missing and BASE_TYPE not in known:
        missing.add(BASE_TYPE)  # every other type's cost stands on the base's slope
    return sorted(missing, key=lambda t: (t != BASE_TYPE, t))


@dataclass(frozen=True)
class ProbeTiming(CpuShared):
    """One `BASE_TYPE` probe at its shallower depth: its layers, the seconds it took to write, load and warm up, its
    seconds per decoded token (the faster of two calls), and the CPU's share the calls had."""

    layers: int
    load: float
    token: float
    cpu_share: float = 1.0


def probe_timing(shape: LayerShape, threads: int = 1) -> ProbeTiming:
    """What `measurement_seconds` prices a measurement by: a few seconds, once per CPU, llama.cpp build and shape
    (`cache_root.measured_once`: not kept when other work held the CPU)."""
    return measured_once(
        "decode-probe-",
        cost_key(_library_origin(), shape, threads),
        lambda: _time_probe(shape, threads),
        ProbeTiming,
    )


def _time_probe(shape: LayerShape, threads: int) -> ProbeTiming:
    depth = probe_depths(layer_bytes(shape, BASE_TYPE))[0]
    with tempfile.TemporaryDirectory(prefix="masa-decode-cost-") as folder:
        start = time.perf_counter()
        probe = _Probe(Path(folder), shape, _blocks(shape, BASE_TYPE), depth, threads)
        try:
            load = time.perf_counter() - start
            cpu, wall = time.process_time(), time.perf_counter()
            token = min(probe.time(), probe.time())
            share = min(1.0, (time.process_time() - cpu) / (time.perf_counter() - wall) / threads)
        finally:
            probe.close()
    return ProbeTiming(depth, load, token, share)


def measurement_seconds(type_names, shape: LayerShape, threads: int = 1, quantize_rate=None) -> float:
    """How long `decode_costs(type_names, ...)` will take to measure the types it has not (0: all cached). Each
    measurement loads its two probes `PROBE_ROUNDS` times and decodes `PROBE_REPEATS` calls of `PROBE_TOKENS` from
    each (`BASE_TYPE`'s two depths, every other type's probe beside `BASE_TYPE`'s at its depth), priced by
    `probe_timing`: a probe's loading by its bytes, its decoding by its layers (a type's decode cost per weight
    stands within 2x of `BASE_TYPE`'s at one thread, where bytes would price a 4-bit type 4x cheaper); and
    quantizes one layer in the type at `quantize_rate(type)` weights a second (None: not priced)."""
    missing = unmeasured_types(type_names, shape, threads)
    if not missing:
        return 0.0
    timing, base = probe_timing(shape, threads), layer_bytes(shape, BASE_TYPE)
    per_layer = PROBE_REPEATS * PROBE_TOKENS * timing.token / timing.layers
    per_byte = timing.load / (timing.layers * base)  # the timed probe's bytes
    seconds = 0.0
    for type_name in missing:
        if type_name == BASE_TYPE:
            probes = [(depth, depth * base) for depth in probe_depths(base)]
        else:
            depth = probe_depths(layer_bytes(shape, type_name))[0]
            probes = [(depth, depth * base), (depth, depth * layer_bytes(shape, type_name))]
        seconds += PROBE_ROUNDS * sum(d * per_layer + b * per_byte for d, b in probes)
        if quantize_rate is not None:
            seconds += shape.weights / quantize_rate(type_name)
    return seconds


def decode_seconds(matrices: dict[str, tuple[str, int]], costs: dict[str, float]) -> float:
    """Predicted seconds per decoded token, the fixed part left out: Σ weights × cost over `matrices` (name →
    (type, weights)); the token embedding is a row lookup in decode, not a product, and costs nothing here."""
    return sum(
        weights * costs[type_name] * 1e-9
        for name, (type_name, weights) in matrices.items()
        if name != "token_embd.weight"
    )


def file_matrices(path: str | os.PathLike) -> dict[str, tuple[str, int]]:
    """A GGUF's matrices: name → (GGML type, weights); with a tied output (no `output.weight`), the embedding is
    the output product and counts under that name."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    matrices = {
        t.name: (t.tensor_type.name, int(np.prod(t.shape)))
        for t in reader.tensors
        if len(t.shape) >= 2 and not t.name.startswith("rope_freqs")
    }
    if "output.weight" not in matrices and "token_embd.weight" in matrices:
        matrices["output.weight"] = matrices["token_embd.weight"]
    return matrices


def file_layer_shape(path: str | os.PathLike) -> LayerShape:
    """The widest layer of a GGUF (per-layer widths and head counts: the largest), from its metadata."""
    import gguf

    fields = gguf.GGUFReader(str(path)).fields
    arch = fields["general.architecture"].contents()

    def widest(key: str, default=None) -> int:
        if f"{arch}.{key}" not in fields:
            return default
        value = fields[f"{arch}.{key}"].contents()
        return int(max(value) if isinstance(value, list) else value)

    hidden, heads = widest("embedding_length"), widest("attention.head_count")
    return LayerShape(
        hidden=hidden, heads=heads, kv_heads=widest("attention.head_count_kv", heads),
        head_dim=widest("attention.key_length", hidden // heads), intermediate=widest("feed_forward_length"),
    )  # fmt: skip


def matrices_layer_shape(matrices: list[tuple], geometry) -> LayerShape:
    """The widest layer of a file about to be written (`write_gguf`'s matrices: GGUF name, array, ...; rows =
    outputs): its query and KV rows and MLP width read from its matrices where they stand apart, else from the
    config's `geometry` (`adapters.ProjectionGeometry`; Phi-3's fused `attn_qkv`): what its decode costs are
    measured on, in the probe's llama architecture."""
    widest = {"attn_q": 0, "attn_k": 0, "ffn_down": 0}
    for name, array, *_ in matrices:
        role = name.split(".")[2] if name.startswith("blk.") else None
        if role in widest:  # rows for the attention's, the row length (its input width) for the MLP's
            widest[role] = max(widest[role], array.shape[1] if role == "ffn_down" else array.shape[0])
    head_dim = geometry.head_dim
    shape = LayerShape(
        hidden=geometry.hidden_size, heads=widest["attn_q"] // head_dim or geometry.num_heads,
        kv_heads=widest["attn_k"] // head_dim or geometry.num_kv_heads, head_dim=head_dim,
        intermediate=widest["ffn_down"] or geometry.intermediate_size,
    )  # fmt: skip
    if not shape.intermediate:
        raise UserError("--speed: a mixture of experts' decode cost is not measured: drop --speed")
    return shape


def predicted_decode_seconds(path: str | os.PathLike, threads: int = 1, progress: bool = False) -> float:
    matrices = file_matrices(Path(path))
    costs = decode_costs({t for t, _ in matrices.values()}, file_layer_shape(path), threads, progress)
    return decode_seconds(matrices, costs)
