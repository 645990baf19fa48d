"""Section 6 of BENCHMARKS.md, the choices behind today's defaults: rendered from the validation runs kept in
`benchmarks/results/choices/` (each measured once by the command it records; `make bench` does not re-run them).
"""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.report.budget_split import budget_split_section
from benchmarks.report.markdown import difference, interval, link, paired_verdict
from benchmarks.report.plots import REPO, label

CHOICES = REPO / "benchmarks" / "results" / "choices"


def choices_section(doc: Path) -> list[str]:
    parts = [
        _neuron_order(doc),
        _anchored(doc),
        _neuron_refinements(doc),
        _calibration_size(doc),
        _mlp_calibration_windows(doc),
        _sensitivity_windows(doc),
        _calibration_precision(doc),
        _attention_forms(doc),
        _whole_model_forms(doc),
        _embedding_target(doc),
        budget_split_section(doc, _load),
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


def _neuron_refinements(doc: Path) -> list[str]:
    path, data = _load("neuron-refinements-validation.json")
    if data is None:
        return []
    lines = [
        "### A compensating bias, and a per-channel Fisher weight, for the neuron form (neither kept)",
        "",
        f"From {link(path, doc)}: every MLP keeps the same fraction of its neurons by the greedy order, attention "
        f"untouched; original {data['original']['ppl']:.3f}. `centered`: the order and refit on the covariance "
        "with a new `down_proj` bias (FLAP's bias compensation made the least-squares optimum; never worse on the "
        "calibration tokens). `fisher`: the order weighs each output channel by its mean squared loss gradient "
        f"(first {data['fisher_windows']} calibration windows), a diagonal Fisher where the allocation takes it "
        "isotropic.",
        "",
        "| kept | variant | perplexity [95% CI] | KL | minus `greedy` |",
        "|---|---|---|---|---|",
    ]
    for r in data["rows"]:
        lines.append(
            f"| {r['keep']:.0%} | `{r['variant']}` | {r['ppl']:.3f}{interval(r['ppl_ci95'])} | "
            f"{r['kl_to_original']:.3f} | {'—' if r['variant'] == 'greedy' else difference(r['minus_greedy'])} |"
        )
    verdicts = []
    for variant in ("centered", "fisher"):
        found = [r for r in data["rows"] if r["variant"] == variant]
        verdicts.append(
            f"`{variant}` "
            + ", ".join(paired_verdict(r["minus_greedy"]) + f" at {r['keep']:.0%} kept" for r in found)
        )
    improved = any(not r["minus_greedy"]["tie"] and r["minus_greedy"]["value"] < 0 for r in data["rows"])
    decision = (
        "Not adopted: a gain at one kept fraction moves no default before the whole-model runs at 20% and 30% on "
        "validation, and `centered` needs a bias on every down_proj (a tensor per layer the plain layout lacks)."
        if improved
        else "Neither is better anywhere: the default stays."
    )
    return [*lines, "", "Against `greedy`, paired: " + "; ".join(verdicts) + ". " + decision, ""]


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
        "### Calibration windows for the model 20% smaller: 64 or 128, both forms",
        "",
        f"From {link(path, doc)}: `--targets attn,mlp --ratio {data['ratio_of_model']:g} --ratio-of model`, "
        f"validation split (first {data['max_tokens']:,} tokens), every checkpoint on the same windows; more "
        "windows minus fewer: " + "; ".join(notes) + ". Both forms gain; how many windows a run takes when "
        "the MLP is targeted (`mlp_samples`, either form) was chosen by the scan below. Compression times include "
        "a calibration read from the cache where an earlier run of the same windows had written it.",
        "",
        *rows,
        "",
    ]


def _mlp_calibration_windows(doc: Path) -> list[str]:
    """The scan behind `calibration.mlp_samples` (compressor/api/model_defaults.py): the default at the model 20% and 30%
    smaller from the first N calibration windows, each minus the fewest."""
    path, data = _load("calibration-windows-mlp-validation.json")
    if data is None:
        return []
    rows = [
        "| model smaller by | windows | perplexity | minus the fewest | compression (s) |",
        "|---|---|---|---|---|",
    ]
    for ratio, scan in data["ratios"].items():
        result = scan["forms"]["default"]
        fewest = min(result["runs"], key=int)
        for windows, run in sorted(result["runs"].items(), key=lambda item: int(item[0])):
            gain = "—" if windows == fewest else difference(result["minus_smallest"][windows])
            rows.append(
                f"| {float(ratio):.0%} | {windows} | {run['ppl']:.3f}{interval(run['ppl_ci95'])} | {gain} | "
                f"{run['compress_seconds']:.0f} |"
            )
    return [
        "### Calibration windows when the MLP is targeted (`calibration.mlp_samples`)",
        "",
        f"From {link(path, doc)}: the default, `--targets attn,mlp --ratio-of model`, compressed from the first N "
        f"calibration windows of 512 tokens (the same seed, so a smaller set starts a larger one), every checkpoint "
        f"scored on the same first {data['max_tokens']:,} validation tokens; each count minus the fewest, paired. "
        "Compression times include the capture where no earlier run had cached the windows' statistics, and "
        f"compare only within a count's first run. {data['decision']}",
        "",
        *rows,
        "",
    ]


