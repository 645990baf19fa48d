"""Quality at equal size: several methods and ratios on one model, with ONE calibration and ONE evaluation.

Calibration statistics are collected once on the original model and reused by every method, and all
methods are evaluated on the same held-out windows, so the numbers are comparable.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from dataclasses import dataclass

import torch

from compressor.adapters import get_adapter
from compressor.api import evaluation_token_windows, peak_rss_gb
from compressor.calibration.sources import load_documents
from compressor.calibration.windows import bos_token_id_for, calibration_windows, tokenize_documents
from compressor.capture import collect_statistics
from compressor.evaluate import evaluate_perplexity
from compressor.models import load_model, resolve_model
from compressor.pipeline import compress_model
from compressor.recipes.schema import CompressionSettings, EvaluationSettings

# name -> overrides of the recipe's compression settings
VARIANTS: dict[str, dict] = {
    "masa": {"method": "masa"},
    "masa-paper": {"method": "masa-paper"},
    "masa-zero-atoms": {"method": "masa", "bases": 0},
    "svd-llm": {"method": "svd-llm"},
    "svd": {"method": "svd"},
    "shared-mean": {"method": "shared-mean"},
}


@dataclass
class QualitySetup:
    """What every measured variant shares: the model, ONE calibration and ONE evaluation."""

    source: object
    loaded: object
    calibration: object
    calib_name: str
    windows: torch.Tensor
    evaluation: object
    eval_windows: list
    eval_name: str
    original: object
    stats: object
    recipe: object


def prepare_quality(
    model: str,
    calib_samples: int | None = None,
    seq_len: int | None = None,
    eval_seq_len: int | None = None,
    eval_max_tokens: int | None = None,
    progress: bool = True,
    log=print,
    mlp: bool = False,
) -> QualitySetup:
    source = resolve_model(model)
    recipe = source.recipe
    calibration = recipe.calibration.model_copy(
        update={k: v for k, v in {"samples": calib_samples, "seq_len": seq_len}.items() if v is not None}
    )
    evaluation = (recipe.evaluation if recipe else EvaluationSettings()).model_copy(
        update={
            k: v for k, v in {"seq_len": eval_seq_len, "max_tokens": eval_max_tokens}.items() if v is not None
        }
    )
    loaded = load_model(source, progress=progress)
    tokenizer = loaded.tokenizer
    calib_text = load_documents(calibration.source, "calibration")
    ids = tokenize_documents(tokenizer, calib_text.documents)
    windows = calibration_windows(
        ids, calibration.samples, calibration.seq_len, calibration.seed, bos_id=bos_token_id_for(tokenizer)
    )
    eval_windows, eval_name = evaluation_token_windows(tokenizer, evaluation)
    original = evaluate_perplexity(loaded.model, eval_windows, progress=progress, description="original")
    log(f"original ppl {original.ppl:.3f} ({original.tokens} tokens, {original.seconds:.0f} s)")
    stats = collect_statistics(loaded.model, get_adapter(loaded.model), windows, progress=progress, mlp=mlp)
    return QualitySetup(
        source, loaded, calibration, calib_text.name, windows, evaluation, eval_windows, eval_name, original,
        stats, recipe,
    )  # fmt: skip


def measure_variant(
    setup: QualitySetup, name: str, overrides: dict, ratio: float, progress: bool = True
) -> dict:
    """Compress a copy of the model with the recipe's settings and `overrides`, then evaluate it."""
    model_copy = copy.deepcopy(setup.loaded.model)
    settings = CompressionSettings(**{**setup.recipe.compression.model_dump(), **overrides})
    start = time.perf_counter()
    outcome = compress_model(
        model_copy,
        get_adapter(model_copy),
        setup.stats,
        settings,
        ratio,
        progress=progress,
        windows=setup.windows,
    )
    seconds = time.perf_counter() - start
    result = evaluate_perplexity(
        model_copy, setup.eval_windows, progress=progress, description=f"{name}@{ratio}"
    )
    return {
        "method": name,
        "ratio": ratio,
        "achieved_ratio": outcome.plan.achieved_ratio(),
        "attention_params_after": outcome.plan.attention_params_after(),
        "ppl": result.ppl,
        "compress_seconds": seconds + setup.stats.seconds,
        "stage_seconds": dict(outcome.seconds),
        "settings": settings.model_dump(),
        "groups": outcome.report.get("grouping", {}).get("groups"),
        "report": {
            k: outcome.report[k] for k in ("shape_search", "effective_settings") if k in outcome.report
        },
    }


def quality_header(setup: QualitySetup) -> dict:
    return {
        "model": setup.source.describe(),
        "calibration": {
            **setup.calibration.model_dump(), "text": setup.calib_name, "tokens": int(setup.windows.numel())
        },
        "evaluation": {**setup.evaluation.model_dump(), "text": setup.eval_name, "tokens": setup.original.tokens},
        "original_ppl": setup.original.ppl,
        "calibration_seconds": setup.stats.seconds,
    }  # fmt: skip


def run_quality(
    model: str,
    variants: dict[str, dict],
    ratios: list[float],
    calib_samples: int | None = None,
    seq_len: int | None = None,
    eval_seq_len: int | None = None,
    eval_max_tokens: int | None = None,
    progress: bool = True,
    log=print,
) -> dict:
    # The MLP inputs' statistics only when a variant compresses MLP projections (they cost calibration time).
    mlp = any("mlp" in overrides.get("targets", "attn") for overrides in variants.values())
    setup = prepare_quality(model, calib_samples, seq_len, eval_seq_len, eval_max_tokens, progress, log, mlp)
    rows = []
    for ratio in ratios:
        for name, overrides in variants.items():
            row = measure_variant(setup, name, overrides, ratio, progress)
            rows.append(row)
            log(f"{name:>18} ratio {ratio:.2f} achieved {row['achieved_ratio']:.4f} ppl {row['ppl']:.3f}")
    return {**quality_header(setup), "quality": rows, "peak_rss_gb": peak_rss_gb()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--ratios", default="0.2")
    parser.add_argument("--calib-samples", type=int)
    parser.add_argument("--seq-len", type=int)
    parser.add_argument("--eval-max-tokens", type=int)
    parser.add_argument("--out")
    args = parser.parse_args()
    variants = {name: VARIANTS[name] for name in args.variants.split(",")}
    result = run_quality(
        args.model,
        variants,
        [float(r) for r in args.ratios.split(",")],
        calib_samples=args.calib_samples,
        seq_len=args.seq_len,
        eval_max_tokens=args.eval_max_tokens,
        progress=False,
    )
    text = json.dumps(result, indent=2)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text)


if __name__ == "__main__":
    main()
