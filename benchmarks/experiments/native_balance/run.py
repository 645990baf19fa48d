"""Where the engine-native form (`--native`: whole query heads, MLPs in multiples of 32) loses, and the budget
between its two kinds of units, on the validation split.

The bundled model 20% smaller in the native form scores 1.48x the original's perplexity on the test split in
llama.cpp, where issue 57 asks 1.45x (the factored default: 1.38x). This measures, from the native run's own
calibration (the recipe's `mlp_samples` windows):

- the split of the loss: the native model with every layer's attention put back (only its MLPs narrowed), and
  with every MLP put back (only its heads removed);
- the budget between heads and neurons: the loss sensitivity of every MLP unit multiplied by `w`
  (`mlp-weight-w`), which moves the cut towards the heads (w > 1) or the MLP (w < 1);
- the loss sensitivity from more windows (`sensitivity-16`: the backward pass over 16 windows, not 4);
- with `--attention-free L1,L2,...`, instead: layers without attention (what llama.cpp's `deci` runs with a
  layer's head count 0), the parameters they free given to the rest: the native model at a smaller ratio with
  the attention of those layers removed (its output zero: the layout has no bias for it; `-mean`: replaced by
  its calibration mean, which it cannot hold), so that the model holds as many parameters as the native one.

Every model and the original scored in one pass over the same validation windows (paired differences to the
native default). `python -m benchmarks.experiments.native_balance.run [--model-ratio 0.2] [--max-tokens 0]
[--out F]`: `benchmarks/results/choices/native-balance-validation.json`.
"""

from __future__ import annotations

import argparse
import copy

import torch

from benchmarks.experiments.budget_split.run import MLP_UNITS, restored, reweighted
from benchmarks.suite.common import command_line, write_json
from benchmarks.suite.quality import build_variant, validation_header, validation_setup
from benchmarks.suite.whole_model import model_ratio_as_targets
from compressor.api.run_options import NATIVE_FORMS
from compressor.evaluation.intervals import paired_difference
from compressor.evaluation.perplexity import evaluate_against
from compressor.modeling.adapters import get_adapter

MLP_WEIGHTS = (0.5, 0.7, 1.5, 2.0, 3.0)
MORE_SENSITIVITY_WINDOWS = 16
#: Calibration windows the attention-free variant's mean is taken over.
MEAN_WINDOWS = 16


def native_overrides() -> dict:
    """The compression settings `--targets attn,mlp --native` sets."""
    return {"method": "masa", "targets": "attn,mlp", **NATIVE_FORMS}


