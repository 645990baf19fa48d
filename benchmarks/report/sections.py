"""Sections of BENCHMARKS.md beyond the attention benchmark: the whole model (curve, second domain, speed of the
model 20% smaller) and the engines' summary rows, from results.json (the choices behind the defaults:
`benchmarks.report.choices`).
"""

from __future__ import annotations

import re
from pathlib import Path

from benchmarks.report.markdown import difference, interval, number
from benchmarks.report.plots import (
    CURVE_STYLE,
    MIN_TARGETS,
    REPO,
    STAGE_LABELS,
    TARGETS,
    WHOLE_MODEL_AIMS,
    label,
    whole_model_run,
)
from benchmarks.report.zero_shot import zero_shot_lines

DEFAULT = "masa-attn-mlp"


def verdict(key: str, results: dict) -> str:
    if not isinstance(results.get(key), (int, float)):
        return "not measured"
    if key in MIN_TARGETS:
        return "met" if results[key] >= MIN_TARGETS[key][0] else "**missed**"
    return "met" if results[key] <= TARGETS[key][0] else "**missed**"


def compression_section(results: dict, rel) -> list[str]:
    c, whole, demo = results["compression"], results.get("whole_model_compression"), results.get("demo")
    whole_bf16 = results.get("whole_model_bfloat16_compression")
    bf16_skipped = (whole_bf16 or {}).get("skipped")
    whole_bf16 = None if bf16_skipped else whole_bf16  # a column only for a run that was timed
    runs = (
        {"attention 0.2": c}
        | ({"model 20% smaller": whole} if whole else {})
        | ({"model 20% smaller, `--calib-precision bfloat16`": whole_bf16} if whole_bf16 else {})
    )
    bracketed = "forward_after" in c
    seen = {k for run in runs.values() for k in run["stage_seconds"]}
    order = [*STAGE_LABELS, *sorted(seen - set(STAGE_LABELS))]  # the pipeline's order; `other` last
    stages = sorted(seen, key=lambda k: (k == "other", order.index(k)))
    lines = [
        "## 3. The compression run: time and memory per stage",
        "",
        "Real runs in fresh processes (`--no-stats-cache`: the capture is timed, never read from a cache; "
        "calibration tokens: "
        + ", ".join(
            f"{name} {r['calibration']['samples']}×{r['calibration']['seq_len']}" for name, r in runs.items()
        )
        + "; no evaluation): "
        f"`{c['command']}`"
        + (f", `{whole['command']}`" if whole else "")
        + (f" and `{whole_bf16['command']}`" if whole_bf16 else "")
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
        f"| reference: one plain forward pass over the run's calibration tokens (batch {c['forward']['batch_size']}, "
        "no hooks, fresh process"
        + ("; the mean of one before and one after the run" if bracketed else "")
        + ") | "
        + " | ".join("{:.1f} ({})".format(*_forward(r, c)) for r in runs.values())
        + " |",
        "",
        f"- **Attention 0.2: {results['compress_over_forward']:.2f}x one plain forward pass** "
        f"(target ≤ {TARGETS['compress_over_forward'][0]:g}x: {verdict('compress_over_forward', results)}"
        f"{_drift(c)}); "
        f"calibration capture alone {c['stage_seconds'].get('calibration', 0) / c['forward_seconds']:.2f}x (target ≤ "
        f"{TARGETS['calibration_over_forward'][0]:g}x: {verdict('calibration_over_forward', results)}).",
    ]
    lines += _whole_model_bullets(results, c, whole, whole_bf16)
    if bf16_skipped:
        lines.append(f"- `--calib-precision bfloat16`: {bf16_skipped}.")
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


def _forward(run: dict, attention: dict) -> tuple[float, str]:
    """The plain forward pass a run's time is compared with, as (seconds, "windows×tokens[; before / after]"):
    its own over its calibration windows (the mean of one before and one after the run, both shown), or (results
    from before the model 20% smaller took the recipe's `mlp_samples`) the attention run's, over the same windows
    then."""
    own = run if "forward" in run else attention
    label = f"{own['forward']['windows']}×{own['forward']['seq_len']}"
    if "forward_after" in own:
        label += f"; {own['forward']['seconds']:.1f} before, {own['forward_after']['seconds']:.1f} after"
    return own["forward_seconds"], label


def _drift(run: dict) -> str:
    """The ratio against each of the two forwards around a run (the machine's drift during it), if timed so."""
    if "forward_after" not in run:
        return ""
    low, high = sorted(run["compress_seconds"] / run[key]["seconds"] for key in ("forward", "forward_after"))
    if f"{low:.2f}" == f"{high:.2f}":  # the two forwards agree: the machine held its speed through the run
        return f"; {low:.2f}x against either forward alone"
    return f"; {low:.2f}x to {high:.2f}x against the forward before or after it alone"


