"""One set of figures: the README's are rendered from the committed results files, and every headline figure the
docs and `--help` quote equals the results file's value at the precision printed, so a stale figure fails here.

BENCHMARKS.md is rendered too (tests/test_benchmarks.py checks it); the README's blocks are checked below (the
support matrix is the render of the family registry: tests/test_families.py holds each cell); outside them the
README quotes no measured figure at all.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from benchmarks.report.plots import WHOLE_MODEL_AIMS
from benchmarks.report.readme import RESULTS_DIR, render_readme

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text()
OPTIONS = (REPO / "docs" / "options.md").read_text()
METHOD = (REPO / "docs" / "method.md").read_text()
BLOCK = re.compile(r"<!-- (\w+):begin -->\n.*?<!-- \1:end -->", flags=re.S)


def _results(name: str = "results.json") -> dict:
    return json.loads((RESULTS_DIR / name).read_text())


def _paragraph(text: str, starts: str) -> str:
    """The list item of docs/options.md that starts with `starts` (up to the next item or heading)."""
    match = re.search(rf"^- {re.escape(starts)}.*?(?=^- |^#|\Z)", text, flags=re.S | re.M)
    assert match, f"no item starting with {starts!r}"
    return " ".join(match.group(0).split())


def _help(argv: list[str], capsys, monkeypatch) -> str:
    from compressor.cli import main

    monkeypatch.setenv("COLUMNS", "200")
    capsys.readouterr()
    try:
        main([*argv, "--help"])
    except SystemExit as exit_info:
        assert exit_info.code in (0, None)
    return " ".join(capsys.readouterr().out.replace("│", " ").split())


def test_the_readme_blocks_are_the_render_of_the_committed_results():
    assert {m.group(1) for m in BLOCK.finditer(README)} == {"bytes", "results", "limitations", "support"}
    assert render_readme(README) == README, (
        "run: python -m benchmarks.report (it refreshes README.md's blocks)"
    )


def test_outside_its_rendered_blocks_the_readme_types_no_measured_figure():
    prose = BLOCK.sub("", README)
    figures = re.findall(
        r"\b\d+(?:\.\d+)?x\b|\b[\d.,]+ ?(?:MiB|GiB|minutes|min)\b|(?<!≥ )\b\d+\.\d{2}\b", prose
    )
    assert not figures, f"README.md types figures by hand (render them from benchmarks/results/): {figures}"


def test_the_readme_gives_at_most_one_measurement_date_line():
    assert len(re.findall(r"\bMeasured from\b|\bmeasured on\b", README)) == 1


def test_the_whole_model_ratio_docs_method_quotes_is_the_results_file():
    whole = _results("whole-model-256-test.json")
    default = next(r for r in whole["quality"] if r["method"] == "masa-attn-mlp" and r["model_ratio"] == 0.2)
    quoted = re.search(
        r"reaching (\d\.\d\d)x of the original's perplexity at 20% \((\d\.\d\d)x on\s+the test split", METHOD
    )
    assert quoted, "docs/method.md no longer quotes the aim and the measured ratio of the model 20% smaller"
    assert float(quoted.group(1)) == WHOLE_MODEL_AIMS[0.2]
    assert quoted.group(2) == f"{default['ppl_ratio']:.2f}"


def test_the_neuron_order_share_docs_options_quotes_is_the_results_file():
    quoted = re.search(r"(\d\.\d\d)x its calibration capture", OPTIONS)
    assert quoted and quoted.group(1) == f"{_results()['large_neuron_selection_over_capture']:.2f}"


def test_the_bfloat16_calibration_speed_is_quoted_as_the_results_file_has_it():
    """`whole_model_bfloat16_compress_over_forward`: None (not measured: the CPU emulates bfloat16) or a ratio."""
    value = _results()["whole_model_bfloat16_compress_over_forward"]
    paragraph = _paragraph(OPTIONS, "`--calib-precision")
    ratios = re.findall(r"\b\d+(?:\.\d+)?x\b", paragraph)
    if value is None:
        assert "not measured" in paragraph and not ratios, paragraph
    else:
        assert ratios == [f"{value:.2f}x"], paragraph
    for text in (README, METHOD):  # nowhere else quotes its speed
        for sentence in re.findall(r"[^.]*calib-precision bfloat16[^.]*\.", text):
            assert not re.search(r"\b\d+(?:\.\d+)?x\b", sentence), sentence


def test_compress_help_quotes_no_minutes_and_sends_to_plan_for_the_time(capsys, monkeypatch):
    """A run's time is `plan`'s (this machine's rates, `api/time_estimate.py`), not a figure typed into the help;
    the demo's minutes are the README's, rendered from the results file."""
    shown = _help(["compress"], capsys, monkeypatch)
    assert not re.search(r"\d+ min", shown) and "(its time: `plan`)" in shown


def test_what_export_format_hf_weighs_is_said_alike_in_help_docs_and_readme(capsys, monkeypatch):
    """The attention dense again, the MLP narrower: smaller than the original only when the MLP was narrowed."""
    shown = _help(["export"], capsys, monkeypatch)
    documented = _paragraph(OPTIONS, "`--format gguf|hf`")
    for text in (shown, documented, " ".join(README.split())):
        assert "smaller than the original only when" in text and "NOT smaller" not in text


def test_the_stream_refits_windows_docs_options_quotes_are_the_results_file():
    """The fewer windows docs/options.md quotes for `--refit stream`: the results file's row of that count."""
    rows = _results("choices/stream-refit-windows-validation.json")["rows"]
    paragraph = _paragraph(OPTIONS, "`--refit calibration|stream`")
    quoted = re.search(
        r"(\d+) of its (\d+) lost more than the refit gains: (\S+) \[(\S+), (\S+)\]", paragraph
    )
    assert quoted, paragraph
    row = next(r for r in rows if r["variant"] == f"stream-{quoted.group(1)}")
    assert int(quoted.group(2)) == next(r for r in rows if r["variant"] == "native")["refit_windows"]
    diff = row["minus_native"]
    assert quoted.group(3, 4, 5) == tuple(f"{v:+.3f}" for v in (diff["value"], *diff["ci95"]))
    assert not diff["tie"] and diff["ci95"][0] > 0


def test_the_sensitivity_against_none_docs_options_quotes_are_the_results_file():
    """What docs/options.md says the loss sensitivity's pass buys and costs: the results file's paired difference
    and the default run's stage seconds."""
    rows = {r["variant"]: r for r in _results("choices/sensitivity-against-none-validation.json")["rows"]}
    paragraph = _paragraph(OPTIONS, "`--sensitivity-samples N`")
    quoted = re.search(
        r"lost (\S+) \[(\S+), (\S+)\]\s+perplexity, where the pass took (\d+) s of the (\d+) s", paragraph
    )
    assert quoted, paragraph
    diff = rows["global-relative"]["minus_native"]
    assert quoted.group(1, 2, 3) == tuple(f"{v:+.3f}" for v in (diff["value"], *diff["ci95"]))
    assert not diff["tie"] and diff["ci95"][0] > 0
    seconds = rows["native"]["stage_seconds"]
    assert quoted.group(4, 5) == (f"{seconds['sensitivity']:.0f}", f"{sum(seconds.values()):.0f}")


def test_the_busy_share_docs_options_quotes_is_the_codes():
    """The CPU share below which plan's rates are not kept, as docs/options.md says it."""
    from compressor.runtime.cache_root import BUSY_SHARE

    assert f"under {BUSY_SHARE:.0%} of its time ours" in " ".join(OPTIONS.split())