def widths_and_heads(model: torch.nn.Module) -> dict:
    """Per layer, the MLP width and the query heads the model keeps."""
    adapter = get_adapter(model)
    layers = [adapter.layers[i] for i in range(adapter.num_layers)]
    head_dim = model.config.head_dim if hasattr(model.config, "head_dim") else None
    head_dim = head_dim or model.config.hidden_size // model.config.num_attention_heads
    return {
        "mlp_widths": [layer.mlp.down_proj.in_features for layer in layers],
        "heads": [layer.self_attn.o_proj.in_features // head_dim for layer in layers],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-ratio", type=float, default=0.2)
    parser.add_argument("--max-tokens", type=int, default=0, help="0: the whole validation split")
    parser.add_argument("--out")
    parser.add_argument("--attention-free", help="layers without attention (e.g. 5,7): the second comparison")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    setup = validation_setup(args.max_tokens, progress=False)
    original_model = setup.loaded.model
    ratio = model_ratio_as_targets("smollm2-135m", args.model_ratio)
    overrides = native_overrides()
    default, row = build_variant(setup, "native", overrides, ratio, progress=False)
    if args.attention_free:
        layers = [int(x) for x in args.attention_free.split(",")]
        return attention_free(setup, default, row, ratio, layers, args, argv)
    variants = {
        "native": default,
        "attention-restored": restored(default, original_model, "self_attn"),
        "mlp-restored": restored(default, original_model, "mlp"),
    }
    shapes = {"native": widths_and_heads(default)}
    base = setup.stats.sensitivity
    keys = list(base.weights)
    for weight in MLP_WEIGHTS:
        name = f"mlp-weight-{weight:g}"
        setup.stats.sensitivity = reweighted(base, {k: weight if k[1] in MLP_UNITS else 1.0 for k in keys})
        variants[name], _ = build_variant(setup, name, overrides, ratio, progress=False)
        shapes[name] = widths_and_heads(variants[name])
    setup.stats.sensitivity = None  # measured again by the run, over more windows
    name = f"sensitivity-{MORE_SENSITIVITY_WINDOWS}"
    more = {**overrides, "sensitivity_samples": MORE_SENSITIVITY_WINDOWS}
    variants[name], _ = build_variant(setup, name, more, ratio, progress=False)
    shapes[name] = widths_and_heads(variants[name])
    setup.stats.sensitivity = base
    original, rows = scored_rows(original_model, variants, setup.eval_windows, shapes)
    module = "benchmarks.experiments.native_balance.run"
    payload = validation_header(module, argv, setup, original, args.model_ratio, ratio, row) | {
        "settings": row["settings"],
        "sensitivity_windows": base.windows,
        "rows": rows,
    }
    if args.out:
        write_json(args.out, payload)


def scored_rows(original_model, variants: dict, windows, extra: dict) -> tuple:
    """The original and every variant scored in one pass over `windows`; a row per variant (its `extra` fields
    added) with its paired difference to the native model, each printed as it is made."""
    original, scored = evaluate_against(original_model, variants, windows, progress=False)
    reference = scored["native"][0]
    rows = []
    for name, (result, faith) in scored.items():
        diff = paired_difference(result.window_nll, reference.window_nll, result.window_tokens)
        rows.append({
            "variant": name, "ppl": result.ppl, "ppl_ci95": result.ppl_ci95, "nll": result.nll,
            "ppl_ratio": result.ppl / original.ppl,
            "kl_to_original": faith.kl_to_original, "top1_agreement": faith.top1_agreement,
            "minus_native": None if name == "native" else diff.to_dict(), **extra.get(name, {}),
        })  # fmt: skip
        print(
            f"{name:20s} ppl {result.ppl:8.3f} ({result.ppl / original.ppl:.3f}x)  minus native "
            f"{diff.value:+.3f} [{diff.ci95[0]:+.3f}, {diff.ci95[1]:+.3f}]",
            flush=True,
        )
    return original, rows


def parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def attention_params(model: torch.nn.Module, layers: list[int]) -> int:
    adapter = get_adapter(model)
    return sum(sum(p.numel() for p in adapter.layers[i].self_attn.parameters()) for i in layers)


def attention_means(model: torch.nn.Module, layers: list[int], windows: torch.Tensor) -> dict:
    """Per layer, the mean of its attention output over `windows` (fp64 sums)."""
    adapter = get_adapter(model)
    sums, counts = {}, {}

    def accumulate(layer):
        def hook(module, args, output):
            out = output.double().flatten(0, -2)
            sums[layer] = sums.get(layer, 0) + out.sum(0)
            counts[layer] = counts.get(layer, 0) + len(out)

        return hook

    handles = [adapter.layers[i].self_attn.o_proj.register_forward_hook(accumulate(i)) for i in layers]
    try:
        with torch.no_grad():
            for window in windows:
                model(input_ids=window[None], use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return {layer: (sums[layer] / counts[layer]).float() for layer in layers}


class ConstantOutput(torch.nn.Module):
    """o_proj replaced by a constant (zero or a mean): the layer's attention contributes nothing it computes."""

    def __init__(self, value: torch.Tensor):
        super().__init__()
        self.register_buffer("value", value)

    def forward(self, x):
        return self.value.to(x.dtype).expand(*x.shape[:-1], self.value.shape[0])


def without_attention(model: torch.nn.Module, layers: list[int], means: dict | None) -> torch.nn.Module:
    """A copy of `model` whose `layers` add zero (or, with `means`, their mean) in place of their attention."""
    model = copy.deepcopy(model)
    adapter = get_adapter(model)
    for layer in layers:
        hidden = adapter.layers[layer].self_attn.o_proj.out_features
        value = means[layer] if means else torch.zeros(hidden)
        adapter.layers[layer].self_attn.o_proj = ConstantOutput(value)
    return model


def attention_free(setup, native, row, ratio, layers, args, argv) -> None:
    """The native model against one as large with `layers` attention-free (zero, and the mean as a bound)."""
    original_model = setup.loaded.model
    target = parameters(native)
    freed = attention_params(original_model, layers)
    targets_before = row["target_params_after"] / (1 - row["achieved_ratio"])
    smaller = ratio - 0.75 * freed / targets_before  # a first guess: the allocation keeps some of their heads
    for _ in range(2):  # the ratio whose model, less the attention of `layers`, holds `target` parameters
        candidate, _ = build_variant(setup, "attention-free", native_overrides(), smaller, progress=False)
        smaller += (parameters(candidate) - attention_params(candidate, layers) - target) / targets_before
    candidate, _ = build_variant(setup, "attention-free", native_overrides(), smaller, progress=False)
    means = attention_means(original_model, layers, setup.windows[:MEAN_WINDOWS])
    variants = {
        "native": native,
        "attention-free": without_attention(candidate, layers, None),
        "attention-free-mean": without_attention(candidate, layers, means),
    }
    counted = {
        "native": target,
        "attention-free": parameters(candidate) - attention_params(candidate, layers),
    }
    counts = {name: {"model_params": counted.get(name, counted["attention-free"])} for name in variants}
    original, rows = scored_rows(original_model, variants, setup.eval_windows, counts)
    payload = {
        "command": command_line("benchmarks.experiments.native_balance.run", argv),
        "split": "validation",
        "tokens": original.tokens,
        "model_ratio": args.model_ratio,
        "attention_free_layers": layers,
        "targets_ratio_native": ratio,
        "targets_ratio_attention_free": smaller,
        "original": {"ppl": original.ppl, "ppl_ci95": original.ppl_ci95},
        "rows": rows,
    }
    if args.out:
        write_json(args.out, payload)


if __name__ == "__main__":
    main()
