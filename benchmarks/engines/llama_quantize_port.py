"""The tool's port of `llama-quantize`'s per-tensor rules against `llama-quantize` itself (built from the sources
of the installed llama.cpp: `llama_cpp_tools.py`), with the same importance file.

For every mix: `llama-quantize --dry-run --imatrix FILE MODEL.gguf MIX` prints the type it gives each tensor;
the tool's rules (`gguf_types.matrix_types`, what `export --type MIX` writes) give theirs to the same tensors;
the two are compared tensor by tensor, and so are the tensor bytes those types make. With `--files`, both tools
also write the files: the tool's `export --type MIX --imatrix FILE` and `llama-quantize` applied to the tool's
f32 GGUF, compared tensor by tensor (type and blocks) and in file bytes (the metadata apart).

    python -m benchmarks.engines.llama_quantize_port --model smollm2-135m --files \\
        --out benchmarks/results/llama-quantize-port-smollm2-135m.json
    python -m benchmarks.engines.llama_quantize_port --model qwen2.5-coder-1.5b \\
        --out benchmarks/results/llama-quantize-port-qwen2.5-coder-1.5b.json
"""

from __future__ import annotations

import argparse
import importlib.metadata
import re
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from benchmarks.engines.llama_cpp_tools import llama_cpp_tools
from benchmarks.suite.common import command_line, log, machine_info, write_json

#: One tensor of `llama-quantize`'s log: its name, its type in the input, and (when it changes) the type written.
TENSOR_LINE = re.compile(r"\]\s+(\S+)\s+- \[[^\]]*\], type =\s+(\S+),.*?(?:\((\w+)\))?\s*$")


def their_types(quantize: Path, source: Path, imatrix: Path, mix: str) -> dict[str, str]:
    """Tensor name → the GGML type `llama-quantize --dry-run` gives it in `mix` (upper case)."""
    done = subprocess.run([str(quantize), "--dry-run", "--imatrix", str(imatrix), str(source), mix.upper(), "2"],
                          check=True, capture_output=True, text=True)  # fmt: skip
    types = {}
    for line in (done.stdout + done.stderr).splitlines():
        found = TENSOR_LINE.search(line)
        if found:
            name, current, written = found.groups()
            types[name] = (written or current).upper()
    if not types:
        raise RuntimeError(f"no tensor in llama-quantize's log for {mix}: {done.stderr[-500:]}")
    return types


def our_types(source: Path, mix: str) -> dict[str, str]:
    """Tensor name → the GGML type the tool's rules give it in `mix` with importance weights, from the names and
    shapes of `source` (a GGUF of the model: the tool writes the same tensors)."""
    import gguf

    from compressor.quantize.gguf_types import matrix_types

    reader = gguf.GGUFReader(str(source))
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()

    def value(key: str) -> int:
        return int(reader.fields[f"{arch}.{key}"].parts[-1][0])

    names = {t.name for t in reader.tensors}
    context = {"gqa": value("attention.head_count") // value("attention.head_count_kv"), "has_imatrix": True,
               "n_expert": 1}  # fmt: skip
    types = {}
    for tensor in reader.tensors:
        shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))  # GGUF lists the row length first
        array = np.broadcast_to(np.float32(0), shape if len(shape) > 1 else shape[:1])
        types[tensor.name] = matrix_types(
            tensor.name, array, mix, value("block_count"), "output.weight" in names, context
        )[1]
    return types


def tensor_bytes(source: Path, types: dict[str, str]) -> int:
    """The bytes of `source`'s tensors stored in `types`."""
    import gguf

    total = 0
    for tensor in gguf.GGUFReader(str(source)).tensors:
        block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[types[tensor.name]]]
        total += int(tensor.n_elements) // block * size
    return total