def _sensitivity_windows(doc: Path) -> list[str]:
    path, data = _load("sensitivity-windows-validation.json")
    if data is None:
        return []
    reference = data["reference_windows"]
    rows = ["| target | windows | perplexity | minus " + str(reference) + " windows |", "|---|---|---|---|"]
    for target, result in data["targets"].items():
        for windows, run in result["runs"].items():
            d = result["minus_reference"].get(windows)
            rows.append(
                f"| {target} | {windows} | {run['ppl']:.3f}{interval(run['ppl_ci95'])} | {difference(d) if d else '—'} |"
            )
    ties = all(d["tie"] for result in data["targets"].values() for d in result["minus_reference"].values())
    verdict_line = (
        f"Every count ties with {reference}: the sensitivity is one number per matrix, a mean over thousands of "
        "tokens."
        if ties
        else f"Not every count ties with {reference} (the table says which)."
    )
    return [
        "### Loss-sensitivity windows (`sensitivity_samples`: 4)",
        "",
        f"From {link(path, doc)}: attention 0.2 and the model 20% smaller, the loss sensitivity measured on the "
        f"first N calibration windows, validation split (first {data['max_tokens']:,} tokens), every checkpoint on "
        f"the same windows. {verdict_line} The default takes 4, a quarter of the backward passes (their time: "
        "section 3; the runs here read the calibration from the cache, so their stage times do not compare).",
        "",
        *rows,
        "",
        *_sensitivity_windows_test(doc),
        *_sensitivity_against_none(doc),
    ]


def _sensitivity_windows_test(doc: Path) -> list[str]:
    """The chosen count against the reference count on the test split (`--split test`), where it was measured."""
    path = CHOICES.parent / "sensitivity-windows-test.json"
    if not path.is_file():
        return []
    data = json.loads(path.read_text())
    parts = []
    for target, result in data["targets"].items():
        runs = result["runs"]
        for windows, d in result["minus_reference"].items():
            parts.append(
                f"{target} {runs[windows]['ppl']:.3f} with {windows} windows against "
                f"{runs[str(data['reference_windows'])]['ppl']:.3f} with {data['reference_windows']}: "
                f"{difference(d)}"
            )
    return [
        f"The same on every token of the **test** split ({link(path, doc)}): " + "; ".join(parts) + ".",
        "",
    ]


def _sensitivity_against_none(doc: Path) -> list[str]:
    """The default run (`--native` 20% of the model, its stream refit) with the loss sensitivity against without
    it (`--allocation global-relative`: no backward pass)."""
    path, data = _load("sensitivity-against-none-validation.json")
    if data is None:
        return []
    rows = {row["variant"]: row for row in data["rows"]}
    native, relative = rows["native"], rows["global-relative"]
    verdict = paired_verdict(relative["minus_native"])
    seconds = native["stage_seconds"]
    return [
        f"Whether the backward pass earns its time at all ({link(path, doc)}): the default run, `--native` 20% of "
        f"the model, {native['ppl']:.3f} on {data['tokens']:,} validation tokens, its pass "
        f"{seconds['sensitivity']:.0f} s of the {sum(seconds.values()):.0f} s its stages after the calibration "
        f"took; without the pass (`--allocation global-relative`) {relative['ppl']:.3f}, {verdict} against the "
        "default.",
        "",
    ]


