"""Two refinements of the neuron form measured against it, on the validation split (neither adopted).

Every MLP keeps the same fraction of its neurons by the greedy order (attention untouched), down_proj refit by
least squares, as `benchmarks.experiments.neuron_selection.run`; the variants:

- `greedy`: the default (the order and refit on the autocorrelation C = E[z zᵀ]);
- `centered`: FLAP's bias compensation made exact: the order and refit on the covariance Σ = C − μμᵀ and a new
  down_proj bias D μ − D' μ_S, the least-squares optimum with a free bias (its error is never above the default's
  on the calibration tokens; the bias costs `hidden` numbers per layer, not counted here);
- `fisher`: the order on diag(√f) D instead of D, f the per-channel mean squared loss gradient at down_proj's
  output over the first 16 calibration windows, normalised to mean 1 (a diagonal Fisher where the allocation takes
  it isotropic: `statistics.sensitivity`); the refit is row-separable, so unchanged.

Every variant and the original scored in one pass over the same validation windows (paired differences to
`greedy`). `python -m benchmarks.experiments.neuron_refinements.run [--keep 0.75,0.6] [--out F]`:
`benchmarks/results/choices/neuron-refinements-validation.json`.
"""

from __future__ import annotations

import argparse
import copy

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.experiments.neuron_selection.run import narrow_mlp
from benchmarks.suite.common import command_line, write_json
from benchmarks.suite.quality import prepare_quality
from compressor.evaluation.intervals import paired_difference
from compressor.evaluation.perplexity import evaluate_against
from compressor.math.neurons import neuron_order, order_tail, refit_down
from compressor.modeling.adapters import INPUT_OF, get_adapter

VARIANTS = ("greedy", "centered", "fisher")
FISHER_WINDOWS = 16


def channel_fisher(
    model: nn.Module, windows: torch.Tensor, count: int = FISHER_WINDOWS
) -> dict[int, torch.Tensor]:
    """Per layer, the mean squared loss gradient of each down_proj output channel over `count` windows, divided
    by its mean over the channels (fp64)."""
    adapter = get_adapter(model)
    sums = {
        layer: torch.zeros(adapter.layers[layer].mlp.down_proj.out_features, dtype=torch.float64)
        for layer in range(adapter.num_layers)
    }
    frozen = [(p, p.requires_grad) for p in model.parameters()]
    for p, _ in frozen:
        p.requires_grad_(False)

    def on_output(layer):
        def hook(module, args, output):
            def on_gradient(grad):
                sums[layer].add_(grad.detach().double().square().flatten(0, -2).sum(0))

            output.register_hook(on_gradient)

        return hook

    embeddings = model.get_input_embeddings()
    handles = [embeddings.register_forward_hook(lambda m, a, out: out.detach().requires_grad_(True))]
    handles += [adapter.layers[i].mlp.down_proj.register_forward_hook(on_output(i)) for i in sums]
    try:
        with torch.enable_grad():
            for i in range(min(count, windows.shape[0])):
                batch = windows[i : i + 1]
                logits = model(input_ids=batch, use_cache=False).logits
                F.cross_entropy(
                    logits[:, :-1].flatten(0, 1).float(), batch[:, 1:].flatten(), reduction="sum"
                ).backward()
    finally:
        for handle in handles:
            handle.remove()
        for p, flag in frozen:
            p.requires_grad_(flag)
    return {layer: total / total.mean() for layer, total in sums.items()}


def prune(model: nn.Module, stats, keep: float, variant: str, fisher: dict[int, torch.Tensor]) -> nn.Module:
    """A copy of `model` whose every MLP keeps `keep` of its neurons under `variant` (one of VARIANTS)."""
    model = copy.deepcopy(model)
    adapter = get_adapter(model)
    for layer in range(adapter.num_layers):
        mlp = adapter.layers[layer].mlp
        c = stats.down_autocorr[layer].to(torch.float64)
        mean = stats.input_mean(INPUT_OF["down_proj"], layer).to(torch.float64)
        if variant == "centered":
            c = c - torch.outer(mean, mean)
        down = mlp.down_proj.weight.detach().to(torch.float64)
        scored = down * fisher[layer].sqrt()[:, None] if variant == "fisher" else down
        width = round(keep * down.shape[1])
        neurons = order_tail(c, scored, neuron_order("greedy", c, scored, 0.0), 0.0)
        kept = neurons.kept(width)
        refit = refit_down(c, down, neurons, width, 0.0)
        bias = down @ mean - refit @ mean[kept] if variant == "centered" else None
        narrow_mlp(mlp, kept, refit, bias)
    return model


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", default="0.75,0.6")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    setup = prepare_quality("smollm2-135m", split="validation", mlp=True, evaluate_original=False)
    llama = get_adapter(setup.loaded.model)
    if any(llama.layers[i].mlp.down_proj.bias is not None for i in range(llama.num_layers)):
        raise SystemExit("this comparison assumes a down_proj without a bias of its own")
    fisher = channel_fisher(setup.loaded.model, setup.windows)
    keeps = [float(k) for k in args.keep.split(",")]
    variants = {
        f"{v}@{keep:g}": prune(setup.loaded.model, setup.stats, keep, v, fisher)
        for keep in keeps
        for v in VARIANTS
    }
    original, scored = evaluate_against(setup.loaded.model, variants, setup.eval_windows, progress=False)
    rows = []
    for name, (result, faith) in scored.items():
        variant, keep = name.split("@")
        diff = paired_difference(
            result.window_nll, scored[f"greedy@{keep}"][0].window_nll, result.window_tokens
        )
        rows.append({
            "variant": variant, "keep": float(keep), "ppl": result.ppl, "ppl_ci95": result.ppl_ci95,
            "kl_to_original": faith.kl_to_original, "top1_agreement": faith.top1_agreement,
            "minus_greedy": diff.to_dict(),
        })  # fmt: skip
        print(
            f"{name:16s} ppl {result.ppl:8.3f} vs greedy {diff.value:+.3f} [{diff.ci95[0]:+.3f}, {diff.ci95[1]:+.3f}]"
        )
    payload = {
        "command": command_line("benchmarks.experiments.neuron_refinements.run", argv),
        "split": "validation",
        "tokens": original.tokens,
        "fisher_windows": FISHER_WINDOWS,
        "original": {"ppl": original.ppl, "ppl_ci95": original.ppl_ci95},
        "rows": rows,
    }
    if args.out:
        write_json(args.out, payload)


if __name__ == "__main__":
    main()
