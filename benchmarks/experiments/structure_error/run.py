"""Whether the structure's predicted rise of the loss holds out of sample: one MLP narrowed at a time, on the
validation split.

`compress --size` and the parameter allocation price an MLP's width by ½ ḡ² · tail[width]: the least-squares
refit's output error *on the calibration tokens it was fitted on* (`compressor.math.neurons.order_tail`). With
few calibration tokens per neuron that error is optimistic. Per layer (greedy-block order, no ridge, as the tool
runs) and width, this measures:

- `in_sample`: the tail the tool reads; `held_out`: the same refit's error on the validation tokens'
  autocorrelation; `held_out_drop`: the neurons dropped with no refit, on the same tokens;
  `held_out_ridge_0.01`/`0.1`: refits with a ridge of that fraction of mean(diag C), on the same tokens;
- `fisher_in_sample`/`fisher_held_out`: the same errors weighted by the full output Fisher E[g gᵀ] instead of
  its isotropic mean ḡ² (whether the error's direction matters);
- `measured`: the validation loss rise with that one MLP narrowed (refit installed), paired per window against
  the original, and its standard error; `predicted_in_sample` = ½ ḡ² · in_sample, `predicted_held_out` =
  ½ ḡ² · held_out (and the Fisher-weighted ones).

    python -m benchmarks.experiments.structure_error.run --model smollm2-135m --layers 1,8,15,22,28 \
        --gradient-windows 8 --eval-windows 16
    python -m benchmarks.experiments.structure_error.run --model qwen2.5-coder-1.5b --layers 1,9,18,26 \
        --gradient-windows 8 --eval-windows 8

With `--tokens-per-neuron`, instead: on the bundled model, the ratio held-out / in-sample of the refit's error
against the calibration windows it was fitted on (16 to 256), no loss measured.
"""

from __future__ import annotations

import argparse
import math
import time

import torch
from torch import nn

from benchmarks.suite.common import command_line, log, machine_info, write_json
from benchmarks.suite.quality import evaluation_settings
from compressor.api.model_loading import load_model
from compressor.api.run_options import CompressOptions
from compressor.api.session import (
    calibration_token_windows,
    evaluation_token_windows,
    read_texts,
    resolve_run,
)
from compressor.math.neurons import neuron_order, order_tail, refit_down

FRACTIONS = (0.5, 0.75)
RIDGES = (0.01, 0.1)
#: Calibration windows at which `--tokens-per-neuron` reads the autocorrelation (a prefix of the recipe's).
PREFIXES = (16, 32, 64, 128, 256)


def down_inputs(model, mlps: dict, windows: torch.Tensor, snapshots=(), first_nll: int = 0):
    """Each listed MLP's down_proj input autocorrelation over `windows` (token mean, fp64), also at every
    window count in `snapshots`; and the mean next-token loss of the first `first_nll` windows."""
    width = next(iter(mlps.values())).down_proj.in_features
    sums = {layer: torch.zeros(width, width, dtype=torch.float64) for layer in mlps}

    def hook(layer):
        def add(module, args):
            h = args[0].reshape(-1, width).double()
            sums[layer].addmm_(h.T, h)

        return add

    handles = [mlp.down_proj.register_forward_pre_hook(hook(layer)) for layer, mlp in mlps.items()]
    taken, losses = {}, []
    with torch.no_grad():
        for i in range(windows.shape[0]):
            batch = windows[i : i + 1]
            logits = model(input_ids=batch, use_cache=False).logits
            if i < first_nll:
                losses.append(window_loss(logits, batch))
            if i + 1 in snapshots:
                taken[i + 1] = {k: s / ((i + 1) * windows.shape[1]) for k, s in sums.items()}
    for handle in handles:
        handle.remove()
    tokens = windows.numel()
    return {k: s / tokens for k, s in sums.items()}, taken, torch.tensor(losses, dtype=torch.float64)


def window_loss(logits: torch.Tensor, batch: torch.Tensor) -> float:
    log_probs = torch.log_softmax(logits[:, :-1].float(), -1)
    return -log_probs.gather(-1, batch[:, 1:, None]).squeeze(-1).double().mean().item()


