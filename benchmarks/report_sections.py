"""Sections of BENCHMARKS.md beyond the attention benchmark: the whole model (curve, second domain, speed of the
model 20% smaller) from results.json, and the choices behind today's defaults, from the validation runs kept in
`benchmarks/results/choices/` (each measured once by the command it records; `make bench` does not re-run them).
"""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.markdown import difference, interval, link, number
from benchmarks.plots import CURVE_STYLE, MIN_TARGETS, REPO, STAGE_LABELS, TARGETS

CHOICES = REPO / "benchmarks" / "results" / "choices"
DEFAULT = "masa-attn-mlp"


def verdict(key: str, results: dict) -> str:
    if not isinstance(results.get(key), (int, float)):
        return "not measured"
    if key in MIN_TARGETS:
        return "met" if results[key] >= MIN_TARGETS[key][0] else "**missed**"
    return "met" if results[key] <= TARGETS[key][0] else "**missed**"


def compression_section(results: dict, rel) -> list[str]:
    c, whole, demo = results["compression"], results.get("whole_model_compression"), results.get("demo")
    runs = {"attention 0.2": c} | ({"model 20% smaller": whole} if whole else {})
    seen = {k for run in runs.values() for k in run["stage_seconds"]}
    order = [*STAGE_LABELS, *sorted(seen - set(STAGE_LABELS))]  # the pipeline's order; `other` last
    stages = sorted(seen, key=lambda k: (k == "other", order.index(k)))
    lines = [
        "## 3. The compression run: time and memory per stage",
        "",
        f"Real runs in fresh processes (`--no-stats-cache`: the capture is timed, never read from a cache; "
        f"{c['calibration']['samples']}×{c['calibration']['seq_len']} calibration tokens; no evaluation): "
        f"`{c['command']}`"
        + (f" and `{whole['command']}`" if whole else "")
        + ". Stage times from each run's own summary (`seconds`); every second of the process but loading the model "
        "is counted (`other`: what no stage names); peak RSS is the process's high-water mark (`VmHWM`).",
        "",
        "| stage | " + " | ".join(f"{name} (s)" for name in runs) + " |",
        "|---|" + "---|" * len(runs),
    ]
    for key in stages:
        cells = [
            f"{run['stage_seconds'][key]:.1f}" if key in run["stage_seconds"] else "—"
            for run in runs.values()
        ]
        lines.append(f"| {STAGE_LABELS.get(key, key)} | " + " | ".join(cells) + " |")
    lines += [
        "| **compression (every stage)** | "
        + " | ".join(f"**{r['compress_seconds']:.1f}**" for r in runs.values())
        + " |",
        "| *not counted:* loading the model | "
        + " | ".join(f"{r['load_seconds']:.1f}" for r in runs.values())
        + " |",
        "| peak RSS (GiB) | " + " | ".join(f"{r['peak_rss_gib']:.2f}" for r in runs.values()) + " |",
        f"| reference: one plain forward pass over the same {c['forward']['windows']}×{c['forward']['seq_len']} "
        f"tokens (batch {c['forward']['batch_size']}, no hooks, fresh process) | {c['forward_seconds']:.1f} |"
        + " |"
        * (len(runs) - 1),
        "",
        f"- **Attention 0.2: {results['compress_over_forward']:.2f}x one plain forward pass** "
        f"(target ≤ {TARGETS['compress_over_forward'][0]:g}x: {verdict('compress_over_forward', results)}); "
        f"calibration capture alone {c['stage_seconds'].get('calibration', 0) / c['forward_seconds']:.2f}x (target ≤ "
        f"{TARGETS['calibration_over_forward'][0]:g}x: {verdict('calibration_over_forward', results)}).",
    ]
    if whole:
        lines.append(
            f"- **The model 20% smaller: {results['whole_model_compress_over_forward']:.2f}x** (target ≤ "
            f"{TARGETS['whole_model_compress_over_forward'][0]:g}x: "
            f"{verdict('whole_model_compress_over_forward', results)}); its largest stage is "
            f"{STAGE_LABELS.get(whole['dominant_stage'], whole['dominant_stage'])}."
        )
    if demo:
        lines.append(
            f"- **`make demo` (after the installation, a first run: no statistics cache): "
            f"{results['demo_minutes']:.1f} minutes** (target ≤ {TARGETS['demo_minutes'][0]:g}: "
            f"{verdict('demo_minutes', results)}), of which evaluating the original and the compressed model "
            f"{demo['eval_seconds'] / 60:.1f}; `{demo['command']}`."
        )
    lines += [
        f"- Achieved ratio {c['achieved_ratio']:.4f}; checkpoint {c['checkpoint_mib']:.1f} MiB.",
        "",
        f"![time per stage]({rel('stages')})",
        "",
    ]
    return lines


