"""Quality at equal size: several methods and ratios on one model, with ONE calibration and ONE evaluation.

Calibration statistics are collected once on the original model and reused by every method, and all
methods are evaluated on the same held-out windows, so the numbers are comparable.
"""

from __future__ import annotations

import argparse
import copy
import json
import time

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
    adapter = get_adapter(loaded.model)
    stats = collect_statistics(loaded.model, adapter, windows, progress=progress)
    rows = []
    for ratio in ratios:
        for name, overrides in variants.items():
            model_copy = copy.deepcopy(loaded.model)
            settings = CompressionSettings(**{**recipe.compression.model_dump(), **overrides})
            start = time.perf_counter()
            outcome = compress_model(
                model_copy,
                get_adapter(model_copy),
                stats,
                settings,
                ratio,
                progress=progress,
                windows=windows,
            )
            seconds = time.perf_counter() - start
            result = evaluate_perplexity(
                model_copy, eval_windows, progress=progress, description=f"{name}@{ratio}"
            )
            row = {
                "method": name,
                "ratio": ratio,
                "achieved_ratio": outcome.plan.achieved_ratio(),
                "attention_params_after": outcome.plan.attention_params_after(),
                "ppl": result.ppl,
                "compress_seconds": seconds + stats.seconds,
                "settings": settings.model_dump(),
                "groups": outcome.report.get("grouping", {}).get("groups"),
            }
            rows.append(row)
            log(f"{name:>18} ratio {ratio:.2f} achieved {row['achieved_ratio']:.4f} ppl {result.ppl:.3f}")
            del model_copy
    return {
        "model": source.describe(),
        "calibration": {**calibration.model_dump(), "text": calib_text.name, "tokens": int(windows.numel())},
        "evaluation": {**evaluation.model_dump(), "text": eval_name, "tokens": original.tokens},
        "original_ppl": original.ppl,
        "calibration_seconds": stats.seconds,
        "quality": rows,
        "peak_rss_gb": peak_rss_gb(),
    }


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
