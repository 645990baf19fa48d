"""Two alternatives to `export --size`'s importance statistic, for the error model's check on validation.

The byte budget predicts a matrix's loss rise as ½ · ḡ² · Σ_i R_ii ‖ΔW_{:,i}‖² with R_ii = mean_t x_{t,i}² over
all calibration tokens and ḡ² = mean_t ‖g_t‖² / d_out (g_t = ∂L/∂y_t). That product assumes a token's gradient
size and its input size are independent. Two ways it may fail:

- `skip_first`: every window's first position carries the massive activations of an attention sink; it weighs
  on R_ii, barely on the loss. R_ii over positions ≥ 1 only, times ḡ².
- `gradient_weighted`: the expectation itself, mean_t (‖g_t‖² / d_out) · x_{t,i}², on the gradient windows: no
  independence assumed (the first position enters with its own, small, gradient).
"""

from __future__ import annotations

import torch
from torch import nn

from compressor.quantize.importance import module_paths_of


def alternative_statistics(
    model: nn.Module, windows: torch.Tensor, gradient_windows: int
) -> dict[str, dict[str, torch.Tensor]]:
    """{"skip_first": path → R_ii over positions ≥ 1 of every window, "gradient_weighted": path → mean_t w_t x_t²
    on the first `gradient_windows` windows} for every nn.Linear, in fp64."""
    paths = module_paths_of(model)
    skip: dict[str, torch.Tensor] = {}
    weighted: dict[str, torch.Tensor] = {}
    inputs: dict[str, torch.Tensor] = {}
    state = {"backward": False}

    def input_hook(module, args):
        x = args[0].detach()[0].double()  # (T, d_in) of the one window
        name = paths[id(module)]
        skip[name] = skip.get(name, 0.0) + x[1:].square().sum(0)
        if state["backward"]:
            inputs[name] = x

    def output_hook(module, args, output):
        name = paths[id(module)]

        def add(grad: torch.Tensor) -> None:
            w = grad[0].double().square().sum(-1) / grad.shape[-1]  # (T,)
            weighted[name] = weighted.get(name, 0.0) + (w[:, None] * inputs.pop(name).square()).sum(0)

        if state["backward"]:
            output.register_hook(add)

    modules = [m for m in model.modules() if id(m) in paths]
    handles = [m.register_forward_pre_hook(input_hook) for m in modules]
    handles += [m.register_forward_hook(output_hook) for m in modules]
    frozen = [p for p in model.parameters() if p.requires_grad]
    for p in frozen:
        p.requires_grad_(False)
    embedding = model.get_input_embeddings()
    grad_handle = embedding.register_forward_hook(
        lambda m, a, out: out.detach().requires_grad_() if state["backward"] else None
    )
    try:
        for index, window in enumerate(windows):
            ids = window[None]
            state["backward"] = index < gradient_windows
            with torch.set_grad_enabled(state["backward"]):
                logits = model(input_ids=ids, use_cache=False).logits
                if state["backward"]:
                    loss = nn.functional.cross_entropy(logits[0, :-1].float(), ids[0, 1:], reduction="sum")
                    loss.backward()
    finally:
        for handle in [*handles, grad_handle]:
            handle.remove()
        for p in frozen:
            p.requires_grad_(True)
    n, t = windows.shape
    return {
        "skip_first": {k: v / (n * (t - 1)) for k, v in skip.items()},
        "gradient_weighted": {k: v / (min(gradient_windows, n) * t) for k, v in weighted.items()},
    }