def _label(method: str) -> str:
    return CURVE_STYLE.get(method, (f"`{method}`",))[0]


def whole_model_section(results: dict, rel) -> list[str]:
    w = results.get("whole_model")
    if not w:
        return []
    cal, ev = w["calibration"], w["evaluation"]
    lines = [
        "## 2. The whole model: attention and MLP (`--targets attn,mlp --ratio-of model`)",
        "",
        "`masa-compress MODEL --targets attn,mlp --ratio R --ratio-of model` makes the model R smaller, taking the "
        f"numbers from every linear projection of its layers. One calibration ({cal['samples']}×{cal['seq_len']} "
        f"tokens of {cal['text']}, MLP inputs included), every model scored with the original in one pass over "
        f"the {ev['tokens']:,} tokens of the **{ev['split']}** split (original **{w['original_ppl']:.3f}**"
        f"{interval(w['original_ppl_ci95'])}). Size: the model's float32 weights ({w['model_mib_before']:.1f} MiB "
        "before). Variants: the default (the MLP keeps a subset of its neurons, `down_proj` refit by least "
        "squares, each layer's width from the loss-aware allocation); `--uniform-mlp` (the same width in every "
        "layer: the base architecture with a smaller `intermediate_size`, which `export-dense` writes as a "
        "standard checkpoint with the same logits); `--mlp lowrank` (whitened low-rank factors of gate/up/down, "
        "the default before); FLAP (`--method flap`: whole heads and neurons by the fluctuation metric, a "
        "compensating bias, nothing refit; An et al. 2024); SVD-LLM (the same kept fraction of every matrix). "
        "Differences are paired, on the "
        "same windows; rise ratio: the default's perplexity rise over SVD-LLM's.",
        "",
        "| removed of the model | variant | model MiB | perplexity [95% CI] | × original | KL | top-1 | "
        "differences (paired) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in sorted(w["quality"], key=lambda r: (r["model_ratio"], list(CURVE_STYLE).index(r["method"])
                                                     if r["method"] in CURVE_STYLE else 99)):  # fmt: skip
        diffs = "; ".join(
            f"− {k.removeprefix('minus_')}: {difference(v)}" for k, v in row.items() if k.startswith("minus_")
        )
        if "rise_ratio_vs_svd_llm" in row:
            diffs += f"; rise ratio {row['rise_ratio_vs_svd_llm']:.3f}"
        lines.append(
            f"| {row['model_ratio']:.0%} | {_label(row['method'])} | {row['model_mib']:.1f} | {row['ppl']:.3f}"
            f"{interval(row['ppl_ci95'])} | {row['ppl'] / w['original_ppl']:.2f} | {number(row.get('kl_to_original'), 3)} | "
            f"{row['top1_agreement']:.1%} | {diffs or '—'} |"
        )
    lines += ["", f"![perplexity vs model size]({rel('whole_model')})", "", *_other_texts(w)]
    return lines


def _other_texts(w: dict) -> list[str]:
    lines = []
    for text, scored in (w.get("other_texts") or {}).items():
        ev = scored["evaluation"]
        lines += [
            f"The same models at {scored['targets_ratio']:.4f} of attn+mlp (the model 20% smaller) on **{text}** "
            f"({ev['tokens']:,} tokens of its {ev['split']} split, never calibrated on; original "
            f"{scored['original']['ppl']:.3f}{interval(scored['original']['ppl_ci95'])}):",
            "",
            "| variant | perplexity [95% CI] | KL | top-1 |",
            "|---|---|---|---|",
            *[
                f"| {_label(name)} | {m['ppl']:.3f}{interval(m['ppl_ci95'])} | {m['kl_to_original']:.3f} | "
                f"{m['top1_agreement']:.1%} |"
                for name, m in scored["models"].items()
            ],
            "",
            "Paired differences there: "
            + "; ".join(
                f"{k.replace('_minus_', ' − ')}: {difference(v)}" for k, v in scored["differences"].items()
            )
            + ".",
            "",
        ]
    return lines