def _whole_model_bullets(results: dict, c: dict, whole: dict | None, whole_bf16: dict | None) -> list[str]:
    """Section 3's lines on the model 20% smaller: where its time goes, and with bfloat16 calibration."""
    bullets: list[str] = []
    if whole:
        forward = _forward(whole, c)[0]
        whole_capture = whole["stage_seconds"].get("calibration", 0) / forward
        attention_capture = c["stage_seconds"].get("calibration", 0) / c["forward_seconds"]
        target = TARGETS["whole_model_compress_over_forward"][0]
        bullets.append(
            f"- **The model 20% smaller: {results['whole_model_compress_over_forward']:.3f}x** (target ≤ "
            f"{TARGETS['whole_model_compress_over_forward'][0]:g}x: "
            f"{verdict('whole_model_compress_over_forward', results)}{_drift(whole)}); its largest stage is "
            f"{STAGE_LABELS.get(whole['dominant_stage'], whole['dominant_stage'])}, "
            f"{whole_capture:.2f}x one forward pass by itself: beside the attention's ({attention_capture:.2f}x), "
            "it sums the autocorrelations of the MLP's inputs, `down_proj`'s as wide as the MLP (each token's "
            "product costs width² multiply-adds at every layer, halved to about (1 + 256/width)/2 by taking only "
            f"the blocks above the diagonal). Under the {target:g}x target the rest of the run (sensitivity, "
            f"neuron orders, SVDs, allocation, saving) would have {target - whole_capture:.2f}x; it takes "
            f"{whole['compress_seconds'] / forward - whole_capture:.2f}x, of which the neuron orders "
            f"{whole['stage_seconds'].get('neuron_selection', 0) / forward:.2f}x."
        )
    if whole_bf16:
        ratio = results["whole_model_bfloat16_compress_over_forward"]
        target = TARGETS["whole_model_compress_over_forward"][0]
        capture = whole_bf16["stage_seconds"].get("calibration", 0) / _forward(whole or whole_bf16, c)[0]
        native = "natively" if whole_bf16.get("native_bfloat16_cpu") else "without native support (emulated)"
        bullets.append(
            f"- **With `--calib-precision bfloat16`: {ratio:.3f}x** ({'within' if ratio <= target else 'above'} the "
            f"{target:g}x target), its capture {capture:.2f}x: the calibration's matrix products in bfloat16 "
            f"(autocast; this CPU multiplies bfloat16 {native}), the statistics still summed in fp64. Not the "
            "default: its perplexity cost on the validation split is in section 6."
        )
    return bullets


#: What each variant of section 2 is, by its name in the results.
VARIANT_TEXT = {
    "masa-attn-mlp": "the default (the MLP keeps a subset of its neurons, `down_proj` refit by least squares, each "
    "layer's width from the loss-aware allocation)",
    "masa-attn-mlp-uniform": "`--uniform-mlp` (the same width in every layer: the base architecture with a smaller "
    "`intermediate_size`, which `export-dense` writes as a standard checkpoint with the same logits)",
    "masa-attn-mlp-lowrank": "`--mlp lowrank` (whitened low-rank factors of gate/up/down)",
    "flap-attn-mlp": "FLAP (`--method flap`: whole heads and neurons by the fluctuation metric, a compensating bias, "
    "nothing refit; An et al. 2024)",
    "modegpt-attn-mlp": "MoDeGPT (`--method modegpt`: q/k dimensions in rotary pairs, value heads at a rank, the "
    "MLP's neurons by ridge leverage with down_proj refit, each layer's share from its block influence; Lin et al. "
    "2025)",
    "svd-llm-attn-mlp": "SVD-LLM (the same kept fraction of every matrix)",
}


def _repo_path(path: str) -> str:
    """A file's path from the repository root (as the page links it), or as given outside the repository."""
    found = Path(path).resolve()
    return found.relative_to(REPO).as_posix() if found.is_relative_to(REPO) else found.as_posix()


def _curve_order(method: str) -> int:
    return list(CURVE_STYLE).index(method) if method in CURVE_STYLE else len(CURVE_STYLE)


def _default_ratios(w: dict) -> dict[float, float]:
    """The default's perplexity over the original's, per fraction of the model removed."""
    return {r["model_ratio"]: r["ppl"] / w["original_ppl"] for r in w["quality"] if r["method"] == DEFAULT}


def _aim_verdict(value: float, aim: float) -> str:
    return "met" if value <= aim else "**missed**"


