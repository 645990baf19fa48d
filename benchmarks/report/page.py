"""The one renderer of BENCHMARKS.md: the page and its PNG plots from `benchmarks/results/results.json` (what
`make bench` measured) and the validation runs in `benchmarks/results/choices/` (no measurement here).

`python -m benchmarks.report [--results benchmarks/results/results.json] [--doc BENCHMARKS.md]` re-renders after
an edit of the templates, without running anything again.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from benchmarks.engines.large import summary_rows as large_summary_rows
from benchmarks.report.bytes import bytes_section
from benchmarks.report.choices import choices_section
from benchmarks.report.markdown import difference, interval, mib, number
from benchmarks.report.memory_projection import (
    LARGER_THAN_MEMORY_BOUND,
    larger_than_memory_section,
    projection_section,
)
from benchmarks.report.plan_time import plan_time_section
from benchmarks.report.plots import MIN_TARGETS, REPO, TARGETS, UNITS, _width_name, write_plots
from benchmarks.report.sections import (
    compression_section,
    engines_summary,
    verdict,
    whole_model_latency_lines,
    whole_model_section,
    whole_model_summary,
)

__all__ = ["MIN_TARGETS", "REPO", "TARGETS", "render"]


def _summary(results: dict) -> list[str]:
    rows = ["| measure | value | target | |", "|---|---|---|---|"]
    rows += large_summary_rows(results)  # first: the user's scale (`make bench-large`), where it was run
    for targets, sign in ((TARGETS, "≤"), (MIN_TARGETS, "≥")):
        for key, (bound, what) in targets.items():
            if key not in results:  # a figure the results do not hold: no row
                continue
            unit = UNITS.get(key, "x")
            value = "—" if results[key] is None else f"{results[key]:.3f}{unit}"
            rows.append(f"| {what} (`{key}`) | {value} | {sign} {bound:g}{unit} | {verdict(key, results)} |")
    rows += whole_model_summary(results)
    rows += _scaling_summary(results)
    rows += engines_summary(results)
    rows.append(
        f"| decode latency, compressed attention / original (`decode_latency_ratio`) | "
        f"{results['decode_latency_ratio']:.3f}x | (information) | |"
    )
    return rows


def _scaling_summary(results: dict) -> list[str]:
    """The layer-sequential pipeline's other targets: the deep model's peak, the same checkpoint."""
    s, deep = results.get("scaling", {}), results.get("larger_than_memory")
    rows = []
    if deep:
        ratio = deep["peak_rss_bytes"] / deep["weights_bytes"]
        verdict = "met" if ratio < LARGER_THAN_MEMORY_BOUND else "**missed**"
        rows.append(
            f"| peak RSS of the {deep['layers']}-layer model's `--layerwise` run / its weights "
            f"(`larger_than_memory`) | {ratio:.3f}x | < {LARGER_THAN_MEMORY_BOUND:g}x | {verdict} |"
        )
    if "same_checkpoint" in s:
        same = s["same_checkpoint"]["identical"]
        rows.append(
            f"| `--layerwise` checkpoint = the in-memory one ({s['same_checkpoint']['layers']} layers) | "
            f"{'identical' if same else 'different'} | identical | {'met' if same else '**missed**'} |"
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
            f"| `{r['method']}` | {r['ratio']:g} | {r['achieved_ratio']:.4f} | {r['ppl']:.3f}{interval(r.get('ppl_ci95'))} "
            f"| {number(kl, 4)} | {'—' if top1 is None else f'{top1:.1%}'} | {difference(r.get('default_minus_this'))} |"
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
            f"{interval(h['original']['ppl_ci95'])} | {models[default]['ppl']:.3f}{interval(models[default]['ppl_ci95'])} | "
            f"{models[baseline]['ppl']:.3f}{interval(models[baseline]['ppl_ci95'])} | "
            f"{difference(h.get('default_minus_baseline'))} |"
        )
    return [*lines, ""]


def _quality_section(results: dict, rel) -> list[str]:
    details = results.get("quality_details", {})
    cal, ev = details.get("calibration", {}), details.get("evaluation", {})
    lines = [
        "## 1. Attention: quality at equal size",
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
        f"Original model: perplexity **{results['original_ppl']:.3f}**{interval(results.get('original_ppl_ci95'))}.",
        "",
        *_quality_table(results),
        "",
        *_headline_table(results),
        f"![perplexity vs attention parameters kept]({rel('quality')})",
        "",
    ]
    return lines


def _latency_section(results: dict, rel) -> list[str]:
    lat = results["latency"]
    o, k = lat["original"], lat["compressed"]
    mem = results.get("inference_memory", {})

    def row(label, a, b, digits=1):
        ratio = "—" if not a or b is None else f"{b / a:.3f}x"
        return f"| {label} | {number(a, digits)} | {number(b, digits)} | {ratio} |"

    lines = [
        f"## 4. Inference: the reloaded compressed checkpoint{'s' if results.get('whole_model_latency') else ''} vs the original",
        "",
        f"The attention-only checkpoint written in section 3 is reloaded with `load_compressed`; both models run in one "
        f"process ({lat['torch_threads']} torch thread{'s' if lat['torch_threads'] != 1 else ''}), measured "
        "alternately. Prefill: the "
        f"first {lat['prefill_tokens']} tokens of the held-out text with a KV cache and last-token logits, as "
        f"`generate` does (median of {lat['repeats']} runs after a warm-up). Decode: {lat['decode_tokens']} "
        f"greedy single-token steps with the KV cache after that prefill (median of {lat['repeats']} runs). "
        "Memory: each model alone in a fresh process (load, one prefill, one decode).",
        "",
        "| | original | compressed | ratio |",
        "|---|---|---|---|",
        *[row(*spec) for spec in _latency_rows(lat, mem)],
        "",
        f"- **Prefill ratio {results['prefill_latency_ratio']:.3f}x** (target ≤ 1.15x: "
        f"{verdict('prefill_latency_ratio', results)}); **decode ratio {results['decode_latency_ratio']:.3f}x**.",
        f"- Greedy decoding: {lat['decoded_tokens_equal_to_original']} of the {lat['decode_tokens']} tokens "
        "equal the original model's (the models differ by design; shown for orientation).",
    ]
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
    lines += ["", f"![latency]({rel('latency')})", *whole_model_latency_lines(results), ""]
    return lines


def _latency_rows(lat: dict, mem: dict) -> list[tuple]:
    """(label, original, compressed[, digits]) of the latency table."""
    o, k = lat["original"], lat["compressed"]
    mo, mk = mem.get("original", {}), mem.get("compressed", {})
    projections = "… of which inside q/k/v/o projections (ms)"
    return [
        (f"prefill of {lat['prefill_tokens']} tokens (ms)", o["prefill_ms"], k["prefill_ms"]),
        (projections, o["prefill_projection_ms"], k["prefill_projection_ms"]),
        (f"decode of {lat['decode_tokens']} tokens (ms)", o["decode_ms"], k["decode_ms"]),
        (projections, o["decode_projection_ms"], k["decode_projection_ms"]),
        ("decode per token (ms)", o["decode_ms_per_token"], k["decode_ms_per_token"], 2),
        ("parameters (millions, shared tensors once)", o["params"] / 1e6, k["params"] / 1e6, 2),
        ("parameter memory (MiB)", o["param_gib"] * 1024, k["param_gib"] * 1024),
        ("weights on disk (MiB, safetensors)", mem.get("original_file_mib"), mem.get("compressed_file_mib")),
        ("RSS after loading (MiB)", mib(mo, "rss_after_load_gib"), mib(mk, "rss_after_load_gib")),
        ("peak RSS over load + prefill + decode (MiB)", mib(mo, "peak_rss_gib"), mib(mk, "peak_rss_gib")),
    ]


def _scaling_section(results: dict, rel) -> list[str]:
    s = results["scaling"]
    if s.get("mode") != "layerwise":  # measured before the layer-sequential pipeline: nothing to show
        return [
            "## 5. Scaling with depth",
            "",
            "Re-run `python -m benchmarks.suite.run --sections scaling`.",
            "",
        ]
    runs, first = s["runs"], s["runs"][0]
    width, cal = first["width"], first["calibration"]
    lines = [
        "## 5. Scaling with depth: the layer-sequential pipeline",
        "",
        f"Random Llama models of {_width_name(width)} (hidden {width['hidden_size']}, "
        f"{width['num_attention_heads']} heads, {width['num_key_value_heads']} KV heads, MLP "
        f"{width['intermediate_size']}, vocabulary {width['vocab_size']}, tied embeddings) with "
        + ", ".join(str(r["layers"]) for r in runs)
        + f" layers, compressed with `--layerwise` (masa with the smollm2-135m recipe settings, ratio "
        f"{first['ratio']:g}; {cal['samples']}×{cal['seq_len']} random calibration tokens, "
        f"{first['sensitivity_windows']} loss-sensitivity windows). Each depth runs in a fresh process that "
        "loads the model with its decoder layers left in their safetensors files, runs every calibration and "
        "sensitivity pass one layer at a time (the fp64 statistics spilled per layer), spills each finished "
        "layer and writes the checkpoint tensor by tensor. *Loaded* is the RSS once the model is loaded that "
        "way; *peak* is the process's high-water mark (`VmHWM`); *overhead* = peak − loaded.",
        "",
        "| layers | parameters (M) | weights on disk (MiB) | RSS loaded (MiB) | peak RSS (MiB) | overhead (MiB) "
        "| spilled statistics (MiB) | load / calibration / sensitivity / compress / save (s) |",
        "|---|---|---|---|---|---|---|---|",
        *[_scaling_row(r) for r in runs],
        "",
        *_scaling_verdicts(results),
        "",
        f"![scaling]({rel('scaling')})",
        "",
    ]
    deep = results.get("larger_than_memory")
    lines += larger_than_memory_section(deep) if deep else []
    return lines + projection_section(runs, deep["run"] if deep else None)


def _scaling_row(r: dict) -> str:
    stages = " / ".join(
        f"{r['seconds'][k]:.1f}" for k in ("load", "calibration", "sensitivity", "compress", "save")
    )
    return (
        f"| {r['layers']} | {r['model_params'] / 1e6:.1f} | {r['weights_bytes'] / 2**20:,.0f} | "
        f"{r['rss_loaded_gib'] * 1024:,.0f} | {r['peak_rss_gib'] * 1024:,.0f} | {r['overhead_gib'] * 1024:,.0f} | "
        f"{r['spilled_stats_bytes'] / 2**20:,.0f} | {stages} |"
    )


def _scaling_verdicts(results: dict) -> list[str]:
    """The targets' lines, each verdict from the numbers."""
    s = results["scaling"]
    runs = {r["layers"]: r for r in s["runs"]}
    (a, b), (c, e) = s["peak_ratio_depths"], s["overhead_growth_depths"]
    weights = runs[b]["weights_bytes"] / runs[a]["weights_bytes"]
    return [
        f"- **Peak RSS at {b} / {a} layers: {s['peak_ratio']:.3f}x** (target ≤ "
        f"{TARGETS['depth_memory_ratio'][0]:g}x: {verdict('depth_memory_ratio', results)}), while the weights on "
        f"disk grow {weights:.2f}x.",
        f"- **Overhead at {e} / {c} layers: {s['overhead_growth']:.3f}x** (target ≤ "
        f"{TARGETS['depth_overhead_growth'][0]:g}x: {verdict('depth_overhead_growth', results)}): "
        f"{runs[c]['overhead_gib'] * 1024:,.0f} → {runs[e]['overhead_gib'] * 1024:,.0f} MiB.",
        _same_checkpoint(s),
        f"- Compression time (calibration to save) at {e} / {c} layers: {s['time_ratio']:.2f}x.",
    ]


