"""Which projections does compensated rounding help? On the VALIDATION split, in transformers.

Every decoder-layer matrix of the bundled model is rounded into the q2_k mix's types on its rows (Q3_K for the
1,536-wide `down_proj`, Q4_0 for the 576-wide others: llama.cpp's fallback), once `nearest` (ggml with the
importance weights) and once `compensated` (`quantize/compensated.py`, from the autocorrelations of the
`--calib-samples` calibration windows). For each set of projections, a copy of the model holds that set rounded
(the rest original) either way; both are scored against the original on the first `--max-tokens` validation
tokens, paired on the same windows (perplexity and mean KL, 95% intervals). What it decided: the value
projection keeps `nearest` (`quantize/rounding.py`, `compensates`).

    python -m benchmarks.experiments.compensated_rounding.by_projection \
        --out benchmarks/results/choices/compensated-rounding-by-projection-validation.json
"""

from __future__ import annotations

import argparse
import copy
from pathlib import Path

import numpy as np
import torch

from benchmarks.suite.common import command_line, log, machine_info, write_json
from compressor.api.export import importance_text
from compressor.api.model_loading import load_model, resolve_model
from compressor.api.session import calibration_token_windows, evaluation_token_windows
from compressor.calibration.sources import load_documents
from compressor.evaluation.intervals import paired_difference, paired_mean_difference
from compressor.evaluation.perplexity import evaluate_against
from compressor.modeling.adapters import INPUT_OF, MLP_PROJECTIONS, PROJECTIONS, get_adapter
from compressor.quantize.compensated import compensated_quantize, inverse_factor
from compressor.quantize.ggml_quantize import dequantize_with_llama_cpp, quantize_with_llama_cpp
from compressor.recipes.schema import EvaluationSettings
from compressor.statistics.layer_runner import LayerRunner

SETS = {
    "q, k": ("q_proj", "k_proj"),
    "v": ("v_proj",),
    "o": ("o_proj",),
    "gate, up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
    "all but v": ("q_proj", "k_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    "all": (*PROJECTIONS, *MLP_PROJECTIONS),
}


def q2_k_type(width: int) -> str:
    """The q2_k mix's type on a row of `width` (Q3_K where 256-value blocks fit, else llama.cpp's Q4_0)."""
    return "Q3_K" if width % 256 == 0 else "Q4_0"


def rounded_weights(model, windows: torch.Tensor) -> dict[tuple[int, str], dict[str, torch.Tensor]]:
    """(layer, projection) → {nearest, compensated: the weight it decodes to}, from the windows' statistics."""
    adapter = get_adapter(model)
    runner = LayerRunner(adapter, windows)
    rounded = {}
    for layer in range(adapter.num_layers):
        readers = {INPUT_OF[p]: p for p in (*PROJECTIONS, *MLP_PROJECTIONS)}
        measured = runner.advance_measuring(layer, readers)
        for projection in (*PROJECTIONS, *MLP_PROJECTIONS):
            autocorr = measured[INPUT_OF[projection]].autocorr.cpu()
            weight = adapter.projection(layer, projection).weight.detach().numpy()
            type_name = q2_k_type(weight.shape[1])
            importance = np.diag(autocorr.numpy()).astype(np.float32)
            nearest = quantize_with_llama_cpp(weight, type_name, importance)
            _, compensated = compensated_quantize(weight, type_name, inverse_factor(autocorr))
            rounded[(layer, projection)] = {
                "nearest": torch.from_numpy(dequantize_with_llama_cpp(nearest, type_name, weight.shape)),
                "compensated": torch.from_numpy(compensated),
            }
        log(f"layer {layer} rounded")
    return rounded


def with_rounded(model, rounded: dict, projections: tuple[str, ...], rounding: str):
    """A copy of `model` whose `projections` hold their `rounding`'s weights in every layer."""
    copied = copy.deepcopy(model)
    adapter = get_adapter(copied)
    for (layer, projection), weights in rounded.items():
        if projection in projections:
            adapter.projection(layer, projection).weight.data = weights[rounding].clone()
    return copied


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--calib-samples", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=8192)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    source = resolve_model(args.model)
    original = load_model(source, device="cpu", dtype="float32", progress=False)
    calibration, text = importance_text(source, source, args.calib_samples)
    rounded = rounded_weights(
        original.model, calibration_token_windows(original.tokenizer, calibration, text)
    )
    evaluation = EvaluationSettings(**{**source.recipe.evaluation.model_dump(), "split": "validation",
                                       "max_tokens": args.max_tokens})  # fmt: skip
    windows, _ = evaluation_token_windows(
        original.tokenizer, evaluation, load_documents(evaluation.source, split="validation")
    )
    rows = []
    for name, projections in SETS.items():
        candidates = {
            r: with_rounded(original.model, rounded, projections, r) for r in ("nearest", "compensated")
        }
        reference, scored = evaluate_against(original.model, candidates, windows, progress=False)
        (near, near_faith), (comp, comp_faith) = scored["nearest"], scored["compensated"]
        ppl = paired_difference(comp.window_nll, near.window_nll, comp.window_tokens)
        kl = paired_mean_difference(comp_faith.window_kl, near_faith.window_kl, comp.window_tokens)
        rows.append({
            "projections": name, "nearest_ppl": near.ppl, "compensated_ppl": comp.ppl,
            "nearest_kl": near_faith.kl_to_original, "compensated_kl": comp_faith.kl_to_original,
            "minus_nearest": ppl.value, "minus_nearest_ci95": list(ppl.ci95),
            "kl_minus_nearest": kl.value, "kl_minus_nearest_ci95": list(kl.ci95),
        })  # fmt: skip
        log(
            f"{name}: KL {near_faith.kl_to_original:.4f} nearest, {comp_faith.kl_to_original:.4f} compensated"
        )
    write_json(args.out, {
        "command": command_line("benchmarks.experiments.compensated_rounding.by_projection", argv),
        "model": args.model, "machine": machine_info(), "split": "validation", "tokens": reference.tokens,
        "calib_windows": args.calib_samples, "original_ppl": reference.ppl, "rows": rows,
    })  # fmt: skip
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
