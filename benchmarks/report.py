"""Render BENCHMARKS.md and its PNG plots from `benchmarks/results.json` (no measurement here).

`python -m benchmarks.report [--results benchmarks/results.json] [--doc BENCHMARKS.md]` re-renders after
an edit of the template below, without running anything again.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from benchmarks.markdown import _ci, _difference, _f, _mib
from benchmarks.plots import REPO, STAGE_LABELS, TARGETS, _width_name, write_plots
from benchmarks.report_committed import (
    _ablation_section,
    _basis_sharing_section,
    _calibration_size_section,
    _mlp_section,
    _shape_search_section,
    _sharing_forms_section,
    _sharing_section,
)
from benchmarks.report_whole_model import whole_model_section

__all__ = ["REPO", "TARGETS", "render"]


def _verdict(key: str, results: dict) -> str:
    bound, _ = TARGETS[key]
    return "met" if results[key] <= bound else "**missed**"


def _summary(results: dict) -> list[str]:
    scaling = results["scaling"]
    rows = [
        "| measure | value | target | |",
        "|---|---|---|---|",
    ]
    for key, (bound, what) in TARGETS.items():
        rows.append(f"| {what} (`{key}`) | {results[key]:.3f}x | ≤ {bound:g}x | {_verdict(key, results)} |")
    rows += [
        f"| compression *overhead* at 2x depth / at 1x depth: peak RSS minus RSS with the model loaded "
        f"(`depth_memory_overhead_ratio`) | {results['depth_memory_overhead_ratio']:.3f}x | (information) | |",
        f"| compression time at 2x depth / at 1x depth (`depth_time_ratio`) | {scaling['time_ratio']:.3f}x "
        "| (information) | |",
        f"| decode latency, compressed / original (`decode_latency_ratio`) | "
        f"{results['decode_latency_ratio']:.3f}x | (information) | |",
    ]
    latency = results.get("latency", {})
    if "prefill_ratio_to_previous" in latency:  # today's default vs the former one, same ratio, one process
        for phase in ("prefill", "decode"):
            value = latency[f"{phase}_ratio_to_previous"]
            rows.append(
                f"| {phase} latency, default checkpoint / the former default's (`{phase}_ratio_to_previous`) | "
                f"{value:.3f}x | ≤ 1x (no slower) | {'met' if value <= 1.0 else '**missed**'} |"
            )
    return rows


def _quality_table(results: dict) -> list[str]:
    rows = results["quality"]
    details = results.get("quality_details", {})
    default = details.get("default", rows[0]["method"])
    lines = [
        f"| method | ratio | achieved | perplexity [95% CI] | KL from original | top-1 agreement | "
        f"`{default}` minus this [95% CI] |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in sorted(rows, key=lambda r: (r["ratio"], r["method"] != default)):
        kl, top1 = r.get("kl_to_original"), r.get("top1_agreement")
        lines.append(
            f"| `{r['method']}` | {r['ratio']:g} | {r['achieved_ratio']:.4f} | {r['ppl']:.3f}{_ci(r.get('ppl_ci95'))} "
            f"| {_f(kl, 4)} | {'—' if top1 is None else f'{top1:.1%}'} | {_difference(r.get('default_minus_this'))} |"
        )
    return lines


def _headline_table(results: dict) -> list[str]:
    headline = results.get("headline_evaluations") or {}
    if not headline:
        return []
    details = results.get("headline_details", {})
    default, baseline = details.get("default", "masa"), details.get("baseline", "svd-llm")
    lines = [
        f"The headline pair at ratio {details.get('ratio', 0.2):g} on other windows and text (section "
        "`headline`: same calibration and settings, so the same compressed models; test split of each text):",
        "",
        f"| evaluation | tokens | original | `{default}` | `{baseline}` | `{default}` minus `{baseline}` [95% CI] |",
        "|---|---|---|---|---|---|",
    ]
    for h in headline.values():
        ev, models = h["evaluation"], h["models"]
        lines.append(
            f"| {ev['text']}, {ev['seq_len']}-token windows | {ev['tokens']:,} | {h['original']['ppl']:.3f}"
            f"{_ci(h['original']['ppl_ci95'])} | {models[default]['ppl']:.3f}{_ci(models[default]['ppl_ci95'])} | "
            f"{models[baseline]['ppl']:.3f}{_ci(models[baseline]['ppl_ci95'])} | "
            f"{_difference(h.get('default_minus_baseline'))} |"
        )
    return [*lines, ""]


def _quality_section(results: dict, rel) -> list[str]:
    details = results.get("quality_details", {})
    cal, ev = details.get("calibration", {}), details.get("evaluation", {})
    lines = [
        "## 1. Quality at equal size",
        "",
        f"Model: {details.get('model', '?')}. Calibration: {cal.get('samples', '?')} windows × "
        f"{cal.get('seq_len', '?')} tokens of {cal.get('text', '?')} (seed {cal.get('seed', '?')}), "
        f"collected **once** on the original model and reused by every method and ratio. Evaluation: the "
        f"**{ev.get('split', '?')}** split, {ev.get('tokens', '?'):,} predicted tokens of {ev.get('text', '?')} in "
        f"non-overlapping windows of {ev.get('seq_len', '?')} tokens, every model scored with the original in "
        "one pass over the same windows. `ratio` is the fraction of attention parameters removed (achieved: "
        "counted exactly). Intervals: 95% percentile bootstrap over windows (1000 resamples, seed 0); the last "
        "column is a *paired* bootstrap of the difference on the same windows, and a difference whose interval "
        "contains 0 is a tie. KL from original: mean KL(p_original ‖ p_model) in nats per predicted token.",
        "",
        f"Original model: perplexity **{results['original_ppl']:.3f}**{_ci(results.get('original_ppl_ci95'))}.",
        "",
        *_quality_table(results),
        "",
        *_headline_table(results),
        f"![perplexity vs attention parameters kept]({rel('quality')})",
        "",
    ]
    return lines


def _compression_section(results: dict, rel) -> list[str]:
    c = results["compression"]
    total = c["compress_seconds"]
    lines = [
        "## 2. The compression run: time and memory per stage",
        "",
        f"One real run in a fresh process: `{c['command']}` (method masa, recipe defaults, "
        f"{c['calibration']['samples']}×{c['calibration']['seq_len']} calibration tokens; no evaluation). "
        "Stage times from the run's own summary (`seconds`); peak RSS is the process's high-water mark "
        "(`VmHWM`).",
        "",
        "| stage | seconds | share |",
        "|---|---|---|",
    ]
    for key, value in c["stage_seconds"].items():
        lines.append(f"| {STAGE_LABELS.get(key, key)} | {value:.1f} | {100 * value / total:.0f}% |")
    lines += [
        f"| **compression (sum of the stages above)** | **{total:.1f}** | 100% |",
        f"| *not counted:* loading the model | {c['load_seconds']:.1f} | |",
        f"| *not counted:* reading and tokenizing the calibration text, setup | {c['other_seconds']:.1f} | |",
        f"| reference: one plain forward pass over the same {c['forward']['windows']}×{c['forward']['seq_len']} "
        f"tokens (batch {c['forward']['batch_size']}, no hooks, fresh process) | {c['forward_seconds']:.1f} | |",
        "",
        f"- **Compression time / one plain forward pass: {results['compress_over_forward']:.2f}x** "
        f"(target ≤ 5x: {_verdict('compress_over_forward', results)}); counting the whole process except "
        f"loading the model: {c['compress_over_forward_wall']:.2f}x.",
        f"- The largest stage is {STAGE_LABELS.get(c['dominant_stage'], c['dominant_stage'])} "
        f"({100 * c['stage_seconds'][c['dominant_stage']] / total:.0f}%); calibration capture costs "
        f"{c['stage_seconds'].get('calibration', 0) / c['forward_seconds']:.2f}x the plain forward pass "
        "(the hooks add the fp64 autocorrelations).",
        f"- Peak RSS of the run: **{c['peak_rss_gib']:.2f} GiB**; achieved ratio {c['achieved_ratio']:.4f}; "
        f"checkpoint {c['checkpoint_mib']:.1f} MiB.",
        "",
        f"![time per stage]({rel('stages')})",
        "",
    ]
    return lines


def _latency_section(results: dict, rel) -> list[str]:
    lat = results["latency"]
    o, k = lat["original"], lat["compressed"]
    mem = results.get("inference_memory", {})
    mo, mk = mem.get("original", {}), mem.get("compressed", {})

    def row(label, a, b, digits=1):
        ratio = "—" if not a or b is None else f"{b / a:.3f}x"
        return f"| {label} | {_f(a, digits)} | {_f(b, digits)} | {ratio} |"

    lines = [
        "## 3. Inference: the reloaded compressed checkpoint vs the original",
        "",
        f"The checkpoint written in section 2 is reloaded with `load_compressed`; both models run in one "
        f"process ({lat['torch_threads']} torch thread{'s' if lat['torch_threads'] != 1 else ''}), measured "
        "alternately. Prefill: the "
        f"first {lat['prefill_tokens']} tokens of the held-out text with a KV cache and last-token logits, as "
        f"`generate` does (median of {lat['repeats']} runs after a warm-up). Decode: {lat['decode_tokens']} "
        f"greedy single-token steps with the KV cache after that prefill (median of {lat['repeats']} runs). "
        "Memory: each model alone in a fresh process (load, one prefill, one decode).",
        "",
        "| | original | compressed | ratio |",
        "|---|---|---|---|",
        row(f"prefill of {lat['prefill_tokens']} tokens (ms)", o["prefill_ms"], k["prefill_ms"]),
        row(
            "… of which inside q/k/v/o projections (ms)",
            o["prefill_projection_ms"],
            k["prefill_projection_ms"],
        ),
        row(f"decode of {lat['decode_tokens']} tokens (ms)", o["decode_ms"], k["decode_ms"]),
        row(
            "… of which inside q/k/v/o projections (ms)", o["decode_projection_ms"], k["decode_projection_ms"]
        ),
        row("decode per token (ms)", o["decode_ms_per_token"], k["decode_ms_per_token"], 2),
        row("parameters (millions, shared tensors once)", o["params"] / 1e6, k["params"] / 1e6, 2),
        row("parameter memory (MiB)", o["param_gib"] * 1024, k["param_gib"] * 1024),
        row(
            "weights on disk (MiB, safetensors)", mem.get("original_file_mib"), mem.get("compressed_file_mib")
        ),
        row("RSS after loading (MiB)", _mib(mo, "rss_after_load_gib"), _mib(mk, "rss_after_load_gib")),
        row(
            "peak RSS over load + prefill + decode (MiB)", _mib(mo, "peak_rss_gib"), _mib(mk, "peak_rss_gib")
        ),
        "",
        f"- **Prefill ratio {results['prefill_latency_ratio']:.3f}x** (target ≤ 1.15x: "
        f"{_verdict('prefill_latency_ratio', results)}); **decode ratio {results['decode_latency_ratio']:.3f}x**.",
        f"- Greedy decoding: {lat['decoded_tokens_equal_to_original']} of the {lat['decode_tokens']} tokens "
        "equal the original model's (the models differ by design; shown for orientation).",
    ]
    previous = lat.get("previous")
    if previous:  # the former default's checkpoint at the same ratio, timed in the same process
        lines.append(
            f"- Against the former default (`{lat.get('previous_settings', '--sharing atoms')}`, same ratio and "
            f"calibration, timed alongside): prefill {previous['prefill_ms']:,.1f} ms, decode "
            f"{previous['decode_ms']:,.1f} ms; today's default takes **{lat['prefill_ratio_to_previous']:.3f}x** "
            f"its prefill and **{lat['decode_ratio_to_previous']:.3f}x** its decode."
        )
    for phase, key in (("prefill", "prefill_latency_ratio"), ("decode", "decode_latency_ratio")):
        extra = k[f"{phase}_ms"] - o[f"{phase}_ms"]
        if results[key] <= TARGETS["prefill_latency_ratio"][0] or extra <= 0:
            continue
        extra_proj = k[f"{phase}_projection_ms"] - o[f"{phase}_projection_ms"]
        lines.append(
            f"- What dominates the extra {extra:.1f} ms of {phase}: the attention projections take "
            f"{extra_proj:+.1f} ms more in the compressed model ({o[f'{phase}_projection_ms']:.1f} → "
            f"{k[f'{phase}_projection_ms']:.1f} ms, timed with hooks in separate runs); the rest of the model "
            f"runs identical code in both, so the remaining {extra - extra_proj:+.1f} ms is not the compressed "
            "modules' doing (noise between runs). "
            + (
                "Per decoded token each shared projection first materializes Σ c·D (an out×in tensor written, "
                "then read by the matmul) and then applies the residual factors: at one token per step this "
                "memory traffic is about twice that of the dense weight it replaces, plus the factors."
                if phase == "decode"
                else "For long inputs each shared projection rebuilds its dense weight (Σ c·D + A·B, an "
                "out×in×r operation) before the matmul."
            )
        )
    lines += ["", f"![latency]({rel('latency')})", ""]
    return lines


def _scaling_section(results: dict, rel) -> list[str]:
    s = results["scaling"]
    runs = s["runs"]
    width = runs[0]["width"]
    cal = runs[0]["calibration"]
    lines = [
        "## 4. Scaling with depth",
        "",
        f"Random Llama models of {_width_name(width)}: hidden {width['hidden_size']}, "
        f"{width['num_attention_heads']} heads, {width['num_key_value_heads']} KV heads, MLP "
        f"{width['intermediate_size']}, vocabulary {width['vocab_size']}, tied embeddings; with "
        + " and ".join(str(r["layers"]) for r in runs)
        + f" layers; the same {cal['samples']}×{cal['seq_len']} random calibration tokens; the real "
        f"`collect_statistics` + `compress_model` (masa with the smollm2-135m recipe settings, ratio "
        f"{runs[0]['ratio']:g}) + `save_compressed`, "
        "each depth in a fresh process. *Peak RSS* is the process's high-water mark (`VmHWM`); *with the model "
        "loaded* is "
        "its RSS once the model is built (Python, torch and the weights); *overhead* is the difference, "
        "what the compression run adds on top of the model.",
        "",
        "| layers | parameters (M) | weights (MiB) | autocorrelation stats (MiB) | RSS with the model "
        "loaded (MiB) | peak RSS (MiB) | overhead (MiB) | compression time (s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        lines.append(
            f"| {r['layers']} | {r['model_params'] / 1e6:.1f} | {r['model_gib'] * 1024:.0f} | "
            f"{r['stats_gib'] * 1024:.0f} | {r['rss_after_model_gib'] * 1024:.0f} | "
            f"{r['peak_rss_gib'] * 1024:.0f} | {r['overhead_gib'] * 1024:.0f} | {r['compress_seconds']:.1f} |"
        )
    peak_stage = _peak_stage(runs[-1])
    lines += [
        "",
        f"- **Raw peak RSS ratio ({s['depth_factor']:g}x depth): {s['peak_ratio']:.3f}x** (target ≤ 1.2x: "
        f"{_verdict('depth_memory_ratio', results)}). The model itself grows {s['model_ratio']:.2f}x "
        "(its weights are part of every peak).",
        f"- **Compression overhead ratio (peak minus the loaded model): {s['overhead_ratio']:.3f}x**; the "
        f"overhead at {runs[0]['layers']} → {runs[-1]['layers']} layers grows {runs[0]['overhead_gib'] * 1024:.0f} "
        f"→ {runs[-1]['overhead_gib'] * 1024:.0f} MiB. What grows with depth: the fp64 autocorrelations "
        f"collected for all layers at once ({runs[0]['stats_gib'] * 1024:.0f} → {runs[-1]['stats_gib'] * 1024:.0f}"
        " MiB, 2 matrices per layer, needed until the allocation has seen every layer) and the fp64 stack of the "
        "largest group's weights that Matrix PCA decomposes (transient, about 2·L_g·out·in·8 bytes for one "
        f"projection type: {_pca_stack_pair(runs)} MiB); the Cholesky factors are freed layer by layer. "
        "Streaming the Gram matrix and the atoms layer by layer (and offloading the statistics) would flatten "
        "both; the model's own weights grow "
        f"{s['model_ratio']:.2f}x. The peak is reached during the stage: {peak_stage}.",
        f"- Compression time ratio: {s['time_ratio']:.2f}x for {s['depth_factor']:g}x the layers.",
        "",
        f"![scaling]({rel('scaling')})",
        "",
    ]
    return lines


def _pca_stack_pair(runs: list[dict]) -> str:
    """Size of Matrix PCA's fp64 input for the largest group (q_proj, the widest square projection), per run:
    the stacked weights and matrix_pca's flattened copy of them."""
    sizes = []
    for run in runs:
        hidden = run["width"]["hidden_size"]
        largest = max(len(g) for g in run.get("groups") or [[0] * (run["layers"] - 2)])
        sizes.append(2 * largest * hidden * hidden * 8 / 2**20)
    return " → ".join(f"{v:.0f}" for v in sizes)