def whole_model_latency_lines(results: dict) -> list[str]:
    timed = results.get("whole_model_latency")
    if not timed:
        return []
    names = {"default": "default checkpoint (`load_compressed`)", "uniform": "`--uniform-mlp` checkpoint",
             "uniform-dense": "`--uniform-mlp`, `export-dense` (plain transformers)"}  # fmt: skip
    lines = [
        "",
        "**The model 20% smaller**, timed the same way against the original (each in its own process with the "
        "original): " + "; ".join(f"`{c}`" for c in timed["commands"].values()) + ".",
        "",
        "| model | on disk (MiB) | prefill (ms) | decode (ms) | prefill speed-up | decode speed-up |",
        "|---|---|---|---|---|---|",
    ]
    first = next(iter(k for k in names if k in timed))
    lines.append(
        f"| original | {results['inference_memory'].get('original_file_mib', 0):.1f} | "
        f"{timed[first]['original']['prefill_ms']:.1f} | {timed[first]['original']['decode_ms']:.1f} | 1 | 1 |"
    )
    for key, label in names.items():
        if key in timed:
            lat = timed[key]
            lines.append(
                f"| {label} | {timed['mib'][key]:.1f} | {lat['compressed']['prefill_ms']:.1f} | "
                f"{lat['compressed']['decode_ms']:.1f} | {1 / lat['prefill_ratio']:.3f}x | {1 / lat['decode_ratio']:.3f}x |"
            )
    lines += [
        "",
        f"- **Decode {results['whole_model_decode_speedup']:.3f}x faster** (target ≥ 1.15x; the bound, every "
        "weight read once per token, is 1/(1 − 0.2) = 1.25x) and **prefill "
        f"{results['whole_model_prefill_speedup']:.3f}x** (target: not slower). The original's row is the one timed "
        "beside the default checkpoint.",
        *_decode_ceiling_lines(timed.get("default", {})),
    ]
    return lines


def decode_speedup_ceiling(lat: dict) -> float | None:
    """The decode speed-up the compressed model could reach if the time inside its layers' weight-reading
    modules (attention projections and MLPs) fell exactly in proportion to the layer parameters removed and the
    rest of a step (output head, norms, rotary, attention over the cache, Python) stayed the original's."""
    o, k = lat.get("original", {}), lat.get("compressed", {})
    if "decode_mlp_ms" not in o or not o.get("layer_params") or "layer_params" not in k:
        return None
    removed = 1 - k["layer_params"] / o["layer_params"]
    saved = (o["decode_projection_ms"] + o["decode_mlp_ms"]) * removed
    return o["decode_ms"] / (o["decode_ms"] - saved)


def _decode_ceiling_lines(lat: dict) -> list[str]:
    ceiling = decode_speedup_ceiling(lat)
    if ceiling is None:
        return []
    o = lat["original"]
    layers = o["decode_projection_ms"] + o["decode_mlp_ms"]
    other = o["decode_ms"] - layers - o["decode_lm_head_ms"]
    removed = 1 - lat["compressed"]["layer_params"] / o["layer_params"]
    return [
        f"- Where the original's {o['decode_ms']:.0f} ms of decode go (hooks, separate runs): "
        f"{o['decode_projection_ms']:.0f} ms in the attention projections, {o['decode_mlp_ms']:.0f} ms in the "
        f"MLPs, {o['decode_lm_head_ms']:.0f} ms in the output head (not compressed), and {other:.0f} ms elsewhere "
        "(norms, rotary, attention over the cache, Python), which no weight compression shrinks. Removing "
        f"{100 * removed:.1f}% of the layers' parameters saves at most {100 * removed:.1f}% of their "
        f"{layers:.0f} ms: **the ceiling of the decode speed-up on this machine is {ceiling:.3f}x**, not 1.25x.",
    ]


# -- the choices behind the defaults ---------------------------------------------------------------------------
def choices_section(doc: Path) -> list[str]:
    parts = [
        _neuron_order(doc),
        _anchored(doc),
        _calibration_size(doc),
        _attention_forms(doc),
        _whole_model_forms(doc),
    ]
    body = [line for part in parts for line in part]
    if not body:
        return []
    return [
        "## 6. The choices behind the defaults (validation split)",
        "",
        "Each default was chosen on the **validation** split (58,765 tokens of held-out Wikipedia articles, never "
        "calibrated on, never used for the numbers above), by paired differences on the same windows; a "
        "difference whose 95% interval holds 0 is a tie. Each file records the command that measured it. The "
        "findings of earlier versions are in [docs/past-findings.md](docs/past-findings.md).",
        "",
        *body,
    ]


