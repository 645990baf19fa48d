"""Whole-model compression (`--targets attn,mlp --ratio-of model`): at each fraction of the whole model removed,
the default (the MLP by neuron selection), the MLP by low-rank factors (`--mlp lowrank`), one MLP width in
every layer (`--uniform-mlp`: a standard architecture) and SVD-LLM's uniform ranks, from ONE calibration scored
with the original in ONE pass over the same windows (paired differences); the models at the headline fraction
scored again on a second text domain. `make bench`'s `whole_model` section runs `measure_whole_model`.

`python -m benchmarks.suite.whole_model [--model-ratios 0.1,0.2,0.3,0.4] [--variants ...] [--split test] [--out F]`
(`--split validation` for choices; `--out benchmarks/results/choices/whole-model-validation.json` keeps one, which
BENCHMARKS.md then renders in its choices section: none is kept today).
"""

from __future__ import annotations

import argparse

from benchmarks.suite.common import command_line, write_json
from benchmarks.suite.quality import (
    VARIANTS,
    compare,
    evaluation_settings,
    run_quality,
    score,
    strip_windows,
    variant_key,
)
from compressor.api.preview import model_parameter_count, read_model_config
from compressor.api.run_options import CompressOptions
from compressor.api.session import resolve_run
from compressor.math.accounting import targets_ratio
from compressor.methods import ModelShape
from compressor.modeling.adapters import target_projections

MODEL = "smollm2-135m"
#: The default (the MLP by neuron selection, widths per layer), the MLP by low-rank factors (`--mlp lowrank`),
#: one MLP width in every layer (a standard architecture: export-dense), and SVD-LLM's uniform ranks.
DEFAULT, LOWRANK, UNIFORM, BASELINE, FLAP, MODEGPT = (
    "masa-attn-mlp",
    "masa-attn-mlp-lowrank",
    "masa-attn-mlp-uniform",
    "svd-llm-attn-mlp",
    "flap-attn-mlp",
    "modegpt-attn-mlp",
)
CURVE = (DEFAULT, LOWRANK, UNIFORM, FLAP, MODEGPT, BASELINE)
#: Paired differences reported per row: this variant minus each partner, on the same windows.
PARTNERS = {
    DEFAULT: (LOWRANK, BASELINE, FLAP, MODEGPT),
    UNIFORM: (DEFAULT,),
    "masa-attn-mlp-basis": (DEFAULT,),
    FLAP: (BASELINE,),
    MODEGPT: (BASELINE,),
}
BYTES_PER_NUMBER = 4  # the bundled model's weights are float32


def model_ratio_as_targets(model: str, ratio: float) -> float:
    """The attn+mlp ratio that removes `ratio` of the whole model's parameters (as `--ratio-of model` does)."""
    run = resolve_run(model, CompressOptions())
    config, _ = read_model_config(run.source)
    targets = ModelShape.from_config(config, target_projections("attn,mlp")).params_before
    return targets_ratio(ratio, "model", model_parameter_count(config), targets, "attn,mlp")


def measure_whole_model(
    variants: list[str],
    model_ratios: list[float],
    split: str = "test",
    headline: float | None = 0.2,
    other_texts: tuple[str, ...] = ("shakespeare",),
    log=print,
    headline_variants: tuple[str, ...] = (),
    **quality_settings,
) -> dict:
    """The curve: every variant at every fraction of the model (and `headline_variants` at the `headline`
    fraction only), one calibration, one scoring pass; the rows carry their model size, their rise over the
    original and their paired differences to their partners. At the `headline` fraction the same models are
    scored on `other_texts` too."""
    as_targets = {r: model_ratio_as_targets(MODEL, r) for r in model_ratios}
    chosen = {name: VARIANTS[name] for name in variants}
    extra = {as_targets[headline]: list(headline_variants)} if headline_variants else None
    result = run_quality(
        MODEL, chosen, list(as_targets.values()), progress=False, split=split, log=log, extra_variants=extra,
        **quality_settings,
    )  # fmt: skip
    chosen.update({name: VARIANTS[name] for name in headline_variants})
    variants = [*variants, *headline_variants]
    scores = result["_scores"]
    by_target = {round(t, 12): r for r, t in as_targets.items()}
    for row in result["quality"]:
        this = variant_key(row["method"], row["ratio"])
        row["model_ratio"] = by_target[round(row["ratio"], 12)]
        row["model_mib"] = row["model_params_after"] * BYTES_PER_NUMBER / 2**20
        row["rise"] = compare(scores, this, "original")
        for partner in PARTNERS.get(row["method"], ()):
            if partner in chosen:
                row[f"minus_{partner}"] = compare(scores, this, variant_key(partner, row["ratio"]))
    rows = {(r["method"], r["ratio"]): r for r in result["quality"]}
    for (method, ratio), row in rows.items():
        if method == DEFAULT and (BASELINE, ratio) in rows:
            row["rise_ratio_vs_svd_llm"] = row["rise"]["value"] / rows[(BASELINE, ratio)]["rise"]["value"]
    payload = {k: v for k, v in result.items() if not k.startswith("_")}
    payload["model_ratios"] = {str(r): t for r, t in as_targets.items()}
    payload["model_mib_before"] = result["model_params_before"] * BYTES_PER_NUMBER / 2**20
    if headline is not None and other_texts:
        payload["other_texts"] = _other_texts(result, as_targets[headline], variants, other_texts, split, log)
    return payload


def _other_texts(result: dict, ratio: float, variants: list[str], texts, split: str, log) -> dict:
    """The models at one ratio scored on each other text (its `split`), with the partners' differences."""
    setup, models = result["_setup"], result["_models"]
    at = {name: models[variant_key(name, ratio)] for name in variants}
    out = {}
    for text in texts:
        evaluation = evaluation_settings(
            setup.recipe, split, max_tokens=setup.evaluation.max_tokens, text=text
        )
        log(f"whole model at {ratio:.4f} of attn+mlp on {text} ({split})")
        scores = score(setup, at, evaluation, progress=False)
        differences = {
            f"{name}_minus_{partner}": compare(scores, name, partner)
            for name in variants
            for partner in PARTNERS.get(name, ())
            if partner in at
        }
        out[text] = {**strip_windows(scores), "differences": differences, "targets_ratio": ratio}
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--model-ratios", default="0.1,0.2,0.3,0.4", help="fractions of the whole model removed"
    )
    parser.add_argument("--variants", default=",".join(CURVE))
    parser.add_argument("--headline-variants", default="", help="variants measured at 0.2 of the model only")
    parser.add_argument("--split", default="test")
    parser.add_argument("--no-other-texts", action="store_true", help="skip the second text domain")
    parser.add_argument("--eval-max-tokens", type=int, help="evaluation tokens per text (default: all)")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    ratios = [float(r) for r in args.model_ratios.split(",")]
    payload = measure_whole_model(
        args.variants.split(","), ratios, args.split, headline=0.2 if 0.2 in ratios else None,
        other_texts=() if args.no_other_texts else ("shakespeare",),
        headline_variants=tuple(v for v in args.headline_variants.split(",") if v),
        eval_max_tokens=args.eval_max_tokens,
    )  # fmt: skip
    payload["command"] = command_line("benchmarks.suite.whole_model", argv)
    if args.out:
        write_json(args.out, payload)
    for row in payload["quality"]:
        print(row["method"], f"model {row['model_ratio']:.2f}", f"{row['ppl']:.3f}", row["ppl_ci95"],
              {k: v["value"] for k, v in row.items() if k.startswith("minus_")})  # fmt: skip


if __name__ == "__main__":
    main()
