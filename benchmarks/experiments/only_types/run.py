"""What does `--only-types` (k-quants alone) cost and buy at the byte budgets where `export --size` decodes slower
than llama.cpp's mix of the same bytes? On the VALIDATION split.

At each of `--types` (a llama.cpp mix): its importance-weighted mix, `export --size` at its bytes choosing among
every candidate type (the default: IQ3_S included), and the same with `--only-types` (default: the k-quants,
q8_0 and f16, for Qwen2.5-Coder-1.5B, whose rows all take k-quants); llama.cpp scores the three on the first `--max-tokens` validation tokens against the original in
transformers, paired on the same windows (95% interval; inside it, a tie), and times them in turns (decode and
prefill tokens/s, 1 and 2 threads, the median of `--repeats`).

    python -m benchmarks.experiments.only_types.run --out benchmarks/results/choices/only-types-qwen2.5-coder-1.5b-validation.json

The bundled model (rows of 576: only its down_proj takes k-quants; the others choose among Q4_0, Q5_0, Q8_0, F16
without Q4_1): `--model smollm2-135m --only-types q2_k,q3_k,q4_k,q5_k,q6_k,q8_0,q4_0,q5_0,f16 --max-tokens 8192
--out benchmarks/results/choices/only-types-smollm2-135m-validation.json`.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from benchmarks.engines.bytes_frontier import score_files
from benchmarks.suite.common import command_line, log, machine_info, write_json
from compressor.api.export import export
from compressor.api.model_loading import load_model, resolve_model
from compressor.evaluation.intervals import paired_difference

MODEL = "qwen2.5-coder-1.5b"
K_QUANTS = "q2_k,q3_k,q4_k,q5_k,q6_k,q8_0,f16"
#: What each `--size` file is compared with, paired on the same windows.
PAIRED = {"every type": ("mix",), "only types": ("mix", "every type")}


def write_files(model: str, types: list[str], variants: dict[str, dict], work: Path) -> dict:
    """(mix name, kind) → what was written: its file, bytes, matrices by type, predicted rise and speed record. At
    each mix's bytes: the mix itself (importance weights below 8 bits), then `export --size` with each of
    `variants` (kind → the export's options, e.g. `{"only_types": "q4_k"}`)."""
    files = {}
    for tensor_type in types:
        log(f"export {model} --type {tensor_type} (importance weights below 8 bits)")
        written = {"mix": export(model, work / f"{tensor_type}-mix.gguf", tensor_type=tensor_type, overwrite=True,
                                 progress=False)}  # fmt: skip
        budget = written["mix"].details["bytes"]
        for kind, options in variants.items():
            log(f"export {model} --size {budget:,} ({tensor_type}'s bytes) {options}")
            written[kind] = export(model, work / f"{tensor_type}-{kind.replace(' ', '-')}.gguf", size=budget,
                                   overwrite=True, progress=False, **options)  # fmt: skip
        for kind, result in written.items():
            files[(tensor_type, kind)] = {
                "out": str(result.path), "bytes": result.details["bytes"],
                "type_counts": result.details["type_counts"],
                "predicted_loss_rise": result.details.get("predicted_loss_rise"), "speed": result.details.get("speed"),
            }  # fmt: skip
    return files


def time_files(model: str, files: dict, repeats: int) -> dict:
    """Each file's decode and prefill tokens/s, the three files of one mix's bytes timed in turns."""
    from benchmarks.engines.llama_cpp import PROMPT_TOKENS, _prompt_text, measure_speeds

    tokenizer = load_model(resolve_model(model), device="cpu", dtype="float32", progress=False).tokenizer
    prompt = tokenizer(_prompt_text(), add_special_tokens=False)["input_ids"][:PROMPT_TOKENS]
    # measure_speeds times in turns the files sharing a key's second element: here the mix's bytes
    return measure_speeds({(kind, t): f["out"] for (t, kind), f in files.items()}, prompt, repeats)


def compare(files: dict, reference, scored: dict, speeds: dict, paired: dict = PAIRED) -> list[dict]:
    """One row per file; the `--size` files carry their difference to the mix and `only types` to `every type`,
    paired on the same windows, and decode tokens/s as a multiple of the mix's."""
    rows = []
    for (tensor_type, kind), written in files.items():
        result, faith = scored[f"{tensor_type}|{kind}"]
        speed = speeds[(kind, tensor_type)]
        mix_speed = speeds[("mix", tensor_type)]
        row = {"type": tensor_type, "kind": kind, **{k: v for k, v in written.items() if k != "out"},
               "ppl": result.ppl, "ppl_ci95": result.ppl_ci95, "kl": faith.kl_to_original,
               "top1": faith.top1_agreement, "speeds": speed,
               "decode_vs_mix": speed["decode_tokens_per_second"] / mix_speed["decode_tokens_per_second"],
               "decode_vs_mix_2t": speed["decode_tokens_per_second_2t"] / mix_speed["decode_tokens_per_second_2t"]}  # fmt: skip
        for other in paired.get(kind, ()):
            base, _ = scored[f"{tensor_type}|{other}"]
            difference = paired_difference(result.window_nll, base.window_nll, result.window_tokens)
            key = f"minus_{other.replace(' ', '_')}"
            row |= {key: difference.value, f"{key}_ci95": list(difference.ci95)}
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--types", default="q3_k_m,q2_k")
    parser.add_argument("--only-types", default=K_QUANTS)
    parser.add_argument("--max-tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    types = [t.strip() for t in args.types.split(",") if t.strip()]
    with tempfile.TemporaryDirectory(prefix="masa-only-types-") as work:
        variants = {"every type": {}, "only types": {"only_types": args.only_types}}
        files = write_files(args.model, types, variants, Path(work))
        paths = {f"{t}|{kind}": f["out"] for (t, kind), f in files.items()}
        reference, scored = score_files(args.model, paths, args.max_tokens, per_pass=3, split="validation")
        speeds = time_files(args.model, files, args.repeats)
    write_json(args.out, {
        "command": command_line("benchmarks.experiments.only_types.run", argv), "model": args.model,
        "machine": machine_info(), "split": "validation", "tokens": reference.tokens, "only_types": args.only_types,
        "original_ppl": reference.ppl, "rows": compare(files, reference, scored, speeds),
    })  # fmt: skip
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