def _calibration_precision(doc: Path) -> list[str]:
    path, data = _load("calibration-precision-validation.json")
    if data is None:
        return []
    rows = [
        "| target | seed | `model` (float32) | `bfloat16` | bfloat16 − model | model: this seed − the first | "
        "compression (s): model / bfloat16 |",
        "|---|---|---|---|---|---|---|",
    ]
    summary = []
    for target, result in data["targets"].items():
        runs, effects = result["runs"], result["bfloat16_minus_model"]
        seeds = list(effects)
        for seed in seeds:
            model, bf16 = runs[f"model-s{seed}"], runs[f"bfloat16-s{seed}"]
            rows.append(
                f"| {target} | {seed} | {model['ppl']:.3f}{interval(model['ppl_ci95'])} | "
                f"{bf16['ppl']:.3f}{interval(bf16['ppl_ci95'])} | {difference(effects[seed])} | "
                f"{difference(result['model_seed_minus_first_seed'].get(seed))} | "
                f"{model['compress_seconds']:.0f} / {bf16['compress_seconds']:.0f} |"
            )
        worse = sum(1 for d in effects.values() if not d["tie"] and d["value"] > 0)
        ties = sum(1 for d in effects.values() if d["tie"])
        spread = [abs(d["value"]) for d in result["model_seed_minus_first_seed"].values()]
        mean_effect = sum(d["value"] for d in effects.values()) / len(effects)
        summary.append(
            f"{target}: bfloat16 worse at {worse} of {len(effects)} seeds, a tie at {ties}, "
            f"{mean_effect:+.3f} on average"
            + (f"; another calibration seed moves float32 by up to {max(spread):.3f}" if spread else "")
        )
    return [
        "### The calibration's forward passes in bfloat16 (`--calib-precision`)",
        "",
        f"From {link(path, doc)}: attention 0.2 and the model 20% smaller, calibrated in the model's float32 "
        "(`model`) and with bfloat16 matrix products (`bfloat16`, autocast; the statistics still summed in fp64), "
        f"at several calibration seeds, validation split (first {data['max_tokens']:,} tokens), every checkpoint on "
        "the same windows. "
        + "; ".join(summary)
        + ". Compression times are of runs beside other work on the "
        "machine; section 3 times the run alone. `model` stays the default: for the attention bfloat16 costs a "
        "little at every seed, and every figure on this page was measured with `model`; `--calib-precision "
        "bfloat16` is the option for a faster calibration.",
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
            f"| `{r['method']}` ({label(r['method'])}) | {r['ppl']:.3f}{interval(r['ppl_ci95'])} | "
            f"{r['kl_to_original']:.3f} | {diffs or '—'} |"
        )
    return [*lines, ""]


def _embedding_target(doc: Path) -> list[str]:
    """The low-rank embedding taking part of the model's cut, against the default alone (`--targets embed` is not
    built: this is why)."""
    path, data = _load("embedding-validation.json")
    if data is None:
        return []
    rows = ["| model | embedding rank | row weights | metric | model smaller by | perplexity | minus the default |",
            "|---|---|---|---|---|---|---|"]  # fmt: skip
    minus = next(k for row in data["rows"].values() for k in row if k.startswith("minus_"))
    for name, row in data["rows"].items():
        rank = row["embedding_rank"]
        weights = "—" if rank is None else f"counts + {row['pseudo_count']:g}"
        metric = "—" if rank is None else ("H + ḡ² I" if row["input_term"] else "H")
        rows.append(
            f"| {label(name) if rank is None else name} | {rank or 'whole'} | {weights} | {metric} | "
            f"{row['model_ratio']:.2%} | {row['ppl']:.3f}{interval(row['ppl_ci95'])} | {difference(row.get(minus))} |"
        )
    differences = [row[minus] for row in data["rows"].values() if minus in row]
    wins = sum(d["ci95"][1] < 0 for d in differences)
    ties = sum(d["tie"] for d in differences)
    verdict = (
        f"No low-rank embedding beats the default, which cuts the layers alone ({ties} tie, "
        f"{len(differences) - ties} lose): the embedding is not offered as a target."
        if not wins
        else f"{wins} of {len(differences)} low-rank embeddings beat the default (the table says which)."
    )
    return [
        "### The embedding as a target (measured; not offered)",
        "",
        f"From {link(path, doc)}: the model 20% smaller, part of the cut taken by a low-rank tied embedding "
        "`E ≈ A B` (`benchmarks/experiments/embedding_target/embedding.py`: the SVD weighted by each token's calibration count on one side "
        "and by `M = H + ḡ² I` on the other, H the autocorrelation of the output head's input, ḡ² the loss "
        "gradient's mean square at the embedding's output: the second-order loss of the error), the layers "
        f"compressed by the default at the rest of the budget; validation split, original {data['original_ppl']:.3f}. "
        f'{verdict} Docs: docs/method.md, "The embedding".',
        "",
        *rows,
        "",
    ]
