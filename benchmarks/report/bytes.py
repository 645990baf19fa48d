"""BENCHMARKS.md section 7, in bytes: llama.cpp's mixes with and without the tool's importance weights and
`export --size` at their sizes (`benchmarks/results/bytes-*.json`, `make bench-bytes`), and the byte budget's
error model checked on the validation split (`results/choices/byte-error-model-validation.json`)."""

from __future__ import annotations

import json

from benchmarks.report.byte_choices import byte_choice_lines
from benchmarks.report.eval_speed import eval_speed_lines
from benchmarks.report.markdown import difference, interval, number, paired_reading, reading
from benchmarks.report.plots import REPO
from compressor.statistics.partly_compressed import STREAM_REFIT_WINDOWS

RESULTS = REPO / "benchmarks" / "results"
CHOICES = RESULTS / "choices"


#: What each model's packaged weights do to its frontier, said beside its figures.
CAVEATS = {
    "qwen2.5-coder-1.5b": "Its packaged weights are dequantized Q4_K_M values: the q4_k_m budget is the mix's home "
    "ground, the budgets below it are the test.",
    "smollm2-135m": "**Read with care:** the packaged weights are dequantized Q4_K/Q5_0 values, which Q4_1 and Q4_K "
    "store exactly, and the allocation finds that grid (its files are almost all Q4_1), while llama.cpp's mixes, "
    "on rows 576 wide, fall back to 32-value types that do not fit it. So this says what llama.cpp's fixed mixes "
    "lose on this model, not what `--size` gains on a model trained in 16 bits.",
}


def by_budget(data: dict) -> list[dict]:
    """The frontier's rows, largest budget first."""
    return sorted(data["frontier"], key=lambda row: -row["baseline_bytes"])


def frontier_table(data: dict) -> list[str]:
    """The tool's `--size` file against llama.cpp's mix of the same bytes, one row per budget (this page and the
    results page `bytes_frontier` writes), led by the paired mean KL to the original where the run kept it; where
    structure was allocated too, its file against types alone."""
    structure = any("minus_types_only" in row for row in data["frontier"])
    timed = any("decode_ratio" in row for row in data["frontier"])  # a merged run: some budgets untimed
    kl = any("kl_diff" in row for row in data["frontier"])
    lines = [
        "| budget | llama.cpp's mix (with the importance weights) | `--size` |"
        + (" mean KL to the original, ours − mix [95%] | reading |" if kl else "")
        + " ours − mix [95%] | reading |"
        + (" parameters removed | structure − types only [95%] |" if structure else "")
        + (" decode, ours / mix (1 · 2 threads) |" if timed else ""),
        "|---|---|---|---|---|"
        + ("---|---|" if kl else "")
        + ("---|---|" if structure else "")
        + ("---|" if timed else ""),
    ]
    for row in by_budget(data):
        line = (
            f"| {row['type']} | {row['baseline_bytes'] / 2**20:.2f} MiB, {row['baseline_ppl']:.2f} | "
            f"{row['ours_bytes'] / 2**20:.2f} MiB, {row['ours_ppl']:.2f} |"
        )
        if kl:
            line += f" {_kl_difference(row)} |"
        line += (
            f" {row['diff']:+.3f} [{row['diff_lo']:+.3f}, {row['diff_hi']:+.3f}] | "
            f"{reading(row['diff_lo'], row['diff_hi'], 'ours better', 'ours worse')} |"
        )
        if structure:
            line += f" {row.get('removed_parameters', 0):,} | {_versus_types(row)} |"
        if timed:
            line += (
                f" {row['decode_ratio']:.2f}x · {row['decode_ratio_2t']:.2f}x |"
                if "decode_ratio" in row
                else " — |"
            )
        lines.append(line)
    return lines


