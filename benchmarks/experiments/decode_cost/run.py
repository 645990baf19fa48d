"""Does the decode cost per type measured in llama.cpp (`quantize/decode_cost.py`: probe files of the model's layer
shape) predict which GGUF of the same bytes llama.cpp decodes faster? Against measured decode, at each of `--types`
(a llama.cpp mix).

At each mix's bytes: the importance-weighted mix and `export --size` (types alone, every candidate type); each file's
predicted seconds per token (Σ weights × the type's ns per weight on this CPU, 1 thread) and its measured decode
tokens/s (llama.cpp, 1 and 2 threads, the median of `--repeats`, the two files of one budget timed in turns). The
verdict is the predicted ratio ours / mix against the measured one, budget by budget: how far apart, and whether
it tells which file is faster. No quality is scored here (the bytes benchmark scores these files).

    python -m benchmarks.experiments.decode_cost.run --out benchmarks/results/choices/decode-cost-smollm2-135m.json
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from benchmarks.experiments.only_types.run import time_files
from benchmarks.suite.common import command_line, log, machine_info, write_json
from compressor.api.export import export
from compressor.quantize.decode_cost import (
    decode_costs,
    file_layer_shape,
    file_matrices,
    predicted_decode_seconds,
)

MODEL = "smollm2-135m"
TYPES = "q8_0,q6_k,q5_k_m,q4_k_m,q3_k_m,q2_k"


def write_files(model: str, types: list[str], work: Path) -> dict:
    """(mix name, kind) → its file and type counts: the mix and `export --size` at its bytes."""
    files = {}
    for tensor_type in types:
        log(f"export {model} --type {tensor_type}, then --size at its bytes")
        mix = export(
            model, work / f"{tensor_type}-mix.gguf", tensor_type=tensor_type, overwrite=True, progress=False
        )
        ours = export(model, work / f"{tensor_type}-size.gguf", size=mix.details["bytes"], overwrite=True,
                      progress=False)  # fmt: skip
        for kind, result in (("mix", mix), ("every type", ours)):
            files[(tensor_type, kind)] = {"out": str(result.path), "bytes": result.details["bytes"],
                                          "type_counts": result.details["type_counts"]}  # fmt: skip
    return files


def compare(files: dict, speeds: dict) -> list[dict]:
    """Per budget: predicted and measured decode of ours as a multiple of the mix's."""
    rows = []
    for tensor_type in dict.fromkeys(t for t, _ in files):
        mix, ours = files[(tensor_type, "mix")], files[(tensor_type, "every type")]
        predicted = {k: predicted_decode_seconds(f["out"]) for k, f in (("mix", mix), ("ours", ours))}
        measured = {k: speeds[(kind, tensor_type)] for k, kind in (("mix", "mix"), ("ours", "every type"))}
        rows.append({
            "type": tensor_type, "mix_types": mix["type_counts"], "ours_types": ours["type_counts"],
            "predicted_ms_per_token": {k: 1e3 * v for k, v in predicted.items()},
            "predicted_ratio": predicted["mix"] / predicted["ours"],
            "measured_ratio": measured["ours"]["decode_tokens_per_second"] / measured["mix"]["decode_tokens_per_second"],
            "measured_ratio_2t": measured["ours"]["decode_tokens_per_second_2t"]
            / measured["mix"]["decode_tokens_per_second_2t"],
            "measured_ms_per_token": {k: 1e3 / v["decode_tokens_per_second"] for k, v in measured.items()},
        })  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--types", default=TYPES)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    types = [t.strip() for t in args.types.split(",") if t.strip()]
    with tempfile.TemporaryDirectory(prefix="masa-decode-cost-") as work:
        files = write_files(args.model, types, Path(work))
        speeds = time_files(args.model, files, args.repeats)
        rows = compare(files, speeds)
        first = next(iter(files.values()))["out"]
        shape = file_layer_shape(first)
        used = sorted({t for f in files.values() for t, _ in file_matrices(f["out"]).values()})
        costs = decode_costs(used, shape, progress=False)  # what the predictions read, from the cache
    agree = sum((r["predicted_ratio"] > 1) == (r["measured_ratio"] > 1) for r in rows)
    write_json(args.out, {
        "command": command_line("benchmarks.experiments.decode_cost.run", argv), "model": args.model,
        "machine": machine_info(), "repeats": args.repeats, "rows": rows,
        "same_faster_file": f"{agree} of {len(rows)}",
        "largest_ratio_error": max(abs(r["predicted_ratio"] / r["measured_ratio"] - 1) for r in rows),
        "layer_shape": shape.__dict__, "ns_per_weight": costs,
    })  # fmt: skip
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