def _same_checkpoint(s: dict) -> str:
    same, first = s["same_checkpoint"], s["runs"][0]
    memory = first.get("in_memory") or {}
    verdict = "met" if same["identical"] else "**missed**"
    line = (
        f"- **The layer-sequential checkpoint at {same['layers']} layers is "
        f"{'byte-for-byte identical to' if same['identical'] else 'not identical to'} the in-memory path's** "
        f"(SHA-256 of the safetensors; target identical: {verdict})."
    )
    if memory:
        line += (
            f" The in-memory path (no `--layerwise`) peaked at {memory['peak_rss_gib'] * 1024:,.0f} MiB (overhead "
            f"{memory['overhead_gib'] * 1024:,.0f} MiB, {memory['seconds']:.1f} s) against the layer-sequential "
            f"run's {first['peak_rss_gib'] * 1024:,.0f} MiB (overhead {first['overhead_gib'] * 1024:,.0f} MiB)."
        )
    return line


def _merged_note(results: dict) -> list[str]:
    """Sections re-run separately (`--sections`) carry their own dates and machines: say so."""
    if not results.get("merged"):
        return []
    dates = results.get("section_dates") or {}
    machines = results.get("section_machines") or {}
    lines = [
        "**Sections measured in separate runs and merged** (`--sections`): "
        + ", ".join(f"{name} at {date}" for name, date in dates.items())
        + ".",
        "",
    ]
    # A ratio of two timings depends on the machine (its vector units, its memory): say which sections came from
    # which, rather than let the header's machine, the last run's, speak for all of them.
    by_machine: dict[str, list[str]] = {}
    for name in dates:
        by_machine.setdefault(machines.get(name, "a machine not recorded"), []).append(name)
    if machines and len(by_machine) > 1:
        lines += [
            "**Not all on one machine**: "
            + "; ".join(f"{', '.join(names)} on {machine}" for machine, names in by_machine.items())
            + ". Timings and their ratios compare only within a machine.",
            "",
        ]
    return lines