def _load(name: str):
    path = CHOICES / name
    return (path, json.loads(path.read_text())) if path.is_file() else (path, None)


def _neuron_order(doc: Path) -> list[str]:
    path, data = _load("neuron-selection-round2.json")
    if data is None:
        return []
    reference = next(k for k in data["rows"][0] if k.startswith("minus_"))
    lines = [
        "### Which neurons the MLP keeps (`--neuron-order`)",
        "",
        f"From {link(path, doc)}: every MLP keeps the same fraction of its neurons, attention untouched, "
        f"`down_proj` refit; original {data['original']['ppl']:.3f}. Orders: `greedy` (forward selection by output "
        "energy explained), `energy` (each neuron's own output energy), `leverage` (MoDeGPT's ridge leverage, "
        f"with its λ); the refit has no ridge (round 1, {link(CHOICES / 'neuron-selection-round1.json', doc)}, "
        "on the first 16,384 validation tokens: a ridge of 0.01 or 0.1 of mean(diag C) tied for `energy` and "
        "hurt `greedy`). Build times: the 30 layers' orders and tails on 2 shared cores (compare within the "
        "table).",
        "",
        f"| kept | order (λ) | perplexity [95% CI] | KL | minus `{reference.removeprefix('minus_')}` | build (s) |",
        "|---|---|---|---|---|---|",
    ]
    for r in data["rows"]:
        lam = f" ({r['order_ridge']:g})" if r["rule"] == "leverage" else ""
        is_reference = r["variant"].split("@")[0] == reference.removeprefix("minus_")
        lines.append(
            f"| {r['keep']:.0%} | `{r['rule']}`{lam} | {r['ppl']:.3f}{interval(r['ppl_ci95'])} | "
            f"{r['kl_to_original']:.3f} | {'—' if is_reference else difference(r[reference])} | "
            f"{r['build_seconds']:.0f} |"
        )
    return [*lines, "", "`greedy` is the default; `energy` (about 15× cheaper to compute) is the option.", ""]


def _anchored(doc: Path) -> list[str]:
    path, data = _load("anchored-refit-validation.json")
    if data is None:
        return []
    d, a = data["default"], data["anchored"]
    return [
        "### An anchored refit of `down_proj` (not kept)",
        "",
        f"From {link(path, doc)}, the model 20% smaller: every `down_proj` refit, layer by layer in one "
        "sequential pass, to map the compressed model's own kept activations to the original model's MLP output "
        f"(AA-SVD's closed form). Default {d['ppl']:.3f}{interval(d['ppl_ci95'])}, anchored "
        f"{a['ppl']:.3f}{interval(a['ppl_ci95'])}: **{difference(data['anchored_minus_default'])} worse** "
        f"(original {data['original']['ppl']:.3f}). It fits the calibration's compounded errors and loses on held-out "
        "text; the tool does not offer it.",
        "",
    ]


def _calibration_size(doc: Path) -> list[str]:
    path, data = _load("calibration-size-validation.json")
    if data is None:
        return []
    rows = ["| form | windows | perplexity | compression (s) |", "|---|---|---|---|"]
    notes = []
    for form, result in data["forms"].items():
        for windows, run in result["runs"].items():
            rows.append(
                f"| {form} | {windows} | {run['ppl']:.3f}{interval(run['ppl_ci95'])} | {run['compress_seconds']:.0f} |"
            )
        notes.append(f"{form} {difference(result['larger_minus_smaller'])}")
    return [
        "### Calibration windows for the model 20% smaller (`--native` takes twice the recipe's)",
        "",
        f"From {link(path, doc)}: `--targets attn,mlp --ratio {data['ratio_of_model']:g} --ratio-of model`, "
        f"validation split (first {data['max_tokens']:,} tokens), every checkpoint on the same windows; more "
        "windows minus fewer: " + "; ".join(notes) + ". `--native` (least-squares refits of `o_proj` and "
        "`down_proj`) now calibrates on twice the recipe's windows when the MLP is targeted. The default form "
        "gains as much, but it is not moved yet: every whole-model figure and its peers (which share the "
        "calibration) would have to be measured again (`make bench`, section 2). Compression times include a "
        "calibration read from the cache where an earlier run of the same windows had written it.",
        "",
        *rows,
        "",
    ]


# The attention-form comparisons, in the order they were measured (each file records its calibration and windows).
ATTENTION_FORM_FILES = ("attention-forms-validation.json", "attention-forms-validation-round2.json")


