"""The bundled model's compressions that the end-to-end tests share: one per form, each run once per session.

Each form is a small run of the real path (the bundled SmolLM2-135M, the real Wikipedia text), fixed here so
that its quality can be committed and held: `tests/fixtures/bundled-quality.json` records, for each form, the
original's perplexity and the rise with its paired 95% interval, written by

    python tests/bundled_runs.py [FORM ...]

(run it after a change that is meant to move them, and say so in the commit). The tests then require today's
rise to lie inside the committed interval: a regression that moves it further than its own sampling error fails.
"""

from __future__ import annotations

import json
import platform
import sys
from pathlib import Path

#: The forms, as `CompressOptions` keywords, each with a calibration of seconds: the attention on 8 windows of
#: 128 tokens; the MLP's least-squares refits need more tokens than their 1536-wide inputs (on 8 x 128 the model
#: 20% smaller scored a perplexity of 3e7), so the whole model takes 16 windows of 256 (1.8x the original's).
FORMS = {
    "attention": dict(ratio=0.2, calib_samples=8, seq_len=128),
    "whole-model": dict(ratio=0.2, ratio_of="model", targets="attn,mlp", calib_samples=16, seq_len=256),
    # A sharing form, held as the defaults are: the atoms (MASA's shared dictionary) at half of the attention.
    "sharing-atoms": dict(ratio=0.5, sharing="atoms", calib_samples=8, seq_len=128),
}
#: Every form scored on the same 16 windows of 256 test tokens: the rise's paired interval narrow enough to catch
#: a regression, the scoring a few seconds.
COMMON = dict(eval_seq_len=256, eval_max_tokens=4096)
QUALITY = Path(__file__).with_name("fixtures") / "bundled-quality.json"


def options(form: str, out: Path, **extra):
    from compressor.api import CompressOptions

    return CompressOptions(**{**COMMON, **FORMS[form], "out": str(out), **extra})


def compress_form(form: str, out: Path, **extra):
    """One run of `form` through the library API (fp32 on the CPU, as every committed figure)."""
    from compressor.api import compress

    return compress(
        "smollm2-135m", options(form, out, **extra), device="cpu", dtype="float32", progress=False
    )


def quality_record(summary: dict) -> dict:
    """What `bundled-quality.json` holds of one run: enough to hold the next one to it."""
    quality = summary["quality"]
    return {
        "ppl_before": summary["ppl_before"],
        "ppl_after": summary["ppl_after"],
        "rise": summary["ppl_after"] - summary["ppl_before"],
        "rise_ci95": quality["ppl_rise_ci95"],
        "kl_to_original": summary["kl_to_original"],
        "top1_agreement": summary["top1_agreement"],
        "achieved_ratio": summary["achieved_ratio"],
        "tokens": quality["tokens"],
    }


def committed_quality() -> dict:
    return json.loads(QUALITY.read_text())["forms"]


def record(out_dir: Path, only: list[str] | None = None) -> dict:
    """Run every form (or those of `only`, the others' committed records kept) and write their records."""
    import torch

    torch.set_num_threads(2)  # as the tests run (tests/conftest.py)
    forms = committed_quality() if only else {}
    forms |= {form: quality_record(compress_form(form, out_dir / form).summary) for form in only or FORMS}
    payload = {
        "command": "python tests/bundled_runs.py",
        "settings": {form: {**COMMON, **FORMS[form]} for form in FORMS},
        "machine": f"{platform.processor() or platform.machine()}, torch {torch.__version__}, 2 threads",
        "forms": {form: forms[form] for form in FORMS},
    }
    QUALITY.write_text(json.dumps(payload, indent=2) + "\n")
    return payload


if __name__ == "__main__":
    import tempfile

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    with tempfile.TemporaryDirectory() as tmp:  # `python tests/bundled_runs.py [FORM ...]`: those forms only
        print(json.dumps(record(Path(tmp), sys.argv[1:] or None), indent=2))
