"""`write_gguf`: a model of plain projections (the original, or one compressed to engine-native forms: narrower
MLPs, fewer heads) as a GGUF file that llama.cpp runs as it is.

The architecture written follows the shapes: llama.cpp's own (`llama`, `qwen2`) when every layer has the same
MLP width and head counts, `deci` (the DeciLM / Nemotron-NAS layout, whose MLP width and head counts are arrays
with one entry per layer under the same tensor names) when they differ. The tokenizer and chat template are
copied from a GGUF of the source model (the packaged models are GGUFs; a user's GGUF is one), or converted from a
Hugging Face folder's tokenizer as llama.cpp's converter converts it (`gguf_tokenizer.py`).

Weights go through `gguf`'s pure-Python writer. Matrices are stored in the requested type; where a matrix's
rows do not fill whole quantization blocks (q8_0/q5_0/q4_0: 32 values) it falls back to f16, and every such
tensor is listed in the result. llama.cpp's mixes (q2_k ... q6_k, the i-quants) are quantized by llama.cpp's own
code, with `llama-quantize`'s choice of type per tensor and its fallbacks (`ggml_quantize.py`). With importance
weights (`importance`: the tool's own imatrix, `quantize/importance.py`) every quantized matrix goes through
llama.cpp's quantizer with its vector, as `llama-quantize --imatrix` quantizes it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import numpy as np
import torch
from torch import nn

from compressor.checkpoint import gguf_families as fam
from compressor.checkpoint.gguf_file import gguf_writer
from compressor.checkpoint.gguf_tokenizer import tokenizer_fields as tokenizer_fields_of
from compressor.modeling.adapters import geometry_from_config, get_adapter
from compressor.modeling.families import FAMILIES
from compressor.quantize.ggml_quantize import K_QUANT_MIXES, needs_imatrix, padded, quantize_with_llama_cpp
from compressor.quantize.gguf_types import (
    GGUF_TYPES,
    check_gguf_type,
    check_some_matrix_fits,
    dominant_file_type,
    matrix_types,
    type_counts,
)
from compressor.quantize.rounding import Rounder
from compressor.runtime.errors import UserError

# model_type → llama.cpp architecture when all layers share their shapes; Q/K rows are permuted for those whose
# rope rotates interleaved pairs (`gguf_families.PERMUTED_ROPE`; transformers rotates halves, as `qwen2` does).
UNIFORM_ARCHITECTURE = {name: family.llama_cpp for name, family in FAMILIES.items() if family.llama_cpp}
PER_LAYER_ARCHITECTURE = "deci"


@dataclass
class GgufExport:
    """What a GGUF export wrote: the file, its architecture, and each matrix that could not take the type."""

    path: Path
    architecture: str
    tensor_type: str
    bytes: int
    parameters: int
    fallbacks: dict[str, str] = field(default_factory=dict)  # tensor name → the type it was stored in
    types: dict[str, str] = field(
        default_factory=dict
    )  # every matrix's name → the GGML type it was stored in
    imatrix: str = "none"  # where the importance weights came from, or none
    mlp_widths: list[int] = field(default_factory=list)
    heads: list[int] = field(default_factory=list)
    kv_heads: list[int] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {
            "architecture": self.architecture,
            "type": self.tensor_type,
            "bytes": self.bytes,
            "parameters": self.parameters,
            "fallbacks": dict(self.fallbacks),
            "type_counts": type_counts(self.types),
            "imatrix": self.imatrix,
            "mlp_widths": list(self.mlp_widths),
            "heads": list(self.heads),
            "kv_heads": list(self.kv_heads),
        }


def check_gguf_output(out: str | os.PathLike, overwrite: bool) -> Path:
    """The output path, or a one-line error: it exists (without `overwrite`), or its name does not end in .gguf."""
    out = Path(out)
    if out.exists() and not overwrite:
        raise UserError(f"{out}: already exists: pass --overwrite or choose another path")
    if out.suffix != ".gguf":
        raise UserError(f"{out}: a GGUF file's name ends in .gguf: choose OUT.gguf")
    return out


def layer_shapes(model: nn.Module) -> tuple[list[int], list[int], list[int]]:
    """Per layer: the MLP width, the query heads and the KV heads of a model of plain projections; a projection
    that is still low-rank or shared has no engine form and is a one-line error."""
    adapter = get_adapter(model)
    config = adapter.config
    head_dim = geometry_from_config(config).head_dim
    widths, heads, kv_heads = [], [], []
    for index in range(adapter.num_layers):
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            module = adapter.projection(index, name)
            if not isinstance(module, nn.Linear):
                raise UserError(
                    f"layer {index} {name} is {type(module).__name__} (not a plain projection): llama.cpp "
                    "runs whole heads only: compress with --native (or leave the attention out of --targets)"
                )
        if adapter.family.experts:  # experts kept whole: their width (experts x hidden x width)
            widths.append(int(adapter.mlp(index).experts.down_proj.shape[-1]))
        for name in () if adapter.family.experts else ("gate_proj", "up_proj", "down_proj"):
            if not isinstance(adapter.find_projection(index, name), nn.Linear):
                raise UserError(
                    f"layer {index} {name} is not a plain projection: llama.cpp runs narrower MLPs only: "
                    "compress with --native (or leave the MLP out of --targets)"
                )
        if not adapter.family.experts:
            widths.append(adapter.projection(index, "down_proj").in_features)
        heads.append(adapter.projection(index, "q_proj").out_features // head_dim)
        kv_heads.append(adapter.projection(index, "k_proj").out_features // head_dim)
    return widths, heads, kv_heads


def check_family_exports(model_type: str) -> None:
    """A one-line error for a family with no llama.cpp mapping."""
    if model_type not in UNIFORM_ARCHITECTURE:
        raise UserError(
            f"model_type '{model_type}': GGUF export is not implemented for it (it is for "
            f"{', '.join(UNIFORM_ARCHITECTURE)}): its tensor names and norms need their own llama.cpp mapping"
        )


def check_config_exports(config, budgeted: bool = False) -> None:
    """Every refusal `write_gguf` would make from the model's config alone, made before any weight is read or any
    statistic measured (the per-layer shapes are checked once the weights are there)."""
    check_family_exports(config.model_type)
    fam.check_exportable(config, config.num_hidden_layers, budgeted=budgeted)


def choose_architecture(model_type: str, widths: list[int], heads: list[int], kv_heads: list[int]) -> str:
    """llama.cpp's own architecture for the family when every layer has the same shapes, else `deci`."""
    check_family_exports(model_type)
    uniform = len(set(widths)) == 1 and len(set(heads)) == 1 and len(set(kv_heads)) == 1
    if not uniform and fam.per_layer_refusal(model_type):
        raise UserError(fam.per_layer_refusal(model_type))
    return UNIFORM_ARCHITECTURE[model_type] if uniform else PER_LAYER_ARCHITECTURE


