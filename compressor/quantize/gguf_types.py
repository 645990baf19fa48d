"""What type each GGUF matrix takes: the `--type` values (the float and legacy types `gguf` writes, llama.cpp's mixes
of `ggml_quantize.py`), when importance weights apply (`--imatrix`), and each matrix's type in a file of one type."""

from __future__ import annotations

import json
import os

import numpy as np
from torch import nn

from compressor.quantize.ggml_quantize import (
    K_QUANT_FALLBACK,
    K_QUANT_MIXES,
    NEEDS_IMATRIX,
    check_quantizer,
    fitting_type,
    ggml_block,
    mix_type,
)
from compressor.runtime.errors import UserError

# --type → (the GGUF tensor type of a matrix, `general.file_type`); 1-D tensors (norms, biases) stay f32 always.
GGUF_TYPES = {
    "f32": ("F32", "ALL_F32"),
    "f16": ("F16", "MOSTLY_F16"),
    "bf16": ("BF16", "MOSTLY_BF16"),
    "q8_0": ("Q8_0", "MOSTLY_Q8_0"),
    "q5_0": ("Q5_0", "MOSTLY_Q5_0"),
    "q4_0": ("Q4_0", "MOSTLY_Q4_0"),
}
# llama.cpp types whose per-tensor rules are not written here: its `llama-quantize` makes them.
OTHER_K_QUANTS = ("q2_k_s", "q4_1", "q5_1", "iq3_xs", "iq2_s", "iq2_m", "iq1_s", "iq1_m")
#: The --type values whose matrices take fewer than 8 bits: importance weights change their blocks (q8_0 ignores them).
BELOW_8_BITS = ("q5_0", "q4_0", *K_QUANT_MIXES)
FALLBACK_TYPE = "F16"


def type_counts(types: dict[str, str]) -> dict[str, int]:
    """How many matrices each GGML type holds, most first."""
    counts: dict[str, int] = {}
    for type_name in types.values():
        counts[type_name] = counts.get(type_name, 0) + 1
    return dict(sorted(counts.items(), key=lambda item: (-item[1], item[0])))


def check_gguf_type(tensor_type: str) -> str:
    """The `--type` value, lower-cased, or a one-line error naming the types there are."""
    name = tensor_type.lower()
    choices = ", ".join([*GGUF_TYPES, *K_QUANT_MIXES])
    if name in OTHER_K_QUANTS:
        raise UserError(
            f"--type {name}: not written by this tool: export --type f16, then run llama.cpp's "
            f"`llama-quantize OUT.gguf OUT-{name}.gguf {name.upper()}`; or choose one of {choices}"
        )
    if name in K_QUANT_MIXES:
        check_quantizer()
    elif name not in GGUF_TYPES:
        raise UserError(f"--type {tensor_type}: unknown GGUF type: choose one of {choices}")
    return name


IMATRIX_CHOICES = ("calibration", "none")


def check_imatrix(tensor_type: str, imatrix: str | None) -> bool:
    """Whether the export weighs its quantization by importance (`--imatrix`: `calibration`, `none`, or llama.cpp's
    importance file; None: `calibration` for every type below 8 bits, `none` for the others), or a one-line error
    where the choice cannot apply."""
    if imatrix is None:
        return tensor_type in BELOW_8_BITS
    if imatrix not in IMATRIX_CHOICES and not is_imatrix_path(imatrix):
        raise UserError(
            f"--imatrix {imatrix}: unknown: choose calibration, none, or an importance file (FILE.gguf, FILE.dat)"
        )
    if imatrix != "none" and tensor_type not in BELOW_8_BITS:
        raise UserError(
            f"--imatrix {imatrix}: --type {tensor_type} does not use importance weights (only the types below "
            "8 bits do): drop --imatrix"
        )
    if (
        imatrix == "none"
        and tensor_type in K_QUANT_MIXES
        and K_QUANT_MIXES[tensor_type].base in NEEDS_IMATRIX
    ):
        raise UserError(
            f"--imatrix none: --type {tensor_type} needs importance weights (llama.cpp refuses it without them): "
            "drop --imatrix none"
        )
    return imatrix != "none"


def is_imatrix_path(imatrix: str | None) -> bool:
    """Whether `--imatrix` names a file (llama.cpp's importance file) rather than `calibration` or `none`."""
    return (
        imatrix is not None
        and imatrix not in IMATRIX_CHOICES
        and ("/" in imatrix or imatrix.endswith((".gguf", ".dat")) or os.path.exists(imatrix))
    )


def block_size(tensor_type: str) -> int:
    """Values per block of a `--type` (1 for the float types); of a llama.cpp mix, of its fallback for rows that
    do not fill its 256-value blocks (32), since those matrices still take a quantized type."""
    if tensor_type in K_QUANT_MIXES:
        base = K_QUANT_MIXES[tensor_type].base
        return ggml_block(K_QUANT_FALLBACK.get(base, base))
    return ggml_block(GGUF_TYPES[tensor_type][0])


