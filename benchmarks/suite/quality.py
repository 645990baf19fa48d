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

from benchmarks.suite.common import command_line, write_json
from compressor.api.model_loading import load_model
from compressor.api.pipeline import compress_model, sensitivity_projections
from compressor.api.run_options import CompressOptions
from compressor.api.session import (
    calibration_token_windows,
    evaluation_token_windows,
    peak_rss_gb,
    read_texts,
    resolve_run,
)
from compressor.evaluation.intervals import paired_difference
from compressor.evaluation.perplexity import evaluate_against, evaluate_perplexity
from compressor.methods import get_method
from compressor.modeling.adapters import get_adapter
from compressor.recipes.schema import CompressionSettings, EvaluationSettings
from compressor.runtime.device import calibration_autocast
from compressor.statistics.cache import attach_cached_sensitivity, cached_statistics, save_sensitivity
from compressor.statistics.capture import collect_statistics

# name -> overrides of the recipe's compression settings
VARIANTS: dict[str, dict] = {
    "masa": {"method": "masa"},
    "masa-paper": {"method": "masa-paper"},
    # The former default allocation (relative whitened error), for the loss-aware default's comparison.
    "masa-relative": {"method": "masa", "allocation": "global-relative"},
    # Whole-model compression: every linear projection of the decoder layers.
    "masa-attn-mlp": {"method": "masa", "targets": "attn,mlp"},
    "masa-attn-mlp-relative": {"method": "masa", "targets": "attn,mlp", "allocation": "global-relative"},
    # The MLP's forms: low-rank factors (the default before neuron selection), one width in every layer.
    "masa-attn-mlp-lowrank": {"method": "masa", "targets": "attn,mlp", "mlp": "lowrank"},
    "masa-attn-mlp-uniform": {"method": "masa", "targets": "attn,mlp", "uniform_mlp": True},
    "masa-attn-mlp-basis": {"method": "masa", "targets": "attn,mlp", "sharing": "basis"},
    "svd-llm-attn-mlp": {"method": "svd-llm", "targets": "attn,mlp"},
    # A structured peer (FLAP, An et al. 2024) in the engine-native forms.
    "flap-attn-mlp": {"method": "flap", "targets": "attn,mlp"},
    # A decomposing peer (MoDeGPT, Lin et al. 2025): q/k dimensions, v/o ranks, Nyström MLP, per-layer sparsity.
    "modegpt-attn-mlp": {"method": "modegpt", "targets": "attn,mlp"},
    "masa-zero-atoms": {"method": "masa", "sharing": "atoms", "bases": 0},
    "svd-llm": {"method": "svd-llm"},
    "svd": {"method": "svd"},
    "shared-mean": {"method": "shared-mean"},
    "basis-sharing": {"method": "basis-sharing"},
    # MASA's forms of sharing (`--sharing`), every other setting the recipe's
    **{
        f"sharing-{form}": {"method": "masa", "sharing": form}
        for form in ("atoms", "basis", "qkv", "none", "auto")
    },
    # The `basis` form over runs of 2 and 8 layers (the default's runs are 4).
    **{f"sharing-basis-{n}": {"method": "masa", "sharing": "basis", "basis_layers": n} for n in (2, 8)},
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
    original: object  # PerplexityResult of the original on eval_windows (None until scored)
    stats: object
    recipe: object
    stats_key: str  # the statistics' cache key, which their loss sensitivity is cached under
    # Whether `stats.sensitivity` is in the cache (else saved once a variant measures it).
    sensitivity_cached: bool


def evaluation_settings(
    recipe,
    split: str = "test",
    seq_len: int | None = None,
    max_tokens: int | None = None,
    text: str | None = None,
) -> EvaluationSettings:
    """The recipe's evaluation with the given split, window length, token cap (None: all) and text."""
    base = recipe.evaluation if recipe else EvaluationSettings()
    update = {"split": split, "max_tokens": max_tokens}
    update.update({k: v for k, v in {"seq_len": seq_len, "source": text}.items() if v is not None})
    return base.model_copy(update=update)


def prepare_quality(
    model: str,
    calib_samples: int | None = None,
    seq_len: int | None = None,
    eval_seq_len: int | None = None,
    eval_max_tokens: int | None = None,
    progress: bool = True,
    log=print,
    mlp: bool = False,
    split: str = "test",
    evaluate_original: bool = True,
) -> QualitySetup:
    # The same resolution, text and windows as a `compress` run with these options (`compressor.api.session`);
    # with the MLP targeted, the recipe's `mlp_samples` windows, as such a run takes.
    targets = "attn,mlp" if mlp else None
    run = resolve_run(model, CompressOptions(calib_samples=calib_samples, seq_len=seq_len, targets=targets))
    source, recipe, calibration = run.source, run.recipe, run.calibration
    evaluation = evaluation_settings(recipe, split, eval_seq_len, eval_max_tokens)
    loaded = load_model(source, progress=progress)
    tokenizer = loaded.tokenizer
    calib_text, _ = read_texts(run, evaluate=False, allow_overlap=True)
    windows = calibration_token_windows(tokenizer, calibration, calib_text)
    eval_windows, eval_name = evaluation_token_windows(tokenizer, evaluation)
    original = None
    if evaluate_original:
        original = evaluate_perplexity(loaded.model, eval_windows, progress=progress, description="original")
        log(
            f"original ppl {original.ppl:.3f} ({original.tokens} tokens of {split}, {original.seconds:.0f} s)"
        )
    # The cache a `compress` run with the same model, text and windows fills: the same numbers either way.
    adapter = get_adapter(loaded.model)
    autocast = calibration_autocast(calibration.precision, loaded.dtype)  # as `compress` does
    stats, note, key = cached_statistics(
        loaded.model, adapter, calib_text.fingerprint, windows, loaded.dtype, mlp,
        lambda: collect_statistics(loaded.model, adapter, windows, progress=progress, mlp=mlp, autocast=autocast),
        autocast=autocast,
    )  # fmt: skip
    log(f"calibration statistics: {note}")
    samples, projections = recipe.compression.sensitivity_samples, sensitivity_projections(mlp)
    cached = attach_cached_sensitivity(stats, key, samples, adapter.num_layers, projections)
    return QualitySetup(
        source, loaded, calibration, calib_text.name, windows, evaluation, eval_windows, eval_name, original,
        stats, recipe, key, cached,
    )  # fmt: skip


def validation_setup(max_tokens: int, progress: bool = True) -> QualitySetup:
    """The bundled model's calibration with the MLP targeted, scored on the first `max_tokens` of the validation
    split (0: all of it); the original not scored yet (the choice benchmarks score it beside their variants)."""
    return prepare_quality(
        "smollm2-135m", split="validation", eval_max_tokens=max_tokens or None, mlp=True,
        evaluate_original=False, progress=progress,
    )  # fmt: skip


def validation_header(
    module: str, argv, setup: QualitySetup, original, model_ratio: float, targets_ratio: float, row: dict
) -> dict:
    """What a validation experiment's results file opens with (`benchmarks/experiments/*/run.py`): its command,
    the split and its tokens, the ratio asked and achieved (`row`: a `build_variant` row), the calibration windows,
    and the original's perplexity (`original`: its evaluation on the same windows)."""
    return {
        "command": command_line(module, argv),
        "split": "validation",
        "tokens": original.tokens,
        "model_ratio": model_ratio,
        "targets_ratio": targets_ratio,
        "achieved_ratio": row["achieved_ratio"],
        "calibration_windows": int(setup.windows.shape[0]),
        "original": {"ppl": original.ppl, "ppl_ci95": original.ppl_ci95, "nll": original.nll},
    }


def build_variant(
    setup: QualitySetup, name: str, overrides: dict, ratio: float, progress: bool = True
) -> tuple[torch.nn.Module, dict]:
    """A compressed copy of the model (the recipe's settings with `overrides`) and its row, not yet scored."""
    model_copy = copy.deepcopy(setup.loaded.model)
    settings = CompressionSettings(**{**setup.recipe.compression.model_dump(), **overrides})
    # As a CLI run would: a setting the method does not read is an error, never silently dropped.
    get_method(settings.method).refuse_unread(overrides, settings)
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
    if setup.stats.sensitivity is not None and not setup.sensitivity_cached:
        # The first variant that reads the loss sensitivity measured it on the shared statistics: cache it.
        save_sensitivity(setup.stats.sensitivity, setup.stats_key)
        setup.sensitivity_cached = True
    row = {
        "method": name,
        "ratio": ratio,
        "achieved_ratio": outcome.plan.achieved_ratio(),
        "target_params_after": outcome.plan.params_after(),
        "model_params_after": sum(p.numel() for p in model_copy.parameters()),
        "compress_seconds": seconds + setup.stats.seconds,
        "stage_seconds": dict(outcome.seconds),
        "settings": settings.model_dump(),
        "groups": outcome.report.get("grouping", {}).get("groups"),
        "report": {
            k: outcome.report[k]
            for k in ("shape_search", "effective_settings", "sharing", "atoms_dropped_unused")
            if k in outcome.report
        },
    }
    choice = outcome.report.get("sharing_choice")
    if choice:  # what --sharing auto chose, without the per-candidate costs
        row["report"]["sharing_choice"] = {
            "rounds": choice["rounds"],
            "chosen": [[c["group"], c["projection"]] for c in choice["candidates"] if c["chosen"] == "basis"],
        }
    return model_copy, row


def measure_variant(
    setup: QualitySetup, name: str, overrides: dict, ratio: float, progress: bool = True
) -> dict:
    """Compress a copy of the model with the recipe's settings and `overrides`, then evaluate it."""
    model_copy, row = build_variant(setup, name, overrides, ratio, progress)
    result = evaluate_perplexity(
        model_copy, setup.eval_windows, progress=progress, description=f"{name}@{ratio}"
    )
    return {**row, "ppl": result.ppl, "ppl_ci95": result.ppl_ci95}


def score(
    setup: QualitySetup,
    models: dict[str, torch.nn.Module],
    evaluation: EvaluationSettings,
    progress: bool = True,
) -> dict:
    """Score the original and `models` on `evaluation`'s windows in one pass (same windows for all).

    Returns the evaluation's description, the original's perplexity with its interval, and per model its
    perplexity, interval, KL from the original, top-1 agreement and per-window NLL (for paired differences).
    """
    windows, text = evaluation_token_windows(setup.loaded.tokenizer, evaluation)
    original, scored = evaluate_against(setup.loaded.model, models, windows, progress=progress)
    return {
        "evaluation": {
            **evaluation.model_dump(),
            "text": text,
            "tokens": original.tokens,
            "windows": original.windows,
        },
        "original": {"ppl": original.ppl, "ppl_ci95": original.ppl_ci95, "window_nll": original.window_nll},
        "models": {
            name: {
                "ppl": result.ppl,
                "ppl_ci95": result.ppl_ci95,
                **faith.to_dict(),
                "window_nll": result.window_nll,
            }
            for name, (result, faith) in scored.items()
        },
        "window_tokens": original.window_tokens,
    }


def compare(scores: dict, a: str, b: str) -> dict:
    """Paired difference ppl(a) − ppl(b) on the windows of `scores` (`"original"` names the original)."""

    def nll(name):
        return (
            scores["original"]["window_nll"] if name == "original" else scores["models"][name]["window_nll"]
        )

    return paired_difference(nll(a), nll(b), scores["window_tokens"]).to_dict()


def strip_windows(scores: dict) -> dict:
    """`scores` without the per-window arrays (kept out of the committed JSON: they are bulky)."""
    out = {**scores, "original": {k: v for k, v in scores["original"].items() if k != "window_nll"}}
    out["models"] = {
        n: {k: v for k, v in m.items() if k != "window_nll"} for n, m in scores["models"].items()
    }
    out.pop("window_tokens", None)
    return out


def quality_header(setup: QualitySetup) -> dict:
    return {
        "model": setup.source.describe(),
        "calibration": {
            **setup.calibration.model_dump(), "text": setup.calib_name, "tokens": int(setup.windows.numel())
        },
        "evaluation": {
            **setup.evaluation.model_dump(), "text": setup.eval_name,
            "tokens": setup.original.tokens if setup.original else None,
        },
        "model_params_before": sum(p.numel() for p in setup.loaded.model.parameters()),
        "original_ppl": setup.original.ppl if setup.original else None,
        "original_ppl_ci95": setup.original.ppl_ci95 if setup.original else None,
        "calibration_seconds": setup.stats.seconds,
    }  # fmt: skip


def variant_key(name: str, ratio: float) -> str:
    return f"{name}@{ratio:g}"


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
    split: str = "test",
    extra_variants: dict[float, list[str]] | None = None,
) -> dict:
    """Every variant at every ratio (and `extra_variants`: ratio -> names, e.g. one ablation at 0.2), built
    from ONE calibration and scored with the original in ONE pass over the same windows of `split`.

    The built models stay in memory (``result["_models"]``), so that callers can score them on other texts
    or window lengths without compressing again.
    """
    # The MLP inputs' statistics only when a variant compresses MLP projections (they cost calibration time).
    mlp = any("mlp" in overrides.get("targets", "attn") for overrides in variants.values())
    setup = prepare_quality(
        model, calib_samples, seq_len, eval_seq_len, eval_max_tokens, progress, log, mlp, split,
        evaluate_original=False,
    )  # fmt: skip
    plan = [(name, ratio) for ratio in ratios for name in variants]
    plan += [(name, ratio) for ratio, names in (extra_variants or {}).items() for name in names]
    models, rows = {}, []
    for name, ratio in plan:
        model_copy, row = build_variant(
            setup, name, variants[name] if name in variants else VARIANTS[name], ratio, progress
        )
        models[variant_key(name, ratio)] = model_copy
        rows.append(row)
        log(f"built {name:>18} ratio {ratio:.2f} achieved {row['achieved_ratio']:.4f}")
    scores = score(setup, models, setup.evaluation, progress)
    for row in rows:
        row.update({k: v for k, v in scores["models"][variant_key(row["method"], row["ratio"])].items()
                    if k != "window_nll"})  # fmt: skip
        log(f"{row['method']:>18} ratio {row['ratio']:.2f} ppl {row['ppl']:.3f} {row['ppl_ci95']}")
    header = quality_header(setup)
    header["evaluation"]["tokens"] = scores["evaluation"]["tokens"]
    header["original_ppl"] = scores["original"]["ppl"]
    header["original_ppl_ci95"] = scores["original"]["ppl_ci95"]
    return {
        **header,
        "quality": rows,
        "peak_rss_gb": peak_rss_gb(),
        "_scores": scores,
        "_models": models,
        "_setup": setup,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--ratios", default="0.2")
    parser.add_argument("--calib-samples", type=int)
    parser.add_argument("--seq-len", type=int)
    parser.add_argument("--eval-max-tokens", type=int)
    parser.add_argument(
        "--split", default="test", help="evaluation split (choose on validation, report test)"
    )
    parser.add_argument("--out")
    args = parser.parse_args()
    variants = {name: VARIANTS[name] for name in args.variants.split(",")}
    first = next(iter(variants))
    result = run_quality(
        args.model,
        variants,
        [float(r) for r in args.ratios.split(",")],
        calib_samples=args.calib_samples,
        seq_len=args.seq_len,
        eval_max_tokens=args.eval_max_tokens,
        progress=False,
        split=args.split,
    )
    for row in result["quality"]:
        # Paired, on the same windows: the first variant minus this row's, and this row's rise.
        this = variant_key(row["method"], row["ratio"])
        row["rise"] = compare(result["_scores"], this, "original")
        if row["method"] != first:
            row[f"{first}_minus_this"] = compare(result["_scores"], variant_key(first, row["ratio"]), this)
    public = {k: v for k, v in result.items() if not k.startswith("_")}
    if args.out:
        write_json(args.out, public)
    print(json.dumps(public, indent=2))


if __name__ == "__main__":
    main()