def write_gguf(
    model: nn.Module,
    tokenizer: Path,
    out: str | os.PathLike,
    *,
    tensor_type: str = "f16",
    name: str = "",
    overwrite: bool = False,
    extra_fields: dict[str, str] | None = None,
    on_tensor: Callable[[str], None] | None = None,
    importance: Mapping[str, torch.Tensor] | None = None,
    imatrix_note: str = "",
    choose_types: Callable[[list[tuple[str, np.ndarray, str]], int, Callable], dict[str, str]] | None = None,
    rounding: Rounder | None = None,
) -> GgufExport:
    """Write `model` (plain projections, any per-layer widths and head counts) as a GGUF file at `out`,
    atomically (a temporary sibling renamed into place), with the tokenizer of `tokenizer` (a GGUF file, or a
    Hugging Face folder converted as llama.cpp's converter converts it: `gguf_tokenizer.py`) and the string fields
    `extra_fields` (e.g. the source model's name).

    `importance`: per module path (`model.layers.3.mlp.down_proj`), the mean square of each input column over
    calibration text (`quantize.importance`); every quantized matrix that has one is quantized by llama.cpp with
    it, and `imatrix_note` (the text and windows it came from) is recorded as `llama-quantize --imatrix` does.

    `choose_types`: given the matrices (GGUF name, fp32 array, module path) and the bytes of everything else
    (metadata, tokenizer, 1-D tensors, as written, padded), each matrix's GGML type (`byte_budget`): the file is
    then exactly those bytes plus the matrices' padded blocks; its third argument, a mix's type (`--speed mix`).

    `rounding`: given every matrix (GGUF name, fp32 array, module path, GGML type), the blocks of those it rounds
    itself (`quantize/rounding.py`, `--rounding compensated`); the others are rounded here."""
    tensor_type = check_gguf_type(tensor_type)
    out = check_gguf_output(out, overwrite)
    adapter = get_adapter(model)
    config = adapter.config
    fam.check_exportable(config, adapter.num_layers, budgeted=choose_types is not None)
    widths, heads, kv_heads = layer_shapes(model)
    architecture = choose_architecture(config.model_type, widths, heads, kv_heads)
    tokenizer_fields = tokenizer_fields_of(tokenizer)
    rope_factors = fam.llama3_rope_factors(config)
    file_type = (
        K_QUANT_MIXES[tensor_type].file_type if tensor_type in K_QUANT_MIXES else GGUF_TYPES[tensor_type][1]
    )
    check_some_matrix_fits(model, tensor_type)
    has_output = not bool(getattr(config, "tie_word_embeddings", False))
    experts = _experts(config) if adapter.family.experts else None
    mix_context = {"gqa": heads[0] // max(kv_heads[0], 1), "has_imatrix": importance is not None,
                   "n_expert": experts[0] if experts else 1}  # fmt: skip
    by_llama_cpp = tensor_type in K_QUANT_MIXES or importance is not None

    def field_writer():  # the file type as it stands when called
        return _field_writer(
            config, architecture, (widths, heads, kv_heads), file_type, name, tokenizer_fields, extra_fields,
            experts, None if importance is None else (len(importance), imatrix_note),
        )  # fmt: skip

    tensors = list(_gguf_tensors(model, architecture, heads, kv_heads, rope_factors))
    chosen: dict[str, str] = {}
    if choose_types is not None:  # the budget's types replace the --type mix (`export` passes f16)
        mix_type_of = partial(mix_stored_type, len(widths), has_output, mix_context)
        matrices = [t for t in tensors if t[1].ndim == 2]
        chosen = choose_types(matrices, fixed_bytes(field_writer(), architecture, tensors), mix_type_of)
        file_type = dominant_file_type(chosen, tensors)
        by_llama_cpp = True
    add_fields = field_writer()

    def type_of(tensor_name: str, array: np.ndarray) -> tuple[str, str]:
        if tensor_name in chosen:
            return chosen[tensor_name], chosen[tensor_name]
        return matrix_types(tensor_name, array, tensor_type, len(widths), has_output, mix_context)

    fallbacks, types, parameters = _write_file(
        out, architecture, add_fields, tensors, type_of, (importance, rounding), by_llama_cpp, on_tensor
    )
    return GgufExport(
        path=out, architecture=architecture, tensor_type=tensor_type, bytes=out.stat().st_size,
        parameters=parameters, fallbacks=fallbacks, types=types,
        imatrix=(imatrix_note or "calibration") if importance is not None else "none",
        mlp_widths=widths, heads=heads, kv_heads=kv_heads,
    )  # fmt: skip