def _kl_difference(row: dict) -> str:
    """A frontier row's paired mean-KL difference and its reading (two cells), `— | —` where not kept."""
    if "kl_diff" not in row:
        return "— | —"
    lo, hi = row["kl_diff_lo"], row["kl_diff_hi"]
    return f"{row['kl_diff']:+.4f} [{lo:+.4f}, {hi:+.4f}] | {reading(lo, hi, 'ours closer', 'ours further')}"


def _versus_types(row: dict) -> str:
    if "minus_types_only" not in row:
        return "nothing removed" if not row.get("removed_parameters") else ""
    return paired_reading(row, "minus_types_only")


def below_table(data: dict) -> list[str]:
    """Budgets under the ladder: `compress --size` against `export --size` (types alone) where both fit."""
    lines = [
        "| budget | `compress --size`: MiB, perplexity | parameters removed | types alone | structure − types only [95%] |",
        "|---|---|---|---|---|",
    ]
    for row in data.get("below_ladder", []):
        alone = f"{row['types_only_ppl']:.2f}" if "types_only_ppl" in row else "cannot reach these bytes"
        lines.append(
            f"| {row['type']} | {row['ours_bytes'] / 2**20:.2f}, {row['ours_ppl']:.2f} | "
            f"{row.get('removed_parameters', 0):,} | {alone} | {_versus_types(row) or '—'} |"
        )
    return lines


def gain_table(data: dict) -> list[str]:
    """Each mix without minus with the importance weights, paired, largest file first."""
    size = {row["type"]: row["bytes"] for row in data["rows"] if row["imatrix"] == "calibration"}
    lines = ["| mix | without − with the importance weights [95%] | reading |", "|---|---|---|"]
    for mix, gain in sorted(data["imatrix_gain"].items(), key=lambda kv: -size[kv[0]]):
        lo, hi = gain["ci95"]
        lines.append(
            f"| {mix} | {gain['plain_minus_imatrix']:+.3f} [{lo:+.3f}, {hi:+.3f}] | "
            f"{reading(-hi, -lo, 'the weights help', 'the weights hurt')} |"
        )
    return lines


def commands(data: dict) -> str:
    """The command (or, for merged runs, the commands in order) that wrote a bytes results file, and any that timed
    its budgets again."""
    wrote = ", then ".join(f"`{command}`" for command in [*data.get("earlier_commands", []), data["command"]])
    retimed = ", ".join(f"`{command}`" for command in data.get("retimed", []))
    return wrote + (f"; speeds timed again by {retimed}" if retimed else "")


def _frontier(name: str, data: dict) -> list[str]:
    p = data["protocol"]
    return [
        f"**{data['model']}** ({commands(data)}): every file run by llama.cpp on the first {p['tokens']:,} "
        f"predicted tokens of the test split ({p['windows']} windows of {p['seq_len']}), paired on the same "
        f"windows; the original at f16 scores {next(r['ppl'] for r in data['rows'] if r['type'] == 'f16'):.2f}. "
        f"Importance weights: {data['imatrix']}. {CAVEATS[data['model']]} Every file: "
        f"[{name}.md](benchmarks/results/{name}.md).",
        "",
        *frontier_table(data),
        "",
        *gain_table(data),
        "",
    ]


#: The bundled model's `--native` form in llama.cpp, its perplexity over the original's on the whole test split:
#: the bound it is held to (the 1.5B model's is `large_native_llama_cpp_ppl_ratio`'s, in the summary).
NATIVE_BOUND_BUNDLED = 1.45