def _gib_pair(runs: list[dict], key: str) -> str:
    if not all(key in r for r in runs):
        return "?"
    return f"{runs[0][key] * 1024:.0f} → {runs[-1][key] * 1024:.0f}"


def _peak_stage(run: dict) -> str:
    """The first stage after which the process had reached its final peak RSS."""
    final = run["peak_rss_gib"]
    for stage, peak in run["peak_gib_after"].items():
        if peak >= final - 1e-9:
            return stage
    return "?"


def _merged_note(results: dict) -> list[str]:
    """Sections re-run separately (`--sections`) carry their own dates: say so."""
    if not results.get("merged"):
        return []
    dates = results.get("section_dates") or {}
    return [
        "**Sections measured in separate runs and merged** (`--sections`): "
        + ", ".join(f"{name} at {date}" for name, date in dates.items())
        + ".",
        "",
    ]


def render_markdown(results: dict, doc: Path, plots: dict[str, Path]) -> str:
    def rel(name: str) -> str:
        return Path(os.path.relpath(plots[name], doc.parent)).as_posix()

    m = results["machine"]
    load = m.get("load_average_start")
    raw = Path(os.path.relpath(results["_results_path"], doc.parent)).as_posix()
    lines = [
        "# Benchmarks",
        "",
        f"Generated by `{results['command']}`"
        + (f" (`{results['make_target']}`)" if results.get("make_target") else "")
        + f" on {results['date']} in {results['wall_minutes']:.1f} minutes"
        + (" (**quick mode**: reduced settings for CI, not for reading)" if results.get("quick") else "")
        + (
            ". Every number below comes from that one run, so the ratios compare like with like"
            if not results.get("merged")
            else ""
        )
        + f". Raw numbers: [`{raw}`]({raw}); re-render this page from them with `python -m benchmarks.report`.",
        "",
        "**Machine:** "
        f"{m['cpu']}, {m['cores']} cores ({m['usable_cores']} usable), {m['ram_gib']} GiB RAM, {m['os']}; "
        f"Python {m['python']}, torch {m['torch']} ({m['torch_threads']} thread"
        + ("s" if m["torch_threads"] != 1 else "")
        + (
            ", set with `--threads` (the quick mode sets 1)"
            if m.get("threads_requested")
            else ", torch's default"
        )
        + f"), transformers {m['transformers']}; device {m['device']}."
        + (
            f" Load average at the start: {load[0]:.2f} (1 min); at the end: {m['load_average_end'][0]:.2f}."
            if load
            else ""
        ),
        "",
        *_merged_note(results),
        "## Summary",
        "",
        *_summary(results),
        "",
        *_quality_section(results, rel),
        *_compression_section(results, rel),
        *_latency_section(results, rel),
        *_scaling_section(results, rel),
    ]
    lines += whole_model_section(doc)
    lines += _ablation_section(doc)
    lines += _calibration_size_section(doc)
    lines += _mlp_section(doc)
    lines += _shape_search_section(doc)
    lines += _sharing_section(doc)
    lines += _sharing_forms_section(doc)
    lines += _basis_sharing_section(doc, results)
    notes = results.get("notes") or []
    if notes:
        lines += ["## Notes", "", *[f"- {n}" for n in notes], ""]
    return "\n".join(lines).rstrip() + "\n"


def render(results: dict, results_path: Path, doc: Path, plot_dir: Path) -> list[Path]:
    """Write the plots and the markdown page; return every file written."""
    plots = write_plots(results, plot_dir)
    text = render_markdown({**results, "_results_path": str(results_path)}, doc, plots)
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(text)
    return [doc, *plots.values()]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--results", default=str(REPO / "benchmarks" / "results.json"))
    parser.add_argument("--doc", default=str(REPO / "BENCHMARKS.md"))
    parser.add_argument("--plot-dir", help="default: the folder of --results")
    args = parser.parse_args(argv)
    results_path = Path(args.results)
    results = json.loads(results_path.read_text())
    written = render(results, results_path, Path(args.doc), Path(args.plot_dir or results_path.parent))
    for path in written:
        print(path)


if __name__ == "__main__":
    main()
