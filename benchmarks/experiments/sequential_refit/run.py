"""Refits that see the compressed model's own inputs, for the engine-native form, on the validation split.

The native form (`--native`: whole heads, MLPs in multiples of 32) refits each narrowed matrix (o_proj on the
kept heads, down_proj on the kept neurons) by least squares on the ORIGINAL model's statistics: the inputs it is
fitted on are not the ones it meets once the layers before it are compressed. Here, after the native run, every
layer in turn (both models advanced one layer at a time over the calibration windows):

- `sequential`: o_proj, then down_proj, refit on the compressed model's own inputs to reproduce the original
  layer's output of that matrix (the cross-moment Σ t xᵀ against Σ x xᵀ, fp64 sums);
- `sequential-residual`: the same, the target adding the gap between the two residual streams at that point
  (original − compressed), so each refit also pulls the stream back towards the original's;
- `sequential-down`: down_proj alone, as `sequential` refits it.

The shapes (kept heads and neurons) stay the native run's; only those matrices' values change, so every
variant holds exactly its parameters and runs in llama.cpp as it does. Every variant and the original are
scored in one pass over the same validation windows (paired differences to the native model).
`python -m benchmarks.experiments.sequential_refit.run [--model-ratio 0.2] [--max-tokens 0] [--out F]`:
`benchmarks/results/choices/sequential-refit-validation.json`.
"""

from __future__ import annotations

import argparse
import copy
import time

import torch

from benchmarks.experiments.native_balance.run import native_overrides, scored_rows, widths_and_heads
from benchmarks.suite.common import write_json
from benchmarks.suite.quality import build_variant, validation_header, validation_setup
from benchmarks.suite.whole_model import model_ratio_as_targets
from compressor.modeling.adapters import get_adapter
from compressor.statistics.capture import add_gram, check_gram
from compressor.statistics.layer_runner import LayerRunner

#: Variant → (the matrices refit, in the order of the layer's computation; whether the target closes the
#: residual stream's gap).
VARIANTS = {
    "sequential": (("o_proj", "down_proj"), False),
    "sequential-residual": (("o_proj", "down_proj"), True),
    "sequential-down": (("down_proj",), False),
}
#: The damping of Σ x xᵀ before its Cholesky, relative to its mean diagonal (the solve's only regularization).
DAMPING = 1e-6
BATCH = 8


class _Stop(Exception):
    pass


def _module(layer: torch.nn.Module, projection: str) -> torch.nn.Module:
    return layer.self_attn.o_proj if projection == "o_proj" else layer.mlp.down_proj


def _capture(runner: LayerRunner, index: int, batch: int, projection: str, residual: bool, advance: bool):
    """(the matrix's input, its output, the residual stream its output is added to), flattened over tokens, from
    running layer `index` on the runner's hidden states of `batch`: stopped once the matrix has run, or with
    `advance` run to the end, the batch's hidden state then moved past the layer (the runner's `advance`)."""
    layer = runner.adapter.layers[index]
    seen = {}

    def on_matrix(module, args, output):
        seen["input"], seen["output"] = args[0].detach(), output.detach()
        if not advance:
            raise _Stop

    def on_stream(module, args):  # the post-attention norm reads the stream down_proj's output is added to
        seen["stream"] = args[0].detach()

    handles = [_module(layer, projection).register_forward_hook(on_matrix)]
    if residual and projection == "down_proj":
        handles.append(layer.post_attention_layernorm.register_forward_pre_hook(on_stream))
    if residual and projection == "o_proj":
        seen["stream"] = runner.hidden[batch]  # o_proj's output is added to the layer's input
    try:
        out = runner._run(index, batch)
        if advance:
            runner.hidden[batch] = out.detach()
    except _Stop:
        pass
    finally:
        for handle in handles:
            handle.remove()
    return {k: v.reshape(-1, v.shape[-1]).double() for k, v in seen.items()}