def whole_model_summary(results: dict) -> list[str]:
    """The summary's rows of the whole model: the default's perplexity ratio at each fraction it was aimed at."""
    w = whole_model_run(results)
    ratios = _default_ratios(w) if w else {}
    rows = []
    for fraction, aim in WHOLE_MODEL_AIMS.items():
        if fraction in ratios:
            key = (
                " (`whole_model_ppl_ratio`)" if fraction == 0.2 and "whole_model_ppl_ratio" in results else ""
            )
            rows.append(
                f"| perplexity of the model {fraction:.0%} smaller / the original's (test split, section 2){key} | "
                f"{ratios[fraction]:.3f}x | ≤ {aim:.2f}x | {_aim_verdict(ratios[fraction], aim)} |"
            )
    return rows


def whole_model_section(results: dict, rel) -> list[str]:
    w = whole_model_run(results)
    if not w:
        return []
    cal, ev = w["calibration"], w["evaluation"]
    methods = sorted({r["method"] for r in w["quality"]}, key=_curve_order)
    source = ""
    if w.get("_path"):
        path = _repo_path(w["_path"])
        command = re.sub(r" --out \S+", "", w["command"])  # where it was first written; the file is linked
        source = f" Measured by `{command}` ([`{path}`]({path}))."
    lines = [
        "## 2. The whole model: attention and MLP (`--targets attn,mlp --ratio-of model`)",
        "",
        "`masa-compress MODEL --targets attn,mlp --ratio R --ratio-of model` makes the model R smaller, taking the "
        f"numbers from every linear projection of its layers.{source} One calibration ({cal['samples']}×"
        f"{cal['seq_len']} tokens of {cal['text']}, MLP inputs included), every model scored with the original in "
        f"one pass over the {ev['tokens']:,} tokens of the **{ev['split']}** split (original "
        f"**{w['original_ppl']:.3f}**{interval(w['original_ppl_ci95'])}). Size: the model's float32 weights "
        f"({w['model_mib_before']:.1f} MiB before). Variants: "
        + "; ".join(VARIANT_TEXT.get(m, f"`{m}`") for m in methods)
        + ". Differences are paired, on the same windows"
        + (
            "; rise ratio: the default's perplexity rise over SVD-LLM's"
            if any("rise_ratio_vs_svd_llm" in r for r in w["quality"])
            else ""
        )
        + "; time: the method's own stages, after the calibration all share"
        + (f" ({w['calibration_seconds']:.0f} s)" if w.get("calibration_seconds") else "")
        + ".",
        "",
        "| removed of the model | variant | model MiB | perplexity [95% CI] | × original | KL | top-1 | time (s) | "
        "differences (paired) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in sorted(w["quality"], key=lambda r: (r["model_ratio"], _curve_order(r["method"]))):
        diffs = "; ".join(
            f"− {k.removeprefix('minus_')}: {difference(v)}" for k, v in row.items() if k.startswith("minus_")
        )
        if "rise_ratio_vs_svd_llm" in row:
            diffs += f"; rise ratio {row['rise_ratio_vs_svd_llm']:.3f}"
        lines.append(
            f"| {row['model_ratio']:.0%} | {label(row['method'])} | {row['model_mib']:.1f} | {row['ppl']:.3f}"
            f"{interval(row['ppl_ci95'])} | {row['ppl'] / w['original_ppl']:.2f} | {number(row.get('kl_to_original'), 3)} | "
            f"{row['top1_agreement']:.1%} | {_method_seconds(row)} | {diffs or '—'} |"
        )
    ratios = _default_ratios(w)
    aims = [
        f"the model {fraction:.0%} smaller {ratios[fraction]:.3f}x the original's perplexity (aim ≤ {aim:.2f}x: "
        f"{_aim_verdict(ratios[fraction], aim)})"
        for fraction, aim in WHOLE_MODEL_AIMS.items()
        if fraction in ratios
    ]
    lines += [
        "",
        *([f"- **The default's aims**: {'; '.join(aims)}.", ""] if aims else []),
        f"![perplexity vs model size]({rel('whole_model')})",
        "",
        *_other_texts(w),
        *zero_shot_lines(),
    ]
    return lines


def _method_seconds(row: dict) -> str:
    """The seconds of a variant's own stages (sensitivity, neuron orders, factors...), calibration excluded."""
    stages = row.get("stage_seconds")
    return f"{sum(stages.values()):.0f}" if stages else "—"


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
                f"| {label(name)} | {m['ppl']:.3f}{interval(m['ppl_ci95'])} | {m['kl_to_original']:.3f} | "
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
    for key, name in names.items():
        if key in timed:
            lat = timed[key]
            lines.append(
                f"| {name} | {timed['mib'][key]:.1f} | {lat['compressed']['prefill_ms']:.1f} | "
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
