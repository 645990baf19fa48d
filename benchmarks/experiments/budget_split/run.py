"""Where the model 20% (30%) smaller loses, and three levers on it measured against the default (none adopted).

Issue 33 asks the default to reach 1.30x the original's perplexity at 20% and 1.6x at 30%. This measures, on
the validation split, from the default's own calibration (the recipe's `mlp_samples` windows):

- the split of the loss: the default with every layer's attention put back (only its MLP compressed), and with
  every MLP put back (only its attention compressed);
- the budget between attention and MLP: the loss sensitivity of every MLP unit multiplied by `w`
  (`mlp-weight-w`), which moves the cut towards the attention (w > 1) or the MLP (w < 1);
- the sensitivity at the compressed point: the loss sensitivity re-measured on the default's compressed model
  (same windows, same definition: mean ‖∂L/∂y‖² / d_out) and blended with the original's as
  `s_orig · (s_comp / s_orig)^a` (`endpoint-a`; 1: the compressed model's), then allocated and built again;
- one layer's attention without its computation: per layer, the calibration loss rise when that layer's
  attention output is replaced by its mean (the original model otherwise; 4 windows the sensitivity did not
  read), against what the layer's attention holds;
- a linear path beside a narrowed MLP (the part of a joint refit that has a closed form): at chosen layers and
  kept fractions, the relative output error of the neurons with `down_proj` refit, and what a rank-r map of the
  MLP's input fitted to that error removes, against the neurons the same numbers would keep instead (on the first
  16 calibration windows, in-sample for both).

Every model and the original scored in one pass over the same validation windows (paired differences to the
default). `python -m benchmarks.experiments.budget_split.run [--model-ratio 0.2] [--max-tokens 16384] [--out F]`:
`benchmarks/results/choices/budget-split-validation-{20,30}.json`.
"""

from __future__ import annotations

import argparse
import copy

import torch
from torch import nn

from benchmarks.suite.common import write_json
from benchmarks.suite.quality import build_variant, validation_header, validation_setup
from benchmarks.suite.whole_model import model_ratio_as_targets
from compressor.evaluation.intervals import paired_difference
from compressor.evaluation.perplexity import evaluate_against, evaluate_perplexity
from compressor.math.neurons import greedy_order
from compressor.modeling.adapters import get_adapter
from compressor.statistics.sensitivity import Sensitivity, collect_sensitivity

MLP_UNITS = ("gate_proj", "up_proj", "down_proj")
MLP_WEIGHTS = (0.7, 1.5, 2.5)
ENDPOINT_BLENDS = (0.5, 1.0)
BYPASS_LAYERS = (5, 15, 25)
BYPASS_KEEPS = (0.4, 0.6, 0.75)
BYPASS_RANKS = (16, 64, 128)
BYPASS_WINDOWS = 16
#: The attention-drop scan's windows: calibration windows from this index on (the sensitivity read the first).
DROP_FIRST, DROP_WINDOWS = 64, 4


def restored(compressed: nn.Module, original: nn.Module, part: str) -> nn.Module:
    """A copy of `compressed` with every layer's `part` (`self_attn` or `mlp`) taken from `original`."""
    model = copy.deepcopy(compressed)
    into, source = get_adapter(model), get_adapter(original)
    for layer in range(into.num_layers):
        setattr(into.layers[layer], part, copy.deepcopy(getattr(source.layers[layer], part)))
    return model


def measured_sensitivity(model: nn.Module, keys: list[tuple[int, str]], windows: torch.Tensor) -> dict:
    """Per (layer, projection) of `model` (compressed modules included), its loss sensitivity over the windows
    (`statistics.sensitivity`: the mean over the tokens of ‖∂L/∂y‖² / d_out)."""
    projections = tuple(dict.fromkeys(p for _, p in keys))
    return collect_sensitivity(model, get_adapter(model), windows, projections, progress=False).weights


def reweighted(base: Sensitivity, factor: dict) -> Sensitivity:
    """`base` with each weight multiplied by `factor[key]` (how it was measured kept)."""
    return Sensitivity(
        {k: v * factor[k] for k, v in base.weights.items()}, base.tokens, base.windows, base.seconds
    )


