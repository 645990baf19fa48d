"""README.md's figures, rendered from the committed results files (no measurement here, no figure typed by hand).

Four blocks of README.md are written here, each between its markers: the GGUF files by their bytes
(`bytes_table`, from `bytes-smollm2-135m.json`, `make bench-bytes`), the results table (`results_table`: today's
defaults on the bundled SmolLM2-135M and on Qwen2.5-Coder-1.5B, beside the peers measured on the same
calibration), the limitations that carry a figure (`limitations`), and the support matrix (`support.py`: from
the family registry, which tests/test_families.py holds to it). `python -m benchmarks.report` refreshes
them with BENCHMARKS.md; tests/test_figures.py checks that the committed README is their render.

Sources, all under `benchmarks/results/`:
- `results.json` (`make bench`): the original's perplexity, SVD-LLM at 20% of the attention (`quality`), the
  inference latencies, `make demo`'s run (`demo`), the machine;
- `sensitivity-windows-test.json`: the default at 20% of the attention with today's 4 loss-sensitivity windows
  (`results.json`'s `quality` row of the default was measured with 16, the count before);
- `whole-model-256-test.json`: the model 20% smaller, FLAP and MoDeGPT on the default's 256 calibration windows;
- `large.json` (`make bench-large`): Qwen2.5-Coder-1.5B;
- `engines.json` (`make bench-engines`): the `--native` model and the original in llama.cpp.
A peer measured on another calibration than the default's (SVD-LLM at the model 20% smaller: 64 windows, where
the default takes 256) is left out rather than annotated.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

from benchmarks.report.byte_choices import only_types_sentence
from benchmarks.report.bytes import CAVEATS, by_budget
from benchmarks.report.eval_speed import llama_cpp_eval_limitation
from benchmarks.report.markdown import reading
from benchmarks.report.plots import MIN_TARGETS, REPO, WHOLE_MODEL_AIMS
from benchmarks.report.speed_limit import speed_limit_sentence
from benchmarks.report.support import support_matrix

RESULTS_DIR = REPO / "benchmarks" / "results"
README = REPO / "README.md"
BLOCKS = ("results", "limitations")
PEER_NAMES = {"svd-llm": "SVD-LLM", "flap": "FLAP", "modegpt": "MoDeGPT"}


def _load(results_dir: Path, name: str) -> dict:
    return json.loads((Path(results_dir) / name).read_text())


def _ppl(value: float, original: float, bold: bool = False) -> str:
    text = f"{value:.2f}"
    return f"{f'**{text}**' if bold else text} ({value / original:.2f}x)"


def _peers(peers: list[tuple[str, float]], original: float) -> str:
    return (
        ", ".join(f"{name} {_ppl(ppl, original)}" for name, ppl in sorted(peers, key=lambda p: p[1])) or "—"
    )


def _bundled_rows(results_dir: Path) -> list[str]:
    results = _load(results_dir, "results.json")
    windows = _load(results_dir, "sensitivity-windows-test.json")
    whole = _load(results_dir, "whole-model-256-test.json")
    original = results["original_ppl"]
    tokens = results["quality_details"]["evaluation"]["tokens"]
    calib = results["quality_details"]["calibration"]
    attention = windows["targets"]["attention"]["runs"]["4"]
    assert windows["targets"]["attention"]["options"] == {"ratio": 0.2} and attention["tokens"] == tokens
    svd = next(r for r in results["quality"] if r["method"] == "svd-llm" and r["ratio"] == 0.2)
    latency = results["latency"]
    before, after = (latency[m]["param_gib"] * 1024 for m in ("original", "compressed"))
    rows = [
        f"| SmolLM2-135M (bundled) | 20% of the attention: `--ratio 0.2` | {calib['samples']} | "
        f"{before:.1f} → {after:.1f} MiB | all {tokens:,} | {original:.2f} → {_ppl(attention['ppl'], original, True)} "
        f"| {_peers([('SVD-LLM', svd['ppl'])], original)} |"
    ]
    assert whole["evaluation"]["tokens"] == tokens
    at_20 = [r for r in whole["quality"] if r["model_ratio"] == 0.2]
    default = next(r for r in at_20 if r["method"] == "masa-attn-mlp")
    peers = [(PEER_NAMES[r["method"].split("-attn")[0]], r["ppl"]) for r in at_20 if r is not default]
    rows.append(
        "| SmolLM2-135M | the model 20% smaller: `--targets attn,mlp --ratio 0.2 --ratio-of model` | "
        f"{whole['calibration']['mlp_samples']} | {whole['model_mib_before']:.1f} → {default['model_mib']:.1f} MiB | "
        f"all {whole['evaluation']['tokens']:,} | {whole['original_ppl']:.2f} → "
        f"{_ppl(default['ppl'], whole['original_ppl'], True)} | {_peers(peers, whole['original_ppl'])} |"
    )
    return rows


def _large_rows(results_dir: Path) -> list[str]:
    runs = _load(results_dir, "large.json")["runs"]
    rows = []
    for name, what in (
        ("attention", "20% of the attention: `--ratio 0.2`"),
        ("whole", "the model 20% smaller: `... --ratio-of model --layerwise`"),
    ):
        run = runs[name]["run"]
        calibration = run["settings"]["calibration"]
        peers = [
            (PEER_NAMES[other["run"]["method"]], other["run"]["ppl_after"])
            for key, other in runs.items()
            if key == f"{name}-svd-llm" and other["run"]["settings"]["calibration"] == calibration
        ]
        quality, original = run["quality"], run["ppl_before"]
        rows.append(
            f"| Qwen2.5-Coder-1.5B | {what} | {calibration['samples']} | {run['weights_bytes_before'] / 2**30:.2f} → "
            f"{run['weights_bytes_after'] / 2**30:.2f} GiB | first {quality['tokens']:,} | {original:.2f} → "
            f"{_ppl(run['ppl_after'], original, True)} | {_peers(peers, original)} |"
        )
    return rows


def _dates_and_machines(results_dir: Path) -> tuple[str, str, str]:
    results = _load(results_dir, "results.json")
    large = _load(results_dir, "large.json")
    dates = [results["section_dates"]["quality"], results["section_dates"]["compression"]]
    dates += [run["date"] for run in large["runs"].values()]
    days = sorted(d[:10] for d in dates)
    machines = {(m["cpu"], m["cores"]) for m in (results["machine"], large["machine"])}
    machine = " and ".join(f"{cores}-core {cpu}" for cpu, cores in sorted(machines))
    return days[0], days[-1], machine


def results_table(results_dir: Path = RESULTS_DIR) -> str:
    """The README's one results table: today's defaults beside the peers measured on the same calibration."""
    results_dir = Path(results_dir)
    results = _load(results_dir, "results.json")
    first, last, machine = _dates_and_machines(results_dir)
    demo = results["demo"]
    lines = [
        "| model | what you ask for | calibration windows (512 tokens) | weights (float32) | test tokens scored "
        "| perplexity: original → compressed (× original) | peers at the same size and calibration |",
        "|---|---|---|---|---|---|---|",
        *_bundled_rows(results_dir),
        *_large_rows(results_dir),
        "",
        "Perplexity on 512-token windows of the test split of the Wikipedia text (never calibrated on). The peers "
        "are re-implemented from their papers and read the same calibration statistics. "
        f"`make demo` (after the installation, its evaluation capped to the first {demo['quality']['tokens']:,} "
        f"predicted test tokens) took {results['demo_minutes']:.1f} minutes. Measured from {first} to {last} on a {machine} "
        "CPU, no GPU; intervals, KL and top-1 agreement: [BENCHMARKS.md](BENCHMARKS.md).",
    ]
    return "\n".join(lines)


def bytes_table(results_dir: Path = RESULTS_DIR) -> str:
    """The README's first table: GGUF files by their bytes in llama.cpp, llama.cpp's own mixes (quantized with the
    tool's importance weights) against `export --size` at each one's bytes (`make bench-bytes`): the 1.5B model
    (rows of 256s: the k-quants fit), then the bundled model."""
    parts = []
    for name, title in (
        ("qwen2.5-coder-1.5b", "Qwen2.5-Coder-1.5B"),
        ("smollm2-135m", "SmolLM2-135M (bundled)"),
    ):
        path = Path(results_dir) / f"bytes-{name}.json"
        if path.is_file():
            parts.append(_bytes_rows(json.loads(path.read_text()), name, title))
    if not parts:
        return "Not measured yet: `make bench-bytes` writes `benchmarks/results/bytes-smollm2-135m.json`."
    return "\n\n".join(parts)


def _bytes_rows(data: dict, name: str, title: str) -> str:
    p = data["protocol"]
    structure = any(row.get("ours") == "structure" for row in data["frontier"])
    ours = "`compress --size`" if structure else "`export --size`"
    kl = {(r["type"], r["imatrix"]): r["kl"] for r in data["rows"] if "kl" in r}
    paired_kl = all("kl_diff" in row for row in data["frontier"])  # the run kept each window's KL
    if paired_kl:  # led by the KL, as llama.cpp's users compare files
        lines = [
            "| budget (the size of llama.cpp's mix) | mean KL to the original: mix → ours (× the mix's) | "
            f"ours − mix [95%] | {ours}: MiB | perplexity: mix → ours, ours − mix [95%] |",
            "|---|---|---|---|---|",
        ]
    else:
        lines = [
            "| budget (the size of llama.cpp's mix) | llama.cpp's mix, same importance weights: perplexity | "
            f"{ours}: MiB, perplexity | ours − mix [95%] | mean KL to the original: mix → ours (× the mix's) |",
            "|---|---|---|---|---|",
        ]
    for row in by_budget(data):
        verdict = reading(row["diff_lo"], row["diff_hi"], "**better**", "worse")
        mix_kl, ours_kl = kl[(row["type"], "calibration")], kl[(row["type"], row.get("ours", "size"))]
        if paired_kl:
            kl_verdict = reading(row["kl_diff_lo"], row["kl_diff_hi"], "**closer**", "further")
            lines.append(
                f"| {row['type']}: {row['baseline_bytes'] / 2**20:.1f} MiB | {mix_kl:.4f} → {ours_kl:.4f} "
                f"({ours_kl / mix_kl:.2f}x) | {row['kl_diff']:+.4f} [{row['kl_diff_lo']:+.4f}, "
                f"{row['kl_diff_hi']:+.4f}] {kl_verdict} | {row['ours_bytes'] / 2**20:.1f} | "
                f"{row['baseline_ppl']:.2f} → {row['ours_ppl']:.2f}, {row['diff']:+.2f} "
                f"[{row['diff_lo']:+.2f}, {row['diff_hi']:+.2f}] {verdict} |"
            )
            continue
        lines.append(
            f"| {row['type']}: {row['baseline_bytes'] / 2**20:.1f} MiB | {row['baseline_ppl']:.2f} | "
            f"{row['ours_bytes'] / 2**20:.1f}, {row['ours_ppl']:.2f} | {row['diff']:+.2f} "
            f"[{row['diff_lo']:+.2f}, {row['diff_hi']:+.2f}] {verdict} | {mix_kl:.4f} → {ours_kl:.4f} "
            f"({ours_kl / mix_kl:.2f}x) |"
        )
    gains = data["imatrix_gain"]
    gain = ", ".join(
        f"{t} {g['plain_minus_imatrix']:+.2f} [{g['ci95'][0]:+.2f}, {g['ci95'][1]:+.2f}]"
        for t, g in ((t, gains[t]) for t in ("q4_k_m", "q3_k_m", "q2_k") if t in gains)
    )
    f16, f16_kl = next((r["ppl"], r["kl"]) for r in data["rows"] if r["type"] == "f16")
    lines += [
        "",
        f"{title} as GGUF files run by llama.cpp: perplexity on the first {p['tokens']:,} predicted tokens of the "
        f"test split ({p['windows']} windows of {p['seq_len']}), paired on the same windows; the original at f16: "
        f"{f16:.2f}. The KL is per predicted token, to the original's next-token distribution in transformers, "
        f"averaged (the f16 file's own: {f16_kl:.1e}, what the engine adds on a float file)"
        + (
            "; its difference paired over the same windows. "
            if paired_kl
            else "; its intervals need the frontier measured again (the runs kept no per-window KL). "
        )
        + f"{_structure_reading(data) if structure else 'Types only: no structure in these files.'} "
        f"The importance weights alone (llama.cpp's mix without them minus with them): {gain}. "
        + CAVEATS[name]
        + f" Every row: [benchmarks/results/bytes-{name}.md](benchmarks/results/bytes-{name}.md).",
    ]
    return "\n".join(lines)


def _structure_reading(data: dict) -> str:
    """What the structure did in the frontier's files: where the allocation removed parameters, and what that did
    against the types-only file of the same bytes (paired), on the ladder and under it."""
    rows = [*by_budget(data), *data.get("below_ladder", [])]
    removed = [r for r in rows if r.get("removed_parameters")]
    if not removed:
        return "The allocation removed no parameter at any of these budgets: each file is a per-matrix mix of types."
    parts = []
    for row in removed:
        versus = ""
        if "minus_types_only" in row:
            lo, hi = row["minus_types_only_ci95"]
            versus = (f", against types alone of the same bytes {row['minus_types_only']:+.2f} [{lo:+.2f}, {hi:+.2f}] "
                      f"{reading(lo, hi, 'better', 'worse')}")  # fmt: skip
        elif "ours_ppl" in row:
            versus = f", perplexity {row['ours_ppl']:.2f} where types alone cannot reach these bytes"
        parts.append(f"{row['type']}: {row['removed_parameters']:,} parameters removed{versus}")
    kept = [r["type"] for r in rows if not r.get("removed_parameters")]
    return (
        "Where the allocation chose structure (narrower MLPs, fewer query heads) with the types: "
        + "; ".join(parts)
        + (f"; none at {', '.join(kept)}." if kept else ".")
    )


def _whole_model_decode(results: dict) -> str:
    """The model 20% smaller's decode speed-up, where results.json holds one measured on today's default."""
    speedup, aim = results.get("whole_model_decode_speedup"), MIN_TARGETS.get("whole_model_decode_speedup")
    if speedup is None or aim is None:
        return "; the model 20% smaller (narrower MLPs) is not timed with the current defaults"
    return f"; the model 20% smaller decodes {speedup:.2f}x faster, short of the {aim[0]:.2f}x aimed at"


def _size_instead(results: dict) -> str:
    """What to use instead for a GGUF within a size, with how its files fared against llama.cpp's mixes."""
    rows = [row for key in ("bytes_frontier_bundled", "bytes_frontier_1p5b") for row in results.get(key, [])]
    better = sum(row["diff_hi"] < 0 for row in rows)
    worse = sum(row["diff_lo"] > 0 for row in rows)
    fared = (
        f"against llama.cpp's mix of the same bytes a `--size` file was better at {better} of the {len(rows)} budgets "
        f"of the two models, worse at {worse or 'none'}, a tie at the rest"
    )
    return (
        " For a GGUF within a size use `compress --size` (or `export --size`, types alone), which chooses structure only where "
        f"the allocation predicts it pays: {fared} (the bytes table)." + _structure_overrated()
    )


def _structure_overrated(path: Path | None = None) -> str:
    """Where a measured `compress --size` file (structure chosen) scored worse than `export --size` (types alone)
    of the same budget on the same windows: the structure's loss predicted too low there, said with its figures,
    and, once measured (`guarded`), what the same command writes since a byte budget prices structure only on
    enough calibration tokens (`byte_structure.LEAST_TOKENS_PER_INPUT`)."""
    path = path or RESULTS_DIR / "size-structure-qwen2.5-coder-1.5b.json"
    frontier = RESULTS_DIR / "bytes-qwen2.5-coder-1.5b.json"
    if not path.is_file() or not frontier.is_file():
        return ""
    run = json.loads(path.read_text())
    scored, chosen = run["llama_cpp"], run["compress"]
    rows = json.loads(frontier.read_text())["frontier"]
    row = next((row for row in rows if row["baseline_bytes"] == chosen["budget"]), None)  # types alone
    if row is None or scored["ppl"] <= row["ours_ppl"]:
        return ""
    removed = chosen["structure"]["removed_parameters"] / (
        chosen["parameters"] + chosen["structure"]["removed_parameters"]
    )
    said = (
        f" But on Qwen2.5-Coder-1.5B at the bytes of llama.cpp's {row['type']} mix, `compress --size` had removed "
        f"{removed:.0%} of the parameters and scored {scored['ppl']:.2f} on the same {scored['tokens']:,} test tokens "
        f"where `export --size` scored {row['ours_ppl']:.2f} and the mix {row['baseline_ppl']:.2f} (one run, no interval): "
        f"it predicted a loss rise of {chosen['structure']['predicted_loss_rise']:.3f} nats per token and "
        f"{scored['nll'] - math.log(scored['ppl_original']):.3f} was measured"
    )
    guarded = run.get("guarded")
    if guarded is None:
        return (
            said + ", so its structure error is predicted too low on that model; use `export --size` there."
        )
    removed_now = guarded["compress"]["structure"].get("removed_parameters", 0)
    return (
        said + ": its refits' errors came from the recipe's "
        f"{guarded['calibration_tokens'] / guarded['mlp_width']:.1f} calibration tokens per MLP neuron, far below "
        "their errors on new text (BENCHMARKS.md section 7). A byte budget now offers structure only from "
        f"{guarded['least_tokens_per_input']} tokens per input, and the same command "
        + ("writes types alone" if not removed_now else f"removes {removed_now:,} parameters")
        + f": {guarded['llama_cpp']['ppl']:.2f} on those tokens."
    )


def _engines_limitation(engines: dict, default_windows: int, results: dict) -> str:
    """Bytes in llama.cpp: the figures where `make bench-engines` measured a `--native` model calibrated as today's
    default (the windows its run recorded); else the finding alone, its figures not today's."""
    claim = (
        "- **At equal bytes, plain quantization beats a model made smaller at a fixed ratio in llama.cpp.**"
    )
    instead = _size_instead(results)
    if engines["compression"]["native"].get("calibration_windows") != default_windows:
        return (
            f"{claim} Measured on a `--native` model calibrated on fewer windows than today's default, so its "
            "figures are not repeated here; `make bench-engines` measures them again (benchmarks/README.md)."
            + instead
        )
    rows = {(r["model"], r["type"]): r for r in engines["llama_cpp"]}
    native = rows[("native", "q8_0")]
    smaller = sorted(
        (r for (model, _), r in rows.items() if model == "original" and r["bytes"] <= native["bytes"]),
        key=lambda r: -r["bytes"],
    )
    beaten = [r for r in smaller if r["ppl"] < native["ppl"]]
    quantized = ", ".join(f"{r['type']} ({r['bytes'] / 2**20:.1f} MiB) {r['ppl']:.2f}" for r in beaten)
    if not beaten:
        claim = "- **In llama.cpp, at equal bytes:**"
    return (
        f"{claim} The `--native` model 20% smaller at q8_0 ({native['bytes'] / 2**20:.1f} MiB) scores "
        f"{native['ppl']:.2f}; the original quantized alone, no larger: {quantized or 'none scores better'} (test "
        f"split, first {native['tokens']:,} tokens). What it gains there is speed: it decodes "
        f"{engines['gguf_decode_speedup_f16']:.2f}x as fast as the original at f16." + instead
    )


def limitations(results_dir: Path = RESULTS_DIR) -> str:
    """The README's limitations that carry a figure."""
    results_dir = Path(results_dir)
    results = _load(results_dir, "results.json")
    engines = _load(results_dir, "engines.json")
    whole = _load(results_dir, "whole-model-256-test.json")
    large = _load(results_dir, "large.json")["runs"]["whole"]["run"]
    engines_line = _engines_limitation(engines, whole["calibration"]["mlp_samples"], results)
    ratio = next(r for r in whole["quality"] if r["method"] == "masa-attn-mlp" and r["model_ratio"] == 0.2)
    lines = [
        engines_line,
        "- **Factored forms are not faster in transformers.** The default's checkpoint (20% of the attention in "
        f"low-rank factors) decodes 64 tokens in {results['decode_latency_ratio']:.2f}x the original's time "
        f"(prefill {results['prefill_latency_ratio']:.2f}x)" + _whole_model_decode(results) + ".",
        f"- **The model 20% smaller misses the {WHOLE_MODEL_AIMS[0.2]:.2f}x aim**: {ratio['ppl_ratio']:.2f}x the "
        f"original's perplexity on SmolLM2-135M, {large['quality']['ppl_ratio']:.2f}x on Qwen2.5-Coder-1.5B; "
        "the MLP carries most of the loss (docs/method.md, stage 5).",
        _size_decode(results_dir),
        llama_cpp_eval_limitation(results_dir),
    ]
    return "\n".join(line for line in lines if line)


#: The bytes results files and the names the README gives their models.
BYTES_MODELS = {"qwen2.5-coder-1.5b": "Qwen2.5-Coder-1.5B", "smollm2-135m": "SmolLM2-135M"}


def _size_decode(results_dir: Path) -> str:
    """Where a `--size` file decodes slower than llama.cpp's mix of the same bytes (1 thread, the bytes runs'
    timings), each with the two commonest matrix types of both files: the allocation prices bytes and the loss,
    not the speed of llama.cpp's kernel for each type."""
    slower, faster = [], []
    for model, title in BYTES_MODELS.items():
        path = results_dir / f"bytes-{model}.json"
        if not path.is_file():
            continue
        data = json.loads(path.read_text())
        files = {(row["type"], row["imatrix"]): row for row in data["rows"]}
        timed = [row for row in data["frontier"] if "decode_ratio" in row]
        faster += [row["decode_ratio"] for row in timed if row["decode_ratio"] >= 1]
        budgets = [
            f"{row['type']} {row['decode_ratio']:.2f}x (ours {_commonest(_ours(files, row['type']))}; "
            f"the mix {_commonest(files[(row['type'], 'calibration')])})"
            for row in timed
            if row["decode_ratio"] < 1
        ]
        if budgets:
            slower.append(f"on {title} at {', '.join(budgets)}")
    if not slower:
        return ""
    elsewhere = f"; at the other timed budgets {min(faster):.2f}-{max(faster):.2f}x" if faster else ""
    return (
        "- **A `--size` file can decode slower than llama.cpp's mix of the same bytes** (llama.cpp on the CPU, 1 "
        f"thread, ours / the mix's tokens/s): {'; '.join(slower)}{elsewhere}. The default allocation prices bytes "
        "and the predicted loss, not speed (the bytes table, BENCHMARKS.md section 7)."
        f"{only_types_sentence(results_dir / 'choices')}{speed_limit_sentence(results_dir / 'choices')}"
    )


def _ours(files: dict, budget: str) -> dict:
    """The `--size` file of a budget: `compress --size`'s where the run has one, else `export --size`'s."""
    return files.get((budget, "structure")) or files[(budget, "size")]


def _commonest(row: dict) -> str:
    counts = sorted(row["type_counts"].items(), key=lambda item: -item[1])
    return ", ".join(f"{n} {t}" for t, n in counts[:2])


RENDERERS = {
    "bytes": bytes_table,
    "results": results_table,
    "limitations": limitations,
    "support": support_matrix,
}


def render_readme(text: str, results_dir: Path = RESULTS_DIR) -> str:
    """`text` with every block between `<!-- NAME:begin -->` and `<!-- NAME:end -->` re-rendered."""
    for name, renderer in RENDERERS.items():
        pattern = re.compile(rf"(<!-- {name}:begin -->\n).*?(<!-- {name}:end -->)", flags=re.S)
        if not pattern.search(text):
            raise ValueError(f"README.md has no <!-- {name}:begin --> ... <!-- {name}:end --> block")
        body = renderer(results_dir)
        text = pattern.sub(lambda m, body=body: m.group(1) + body + "\n" + m.group(2), text)
    return text


def refresh_readme(readme: Path = README, results_dir: Path = RESULTS_DIR) -> Path | None:
    """Re-render README.md's blocks from the results files; the path when it changed."""
    readme = Path(readme)
    before = readme.read_text()
    after = render_readme(before, results_dir)
    if after == before:
        return None
    readme.write_text(after)
    return readme
