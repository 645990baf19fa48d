"""Does `--rounding compensated` pay, and where? On the VALIDATION split.

At each of `--types` (a llama.cpp mix): the importance-weighted mix rounded in each of `--mix-kinds` (`nearest`,
llama.cpp's own, always; `compensated`; `compensated quantized stream`, its statistics measured on the inputs the
already rounded layers produce), and `export --size` at the mix's bytes rounded in each of `--size-kinds` (the
types chosen the same way: the allocation prices `nearest`'s errors). llama.cpp scores every file on the first
`--max-tokens` validation tokens against the original in transformers; each compensated file is paired with its
twin on the same windows (the nearest one; for a quantized stream, the compensated one on the original's
statistics; perplexity and the mean KL to the original, 95% intervals; inside it, a tie), and every `--size` file
with the mix rounded nearest (the baseline).

    python -m benchmarks.experiments.compensated_rounding.run --model smollm2-135m \
        --out benchmarks/results/choices/compensated-rounding-smollm2-135m-validation.json
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from benchmarks.engines.bytes_frontier import score_files
from benchmarks.suite.common import command_line, log, machine_info, write_json
from compressor.api.export import export
from compressor.evaluation.intervals import paired_difference, paired_mean_difference

#: Each file's pairings: (its name, the name it is compared with).
PAIRS = (
    ("mix compensated", "mix nearest"),
    ("size compensated", "size nearest"),
    ("size nearest", "mix nearest"),
    ("size compensated", "mix nearest"),
    ("size compensated quantized stream", "size compensated"),
    ("mix compensated quantized stream", "mix compensated"),
)
#: The files of one budget: kind → `export`'s options besides the type or the size.
KINDS = {
    "nearest": {"rounding": "nearest"},
    "compensated": {"rounding": "compensated"},
    "compensated quantized stream": {"rounding": "compensated", "rounding_stream": "quantized"},
}


def write_files(model: str, types: list[str], mix_kinds: list[str], kinds: list[str], work: Path) -> dict:
    """(mix name, kind) → what was written: its file, bytes, matrices by type and seconds. The mixes are
    written `nearest` and in each of `mix_kinds`, the `--size` files in each of `kinds`."""
    files = {}
    for tensor_type in types:
        for kind in dict.fromkeys(["nearest", *mix_kinds]):
            log(f"export {model} --type {tensor_type} --rounding {kind}")
            name = kind.replace(" ", "-")
            files[(tensor_type, f"mix {kind}")] = _export(model, work / f"{tensor_type}-mix-{name}.gguf",
                                                          tensor_type=tensor_type, **KINDS[kind])  # fmt: skip
        budget = files[(tensor_type, "mix nearest")]["bytes"]
        for kind in kinds:
            log(f"export {model} --size {budget:,} ({tensor_type}'s bytes): {kind}")
            name = kind.replace(" ", "-")
            files[(tensor_type, f"size {kind}")] = _export(model, work / f"{tensor_type}-size-{name}.gguf",
                                                           size=budget, **KINDS[kind])  # fmt: skip
    return files


def _export(model: str, out: Path, **options) -> dict:
    start = time.perf_counter()
    result = export(model, out, overwrite=True, progress=False, **options)
    return {
        "out": str(result.path), "bytes": result.details["bytes"], "type_counts": result.details["type_counts"],
        "seconds": round(time.perf_counter() - start, 1),
        "rounding_seconds": result.details.get("rounding", {}).get("seconds"),
        "damped": len(result.details.get("rounding", {}).get("damped", {})),
    }  # fmt: skip


def compare(files: dict, scored: dict) -> list[dict]:
    """One row per file, with its paired differences (`PAIRS`) in perplexity and in mean KL to the original."""
    rows = []
    for (tensor_type, kind), written in files.items():
        result, faith = scored[f"{tensor_type}|{kind}"]
        row = {"type": tensor_type, "kind": kind, **{k: v for k, v in written.items() if k != "out"},
               "ppl": result.ppl, "ppl_ci95": result.ppl_ci95, "kl": faith.kl_to_original,
               "kl_p99": faith.kl_percentiles["p99"], "kl_p999": faith.kl_percentiles["p99.9"],
               "top1": faith.top1_agreement}  # fmt: skip
        for name, other in PAIRS:
            if name != kind or f"{tensor_type}|{other}" not in scored:
                continue
            base, base_faith = scored[f"{tensor_type}|{other}"]
            ppl = paired_difference(result.window_nll, base.window_nll, result.window_tokens)
            kl = paired_mean_difference(faith.window_kl, base_faith.window_kl, result.window_tokens)
            key = f"minus_{other.replace(' ', '_')}"
            row |= {key: ppl.value, f"{key}_ci95": list(ppl.ci95),
                    f"kl_{key}": kl.value, f"kl_{key}_ci95": list(kl.ci95)}  # fmt: skip
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--types", default="q4_k_m,q3_k_m,q2_k")
    parser.add_argument("--max-tokens", type=int, default=8192)
    parser.add_argument("--mix-kinds", default="compensated", help=f"among {', '.join(KINDS)}")
    parser.add_argument("--size-kinds", default="nearest,compensated", help=f"among {', '.join(KINDS)}")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    types = [t.strip() for t in args.types.split(",") if t.strip()]
    with tempfile.TemporaryDirectory(prefix="masa-rounding-") as work:
        mix_kinds, kinds = (
            [k.strip() for k in a.split(",") if k.strip()] for a in (args.mix_kinds, args.size_kinds)
        )
        if unknown := [k for k in (*mix_kinds, *kinds) if k not in KINDS]:
            parser.error(f"unknown kind {unknown[0]!r}: choose among {', '.join(KINDS)}")
        files = write_files(args.model, types, mix_kinds, kinds, Path(work))
        paths = {f"{t}|{kind}": f["out"] for (t, kind), f in files.items()}
        reference, scored = score_files(args.model, paths, args.max_tokens, per_pass=4, split="validation")
    write_json(args.out, {
        "command": command_line("benchmarks.experiments.compensated_rounding.run", argv), "model": args.model,
        "machine": machine_info(), "split": "validation", "tokens": reference.tokens,
        "original_ppl": reference.ppl, "rows": compare(files, scored),
    })  # fmt: skip
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