def mix_stored_type(
    num_layers: int, has_output: bool, context: dict, tensor_name: str, array: np.ndarray, mix: str
) -> str:
    """The GGML type llama.cpp's `mix` stores this matrix in, quantized with importance weights."""
    return matrix_types(tensor_name, array, mix, num_layers, has_output, context | {"has_imatrix": True})[1]


def _field_writer(
    config, architecture, shapes, file_type, name, tokenizer_fields, extra_fields, experts, imatrix
):
    """The function that adds a file's key-values to a writer: header, family fields, tokenizer, `extra_fields`
    and, with `imatrix` (entries, where they came from), the importance weights' record."""

    def add_fields(writer) -> None:
        _write_header(writer, config, architecture, *shapes, file_type, name)
        fam.write_family_fields(writer, config, architecture, experts)
        for field_ in tokenizer_fields:
            field_.write(writer)
        for key, value in (extra_fields or {}).items():
            writer.add_string(key, value)
        if imatrix is not None:
            writer.add_string("quantize.imatrix.dataset", imatrix[1] or "masa-compress calibration")
            writer.add_int32("quantize.imatrix.entries_count", imatrix[0])

    return add_fields


def planned_fixed_bytes(model: nn.Module, tokenizer: Path, name: str = "", extra_fields=None) -> int:
    """The bytes of the GGUF `write_gguf` would write for `model` that no matrix's type changes (metadata,
    tokenizer, 1-D tensors, as its shapes are now): what a byte budget leaves to the matrices. No matrix is
    copied: their shapes are enough."""
    adapter = get_adapter(model)
    config = adapter.config
    widths, heads, kv_heads = layer_shapes(model)
    architecture = choose_architecture(config.model_type, widths, heads, kv_heads)
    experts = _experts(config) if adapter.family.experts else None
    add_fields = _field_writer(
            config, architecture, (widths, heads, kv_heads), "MOSTLY_F16", name, tokenizer_fields_of(tokenizer),
        extra_fields, experts, (1, ""),
    )  # fmt: skip
    rope_factors = fam.llama3_rope_factors(config)
    tensors = [  # a matrix's shape is all the metadata reads of it
        (tensor_name, array if array.ndim < 2 else np.broadcast_to(np.float32(0), array.shape), path)
        for tensor_name, array, path in _gguf_tensors(model, architecture, heads, kv_heads, rope_factors)
    ]
    return fixed_bytes(add_fields, architecture, tensors)


