"""Does an anchored refit of down_proj pay? (issue: errors compound through depth.)

The default compresses every layer from the ORIGINAL model's statistics. The anchored refit then takes the
compressed model layer by layer, in one sequential pass beside the original: down_proj of layer l is refit to map
the compressed model's kept activations z'_S (its inputs, after every earlier layer was compressed and refit) to
the original model's MLP output D z at that layer (AA-SVD's closed form, min E‖D z − D' z'_S‖²):

    D' = D E[z z'_Sᵀ] E[z'_S z'_Sᵀ]⁻¹.

Both models and this refit are built here from one calibration; the original, the default and the anchored model
are scored in one pass over the validation windows (paired differences).

`python -m benchmarks.experiments.anchored_refit.run [--model-ratio 0.2] [--max-tokens 0] [--out F]`
"""

from __future__ import annotations

import argparse
import json

import torch
from torch import nn

from benchmarks.suite.common import command_line, write_json
from benchmarks.suite.quality import build_variant, prepare_quality
from benchmarks.suite.whole_model import model_ratio_as_targets
from compressor.evaluation.intervals import paired_difference
from compressor.evaluation.perplexity import evaluate_against
from compressor.math.whitening import whitening_factor
from compressor.modeling.adapters import get_adapter
from compressor.runtime.device import float64_zeros
from compressor.statistics.capture import add_gram, token_mean
from compressor.statistics.layer_runner import LayerRunner


class _Capture:
    """The input of a module over one forward (a pre-hook), flattened to (tokens, features)."""

    def __init__(self, module: nn.Module):
        self.value = None
        self.handle = module.register_forward_pre_hook(self._hook)

    def _hook(self, module, args):
        self.value = args[0].reshape(-1, args[0].shape[-1])

    def remove(self):
        self.handle.remove()


@torch.no_grad()
def anchored_refit(
    original: nn.Module, compressed: nn.Module, windows: torch.Tensor, target: str = "mlp"
) -> None:
    """Refit every compressed down_proj in place, layer by layer, on the compressed model's own inputs."""
    before, after = get_adapter(original), get_adapter(compressed)
    runner_orig = LayerRunner(before, windows)
    runner_comp = LayerRunner(after, windows)
    for layer in range(before.num_layers):
        down_orig, down_comp = before.layers[layer].mlp.down_proj, after.layers[layer].mlp.down_proj
        width = down_comp.in_features
        cross = float64_zeros(down_orig.in_features, width, device=torch.device("cpu"))  # E[z z'ᵀ]
        gram = float64_zeros(width, width, device=torch.device("cpu"))  # E[z' z'ᵀ]
        tokens = 0
        for b in range(len(runner_orig.hidden)):
            seen_orig, seen_comp = _Capture(down_orig), _Capture(down_comp)
            try:
                runner_orig._run(layer, b)
                runner_comp._run(layer, b)
            finally:
                seen_orig.remove()
                seen_comp.remove()
            z, zc = seen_orig.value.double(), seen_comp.value.double()
            cross.addmm_(z.T, zc)
            add_gram(gram, zc)
            tokens += len(z)
        cross, gram = cross / tokens, token_mean(gram, tokens)
        factor = whitening_factor(gram)
        rhs = down_orig.weight.double() @ cross  # D E[z z'ᵀ]  (hidden, width)
        refit = torch.cholesky_solve(rhs.T, factor.S).T
        down_comp.weight.copy_(refit.to(down_comp.weight.dtype))
        runner_orig.advance(layer)
        runner_comp.advance(layer)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model-ratio", type=float, default=0.2)
    parser.add_argument("--max-tokens", type=int, default=0, help="0: the whole validation split")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    setup = prepare_quality(
        "smollm2-135m", split="validation", eval_max_tokens=args.max_tokens or None, mlp=True,
        evaluate_original=False,
    )  # fmt: skip
    ratio = model_ratio_as_targets("smollm2-135m", args.model_ratio)
    default, row = build_variant(setup, "default", {"targets": "attn,mlp"}, ratio, progress=False)
    anchored, _ = build_variant(setup, "anchored", {"targets": "attn,mlp"}, ratio, progress=False)
    anchored_refit(setup.loaded.model, anchored, setup.windows)
    original, scored = evaluate_against(
        setup.loaded.model, {"default": default, "anchored": anchored}, setup.eval_windows, progress=False
    )
    (d, df), (a, af) = scored["default"], scored["anchored"]
    diff = paired_difference(a.window_nll, d.window_nll, a.window_tokens)
    payload = {
        "command": command_line("benchmarks.experiments.anchored_refit.run", argv),
        "split": "validation", "tokens": original.tokens, "targets_ratio": ratio,
        "original": {"ppl": original.ppl, "ppl_ci95": original.ppl_ci95},
        "default": {"ppl": d.ppl, "ppl_ci95": d.ppl_ci95, "kl": df.kl_to_original, "top1": df.top1_agreement},
        "anchored": {"ppl": a.ppl, "ppl_ci95": a.ppl_ci95, "kl": af.kl_to_original, "top1": af.top1_agreement},
        "anchored_minus_default": diff.to_dict(),
        "achieved_ratio": row["achieved_ratio"],
    }  # fmt: skip
    print(json.dumps(payload, indent=2))
    if args.out:
        write_json(args.out, payload)


if __name__ == "__main__":
    main()