def compare_types(ours: dict[str, str], theirs: dict[str, str]) -> dict:
    differ = {name: {"ours": ours.get(name), "theirs": theirs.get(name)}
              for name in sorted(ours.keys() | theirs.keys()) if ours.get(name) != theirs.get(name)}  # fmt: skip
    counts: dict[str, int] = {}
    for kind in theirs.values():
        counts[kind] = counts.get(kind, 0) + 1
    return {"tensors": len(theirs), "same_type": len(theirs) - len(differ), "differ": differ, "types": counts}


def compare_files(model: str, mix: str, f32: Path, imatrix: Path, quantize: Path, work: Path) -> dict:
    """Both tools' files of `mix`: tensors of a different type or different blocks, and the file bytes."""
    import gguf

    from compressor.api.export import export

    ours, theirs = work / f"{mix}-ours.gguf", work / f"{mix}-theirs.gguf"
    export(model, ours, tensor_type=mix, imatrix=str(imatrix), overwrite=True, progress=False)
    subprocess.run([str(quantize), "--imatrix", str(imatrix), str(f32), str(theirs), mix.upper(), "2"],
                   check=True, capture_output=True)  # fmt: skip
    read = {side: {t.name: (t.tensor_type.name, bytes(t.data)) for t in gguf.GGUFReader(str(path)).tensors}
            for side, path in (("ours", ours), ("theirs", theirs))}  # fmt: skip
    other_type = [n for n, (kind, _) in read["ours"].items() if read["theirs"].get(n, ("",))[0] != kind]
    other_blocks = [n for n, (kind, data) in read["ours"].items()
                    if n not in other_type and read["theirs"][n][1] != data]  # fmt: skip
    result = {"ours_bytes": ours.stat().st_size, "theirs_bytes": theirs.stat().st_size,
              "tensor_bytes": sum(len(data) for _, data in read["ours"].values()),
              "other_type": other_type, "other_blocks": other_blocks}  # fmt: skip
    ours.unlink()
    theirs.unlink()
    return result


def main(argv: list[str] | None = None) -> None:
    from compressor.api.export import export
    from compressor.api.packaged_models import gguf_directory, packaged_model
    from compressor.quantize.ggml_quantize import K_QUANT_MIXES

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--mixes", default=",".join(K_QUANT_MIXES))
    parser.add_argument("--files", action="store_true", help="also write both tools' files and compare them")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    mixes = [m.strip() for m in args.mixes.split(",") if m.strip()]
    quantize = llama_cpp_tools() / "llama-quantize"
    packaged = packaged_model(args.model)
    source = gguf_directory(packaged) / packaged.gguf_file
    rows = []
    with tempfile.TemporaryDirectory(prefix="masa-port-") as work:
        work = Path(work)
        imatrix, f32 = work / "imatrix.gguf", work / "f32.gguf"
        log(f"{args.model}: the tool's importance file (and f32 GGUF)")
        export(args.model, f32, tensor_type="f32", imatrix_out=imatrix, progress=False)
        for mix in mixes:
            log(f"{mix}: llama-quantize --dry-run against the tool's rules")
            ours, theirs = our_types(source, mix), their_types(quantize, source, imatrix, mix)
            row = {"mix": mix, **compare_types(ours, theirs),
                   "ours_tensor_bytes": tensor_bytes(source, ours),
                   "theirs_tensor_bytes": tensor_bytes(source, theirs)}  # fmt: skip
            if args.files:
                log(f"{mix}: both tools' files")
                row["files"] = compare_files(args.model, mix, f32, imatrix, quantize, work)
            rows.append(row)
            log(f"{mix}: {row['same_type']}/{row['tensors']} tensors of the same type")
        f32.unlink()
    write_json(args.out, {
        "command": command_line("benchmarks.engines.llama_quantize_port", argv), "model": args.model,
        "machine": machine_info(), "xllamacpp": importlib.metadata.version("xllamacpp"),
        "dry_run_input": packaged.gguf_file, "rows": rows,
    })  # fmt: skip
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