def check_some_matrix_fits(model: nn.Module, tensor_type: str) -> None:
    """A quantized type that no matrix of the model can take (no row a whole number of blocks) is refused
    before anything is written: every matrix would be f16, and the file would not be what was asked."""
    block = block_size(tensor_type)
    rows = {p.shape[-1] for p in model.parameters() if p.ndim == 2}
    if block > 1 and not any(length % block == 0 for length in rows):
        raise UserError(
            f"--type {tensor_type}: no matrix of this model has rows of a multiple of {block} values (its "
            f"blocks): every one would be stored f16: choose --type f16"
        )


#: The `general.file_type` a budgeted file names, by the type holding most of its matrices' values.
FILE_TYPE_OF = {
    "Q2_K": "MOSTLY_Q2_K", "Q3_K": "MOSTLY_Q3_K_M", "Q4_K": "MOSTLY_Q4_K_M", "Q5_K": "MOSTLY_Q5_K_M",
    "Q6_K": "MOSTLY_Q6_K", "Q8_0": "MOSTLY_Q8_0", "Q4_0": "MOSTLY_Q4_0", "Q4_1": "MOSTLY_Q4_1",
    "Q5_0": "MOSTLY_Q5_0", "Q5_1": "MOSTLY_Q5_1", "IQ4_NL": "MOSTLY_IQ4_NL", "IQ4_XS": "MOSTLY_IQ4_XS",
    "IQ3_S": "MOSTLY_IQ3_S", "IQ3_XXS": "MOSTLY_IQ3_XXS", "IQ2_XS": "MOSTLY_IQ2_XS", "F16": "MOSTLY_F16",
}  # fmt: skip


def dominant_file_type(chosen: dict[str, str], tensors: list) -> str:
    values: dict[str, int] = {}
    for tensor_name, array, _ in tensors:
        if tensor_name in chosen:
            values[chosen[tensor_name]] = values.get(chosen[tensor_name], 0) + array.size
    return FILE_TYPE_OF[max(values, key=values.get)] if values else "MOSTLY_F16"


def matrix_types(
    tensor_name: str,
    array: np.ndarray,
    tensor_type: str,
    num_layers: int,
    has_output: bool,
    mix_context: dict,
):
    """(the type `--type` asks of this tensor, the type it is stored in): 1-D tensors are f32 always; a matrix
    whose rows do not fill whole blocks falls back (f16, or llama.cpp's fallback in a llama.cpp mix)."""
    if array.ndim == 1 or ".ffn_gate_inp." in tensor_name:  # llama.cpp never quantizes an MoE's router
        return "F32", "F32"
    row_length = array.shape[-1]
    if tensor_type in K_QUANT_MIXES:
        wanted = mix_type(
            tensor_name, tensor_type, num_layers, has_output, row_length=row_length, **mix_context
        )
        return wanted, fitting_type(tensor_name, wanted, row_length, has_output)
    wanted = GGUF_TYPES[tensor_type][0]
    return wanted, wanted if row_length % ggml_block(wanted) == 0 else FALLBACK_TYPE


def describe_gguf(path) -> dict:
    """What a GGUF file holds (its tensor infos and metadata; no tensor data is read): the architecture, the file
    type, each matrix's GGML type by layer and how many took each, where its importance weights came from."""
    from pathlib import Path

    import gguf

    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: no such GGUF file")
    try:
        reader = gguf.GGUFReader(str(path))
    except (ValueError, OSError) as err:
        raise UserError(f"{path}: not a readable GGUF file ({err})") from None
    fields = reader.fields

    def field(name: str):
        return fields[name].contents() if name in fields else None

    types = {t.name: t.tensor_type.name for t in reader.tensors if len(t.shape) == 2}
    by_layer: dict[int, dict[str, str]] = {}
    for tensor_name, type_name in types.items():
        if tensor_name.startswith("blk."):
            _, layer, role = tensor_name.split(".")[:3]
            by_layer.setdefault(int(layer), {})[role] = type_name
    for tensor in reader.tensors:  # the layer's shapes: its MLP's width, its query heads (ggml: ne0 = a row)
        if tensor.name.startswith("blk.") and tensor.name.split(".")[2] in ("ffn_up", "attn_q"):
            layer, role = int(tensor.name.split(".")[1]), tensor.name.split(".")[2]
            key = "mlp_width" if role == "ffn_up" else "q_rows"
            by_layer.setdefault(layer, {})[key] = int(tensor.shape[1])
    file_type = field("general.file_type")
    return {
        "path": str(path.resolve()),
        "bytes": path.stat().st_size,
        "architecture": field("general.architecture"),
        "name": field("general.name"),
        "file_type": gguf.LlamaFileType(file_type).name if file_type is not None else None,
        "parameters": int(
            sum(int(np.prod(t.shape)) for t in reader.tensors if not t.name.startswith("rope_freqs"))
        ),
        "imatrix": field("quantize.imatrix.dataset") or "none",
        "structure": json.loads(field("masa_compress.structure") or "null"),
        "only_types": field("masa_compress.only_types"),
        "speed": field("masa_compress.speed"),
        "rounding": field("masa_compress.rounding") or "nearest",
        "type_counts": type_counts(types),
        "other_matrices": {k: v for k, v in types.items() if not k.startswith("blk.")},
        "layers": [{"layer": layer, **by_layer[layer]} for layer in sorted(by_layer)],
    }
