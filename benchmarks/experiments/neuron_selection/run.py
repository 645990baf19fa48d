"""Which neurons to keep, and how much ridge: the selection rules of `compressor.math.neurons` on the validation split.

Every MLP keeps the same fraction of its neurons (attention untouched), down_proj refit by least squares; every
variant and the original scored in one pass over the same validation windows (paired differences). This chose the
default order and ridge of the neuron form (`--mlp neurons`); the others need not stay.

`python -m benchmarks.experiments.neuron_selection.run [--keep 0.75,0.6] [--variants rule:order_ridge:refit_ridge,...]
[--max-tokens 16384] [--out F]`. Round 1 (16,384 tokens; every rule and ridge): `benchmarks/results/choices/neuron-selection-round1.json`;
round 2 (the whole validation split; the leading rules): `benchmarks/results/choices/neuron-selection-round2.json`.
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
from torch import nn

from benchmarks.suite.common import command_line, write_json
from benchmarks.suite.quality import validation_setup
from compressor.evaluation.intervals import paired_difference
from compressor.evaluation.perplexity import evaluate_against
from compressor.math.neurons import neuron_order, order_tail, refit_down
from compressor.modeling.adapters import get_adapter


def prune_uniform(
    model: nn.Module, stats, keep: float, rule: str, order_ridge: float, ridge: float = 0.0
) -> tuple[nn.Module, float]:
    """A copy of `model` whose every MLP keeps `keep` of its neurons by `rule` (with `order_ridge`), down_proj
    refit with `ridge`; and its summed predicted output error."""
    model = copy.deepcopy(model)
    adapter = get_adapter(model)
    error = 0.0
    for layer in range(adapter.num_layers):
        mlp = adapter.layers[layer].mlp
        c = stats.down_autocorr[layer]
        down = mlp.down_proj.weight.detach().double()
        width = round(keep * down.shape[1])
        neurons = order_tail(c, down, neuron_order(rule, c, down, order_ridge), ridge)
        kept = neurons.kept(width)
        refit = refit_down(c, down, neurons, width, ridge)
        error += float(neurons.tail[width])
        bias = None if mlp.down_proj.bias is None else mlp.down_proj.bias.data
        narrow_mlp(mlp, kept, refit, bias)
    return model, error


def narrow_mlp(
    mlp: nn.Module, kept: torch.Tensor, refit: torch.Tensor, down_bias: torch.Tensor | None
) -> None:
    """`mlp` keeping the neurons `kept` (their gate/up rows and biases) with `refit` (hidden × len(kept)) as its
    down_proj, whose bias is `down_bias` (None: none)."""
    width = len(kept)
    for name in ("gate_proj", "up_proj"):
        old = getattr(mlp, name)
        new = nn.Linear(old.in_features, width, bias=old.bias is not None)
        new.weight.data.copy_(old.weight.data[kept])
        if old.bias is not None:
            new.bias.data.copy_(old.bias.data[kept])
        setattr(mlp, name, new)
    down = nn.Linear(width, refit.shape[0], bias=down_bias is not None)
    down.weight.data.copy_(refit.float())
    if down_bias is not None:
        down.bias.data.copy_(down_bias.float())
    mlp.down_proj = down


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--keep", default="0.75,0.6")
    parser.add_argument(
        "--variants",
        default="greedy:0:0,greedy:0.01:0.01,greedy:0.1:0.1,energy:0:0,energy:0:0.01,energy:0:0.1,"
        "leverage:0:0,leverage:0.01:0.01,leverage:0.1:0.1",
        help="rule:order_ridge:refit_ridge, comma-separated (round 1: the same ridge for both)",
    )
    parser.add_argument("--reference", default="energy:0:0", help="the variant the paired differences are to")
    parser.add_argument("--max-tokens", type=int, default=16384, help="0: the whole validation split")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    setup = validation_setup(args.max_tokens)
    keeps = [float(k) for k in args.keep.split(",")]
    variants, predicted, seconds = {}, {}, {}
    for keep in keeps:
        for variant in args.variants.split(","):
            rule, order_ridge, ridge = variant.split(":")
            name = f"{variant}@{keep:g}"
            start = time.perf_counter()
            variants[name], predicted[name] = prune_uniform(
                setup.loaded.model, setup.stats, keep, rule, float(order_ridge), float(ridge)
            )
            seconds[name] = time.perf_counter() - start
            print(
                f"built {name} in {seconds[name]:.1f} s (predicted error {predicted[name]:.4g})", flush=True
            )
    original, scored = evaluate_against(setup.loaded.model, variants, setup.eval_windows, progress=False)
    rows = []
    for name, (result, faith) in scored.items():
        variant, keep = name.split("@")
        rule, order_ridge, ridge = variant.split(":")
        reference = scored[f"{args.reference}@{keep}"][0]
        diff = paired_difference(result.window_nll, reference.window_nll, result.window_tokens)
        rows.append({
            "variant": name, "rule": rule, "order_ridge": float(order_ridge), "ridge": float(ridge),
            "keep": float(keep), "ppl": result.ppl, "ppl_ci95": result.ppl_ci95,
            "kl_to_original": faith.kl_to_original, "top1_agreement": faith.top1_agreement,
            "predicted_error": predicted[name], f"minus_{args.reference}": diff.to_dict(),
            "build_seconds": seconds[name],
        })  # fmt: skip
        print(f"{name:28s} ppl {result.ppl:8.3f} KL {faith.kl_to_original:.4f} "
              f"vs {args.reference} {diff.value:+.3f} [{diff.ci95[0]:+.3f}, {diff.ci95[1]:+.3f}]", flush=True)  # fmt: skip
    payload = {
        "command": command_line("benchmarks.experiments.neuron_selection.run", argv),
        "split": "validation",
        "tokens": original.tokens,
        "original": {"ppl": original.ppl, "ppl_ci95": original.ppl_ci95},
        "rows": rows,
    }
    if args.out:
        write_json(args.out, payload)


if __name__ == "__main__":
    main()