def _fit_error(weight, energy: float, cross, gram, tokens: int) -> float:
    """E‖t − W x‖² over the tokens, from Σ‖t‖², Σ t xᵀ and Σ x xᵀ."""
    return (energy - 2 * float((weight * cross).sum()) + float(((weight @ gram) * weight).sum())) / tokens


@torch.no_grad()
def sequential_refit(original, compressed, windows, projections, residual: bool) -> dict:
    """Refit `projections` of every layer of `compressed` (in place) on its own inputs, layer by layer; the
    calibration error of each refit matrix before and after (E‖t − W x‖² over the tokens, summed over outputs)."""
    start = time.perf_counter()
    before = LayerRunner(get_adapter(original), windows, BATCH)
    after = LayerRunner(get_adapter(compressed), windows, BATCH)
    errors = []
    for index in range(get_adapter(compressed).num_layers):
        for projection in projections:
            module = _module(after.adapter.layers[index], projection)
            width = module.in_features
            gram = torch.zeros(width, width, dtype=torch.float64)
            cross = torch.zeros(module.out_features, width, dtype=torch.float64)
            energy, tokens = 0.0, 0
            last = projection == projections[-1]
            for batch in range(len(after.hidden)):
                want = _capture(before, index, batch, projection, residual, advance=last)
                have = _capture(after, index, batch, projection, residual, advance=False)
                target = want["output"]
                if module.bias is not None:
                    target = target - module.bias.double()
                if residual:
                    target = target + want["stream"] - have["stream"]
                add_gram(gram, have["input"][None])
                cross += target.T @ have["input"]
                energy += float(target.square().sum())
                tokens += len(target)
            check_gram(gram, f"layer {index} {projection}")
            gram = (
                torch.triu(gram) + torch.triu(gram, 1).T
            )  # add_gram fills the blocks above the diagonal only
            damping = DAMPING * float(gram.diagonal().mean())
            factor = torch.linalg.cholesky(gram + damping * torch.eye(width, dtype=torch.float64))
            refit = torch.cholesky_solve(cross.T, factor).T
            moments = (energy, cross, gram, tokens)
            errors.append({"layer": index, "projection": projection,
                           "error_before": _fit_error(module.weight.double(), *moments),
                           "error_after": _fit_error(refit, *moments)})  # fmt: skip
            module.weight.copy_(refit.to(module.weight.dtype))
        if not projections:
            before.advance(index)
        after.advance(index)
    return {"refit_seconds": time.perf_counter() - start, "refit_windows": int(windows.shape[0]),
            "calibration_errors": errors}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-ratio", type=float, default=0.2)
    parser.add_argument("--max-tokens", type=int, default=0, help="0: the whole validation split")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument(
        "--refit-windows", type=int, default=0, help="the first N calibration windows (0: all)"
    )
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    setup = validation_setup(args.max_tokens, progress=False)
    original_model = setup.loaded.model
    ratio = model_ratio_as_targets("smollm2-135m", args.model_ratio)
    native, row = build_variant(setup, "native", native_overrides(), ratio, progress=False)
    variants, extra = {"native": native}, {"native": widths_and_heads(native)}
    for name in args.variants.split(","):
        projections, residual = VARIANTS[name]
        variants[name] = copy.deepcopy(native)
        windows = setup.windows[: args.refit_windows] if args.refit_windows else setup.windows
        extra[name] = sequential_refit(original_model, variants[name], windows, projections, residual)
        print(f"{name}: refit in {extra[name]['refit_seconds']:.0f} s", flush=True)
    original, rows = scored_rows(original_model, variants, setup.eval_windows, extra)
    module = "benchmarks.experiments.sequential_refit.run"
    payload = validation_header(module, argv, setup, original, args.model_ratio, ratio, row) | {
        "settings": row["settings"],
        "damping": DAMPING,
        "rows": rows,
    }
    if args.out:
        write_json(args.out, payload)


if __name__ == "__main__":
    main()