def _vector_note(machine: dict) -> str:
    """The CPU's vector extension and whether it multiplies bfloat16 natively (results written before these were
    recorded: nothing)."""
    if "vector_extension" not in machine:
        return ""
    bfloat16 = "native bfloat16" if machine.get("native_bfloat16") else "bfloat16 emulated"
    return f" ({machine['vector_extension'] or 'vector extension unknown'}, {bfloat16})"


def _run_minutes(results: dict) -> float:
    """This run's own wall time; results written before it was recorded give the sections' total."""
    return results.get("this_run_minutes", results["wall_minutes"])


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
        + f" on {results['date']} in {_run_minutes(results):.1f} minutes"
        + (
            f" (the merged sections took {results['wall_minutes']:.1f} minutes in all)"
            if results.get("merged")
            else ""
        )
        + (" (**quick mode**: reduced settings for CI, not for reading)" if results.get("quick") else "")
        + (
            ". Every number below comes from that one run, so the ratios compare like with like"
            if not results.get("merged")
            else ""
        )
        + f". Raw numbers: [`{raw}`]({raw}); re-render this page from them with `python -m benchmarks.report`.",
        "",
        "**Machine:** "
        f"{m['cpu']}{_vector_note(m)}, {m['cores']} cores ({m['usable_cores']} usable), {m['ram_gib']} GiB RAM, {m['os']}; "
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
        *whole_model_section(results, rel),
        *compression_section(results, rel),
        *_latency_section(results, rel),
        *_scaling_section(results, rel),
    ]
    lines += plan_time_section()
    lines += choices_section(doc)
    lines += bytes_section()
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
    parser.add_argument("--results", default=str(REPO / "benchmarks" / "results" / "results.json"))
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
