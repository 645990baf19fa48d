"""Every option that more than one command takes, declared once (`compress`, `plan`, `inspect`).

The parameter names are the fields of `config.CompressOptions` (and of `CompressionSettings` for the
compression settings), so a command builds its options with `CompressOptions.from_values(locals())`.
"""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from compressor.methods import REGISTRY

Opt = Optional  # typer needs Optional[...] (not X | None) on Python 3.10

METHOD_HELP = "; ".join(f"{name}: {method.summary}" for name, method in REGISTRY.items())

Ratio = Annotated[
    float,
    typer.Option(
        "--ratio",
        "-r",
        help="Fraction of the targeted parameters (attention by default) to remove, in (0, 1).",
    ),
]
RatioOf = Annotated[
    str,
    typer.Option(
        "--ratio-of",
        help="What --ratio is a fraction of: targets (default: the targeted projections' parameters) or model "
        "(all the model's parameters, embeddings included: --ratio 0.2 --ratio-of model makes the model 20% "
        "smaller, the tool removing the numbers from the targeted projections only).",
    ),
]
Method = Annotated[
    Opt[str], typer.Option("--method", "-m", help=f"The method (default: the recipe's, masa). {METHOD_HELP}.")
]
Groups = Annotated[
    Opt[int], typer.Option("--groups", "-g", min=1, help="Groups of consecutive layers G (recipe: 3).")
]
Bases = Annotated[
    Opt[int],
    typer.Option(
        "--bases", "-b", min=0, help="Shared atoms per group and projection B (recipe: 1; 0 = no sharing)."
    ),
]
LargestGroupBases = Annotated[
    Opt[int],
    typer.Option(
        "--largest-group-bases", min=0, help="Atoms for the largest group (recipe: same as --bases)."
    ),
]
EndBoundaries = Annotated[
    Opt[bool],
    typer.Option(
        "--end-boundaries/--no-end-boundaries",
        help="May the first/last KL transitions be group boundaries (first/last layers singletons kept whole)? "
        "Recipe default: yes (paper).",
    ),
]
LogitLens = Annotated[
    Opt[str], typer.Option("--logit-lens", help="final_norm (standard logit lens, default) or raw (paper).")
]
Allocation = Annotated[
    Opt[str],
    typer.Option(
        "--allocation",
        help="paper (Algorithm 1 per (Q,K)/(V,O) pair), global, global-relative (ranks across all matrices by "
        "whitened error per parameter, each error relative to the matrix's output energy) or global-loss (each "
        "error weighted by its loss sensitivity, from one backward pass over calibration windows). Default: the "
        "recipe's.",
    ),
]
Atoms = Annotated[
    Opt[str],
    typer.Option(
        "--atoms",
        help="plain (Matrix PCA of the weights, paper) or whitened (atoms minimizing the group's output error, "
        "coefficients refit per layer). Default: the recipe's.",
    ),
]
Singletons = Annotated[
    Opt[str],
    typer.Option(
        "--singletons", help="keep (singleton groups kept whole, paper) or compress (whitened SVD)."
    ),
]
Statistics = Annotated[
    Opt[str],
    typer.Option(
        "--statistics",
        help="original (whitening statistics of the original model, paper) or sequential (layer l's statistics "
        "on the model whose earlier layers are already compressed; ~1 extra forward pass).",
    ),
]
Targets = Annotated[
    Opt[str],
    typer.Option(
        "--targets",
        help="Projections compressed and counted by --ratio: attn (q/k/v/o, default), mlp (gate/up/down), or "
        "attn,mlp (every linear projection of the layers, as Basis Sharing does).",
    ),
]
Mlp = Annotated[
    Opt[str],
    typer.Option(
        "--mlp",
        help="How --method masa compresses the MLP (with --targets mlp or attn,mlp): neurons (default: each layer "
        "keeps some of its neurons, down_proj refit by least squares; a smaller plain MLP) or lowrank (whitened "
        "low-rank factors).",
    ),
]
UniformMlp = Annotated[
    Opt[bool],
    typer.Option(
        "--uniform-mlp/--per-layer-mlp",
        help="--mlp neurons: the same width in every layer (a standard architecture with a smaller "
        "intermediate_size, for export-dense) or, by default, a width per layer chosen by the allocation.",
    ),
]
AutoGroups = Annotated[
    Opt[bool],
    typer.Option(
        "--auto-groups/--fixed-groups",
        help="Choose G (1-8) and B (0-2) by a proxy computed before building anything (the relative whitened "
        "error left under the budget) instead of --groups/--bases; adds ~1-3 min. Default: the recipe's.",
    ),
]
Sharing = Annotated[
    Opt[str],
    typer.Option(
        "--sharing",
        help="How --method masa shares weights across layers (default: the recipe's). atoms: the paper's shared "
        "matrices per KL group + residuals; basis: k/v of every --basis-layers consecutive layers share one input "
        "basis per type; qkv: one input basis for q/k/v of those layers; none: nothing shared, per-matrix factors; "
        "auto: per run and projection type, a shared basis where the proxy says it pays. Measured: BENCHMARKS.md.",
    ),
]
SensitivitySamples = Annotated[
    Opt[int],
    typer.Option(
        "--sensitivity-samples",
        min=1,
        help="--allocation global-loss: calibration windows of the backward pass that measures each "
        "projection's loss sensitivity (default 16; more: steadier weights, a longer pass).",
    ),
]
BasisLayers = Annotated[
    Opt[int],
    typer.Option(
        "--basis-layers",
        min=2,
        help="--sharing basis/qkv/auto: consecutive layers per shared basis (default 4).",
    ),
]
Calib = Annotated[
    Opt[str],
    typer.Option("--calib", help="Calibration text: wikipedia (default), a file/dir, or a datasets name."),
]
CalibSamples = Annotated[
    Opt[int],
    typer.Option("--calib-samples", "-n", min=1, help="Calibration windows N (recipe: 64 for smollm2-135m)."),
]
SeqLen = Annotated[
    Opt[int], typer.Option("--seq-len", min=8, help="Tokens per calibration window T (recipe: 512).")
]
Seed = Annotated[Opt[int], typer.Option("--seed", help="Seed for calibration window sampling (recipe: 0).")]
RecipeFile = Annotated[
    Opt[str], typer.Option("--recipe", help="A recipe YAML file of your own (see `masa-compress recipes`).")
]
BatchSize = Annotated[int, typer.Option("--batch-size", min=1, help="Windows per forward pass.")]
Layout = Annotated[
    Opt[str],
    typer.Option(
        "--layout",
        help="Known group sizes, first to last (e.g. 1,28,1 from `inspect`): makes the counts final instead of "
        "estimated from assumed groups.",
    ),
]