@torch.no_grad()
def bypass_errors(model: nn.Module, windows: torch.Tensor) -> list[dict]:
    """Per layer of BYPASS_LAYERS and kept fraction: the relative output error of the greedy neurons with down_proj
    refit; with a rank-r linear map of the MLP's input x fitted to what they leave (whitened SVD of E[r xᵀ]); and
    with the neurons the same numbers keep instead (a rank costs 2·hidden, a neuron 3·hidden)."""
    adapter = get_adapter(model)
    seen, sums, handles = {}, {}, []
    for layer in BYPASS_LAYERS:
        mlp = adapter.layers[layer].mlp

        def keep_input(name):
            return lambda module, args: seen.__setitem__(
                name, args[0].reshape(-1, args[0].shape[-1]).double()
            )

        handles += [
            mlp.register_forward_pre_hook(keep_input(("x", layer))),
            mlp.down_proj.register_forward_pre_hook(keep_input(("z", layer))),
        ]
    try:
        for window in windows:
            model(input_ids=window[None], use_cache=False)
            for layer in BYPASS_LAYERS:
                x, z = seen[("x", layer)], seen[("z", layer)]
                for name, value in (("xx", x.T @ x), ("zz", z.T @ z), ("zx", z.T @ x)):
                    sums[(name, layer)] = sums.get((name, layer), 0) + value
                sums[("n", layer)] = sums.get(("n", layer), 0) + len(x)
    finally:
        for handle in handles:
            handle.remove()
    rows = []
    for layer in BYPASS_LAYERS:
        n = sums[("n", layer)]
        cx, cz, czx = (sums[(name, layer)] / n for name in ("xx", "zz", "zx"))
        down = adapter.layers[layer].mlp.down_proj.weight.double()
        hidden = down.shape[0]
        order = greedy_order(cz.float(), down.float())
        total = float(torch.trace(down @ cz @ down.T))

        lower = torch.linalg.cholesky(cx)
        for keep in BYPASS_KEEPS:
            width = int(keep * cz.shape[0])
            refit, kept, error = _neurons(down, cz, order[:width], total)
            left = down @ czx - refit @ czx[kept]  # E[r xᵀ], r what the refit neurons leave
            energy = torch.linalg.svdvals(
                torch.linalg.solve_triangular(lower, left.T, upper=False).T
            ).square()
            row = {"layer": layer, "keep": keep, "width": width, "neurons": error, "ranks": []}
            for rank in BYPASS_RANKS:
                extra = round(rank * 2 * hidden / (3 * hidden))
                row["ranks"].append({
                    "rank": rank, "with_linear_path": error - float(energy[:rank].sum()) / total,
                    "same_numbers_as_neurons": extra, "with_more_neurons": _neurons(down, cz, order[: width + extra], total)[2],
                })  # fmt: skip
            rows.append(row)
    return rows


def _first(output):
    return output[0] if isinstance(output, tuple) else output


@torch.no_grad()
def attention_drop_scan(model: nn.Module, windows: torch.Tensor) -> dict:
    """Per layer, the mean loss over `windows` with that layer's attention output replaced by its mean over the
    same windows, minus the model's own loss."""
    adapter = get_adapter(model)
    sums: dict[int, torch.Tensor] = {}
    counts: dict[int, int] = {}

    def accumulate(layer):
        def hook(module, args, output):
            out = _first(output).double().flatten(0, -2)
            sums[layer] = sums.get(layer, 0) + out.sum(0)
            counts[layer] = counts.get(layer, 0) + len(out)

        return hook

    handles = [
        adapter.layers[i].self_attn.register_forward_hook(accumulate(i)) for i in range(adapter.num_layers)
    ]
    try:
        base = evaluate_perplexity(model, windows, progress=False).nll
    finally:
        for handle in handles:
            handle.remove()
    rises = []
    for layer in range(adapter.num_layers):
        mean = (sums[layer] / counts[layer]).float()

        def replace(module, args, output, mean=mean):
            out = _first(output)
            constant = mean.to(out.dtype).expand_as(out)
            return (constant, *output[1:]) if isinstance(output, tuple) else constant

        handle = adapter.layers[layer].self_attn.register_forward_hook(replace)
        try:
            rises.append(evaluate_perplexity(model, windows, progress=False).nll - base)
        finally:
            handle.remove()
    held = [
        sum(p.numel() for p in adapter.layers[i].self_attn.parameters()) for i in range(adapter.num_layers)
    ]
    return {"loss": base, "rise": rises, "attention_params": held}