def _write_file(out: Path, architecture, add_fields, tensors, type_of, rounding, by_llama_cpp, on_tensor):
    """Write the GGUF at `out` through a temporary sibling renamed into place (nothing half-written is left):
    (fallbacks, every matrix's type, parameters). `rounding`: (the importance weights by module path, the
    `Rounder` or None)."""
    importance, rounder = rounding
    matrices = [(n, a, p, type_of(n, a)[1]) for n, a, p in tensors if a.ndim == 2]
    rounded = {} if rounder is None else rounder(matrices)
    fallbacks: dict[str, str] = {}
    types: dict[str, str] = {}
    parameters = 0
    import gguf

    with gguf_writer(out, architecture) as writer:
        add_fields(writer)
        for tensor_name, array, module_path in tensors:
            parameters += 0 if tensor_name.startswith("rope_freqs") else array.size  # a table, not weights
            wanted, stored = type_of(tensor_name, array)
            weights = None if importance is None else importance.get(module_path)
            if tensor_name in rounded:
                writer.add_tensor(
                    tensor_name, rounded[tensor_name], raw_dtype=gguf.GGMLQuantizationType[stored]
                )
            else:
                _store(writer, tensor_name, array, stored, by_llama_cpp=by_llama_cpp, importance=weights)
            if array.ndim >= 2:
                types[tensor_name] = stored
            if stored != wanted:
                fallbacks[tensor_name] = stored
            if on_tensor is not None:
                on_tensor(tensor_name)
    return fallbacks, types, parameters


def fixed_bytes(add_fields: Callable, architecture: str, tensors: list) -> int:
    """The bytes of a file that its matrices' types do not change: metadata, tokenizer, 1-D tensors (f32)."""
    return metadata_bytes(add_fields, architecture, tensors) + sum(
        padded(array.size * 4) for _, array, _ in tensors if array.ndim == 1
    )


def metadata_bytes(add_fields: Callable, architecture: str, tensors: list) -> int:
    """The padded bytes of a GGUF's header, key-values and tensor infos: written once to a scratch file (their
    size does not depend on the tensors' types, only on names and shapes)."""
    import tempfile

    import gguf

    with tempfile.TemporaryDirectory(prefix="masa-gguf-") as scratch:
        path = Path(scratch) / "header.gguf"
        writer = gguf.GGUFWriter(str(path), architecture)
        add_fields(writer)
        for tensor_name, array, _ in tensors:
            writer.add_tensor_info(tensor_name, array.shape, np.dtype(np.float32), array.size * 4)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        writer.close()
        return padded(path.stat().st_size, gguf.GGUF_DEFAULT_ALIGNMENT)