def _native_form() -> list[str]:
    """Structure alone at a fixed ratio, in llama.cpp: the `--native` model 20% smaller at f16 on each model
    (`results/native-smollm2-135m.json`; the 1.5B model's run in `results/large.json`)."""
    parts = []
    bundled = RESULTS / "native-smollm2-135m.json"
    if bundled.is_file():
        run = json.loads(bundled.read_text())
        # The file's top-level run is `--refit calibration`'s; its `stream` run is `--native`'s default since
        # the file says so (`default`).
        default, other = run["llama_cpp"], None
        if run.get("default", "").startswith("stream") and "stream" in run:
            default, other = run["stream"]["llama_cpp"], run["llama_cpp"]
        parts.append(
            f"the bundled model {default['ppl']:.2f} against {default['ppl_original']:.2f} on all "
            f"{default['tokens']:,} test tokens, {_held(default['ppl_ratio'])}"
            + (_calibration_refit(other) if other else "")
            + " ([native-smollm2-135m.json](benchmarks/results/native-smollm2-135m.json))"
        )
    large = json.loads((RESULTS / "large.json").read_text())["runs"].get("whole-native", {}).get("llama_cpp")
    if large:
        scored = large["eval"]
        parts.append(
            f"the 1.5B model {scored['ppl']:.2f} against {scored['ppl_original']:.2f} on the first "
            f"{scored['tokens']:,} test tokens, {scored['ppl'] / scored['ppl_original']:.3f}x "
            "([large](benchmarks/results/large.md))"
        )
    if not parts:
        return []
    return [
        "**Structure alone, in llama.cpp**: the `--native` model 20% smaller (`--targets attn,mlp --ratio 0.2 "
        "--ratio-of model --native`: its refits read the compressed model's own stream, `--refit stream`; the "
        "1.5B model's run, layer by layer before the stream refit ran that way, read the original's statistics, "
        "`--refit calibration`), "
        "exported at f16, scored by llama.cpp against the original in transformers: "
        + "; ".join(parts)
        + ".",
        "",
        *_native_levers(),
    ]


def _held(ratio: float) -> str:
    return (
        f"{ratio:.3f}x (held to {NATIVE_BOUND_BUNDLED:g}x: "
        f"{'met' if ratio <= NATIVE_BOUND_BUNDLED else '**missed**'})"
    )


def _calibration_refit(scored: dict) -> str:
    """The same run with `--refit calibration` (the 1.5B model's, which runs `--layerwise`), as the bundled
    model's native line continues."""
    return (
        f"; with `--refit calibration` {scored['ppl']:.2f} on the same tokens, {_held(scored['ppl_ratio'])}"
    )


def _native_levers() -> list[str]:
    """Where the bundled model's native form loses and what was tried on the validation split
    (`benchmarks/experiments/native_balance`)."""
    balance, free = (
        CHOICES / "native-balance-validation.json",
        CHOICES / "native-attention-free-validation.json",
    )
    if not balance.is_file():
        return []
    run = json.loads(balance.read_text())
    rows = {row["variant"]: row for row in run["rows"]}

    def diff(row):
        return difference(row["minus_native"])

    weights = [name for name in rows if name.startswith("mlp-weight-")]
    worse = all(rows[name]["minus_native"]["ci95"][0] > 0 for name in weights)
    sentences = [
        f"Where the bundled model's native form loses, on the validation split ({run['tokens']:,} tokens, "
        f"perplexity {rows['native']['ppl']:.2f}, {rows['native']['ppl_ratio']:.3f}x the original's): with every "
        f"attention put back {rows['attention-restored']['ppl_ratio']:.3f}x, with every MLP put back "
        f"{rows['mlp-restored']['ppl_ratio']:.3f}x, so the narrowed MLPs carry most of the loss.",
        "The budget between heads and neurons, the MLP units' loss sensitivity multiplied by w = "
        + ", ".join(name.removeprefix("mlp-weight-") for name in weights)
        + ": "
        + ("every one worse" if worse else "not every one worse")
        + " than the allocation's own "
        "(" + "; ".join(f"{name.removeprefix('mlp-weight-')}: {diff(rows[name])}" for name in weights) + ")",
        *(
            f"the sensitivity over {name.removeprefix('sensitivity-')} windows instead of "
            f"{run['sensitivity_windows']}: {diff(rows[name])}"
            for name in rows
            if name.startswith("sensitivity-")
        ),
    ]
    if free.is_file():
        run = json.loads(free.read_text())
        found = {row["variant"]: row for row in run["rows"]}
        layers = ", ".join(str(x) for x in run["attention_free_layers"])
        sentences.append(
            f"layers {layers} without attention (a head count of 0, which `deci` runs), the parameters given to "
            f"the rest at the same size: {diff(found['attention-free'])}, and "
            f"{diff(found['attention-free-mean'])} even with its mean added back, which the layout cannot hold"
        )
    return [
        sentences[0] + " " + sentences[1] + "; " + "; ".join(sentences[2:]) + ". Nothing adopted "
        "([native_balance](benchmarks/experiments/native_balance/README.md)).",
        "",
        *_sequential_refit(),
    ]