def _neurons(down: torch.Tensor, cz: torch.Tensor, kept: torch.Tensor, total: float):
    """down_proj refit on the `kept` neurons (least squares on C = cz), and the relative output error left."""
    explained = down @ cz[:, kept]  # D C[:, S]
    refit = torch.linalg.solve(cz[kept][:, kept], explained.T).T
    return refit, kept, (total - float(torch.trace(refit @ explained.T))) / total


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-ratio", type=float, default=0.2)
    parser.add_argument("--max-tokens", type=int, default=16384, help="0: the whole validation split")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    setup = validation_setup(args.max_tokens, progress=False)
    original_model = setup.loaded.model
    ratio = model_ratio_as_targets("smollm2-135m", args.model_ratio)
    targets = {"targets": "attn,mlp"}
    default, row = build_variant(setup, "default", targets, ratio, progress=False)
    variants = {
        "default": default,
        "attention-restored": restored(default, original_model, "self_attn"),
        "mlp-restored": restored(default, original_model, "mlp"),
    }
    base = setup.stats.sensitivity
    keys = list(base.weights)
    for weight in MLP_WEIGHTS:
        setup.stats.sensitivity = reweighted(base, {k: weight if k[1] in MLP_UNITS else 1.0 for k in keys})
        variants[f"mlp-weight-{weight:g}"], _ = build_variant(setup, "w", targets, ratio, progress=False)
    at_compressed = measured_sensitivity(default, keys, setup.windows[: base.windows])
    change = {k: at_compressed[k] / base.weights[k] for k in keys}
    for blend in ENDPOINT_BLENDS:
        setup.stats.sensitivity = reweighted(base, {k: change[k] ** blend for k in keys})
        variants[f"endpoint-{blend:g}"], _ = build_variant(setup, "e", targets, ratio, progress=False)
    setup.stats.sensitivity = base
    original, scored = evaluate_against(original_model, variants, setup.eval_windows, progress=False)
    reference = scored["default"][0]
    rows = []
    for name, (result, faith) in scored.items():
        diff = paired_difference(result.window_nll, reference.window_nll, result.window_tokens)
        rows.append({
            "variant": name, "ppl": result.ppl, "ppl_ci95": result.ppl_ci95, "nll": result.nll,
            "kl_to_original": faith.kl_to_original, "top1_agreement": faith.top1_agreement,
            "minus_default": None if name == "default" else diff.to_dict(),
        })  # fmt: skip
        print(
            f"{name:20s} ppl {result.ppl:8.3f}  minus default {diff.value:+.3f} [{diff.ci95[0]:+.3f}, {diff.ci95[1]:+.3f}]"
        )
    module = "benchmarks.experiments.budget_split.run"
    payload = validation_header(module, argv, setup, original, args.model_ratio, ratio, row) | {
        "sensitivity_windows": base.windows,
        "rows": rows,
        "sensitivity_change": {f"{layer}.{p}": v for (layer, p), v in change.items()},
        "drop_windows": [DROP_FIRST, DROP_FIRST + DROP_WINDOWS],
        "attention_drop": attention_drop_scan(
            original_model, setup.windows[DROP_FIRST : DROP_FIRST + DROP_WINDOWS]
        ),
        "bypass_windows": BYPASS_WINDOWS,
        "bypass": bypass_errors(original_model, setup.windows[:BYPASS_WINDOWS]),
    }
    if args.out:
        write_json(args.out, payload)


if __name__ == "__main__":
    main()