def _write_header(writer, config, architecture, widths, heads, kv_heads, file_type, name) -> None:
    import gguf

    uniform = architecture != PER_LAYER_ARCHITECTURE
    writer.add_name(name or getattr(config, "_name_or_path", "") or "masa-compress export")
    writer.add_block_count(len(widths))
    writer.add_context_length(int(getattr(config, "max_position_embeddings", 2048)))
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(widths[0] if uniform else widths)
    writer.add_head_count(heads[0] if uniform else heads)
    writer.add_head_count_kv(kv_heads[0] if uniform else kv_heads)
    head_dim = geometry_from_config(config).head_dim
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(fam.rope_dimensions(config, head_dim))
    writer.add_rope_freq_base(fam.rope_theta(config))
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    writer.add_vocab_size(config.vocab_size)
    writer.add_file_type(getattr(gguf.LlamaFileType, file_type))


def _experts(config) -> tuple[int, int]:
    """(experts per layer, experts per token) of a mixture of experts."""
    count = getattr(config, "num_local_experts", None) or config.num_experts
    return int(count), int(config.num_experts_per_tok)


def _gguf_tensors(
    model, architecture, heads, kv_heads, rope_factors
) -> Iterator[tuple[str, np.ndarray, str]]:
    """(GGUF name, fp32 array, module path) for every tensor llama.cpp reads, in transformers' order, Q/K rows
    permuted for the architectures whose rope rotates interleaved pairs (rows only: the columns, which importance
    weights describe, keep their order)."""
    import gguf

    adapter = get_adapter(model)
    arch = gguf.MODEL_ARCH[architecture.upper()]
    names = gguf.get_tensor_name_map(arch, len(adapter.layers))
    tied = bool(getattr(adapter.config, "tie_word_embeddings", False))
    if rope_factors is not None:
        yield gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight", rope_factors, ""
    yield from fam.rope_tensors(adapter.config, geometry_from_config(adapter.config).head_dim)
    for base, suffix, array, source in fam.family_state(model.state_dict(), adapter.model_type):
        if f"{base}.{suffix}" == "lm_head.weight" and tied:
            continue  # llama.cpp reads the embedding when the file has no output matrix
        if suffix == "inv_freq":
            continue
        if suffix in fam.EXPERT_TENSORS:
            yield fam.expert_tensor_name(suffix, _layer_index(base)), array, source
            continue
        gguf_name = names.get_name(base)
        if gguf_name is None:
            raise UserError(
                f"tensor {base}.{suffix}: no llama.cpp name for it in the {architecture} architecture"
            )
        if architecture in fam.PERMUTED_ROPE and base.endswith(("q_proj", "k_proj")):
            counts = heads if base.endswith("q_proj") else kv_heads
            array = fam.permute_for_rope(array, counts[_layer_index(base)])
        yield f"{gguf_name}.{suffix}", array, source


def _layer_index(module_path: str) -> int:
    parts = module_path.split(".")
    return int(parts[parts.index("layers") + 1])


def _store(
    writer, tensor_name: str, array: np.ndarray, type_name: str, by_llama_cpp: bool, importance=None
) -> None:
    """Add one tensor in GGML type `type_name`, quantized by llama.cpp's code (with its importance weights, if
    any) or by `gguf`'s."""
    import gguf
    from gguf import quants

    if needs_imatrix(tensor_name, type_name) and importance is None:
        raise UserError(
            f"{tensor_name}: its type {type_name} needs importance weights and none were measured for it: "
            "choose another --type"
        )
    if type_name == "F32":
        writer.add_tensor(tensor_name, np.ascontiguousarray(array, dtype=np.float32))
    elif type_name == "F16":
        writer.add_tensor(tensor_name, array.astype(np.float16))
    elif type_name == "BF16" or not by_llama_cpp:
        qtype = gguf.GGMLQuantizationType[type_name]
        writer.add_tensor(tensor_name, quants.quantize(array, qtype), raw_dtype=qtype)
    else:
        qtype = gguf.GGMLQuantizationType[type_name]
        weights = None if importance is None else np.asarray(importance, dtype=np.float32)
        rows = array.reshape(
            -1, array.shape[-1]
        )  # experts (3-D): every expert's rows, as llama.cpp quantizes
        blocks = quantize_with_llama_cpp(rows, type_name, weights)
        writer.add_tensor(tensor_name, blocks.reshape(*array.shape[:-1], -1), raw_dtype=qtype)