def _attention_forms(doc: Path) -> list[str]:
    tables = [_attention_forms_table(doc, *_load(name)) for name in ATTENTION_FORM_FILES]
    tables = [table for table in tables if table]
    if not tables:
        return []
    return [
        "### The attention's form of sharing (`--sharing`, `--basis-layers`) under the loss-aware allocation",
        "",
        *(line for table in tables for line in table),
    ]


def _attention_forms_table(doc: Path, path: Path, data: dict | None) -> list[str]:
    if data is None:
        return []
    rows = data["quality"]
    first = rows[0]["method"]
    methods = list(dict.fromkeys(r["method"] for r in rows))
    ratios = sorted({r["ratio"] for r in rows})
    at = {(r["method"], r["ratio"]): r for r in rows}
    key = f"{first}_minus_this"
    lines = [
        f"From {link(path, doc)}: attention only, at each ratio one calibration and one scoring pass; original "
        f"{data['original_ppl']:.3f}. Each cell: perplexity, then `{first}` minus it (paired; negative: `{first}` "
        "is better).",
        "",
        "| ratio | " + " | ".join(f"`{m}`" for m in methods) + " |",
        "|---|" + "---|" * len(methods),
    ]
    for ratio in ratios:
        cells = []
        for m in methods:
            r = at.get((m, ratio))
            cells.append(
                "—" if r is None else f"{r['ppl']:.3f}" + (f", {difference(r[key])}" if key in r else "")
            )
        lines.append(f"| {ratio:g} | " + " | ".join(cells) + " |")
    tokens = data.get("evaluation", {}).get("tokens")
    notes = [f"Scored on {tokens:,} validation tokens." if tokens else "", data.get("note", "")]
    return [*lines, "", *([" ".join(n for n in notes if n), ""] if any(notes) else [])]


def _whole_model_forms(doc: Path) -> list[str]:
    path, data = _load("whole-model-validation.json")
    if data is None:
        return []
    lines = [
        "### The whole model's form (the model 20% smaller)",
        "",
        f"From {link(path, doc)}; original {data['original_ppl']:.3f}.",
        "",
        "| variant | perplexity [95% CI] | KL | differences (paired) |",
        "|---|---|---|---|",
    ]
    for r in data["quality"]:
        diffs = "; ".join(
            f"− {k.removeprefix('minus_')}: {difference(v)}" for k, v in r.items() if k.startswith("minus_")
        )
        lines.append(
            f"| `{r['method']}` ({_label(r['method'])}) | {r['ppl']:.3f}{interval(r['ppl_ci95'])} | "
            f"{r['kl_to_original']:.3f} | {diffs or '—'} |"
        )
    return [*lines, ""]


#: `make bench-engines`' figures (merged into results.json): key -> (bound, "≤" or "≥", what it is).
ENGINE_TARGETS = {
    "gguf_ppl_ratio_f16_whole_test": (1.5, "≤", "`--native` model 20% smaller in llama.cpp (f16), perplexity / the "
                                      "original's, whole test split"),
    "gguf_ppl_ratio_f16": (1.5, "≤", "the same on the first 16,384 test tokens"),
    "gguf_decode_speedup_f16": (1.15, "≥", "its decode in llama.cpp (1 thread) / the original's, f16"),
    "gguf_decode_speedup_q8_0": (1.15, "≥", "the same at q8_0"),
    "gguf_prefill_speedup_f16": (1.0, "≥", "its prefill in llama.cpp / the original's, f16"),
    "gguf_f32_ppl_over_transformers": (1.005, "≤", "its f32 GGUF's perplexity in llama.cpp / the checkpoint's"),
    "gguf_q8_0_ppl_over_f16": (1.03, "≤", "its q8_0 GGUF's perplexity / its f16's"),
}  # fmt: skip


def engines_summary(results: dict) -> list[str]:
    """The engine figures (benchmarks/results/engines.md), where `make bench-engines` has merged them."""
    rows = []
    for key, (bound, sign, what) in ENGINE_TARGETS.items():
        if not isinstance(results.get(key), (int, float)):
            continue
        met = results[key] <= bound if sign == "≤" else results[key] >= bound
        rows.append(
            f"| {what} (`{key}`, [engines](benchmarks/results/engines.md)) | {results[key]:.3f}x | {sign} {bound:g}x | "
            f"{'met' if met else '**missed**'} |"
        )
    return rows