def _sequential_refit() -> list[str]:
    """The refits on the compressed model's own inputs, on the validation split
    (`benchmarks/experiments/sequential_refit`): what `--refit stream` was chosen on."""
    path = CHOICES / "sequential-refit-validation.json"
    if not path.is_file():
        return []
    run = json.loads(path.read_text())
    rows = {row["variant"]: row for row in run["rows"]}
    stream, own = rows["sequential-residual"], rows["sequential"]
    return [
        f"What moved it: heads' o_proj and neurons' down_proj refit once more, layer by layer, on the compressed "
        f"model's own inputs over the {run['calibration_windows']} calibration windows, each to bring the residual "
        f"stream back to the original's where its output is added: {difference(stream['minus_native'])} "
        f"({rows['native']['ppl_ratio']:.3f}x to {stream['ppl_ratio']:.3f}x the original's, validation); each "
        f"matrix refit to its own original output instead: {difference(own['minus_native'])}. Adopted as "
        "`--refit stream`, opt-in ([sequential_refit](benchmarks/experiments/sequential_refit/README.md)).",
        "",
        *_stream_refit_windows(),
    ]


def _stream_refit_windows() -> list[str]:
    """The scan behind `partly_compressed.STREAM_REFIT_WINDOWS`: the native run's stream refit on all the
    calibration windows, on K of them and not at all (the calibration refit), each minus all of them."""
    path = CHOICES / "stream-refit-windows-validation.json"
    if not path.is_file():
        return []
    data = json.loads(path.read_text())
    rows = ["| stream refit reads | perplexity | minus all windows | stream refit (s) |", "|---|---|---|---|"]
    for row in data["rows"]:
        windows = (
            "none (`--refit calibration`)"
            if row["variant"] == "calibration"
            else f"{row['refit_windows']} windows"
        )
        rows.append(
            f"| {windows} | {row['ppl']:.3f}{interval(row['ppl_ci95'])} | {difference(row['minus_native'])} | "
            f"{row['stage_seconds'].get('stream_refit', 0.0):.0f} |"
        )
    fewest_tying = min(
        (
            row["refit_windows"]
            for row in data["rows"]
            if row["variant"].startswith("stream-") and row["minus_native"]["tie"]
        ),
        default=None,
    )
    default = STREAM_REFIT_WINDOWS or data["calibration_windows"]
    verdict = (
        f"The fewest that tie with all of them: {fewest_tying}"
        if fewest_tying
        else "None of the counts tried ties"
    ) + f"; the default reads {default} (`partly_compressed.STREAM_REFIT_WINDOWS`)."
    return [
        "### Windows the stream refit reads (`--refit stream`)",
        "",
        f"From [`{path.relative_to(REPO)}`]({path.relative_to(REPO)}): `--native` 20% of the model, its stream refit on all "
        f"{data['calibration_windows']} calibration windows, on K of them evenly spaced, and replaced by the "
        f"calibration refit; every checkpoint scored on the same {data['tokens']:,} validation tokens, each minus "
        f"all windows, paired. {verdict}",
        "",
        *rows,
        "",
    ]