def losses(model, windows: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return torch.tensor(
            [window_loss(model(input_ids=windows[i : i + 1], use_cache=False).logits, windows[i : i + 1])
             for i in range(windows.shape[0])], dtype=torch.float64,
        )  # fmt: skip


def output_fisher(model, mlps: dict, windows: torch.Tensor) -> dict:
    """Per MLP, E_t[g_t g_tᵀ] at down_proj's output (g = ∂L/∂y, L the summed next-token loss)."""
    hidden = next(iter(mlps.values())).down_proj.out_features
    sums = {layer: torch.zeros(hidden, hidden, dtype=torch.float64) for layer in mlps}

    def hook(layer):
        def on_output(module, args, output):
            def on_gradient(grad):
                g = grad.reshape(-1, hidden).double()
                sums[layer].addmm_(g.T, g)

            output.register_hook(on_gradient)

        return on_output

    for p in model.parameters():
        p.requires_grad_(False)
    handles = [
        model.get_input_embeddings().register_forward_hook(lambda m, a, o: o.detach().requires_grad_(True))
    ]
    handles += [mlp.down_proj.register_forward_hook(hook(layer)) for layer, mlp in mlps.items()]
    with torch.enable_grad():
        for i in range(windows.shape[0]):
            batch = windows[i : i + 1]
            logits = model(input_ids=batch, use_cache=False).logits
            loss = nn.functional.cross_entropy(
                logits[:, :-1].flatten(0, 1).float(), batch[:, 1:].flatten(), reduction="sum"
            )
            loss.backward()
    for handle in handles:
        handle.remove()
    return {k: s / windows.numel() for k, s in sums.items()}


def error(e: torch.Tensor, autocorr: torch.Tensor, left: torch.Tensor | None = None) -> float:
    """tr(M E C Eᵀ Mᵀ): the output error energy of E on inputs with autocorrelation C (M: an output metric root)."""
    x = e if left is None else left @ e
    return float(((x @ autocorr) * x).sum())


def ridge_refit(autocorr: torch.Tensor, down: torch.Tensor, kept: torch.Tensor, ridge: float) -> torch.Tensor:
    c = autocorr.clone()
    c.diagonal().add_(ridge * autocorr.diagonal().mean())
    return torch.linalg.solve(c[kept[:, None], kept], (down @ c[:, kept]).T).T


def width_at(full: int, fraction: float) -> int:
    return int(round(full * fraction / 32)) * 32


def narrowed(mlp, kept: torch.Tensor, refit: torch.Tensor) -> tuple:
    """Install the MLP at the kept neurons with `refit` as down_proj; returns the original modules."""
    original = (mlp.gate_proj, mlp.up_proj, mlp.down_proj)
    width = len(kept)
    gate = nn.Linear(mlp.gate_proj.in_features, width, bias=False)
    gate.weight.data = mlp.gate_proj.weight.data[kept].clone()
    up = nn.Linear(mlp.up_proj.in_features, width, bias=False)
    up.weight.data = mlp.up_proj.weight.data[kept].clone()
    down = nn.Linear(width, refit.shape[0], bias=False)
    down.weight.data = refit.float()
    mlp.gate_proj, mlp.up_proj, mlp.down_proj = gate, up, down
    return original


def single_changes(model, mlps, calibration, validation, args) -> list[dict]:
    t = time.perf_counter()
    fitted, _, _ = down_inputs(model, mlps, calibration)
    log(f"calibration autocorrelations {time.perf_counter() - t:.0f} s")
    held_out, _, base = down_inputs(model, mlps, validation, first_nll=args.eval_windows)
    fisher = output_fisher(model, mlps, calibration[: args.gradient_windows])
    rows = []
    for layer, mlp in mlps.items():
        g = fisher[layer]
        gbar = g.trace().item() / g.shape[0]
        values, vectors = torch.linalg.eigh(g)
        root = (vectors * values.clamp_min(0).sqrt()) @ vectors.T
        down = mlp.down_proj.weight.detach().double()
        full = down.shape[1]
        order = neuron_order("greedy-block", fitted[layer], down.float(), 0.0)
        tail = order_tail(fitted[layer], down, order, 0.0)
        tail_fisher = order_tail(fitted[layer], root @ down, order, 0.0)
        for fraction in FRACTIONS:
            width = width_at(full, fraction)
            kept = tail.kept(width)
            refit = refit_down(fitted[layer], down, tail, width, 0.0)
            e = down.clone()
            e[:, kept] -= refit
            dropped = down.clone()
            dropped[:, kept] = 0
            row = {
                "layer": layer, "width": width, "full": full, "gbar": gbar,
                "in_sample": float(tail.tail[width] - tail.tail[full]),
                "held_out": error(e, held_out[layer]), "held_out_drop": error(dropped, held_out[layer]),
                "fisher_in_sample": float(tail_fisher.tail[width] - tail_fisher.tail[full]),
                "fisher_held_out": error(e, held_out[layer], root),
            }  # fmt: skip
            for ridge in RIDGES:
                r = down.clone()
                r[:, kept] -= ridge_refit(fitted[layer], down, kept, ridge)
                row[f"held_out_ridge_{ridge}"] = error(r, held_out[layer])
            original = narrowed(mlp, kept, refit)
            diff = losses(model, validation[: args.eval_windows]) - base
            mlp.gate_proj, mlp.up_proj, mlp.down_proj = original
            row |= {
                "measured": diff.mean().item(), "measured_se": (diff.std() / math.sqrt(len(diff))).item(),
                "predicted_in_sample": 0.5 * gbar * row["in_sample"],
                "predicted_held_out": 0.5 * gbar * row["held_out"],
                "predicted_fisher_in_sample": 0.5 * row["fisher_in_sample"],
                "predicted_fisher_held_out": 0.5 * row["fisher_held_out"],
            }  # fmt: skip
            log(f"layer {layer} width {width}: measured {row['measured']:.4f}, predicted in sample "
                f"{row['predicted_in_sample']:.4f}, held out {row['predicted_held_out']:.4f}")  # fmt: skip
            rows.append(row)
    return rows


def tokens_per_neuron(model, mlps, calibration, validation) -> list[dict]:
    _, prefixes, _ = down_inputs(model, mlps, calibration, snapshots=PREFIXES)
    held_out, _, _ = down_inputs(model, mlps, validation)
    rows = []
    for windows, fitted in prefixes.items():
        for layer, mlp in mlps.items():
            down = mlp.down_proj.weight.detach().double()
            full = down.shape[1]
            tail = order_tail(
                fitted[layer], down, neuron_order("greedy-block", fitted[layer], down.float(), 0.0), 0.0
            )
            for fraction in FRACTIONS:
                width = width_at(full, fraction)
                kept = tail.kept(width)
                e = down.clone()
                e[:, kept] -= refit_down(fitted[layer], down, tail, width, 0.0)
                inside, outside = float(tail.tail[width] - tail.tail[full]), error(e, held_out[layer])
                rows.append({
                    "windows": windows, "tokens_per_neuron": windows * calibration.shape[1] / full, "layer": layer,
                    "width": width, "in_sample": inside, "held_out": outside, "ratio": outside / inside,
                })  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--layers", default="1,8,15,22,28")
    parser.add_argument("--gradient-windows", type=int, default=8)
    parser.add_argument("--eval-windows", type=int, default=16)
    parser.add_argument("--tokens-per-neuron", action="store_true")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    run = resolve_run(args.model, CompressOptions(targets="attn,mlp"))
    loaded = load_model(run.source, progress=False)
    model = loaded.model.eval()
    calib_text, _ = read_texts(run, evaluate=False, allow_overlap=True)
    calibration = calibration_token_windows(loaded.tokenizer, run.calibration, calib_text)
    validation, name = evaluation_token_windows(
        loaded.tokenizer, evaluation_settings(run.recipe, "validation", None, None)
    )
    layers = [int(x) for x in args.layers.split(",")]
    mlps = {layer: model.model.layers[layer].mlp for layer in layers}
    payload = {
        "command": command_line("benchmarks.experiments.structure_error.run", argv), "model": args.model,
        "split": "validation", "text": name, "machine": machine_info(),
        "calibration_tokens": int(calibration.numel()),
    }  # fmt: skip
    if args.tokens_per_neuron:
        payload["rows"] = tokens_per_neuron(model, mlps, calibration, validation[:32])
    else:
        validation = validation[: calibration.shape[0]]
        payload["held_out_tokens"] = int(validation.numel())
        payload["rows"] = single_changes(model, mlps, calibration, validation, args)
    if args.out:
        write_json(args.out, payload)
    else:
        print(payload)


if __name__ == "__main__":
    main()
