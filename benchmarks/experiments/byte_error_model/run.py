"""Is `export --size`'s error model right? Predicted against measured rise of the loss, on the VALIDATION split.

The byte budget predicts each (matrix, type)'s rise of the mean next-token loss as ½ · output sensitivity ·
importance-weighted rounding error (`compressor/quantize/byte_budget.py`). Here, on the bundled model:

1. single-tensor changes: a deterministic sample of (matrix, type) pairs (every `--every`-th matrix, its candidate
   types that change it in turn), each matrix replaced by its ggml-decoded quantization alone, the rest kept at fp32;
2. whole plans: every matrix as the budget's plan at the given `--sizes` (each type as written in the file);

each scored in transformers on the first `--max-tokens` validation tokens against the original on the same
windows (the decoded weights are the file's; llama.cpp's own rounding of the activations is not in it), each rise
with its paired 95% interval over windows and the KL divergence to the original beside it (what a second-order
prediction estimates, without the text's first-order noise). Reports the rank correlation (Spearman) of the
predicted rises with the measured ones and with the KL, and their ratios.

    python -m benchmarks.experiments.byte_error_model.run --out benchmarks/results/choices/byte-error-model-validation.json
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from benchmarks.experiments.byte_error_model.predictors import alternative_statistics
from benchmarks.suite.common import command_line, log, write_json
from compressor.api.export import importance_calibration, measure_for_export
from compressor.api.model_loading import load_model, resolve_model
from compressor.api.session import calibration_token_windows, evaluation_token_windows
from compressor.calibration.sources import load_documents
from compressor.evaluation.intervals import resample_indices
from compressor.quantize.budget_chooser import BudgetChooser
from compressor.quantize.byte_budget import (
    GRADIENT_WINDOWS,
    SAMPLE_ROWS,
    allocate,
    evenly_spaced,
    parse_size,
    rounding_errors,
)
from compressor.quantize.ggml_quantize import dequantize_with_llama_cpp, quantize_with_llama_cpp
from compressor.recipes.schema import EvaluationSettings

MODEL = "smollm2-135m"


def decoded(weight: torch.Tensor, type_name: str, importance: torch.Tensor | None) -> torch.Tensor:
    array = weight.detach().float().numpy()
    vector = None if importance is None else importance.numpy().astype(np.float32)
    if type_name == "F16":
        return torch.from_numpy(array.astype(np.float16).astype(np.float32))
    blocks = quantize_with_llama_cpp(array, type_name, vector)
    return torch.from_numpy(dequantize_with_llama_cpp(blocks, type_name, array.shape))


@torch.no_grad()
def window_scores(model, windows: torch.Tensor, reference: list[torch.Tensor] | None = None):
    """Per window, the summed next-token loss and, against `reference` (the original's log-probabilities per
    window, fp32), the summed KL(original ‖ model); with no reference, the model's own log-probabilities in its
    place (to be the reference)."""
    nll, kl, log_probs = [], [], []
    for index, window in enumerate(windows):
        logits = model(input_ids=window[None], use_cache=False).logits[0, :-1].float()
        own = torch.log_softmax(logits, -1)
        nll.append(float(-own.gather(1, window[1:, None]).sum()))
        if reference is None:
            log_probs.append(own)
        else:
            original = reference[index]
            kl.append(float((original.exp() * (original - own)).sum()))
    return np.array(nll), (np.array(kl) if reference is not None else log_probs)


def rise(nll: np.ndarray, base: np.ndarray, tokens: int, kl: np.ndarray | None = None) -> dict:
    """The rise of the mean loss per token over `base` (the original's per-window sums on the same windows), its
    95% interval by a paired bootstrap over windows, and the mean KL to the original (a second-order predictor
    estimates both; the KL is not blurred by the text's first-order noise)."""
    indices = resample_indices(len(nll))
    resampled = (nll - base)[indices].sum(axis=1) / (tokens / len(nll) * indices.shape[1])
    lo, hi = np.percentile(resampled, [2.5, 97.5])
    out = {"measured": float((nll - base).sum() / tokens), "measured_ci95": [float(lo), float(hi)]}
    return out | ({"kl": float(kl.sum() / tokens)} if kl is not None else {})


PREDICTORS = ("default", "skip_first", "gradient_weighted")


def alternative_rises(
    path: str, array: np.ndarray, type_name: str, default: float, importance, alternatives: dict, head: str
) -> dict[str, float]:
    """The predicted rise of `path` stored as `type_name` under each of PREDICTORS: the byte budget's own
    (`default`), and with its matrix term's statistic replaced by each alternative's (the embedding's lookup term
    kept; a tied embedding's matrix term is the head's)."""
    source = head if path not in alternatives["skip_first"] else path
    vector = importance.weights.get(path)
    if vector is None or source not in alternatives["skip_first"]:
        return dict.fromkeys(PREDICTORS, default)
    uniform = evenly_spaced(np.arange(array.shape[0]), SAMPLE_ROWS)
    columns, _ = rounding_errors(array[uniform], type_name, vector.numpy().astype(np.float32))
    scale = 0.5 * array.shape[0] / len(uniform)
    gradient = importance.gradients.get(source, 0.0)
    own = scale * gradient * float(columns @ vector.double().numpy())
    rises = {"default": default}
    rises["skip_first"] = (
        default - own + scale * gradient * float(columns @ alternatives["skip_first"][source].numpy())
    )
    rises["gradient_weighted"] = (
        default - own + scale * float(columns @ alternatives["gradient_weighted"][source].numpy())
    )
    return rises


def fit_predictors(singles: list[dict], measured: np.ndarray) -> dict[str, dict[str, float]]:
    """Per predictor: the rank correlation of its predicted rises with the measured ones (and with the KL to the
    original), and their median ratio."""
    from scipy.stats import spearmanr

    kl = np.array([s["kl"] for s in singles])
    fits = {}
    for name in PREDICTORS:
        guess = np.array([s["predicted_by"][name] for s in singles])
        fit, fit_kl = spearmanr(guess, measured), spearmanr(guess, kl)
        fits[name] = {
            "spearman": float(fit.statistic), "spearman_p": float(fit.pvalue),
            "spearman_kl": float(fit_kl.statistic), "spearman_kl_p": float(fit_kl.pvalue),
            "measured_over_predicted_median": float(np.median(measured / np.maximum(guess, 1e-12))),
            "kl_over_predicted_median": float(np.median(kl / np.maximum(guess, 1e-12))),
        }  # fmt: skip
        log(f"{name}: Spearman {fit.statistic:.3f} (loss rise), {fit_kl.statistic:.3f} (KL)")
    return fits


def measure_plans(sizes: str, options, matrices, importance, alternatives, head: str, model, windows, base):
    """Every matrix as the budget's plan at each of `sizes`: predicted (by each of PREDICTORS) and measured rise."""
    plans = []
    for size in sizes.split(","):
        budget = parse_size(size)
        plan = allocate(options, 0, budget - 1_000_000)  # the matrices' bytes alone, a file's metadata aside
        originals = {path: matrices[path][1].data.clone() for path in matrices}
        for path, type_name in plan.types.items():
            matrices[path][1].data.copy_(decoded(originals[path], type_name, importance.weights.get(path)))
        nll, kl = window_scores(model, windows, base.log_probs)
        measured = rise(nll, base.nll, base.tokens, kl)
        by = dict.fromkeys(PREDICTORS, 0.0)
        for path in matrices:
            matrices[path][1].data.copy_(originals[path])
            chosen = next(o for o in options[path] if o.type_name == plan.types[path])
            rises = alternative_rises(path, originals[path].numpy(), chosen.type_name, chosen.predicted, importance,
                                      alternatives, head)  # fmt: skip
            by = {k: by[k] + rises[k] for k in PREDICTORS}
        plans.append({"budget": budget, "predicted": plan.predicted, "predicted_by": by, **measured,
                      "type_counts": plan.to_dict()["type_counts"]})  # fmt: skip
        log(f"plan {budget:,}: predicted {plan.predicted:.5f}, measured {measured['measured']:.5f}")
    return plans


@dataclass
class Original:
    """The original model on the evaluation windows: per-window summed loss, log-probabilities, predicted tokens."""

    nll: np.ndarray
    log_probs: list[torch.Tensor]
    tokens: int


def matrices_of(model) -> dict[str, tuple[str, torch.nn.Parameter]]:
    """GGUF-like name → (module path, weight) of every matrix `export` writes (the tied head once)."""
    out = {}
    for path, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.nn.Parameter) and weight.ndim == 2 and path != "lm_head":
            out[path] = (path, weight)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--every", type=int, default=6, help="every N-th matrix in the single-change sample")
    parser.add_argument("--sizes", default="105454112,93510176,88201760", help="whole plans' budgets")
    parser.add_argument("--max-tokens", type=int, default=16384)
    parser.add_argument(
        "--out", type=Path, default=Path("benchmarks/results/choices/byte-error-model-validation.json")
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    source = resolve_model(MODEL)
    loaded = load_model(source, device="cpu", dtype="float32", progress=False)
    model = loaded.model
    calibration = importance_calibration(source, source)
    text = load_documents(calibration.source, split="calibration")
    importance, _ = measure_for_export(loaded, calibration, text, progress=False)
    calib_windows = calibration_token_windows(loaded.tokenizer, calibration, text)
    alternatives = alternative_statistics(model, calib_windows, GRADIENT_WINDOWS)
    head = "lm_head"
    chooser = BudgetChooser(model, importance, 0, progress=False)
    evaluation = source.recipe.evaluation.model_copy(
        update={"split": "validation", "max_tokens": args.max_tokens}
    )
    windows, text_name = evaluation_token_windows(loaded.tokenizer, EvaluationSettings(**evaluation.model_dump()),
                                                  load_documents(evaluation.source, split="validation"))  # fmt: skip
    nll, log_probs = window_scores(model, windows)
    tokens = windows.shape[0] * (windows.shape[1] - 1)
    base = Original(nll, log_probs, tokens)
    log(f"original: {nll.sum() / tokens:.5f} nats on {tokens} predicted validation tokens ({text_name})")
    matrices = matrices_of(model)
    options = {
        path: chooser.options(weight.detach().float().numpy(), path) for path, (_, weight) in matrices.items()
    }
    singles = []
    for index, path in enumerate(list(matrices)[:: args.every]):
        # the types that change the matrix: the packaged weights are dequantized Q4_K/Q5_0 values, which some
        # types (Q4_1, Q5_1, ...) store exactly: their (0, 0) points would only tie the ranks
        opts = [o for o in options[path] if o.type_name not in ("F16", "Q8_0") and o.predicted > 1e-7]
        if not opts:
            continue
        option = opts[index % len(opts)]
        weight = matrices[path][1]
        kept = weight.data.clone()
        weight.data.copy_(decoded(kept, option.type_name, importance.weights.get(path)))
        nll, kl = window_scores(model, windows, base.log_probs)
        measured = rise(nll, base.nll, base.tokens, kl)
        weight.data.copy_(kept)
        rises = alternative_rises(
            path, kept.numpy(), option.type_name, option.predicted, importance, alternatives, head
        )
        singles.append({"matrix": path, "type": option.type_name, "predicted": option.predicted,
                        "predicted_by": rises, **measured})  # fmt: skip
        log(f"{path} {option.type_name}: predicted {option.predicted:.5f}, measured {measured['measured']:.5f} "
            f"{measured['measured_ci95']}, KL {measured['kl']:.5f}")  # fmt: skip
    plans = measure_plans(args.sizes, options, matrices, importance, alternatives, head, model, windows, base)
    from scipy.stats import spearmanr

    predicted = np.array([s["predicted"] for s in singles])
    measured = np.array([s["measured"] for s in singles])
    rho, rho_kl = spearmanr(predicted, measured), spearmanr(predicted, [s["kl"] for s in singles])
    by_predictor = fit_predictors(singles, measured)
    resolved = sum(1 for s in singles if s["measured_ci95"][0] > 0 or s["measured_ci95"][1] < 0)
    write_json(args.out, {
        "command": command_line("benchmarks.experiments.byte_error_model.run", argv),
        "model": MODEL, "split": "validation", "tokens": base.tokens, "text": text_name,
        "original_nll": float(base.nll.sum() / base.tokens), "singles": singles, "plans": plans,
        "spearman_singles": float(rho.statistic), "spearman_p": float(rho.pvalue),
        "spearman_singles_kl": float(rho_kl.statistic), "spearman_kl_p": float(rho_kl.pvalue),
        "singles_resolved": resolved,
        "measured_over_predicted_median": float(np.median(measured / np.maximum(predicted, 1e-12))),
        "predictors": by_predictor,
    })  # fmt: skip
    log(f"Spearman {rho.statistic:.3f} (loss rise; {resolved} of {len(singles)} rises' intervals exclude 0), "
        f"{rho_kl.statistic:.3f} (KL) over {len(singles)} single changes; wrote {args.out}")  # fmt: skip


if __name__ == "__main__":
    main()
