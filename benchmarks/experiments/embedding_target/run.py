"""Does the token embedding pay as a compression target? (issue "Side by side with the strongest peers", item 4)

The bundled model's tied embedding is 21% of its parameters and no method cuts it, so the model 20% smaller takes
25% of the layers. Here the same model size is reached by a low-rank embedding (`benchmarks.experiments.embedding_target.embedding`:
`E ≈ A B`, whitened on both sides by what the model reads and writes through it) plus the default on the layers
at the rest of the budget, and scored against the default alone, on the same windows (paired differences).
The embedding's statistics (token counts, the final hidden states' autocorrelation, the loss gradient at the
embedding's output) are read from the compressed layers' model, on the calibration windows.

`python -m benchmarks.experiments.embedding_target.run [--split validation] [--out benchmarks/results/choices/embedding-validation.json]`
"""

from __future__ import annotations

import argparse
import copy
import json
import sys

import torch

from benchmarks.experiments.embedding_target.embedding import (
    factored_params,
    token_row_weights,
    weighted_low_rank,
)
from benchmarks.suite.common import command_line, log, write_json
from benchmarks.suite.quality import VARIANTS, build_variant, compare, prepare_quality, score, strip_windows
from benchmarks.suite.whole_model import DEFAULT, MODEL, model_ratio_as_targets
from compressor.modeling.adapters import get_adapter
from compressor.statistics.sensitivity import LossGradients

MODEL_RATIO = 0.2
#: (name, rank, pseudo count, whether the input term ḡ² I joins the metric)
EMBEDDINGS = (
    ("embed-r544", 544, 1.0, True),
    ("embed-r512", 512, 1.0, True),
    ("embed-r512-output-only", 512, 1.0, False),
    ("embed-r512-pseudo0.1", 512, 0.1, True),
    ("embed-r512-pseudo10", 512, 10.0, True),
)
GRADIENT_WINDOWS = 4  # as the loss sensitivity's default


def embedding_statistics(model: torch.nn.Module, windows: torch.Tensor) -> dict:
    """Token counts, H = Σ_t h_t h_tᵀ / T at the output head's input, and ḡ² = mean_t ‖∂L/∂x_t‖² / d at the
    embedding's output (L the summed next-token loss, over the first `GRADIENT_WINDOWS` windows), in fp64."""
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    vocab, width = embedding.weight.shape
    counts = torch.zeros(vocab, dtype=torch.float64)
    gram = torch.zeros(width, width, dtype=torch.float64)

    def read_head_input(_module, args):
        h = args[0].reshape(-1, width).double()
        gram.add_(h.T @ h)

    hook = head.register_forward_pre_hook(read_head_input)
    with torch.no_grad():
        for window in windows.split(1):
            counts.add_(torch.bincount(window.reshape(-1), minlength=vocab).double())
            model(window)
    hook.remove()
    squared = torch.zeros((), dtype=torch.float64)

    def add_squared(gradient: torch.Tensor) -> None:
        squared.add_(gradient.double().pow(2).sum())

    def track_gradient(_module, _args, output):
        # After LossGradients' own hook, which starts the graph at the embeddings' output (parameters frozen).
        output.register_hook(add_squared)

    with LossGradients(model, get_adapter(model), ()) as gradients, torch.enable_grad():
        hook = embedding.register_forward_hook(track_gradient)
        for window in windows[:GRADIENT_WINDOWS].split(1):
            gradients.backward(window, model(window).logits)
        hook.remove()
    g2 = float(squared) / gradients.tokens / width
    return {"counts": counts, "gram": gram / windows.numel(), "g2": g2}


def with_low_rank_embedding(model: torch.nn.Module, stats: dict, rank: int, pseudo: float, input_term: bool):
    """A copy of `model` whose (tied) embedding is replaced by its weighted rank-`rank` approximation A B."""
    out = copy.deepcopy(model)
    weight = out.get_input_embeddings().weight
    metric = stats["gram"] + (
        stats["g2"] * torch.eye(weight.shape[1], dtype=torch.float64) if input_term else 0
    )
    a, b, tail = weighted_low_rank(weight.detach(), token_row_weights(stats["counts"], pseudo), metric, rank)
    with torch.no_grad():
        weight.copy_((a @ b).to(weight.dtype))
    return out, float(tail[rank])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--split", default="validation")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    setup = prepare_quality(
        MODEL, progress=False, log=log, mlp=True, split=args.split, evaluate_original=False
    )
    model = setup.loaded.model
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    if embedding.weight.data_ptr() != head.weight.data_ptr():
        sys.exit("this measurement reads a tied embedding (the bundled model's)")
    vocab, width = embedding.weight.shape
    params = sum(p.numel() for p in model.parameters())
    removed = MODEL_RATIO * params
    models, rows, layer_models = {}, {}, {}
    for rank in sorted({r for _, r, _, _ in EMBEDDINGS} | {None}, key=lambda r: r or 10**9):
        saved = 0 if rank is None else vocab * width - factored_params(vocab, width, rank)
        layer_ratio = (removed - saved) / params
        built, row = build_variant(
            setup, DEFAULT, VARIANTS[DEFAULT], model_ratio_as_targets(MODEL, layer_ratio), False
        )
        layer_models[rank] = built
        log(f"built the layers at model ratio {layer_ratio:.4f} (embedding rank {rank})")
        if rank is None:
            models[DEFAULT] = built
            rows[DEFAULT] = {"embedding_rank": None, "model_params_after": row["model_params_after"]}
    for name, rank, pseudo, input_term in EMBEDDINGS:
        stats = embedding_statistics(layer_models[rank], setup.windows)
        models[name], error = with_low_rank_embedding(layer_models[rank], stats, rank, pseudo, input_term)
        after = (
            sum(p.numel() for p in layer_models[rank].parameters())
            - vocab * width
            + factored_params(vocab, width, rank)
        )
        rows[name] = {"embedding_rank": rank, "pseudo_count": pseudo, "input_term": input_term, "g2": stats["g2"],
                      "weighted_error": error, "model_params_after": after}  # fmt: skip
        log(f"{name}: weighted error {error:.4g}, ḡ² {stats['g2']:.3g}")
    scores = score(setup, models, setup.evaluation, progress=False)
    for name, row in rows.items():
        row.update({k: v for k, v in scores["models"][name].items() if k != "window_nll"})
        row["model_ratio"] = 1 - row["model_params_after"] / params
        row["rise"] = compare(scores, name, "original")
        if name != DEFAULT:
            row[f"minus_{DEFAULT}"] = compare(scores, name, DEFAULT)
        log(f"{name:>24} ppl {row['ppl']:.3f} model ratio {row['model_ratio']:.4f}")
    payload = {
        "what": "the model 20% smaller with a low-rank embedding taking part of the cut, against the default",
        "command": command_line("benchmarks.experiments.embedding_target.run", argv),
        "split": args.split,
        "original_ppl": scores["original"]["ppl"],
        "evaluation": strip_windows(scores)["evaluation"],
        "rows": rows,
    }
    if args.out:
        write_json(args.out, payload)
    print(json.dumps(payload, indent=2))


if __name__ == "__main__":
    main()
