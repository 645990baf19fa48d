"""The validation runs behind `--size`'s defaults and options (`benchmarks/results/choices/`), as BENCHMARKS.md
section 7 shows them: the error model, the structure's weight κ, the structure's error on new text, the refit
under a byte budget, `--only-types`, `--rounding compensated`, the decode cost of ggml's kernels, and what a ladder
of budgets costs."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from benchmarks.report.markdown import paired_reading, reading
from benchmarks.report.plots import REPO
from benchmarks.report.speed_limit import speed_limit_lines
from compressor.methods.masa.byte_structure import LEAST_TOKENS_PER_INPUT

CHOICES = REPO / "benchmarks" / "results" / "choices"


def byte_choice_lines() -> list[str]:
    return [
        *_llama_quantize_port(), *_structure_weight(), *_structure_error(), *_size_refit(), *_error_model(), *_only_types(),
        *_compensated_rounding(), *_rounding_by_projection(), *_decode_cost(), *speed_limit_lines(), *_ladder_cost(),
    ]  # fmt: skip


def _llama_quantize_port(results: Path = CHOICES.parent) -> list[str]:
    """The tool's port of `llama-quantize`'s per-tensor rules against `llama-quantize` itself, per model run."""
    lines = []
    for path in sorted(results.glob("llama-quantize-port-*.json")):
        data = json.loads(path.read_text())
        rows = data["rows"]
        differ = [f"{r['mix']} ({len(r['differ'])} tensors)" for r in rows if r["differ"]]
        same_bytes = sum(r["ours_tensor_bytes"] == r["theirs_tensor_bytes"] for r in rows)
        files = [r["files"] for r in rows if "files" in r]
        written = ""
        if files:
            apart = sorted({abs(f["ours_bytes"] - f["theirs_bytes"]) for f in files})
            unlike = sum(bool(f["other_type"] or f["other_blocks"]) for f in files)
            written = (
                f" Both tools also wrote every mix (`llama-quantize` from the tool's f32 GGUF, the same importance "
                f"file): {len(files) - unlike} of {len(files)} files hold the same type and the very same blocks in "
                f"every tensor, the files {'-'.join(map(str, apart[:: max(len(apart) - 1, 1)]))} bytes apart (the "
                "metadata)."
            )
        lines += [
            f"**The baseline's types are `llama-quantize`'s own** (`{data['command']}`, {data['model']}, "
            f"`llama-quantize` built from the llama.cpp sources of xllamacpp {data['xllamacpp']}, the tool's "
            f"importance file): at {len(rows) - len(differ)} of {len(rows)} mixes `llama-quantize --dry-run` gives "
            f"every one of the {rows[0]['tensors']} tensors the type the tool's port of its rules gives it"
            + (f" (differing: {', '.join(differ)})" if differ else "")
            + f"; the tensor bytes agree at {same_bytes} of {len(rows)}.{written}",
            "",
        ]
    return lines


def _paired(row: dict, key: str) -> str:
    """`paired_reading`, said as one word where both files scored every window alike (the same file)."""
    if key in row and row[key] == 0 and (row.get(f"{key}_ci95") or row["ci95"]) == [0, 0]:
        return "0 (the same scores)"
    return paired_reading(row, key)


def _size_refit() -> list[str]:
    """`compress --size`'s refit, `calibration` against `stream`, on the validation split."""
    path = CHOICES / "size-refit-validation.json"
    if not path.is_file():
        return []
    data = json.loads(path.read_text())
    lines = [
        f"**The structure's refit under a byte budget** (`{data['command']}`, validation split, {data['tokens']:,} "
        f"tokens, llama.cpp; the original {data['original_ppl']:.2f} in transformers): `compress --size` with each "
        "kept matrix refit on the original's statistics (`--refit calibration`, the default there) or on the "
        "compressed model's own inputs (`stream`, `--native`'s default at a fixed ratio), paired on the same windows.",
        "",
        "| size | refit | MiB | parameters removed | perplexity | stream − calibration [95%] | predicted · measured "
        "rise |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in data["rows"]:
        lines.append(
            f"| {row['size']} | {row['refit']} | {row['bytes'] / 2**20:.2f} | {row['removed']:,} | {row['ppl']:.3f} | "
            f"{_paired(row, 'minus_calibration')} | {row['predicted_rise']:.4f} · {row['measured_rise']:.4f} |"
        )
    return [*lines, ""]


def _only_types_runs(choices: Path) -> list[dict]:
    """The `--only-types` runs, one file per model (`only-types-MODEL-validation.json`)."""
    return [json.loads(path.read_text()) for path in sorted(choices.glob("only-types-*-validation.json"))]


def _only_types() -> list[str]:
    """`--only-types` against every candidate type and llama.cpp's mix of the same bytes, per model run."""
    return [line for data in _only_types_runs(CHOICES) for line in _only_types_table(data)]


def _only_types_table(data: dict) -> list[str]:
    lines = [
        f"**`--only-types {data['only_types']}`** (`{data['command']}`, {data['model']}, validation split, "
        f"{data['tokens']:,} tokens, llama.cpp; the original {data['original_ppl']:.2f} in transformers): at the "
        "bytes of llama.cpp's mix with the importance weights, `export --size` choosing among every candidate type "
        "and among these alone; paired on the same windows; decode tokens/s over the mix's (1 · 2 threads, files "
        "timed in turns).",
        "",
        "| budget | file | MiB | perplexity | − the mix [95%] | − every type [95%] | decode / the mix | matrices by "
        "type |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in data["rows"]:
        counts = ", ".join(f"{n} {t}" for t, n in sorted(row["type_counts"].items(), key=lambda kv: -kv[1]))
        lines.append(
            f"| {row['type']} | {row['kind']} | {row['bytes'] / 2**20:.2f} | {row['ppl']:.3f} | "
            f"{_paired(row, 'minus_mix')} | {_paired(row, 'minus_every_type')} | {row['decode_vs_mix']:.2f}x · "
            f"{row['decode_vs_mix_2t']:.2f}x | {counts} |"
        )
    return [*lines, ""]


BY_PROJECTION = "compensated-rounding-by-projection-validation.json"
#: Each file of a `--rounding` run and what it is paired with: its nearest twin, and llama.cpp's mix rounded
#: nearest (the baseline).
ROUNDING_TWINS = {
    "mix compensated": ("minus_mix_nearest", None),
    "size nearest": (None, "minus_mix_nearest"),
    "size compensated": ("minus_size_nearest", "minus_mix_nearest"),
    "size compensated quantized stream": ("minus_size_compensated", None),
    "mix compensated quantized stream": ("minus_mix_compensated", None),
}


def _compensated_rounding(choices: Path = CHOICES) -> list[str]:
    """`--rounding compensated` against `nearest` (the same types) and against llama.cpp's mix, per model run."""
    lines = []
    for path in sorted(choices.glob("compensated-rounding-*-validation.json")):
        if path.name == BY_PROJECTION:
            continue  # one model's projections, `_rounding_by_projection`
        data = json.loads(path.read_text())
        lines += [
            f"**`--rounding compensated`** (`{data['command']}`, {data['model']}, validation split, "
            f"{data['tokens']:,} tokens, llama.cpp; the original {data['original_ppl']:.2f} in transformers): "
            "llama.cpp's importance-weighted mix and `export --size` at its bytes, each rounded `nearest` "
            "(llama.cpp's own) and `compensated`; the KL is to the original per token (mean, and its 99.9th "
            "percentile over tokens); each difference paired on the same windows, perplexity then KL. A "
            "`quantized stream` file's statistics were measured on the inputs of the layers below already "
            "rounded, and its twin is the compensated file on the original's statistics.",
            "",
            "| budget | file | MiB | rounding (s) | perplexity | KL (p99.9) | top-1 | − its twin [95%] | − the mix, "
            "nearest [95%] |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for row in data["rows"]:
            twin, mix = ROUNDING_TWINS.get(row["kind"], (None, None))
            rounding = "" if row.get("rounding_seconds") is None else f"{row['rounding_seconds']:.0f}"
            lines.append(
                f"| {row['type']} | {row['kind']} | {row['bytes'] / 2**20:.2f} | {rounding} | {row['ppl']:.3f} | "
                f"{row['kl']:.4f} ({row['kl_p999']:.3f}) | {row['top1']:.2%} | {_ppl_and_kl(row, twin)} | "
                f"{_ppl_and_kl(row, mix)} |"
            )
        lines.append("")
    return lines


def _rounding_by_projection(choices: Path = CHOICES) -> list[str]:
    """Compensated rounding per set of projections, against `nearest` (what made `attn_v` keep `nearest`)."""
    path = choices / BY_PROJECTION
    if not path.is_file():
        return []
    data = json.loads(path.read_text())
    lines = [
        f"**Compensated rounding, projection by projection** (`{data['command']}`, {data['model']}, validation "
        f"split, {data['tokens']:,} tokens, in transformers with the decoded weights; calibration "
        f"{data['calib_windows']} windows; the original {data['original_ppl']:.2f}): each set rounded into the "
        "q2_k mix's types on its rows, every layer, the rest of the model original; compensated against nearest, "
        "paired on the same windows.",
        "",
        "| rounded | perplexity: nearest · compensated | KL: nearest · compensated | compensated − nearest [95%] |",
        "|---|---|---|---|",
    ]
    for row in data["rows"]:
        lines.append(
            f"| {row['projections']} | {row['nearest_ppl']:.3f} · {row['compensated_ppl']:.3f} | "
            f"{row['nearest_kl']:.4f} · {row['compensated_kl']:.4f} | {_ppl_and_kl(row, 'minus_nearest')} |"
        )
    return [*lines, ""]


def _ppl_and_kl(row: dict, key: str | None) -> str:
    """A row's paired differences `key` (perplexity) and `kl_`+`key` (the mean KL), each read; empty for none."""
    if key is None or key not in row:
        return ""
    lo, hi = row[f"kl_{key}_ci95"]
    kl = f"{row[f'kl_{key}']:+.4f} [{lo:+.4f}, {hi:+.4f}] {reading(lo, hi, 'better', 'worse')}"
    return f"{paired_reading(row, key)} · KL {kl}"


def _error_model() -> list[str]:
    path = CHOICES / "byte-error-model-validation.json"
    if not path.is_file():
        return []
    data = json.loads(path.read_text())
    plans = "; ".join(
        f"{p['budget'] / 2**20:.1f} MiB: predicted {p['predicted']:.4f}, measured {p['measured']:.4f}"
        for p in data["plans"]
    )
    # Each measured rise has its paired interval, and the KL to the original beside it: what a second-order
    # predictor estimates, without the text's first-order noise.
    singles = data["singles"]
    kl_ratio = statistics.median(s["kl"] / max(s["predicted"], 1e-12) for s in singles)
    return [
        f"**The error model** (`{data['command']}`, validation split, {data['tokens']:,} tokens, in transformers "
        f"with the decoded matrices): over {len(singles)} single changes (one matrix's type) the predicted and "
        f"measured rises of the loss have a rank correlation (Spearman) of {data['spearman_singles']:.2f}, but "
        f"only {data['singles_resolved']} of the {len(singles)} measured rises have a 95% interval (paired, over "
        "windows) that excludes 0: most single changes move the loss by less than its noise on these tokens. "
        "Against the KL divergence to the original on the same tokens, the quantity the prediction (½ · "
        "sensitivity · weighted rounding error, a second-order term) estimates, the rank correlation is "
        f"{data['spearman_singles_kl']:.2f}, KL over predicted median {kl_ratio:.2f}. Whole plans (nats per "
        "token): " + plans + ". " + _predictors(data),
        "",
    ]


def _predictors(data: dict) -> str:
    """The alternatives to the importance statistic tried on the same single changes, where the run has them."""
    tried = data.get("predictors")
    if not tried:
        return ""
    named = "; ".join(
        f"{name} {fit['spearman']:.2f} · {fit['spearman_kl']:.2f}" for name, fit in tried.items()
    )
    return (
        "Two other statistics tried on the same points (`benchmarks/experiments/byte_error_model/"
        f"predictors.py`), Spearman against the loss rise · the KL: {named}."
    )


def _structure_weight() -> list[str]:
    """κ, the structure's weight in `compress --size`, on the validation split: each file against types alone."""
    path = CHOICES / "structure-weight-validation.json"
    if not path.is_file():
        return []
    data = json.loads(path.read_text())
    lines = [
        f"**The structure's weight κ** (`{data['command']}`, validation split, {data['tokens']:,} tokens, llama.cpp; "
        f"the original {data['original_ppl']:.2f} in transformers): at each size, `compress --size` with each κ "
        "against `export --size` (types alone) of the same size, paired on the same windows; the predicted rise of "
        "the loss (structure at κ = 1 plus rounding) against the measured one (nats per token).",
        "",
        "| size | κ | MiB | parameters removed | perplexity | − types alone [95%] | predicted · measured rise |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in data["rows"]:
        kappa = "types alone" if row["weight"] is None else f"{row['weight']:g}"
        if "refused" in row:
            lines.append(f"| {row['size']} | {kappa} | | | below the smallest file of types alone | | |")
            continue
        lines.append(
            f"| {row['size']} | {kappa} | {row['bytes'] / 2**20:.2f} | {row['removed']:,} | {row['ppl']:.3f} | "
            f"{paired_reading(row, 'minus_types_only')} | {row['predicted_rise']:.4f} · {row['measured_rise']:.4f} |"
        )
    lines += [
        "",
        f"Over these files the predicted and measured rises have a rank correlation (Spearman) of "
        f"{data['spearman_files']:.2f}.",
        "",
    ]
    return lines


def _structure_error() -> list[str]:
    """The structure's predicted error on the calibration against new text, one MLP narrowed at a time
    (`benchmarks/experiments/structure_error`), and the calibration tokens per neuron that make it hold."""
    runs = [CHOICES / f"structure-error-{m}-validation.json" for m in ("smollm2-135m", "qwen2.5-coder-1.5b")]
    tokens_path = CHOICES / "structure-error-tokens-validation.json"
    if not all(p.is_file() for p in (*runs, tokens_path)):
        return []
    lines = [
        "**The structure's error on new text** (`benchmarks/experiments/structure_error`, validation split): one MLP "
        "narrowed at a time, its least-squares refit's error on the calibration tokens it was fitted on (what the "
        "allocation reads) against the same refit's error on validation tokens, and the validation loss rise "
        "measured with it installed (nats per token) against the rise each error predicts (½ ḡ² · error).",
        "",
        "| model | calibration tokens per neuron | layer | neurons kept | new / calibration error | measured rise "
        "(± s.e.) | predicted from calibration · new text |",
        "|---|---|---|---|---|---|---|",
    ]
    for path in runs:
        data = json.loads(path.read_text())
        for row in data["rows"]:
            lines.append(
                f"| {data['model']} | {data['calibration_tokens'] / row['full']:.1f} | {row['layer']} | "
                f"{row['width']:,} of {row['full']:,} | {row['held_out'] / row['in_sample']:.2f} | "
                f"{row['measured']:.4f} ± {row['measured_se']:.4f} | {row['predicted_in_sample']:.4f} · "
                f"{row['predicted_held_out']:.4f} |"
            )
    by_tokens: dict[float, list[float]] = {}
    for row in json.loads(tokens_path.read_text())["rows"]:
        by_tokens.setdefault(row["tokens_per_neuron"], []).append(row["ratio"])
    spans = "; ".join(
        f"{t:.0f} tokens per neuron {min(r):.2f}-{max(r):.2f}x" for t, r in sorted(by_tokens.items())
    )
    lines += [
        "",
        f"On the bundled model with fewer calibration windows, new over calibration error: {spans}. A byte budget "
        f"offers a unit's structure only from {LEAST_TOKENS_PER_INPUT} calibration tokens per input of its refit "
        "(`byte_structure.LEAST_TOKENS_PER_INPUT`); the 1.5B model's recipe (32 windows) prices neither its MLP "
        "widths nor its heads, and its `compress --size` file is then `export --size`'s.",
        "",
    ]
    return lines


def only_types_sentence(choices: Path = CHOICES) -> str:
    """The README's line on `--only-types` where the run exists: per budget, decode over the mix's and perplexity
    against every type and the mix, paired (validation split)."""
    runs = _only_types_runs(choices)
    if not runs:
        return ""
    per_model = []
    for data in runs:
        parts = [
            f"{row['type']} {row['decode_vs_mix']:.2f}x, perplexity {_paired(row, 'minus_every_type')} against "
            f"every type and {_paired(row, 'minus_mix')} against the mix"
            for row in data["rows"]
            if row["kind"] == "only types"
        ]
        per_model.append(f" On {data['model']} with {data['only_types']}: {'; '.join(parts)}.")
    return (
        " `--only-types` restricts the allocation to the types named (validation split; ours / the mix's decode, "
        f"1 thread, and paired differences).{''.join(per_model)}"
    )


def _decode_cost(choices: Path = CHOICES) -> list[str]:
    """Decode time predicted from the costs measured in llama.cpp (`quantize/decode_cost.py`) against llama.cpp's
    measured decode of whole files."""
    lines = []
    for path in sorted(choices.glob("decode-cost-*.json")):
        data = json.loads(path.read_text())
        rows = data["rows"]
        errors = sorted(abs(r["predicted_ratio"] / r["measured_ratio"] - 1) for r in rows)
        wider = sum(abs(r["predicted_ratio"] - 1) > abs(r["measured_ratio"] - 1) for r in rows)
        shape = data["layer_shape"]
        costs = ", ".join(
            f"{t} {v:.3f}" for t, v in sorted(data["ns_per_weight"].items(), key=lambda kv: kv[1])
        )
        lines += [
            f"**Decode cost measured in llama.cpp** (`{data['command']}`, {data['model']}, 1 thread, median of "
            f"{data['repeats']}): each file's decode time predicted as Σ weights × its type's cost, measured by "
            f"decoding probe files of the model's layer shape ({shape['hidden']} wide, MLP {shape['intermediate']}) "
            "in llama.cpp on this CPU, the layer's overhead spread over its weights; against the measured decode of "
            f"llama.cpp's mix and `export --size` at its bytes, timed in turns. It named the faster file at "
            f"{data['same_faster_file']} budgets; the predicted ratio was off the measured one by {errors[len(errors) // 2]:.0%} "
            f"at the median budget and {errors[-1]:.0%} at most, the gap predicted wider than measured at {wider} "
            f"of {len(rows)}. Nanoseconds per weight, cheapest first: {costs}.",
            "",
            "| budget | ours, by type | the mix, by type | ours / mix decode, predicted | measured, 1 · 2 threads |",
            "|---|---|---|---|---|",
        ]
        for row in data["rows"]:
            ours = ", ".join(f"{n} {t}" for t, n in row["ours_types"].items())
            mix = ", ".join(f"{n} {t}" for t, n in row["mix_types"].items())
            lines.append(
                f"| {row['type']} | {ours} | {mix} | {row['predicted_ratio']:.2f}x | {row['measured_ratio']:.2f}x · "
                f"{row['measured_ratio_2t']:.2f}x |"
            )
        lines.append("")
    return lines


def _ladder_cost(choices: Path = CHOICES) -> list[str]:
    """`export --type`, then `--size` at two budgets, each a process of its own on a fresh cache: seconds each, and
    whether the importance weights and the rounding errors were measured or read from the cache."""
    path = choices / "byte-ladder-cost.json"
    if not path.is_file():
        return []
    data = json.loads(path.read_text())
    lines = [
        f"**What a ladder of budgets costs** (`{data['command']}`, {data['model']}, {data['machine']['cpu']}, "
        f"{data['machine']['usable_cores']} cores): each command a process of its own, in order, on a cache of "
        "its own (nothing measured before the first).",
        "",
        "| command | seconds | importance weights and sensitivities | rounding errors per type |",
        "|---|---|---|---|",
    ]
    for run in data["runs"]:
        stages = run["stages"]
        lines.append(
            f"| `export {data['model']} OUT {run['flags']}` | {run['seconds']:.0f} | "
            f"{stages['importance'] or 'not needed'} | {stages['rounding_errors'] or 'not needed'} |"
        )
    return [*lines, ""]