def bytes_section() -> list[str]:
    files = sorted(RESULTS.glob("bytes-*.json"))
    if not files:
        return []
    body = [line for path in files for line in _frontier(path.stem, json.loads(path.read_text()))]
    return [
        "## 7. In bytes: llama.cpp's mixes, `export --size` and `compress --size`",
        "",
        "The original as GGUF files: llama.cpp's own mixes (`export --type`, `llama-quantize`'s type per tensor), "
        "each without and with the tool's importance weights (the imatrix, from the recipe's calibration); at the "
        "bytes of each mix with them, `export --size` (every matrix's type chosen by the loss-aware allocation, "
        "nothing removed) and, where the run has it, `compress --size` (each layer's MLP width and query heads "
        "chosen with the types in the same allocation: docs/method.md, stage 6), the tool's `--size` file. Diff: "
        "ours − the mix of the same bytes; an interval holding 0 is a tie.",
        "",
        *body,
        *eval_speed_lines(RESULTS),
        *_native_form(),
        *byte_choice_lines(),
    ]


#: How the results page names each kind of file.
KINDS = {"none": "llama.cpp's mix", "calibration": "llama.cpp's mix + importance weights",
         "size": "`export --size` (types only)", "structure": "`compress --size` (structure and types)"}  # fmt: skip


def results_page(results: dict) -> str:
    """`bytes_frontier`'s results page, `benchmarks/results/bytes-<model>.md`: every file, then the frontier."""
    p = results["protocol"]
    tails = any("kl_p999" in row for row in results["rows"])  # the per-token KL's percentiles, as llama.cpp's
    lines = [
        f"# {results['model']} in bytes: llama.cpp's mixes, `export --size` and `compress --size`",
        "",
        f"{commands(results)}. llama.cpp scores every file on the first {p['tokens']:,} predicted tokens of "
        f"the test split ({p['windows']} windows of {p['seq_len']}; {p['text']}); KL and top-1 against the "
        f"original in transformers (perplexity {number(p['original_transformers_ppl'])}). Importance weights: "
        f"{results['imatrix']}.",
        "",
        "| budget | file | MiB | parameters removed | perplexity [95%] | KL | top-1 | matrices by type |"
        + (" KL p99 · p99.9 |" if tails else ""),
        "|---|---|---:|---:|---|---:|---:|---|" + ("---:|" if tails else ""),
    ]
    for row in sorted(results["rows"], key=lambda r: (-r["bytes"], r["imatrix"])):
        if "refused" in row:
            lines.append(f"| {row['type']} | {KINDS[row['imatrix']]} | {row['bytes'] / 2**20:.1f} | | refused: "
                         "below the smallest file of types alone | | | |" + (" |" if tails else ""))  # fmt: skip
            continue
        mix = ", ".join(f"{n} {t}" for t, n in row["type_counts"].items())
        lines.append(
            f"| {row['type']} | {KINDS[row['imatrix']]} | {row['bytes'] / 2**20:.1f} | "
            f"{row.get('removed_parameters', 0):,} | {number(row['ppl'])}{interval(row['ppl_ci95'])} | "
            f"{row['kl']:.4f} | {row['top1']:.3f} | {mix} |"
            + (
                f" {row['kl_p99']:.3f} · {row['kl_p999']:.3f} |"
                if "kl_p999" in row
                else " — |"
                if tails
                else ""
            )
        )
    if results.get("frontier"):
        lines += [
            "",
            "At each mix's bytes, the tool's `--size` file (`compress --size`: structure and types; `export --size` "
            "where no structure was run) against that mix, paired on the same windows (ours − llama.cpp's mix; "
            "inside the interval, a tie):",
            "",
            *frontier_table(results),
        ]
    if results.get("below_ladder"):
        lines += ["", "Under the ladder (no mix of these bytes):", "", *below_table(results)]
    lines += [
        "",
        "Paired on the same windows, perplexity without the importance weights minus with them:",
        "",
    ]
    lines += gain_table(results)
    return "\n".join(lines) + "\n"
