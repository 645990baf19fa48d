"""Every option that more than one command takes, declared once (`compress`, `plan`, `inspect`, `eval`).

The parameter names are the fields of `run_options.CompressOptions` (and of `CompressionSettings` for the
compression settings), so a command builds its options with `CompressOptions.from_values`. The options that
commands take together are listed once more, as sets (`cli/option_sets.py`), not in each command.

Each option has one line of help (`--help` must fit 80 columns: `cli/help.py`) and sits in a help panel; the
long explanations are in docs/options.md. Where the default is the recipe's, the help names the value every
built-in recipe takes, read from the schema (`CompressionSettings`), not written a second time here.
"""

from __future__ import annotations

from typing import Annotated, Optional, get_args

import typer

from compressor.cli.help import ATOMS, CALIBRATION, EVALUATION, HARDWARE, MLP, OUTPUT, RUN
from compressor.methods import REGISTRY
from compressor.recipes.schema import CompressionSettings

Opt = Optional  # typer needs Optional[...] (not X | None) on Python 3.10


def default(name: str) -> str:
    """The schema's default of a compression setting, as the help shows it."""
    value = CompressionSettings.model_fields[name].default
    return ("yes" if value else "no") if isinstance(value, bool) else str(value)


def values(name: str) -> list[str]:
    """A compression setting's values, from its schema type."""
    return list(get_args(CompressionSettings.model_fields[name].annotation))


def choices(name: str) -> str:
    """A compression setting's values, `a, b or c`."""
    *first, last = values(name)
    return ", ".join(first) + f" or {last}"


def _methods() -> str:
    first = default("method")
    return ", ".join([f"{first} (default)", *(n for n in REGISTRY if n != first)])


# -- the run -----------------------------------------------------------------------------------------------
Model = Annotated[
    str,
    typer.Argument(
        metavar="MODEL",
        help="Recipe alias, model folder, .gguf file, hub id, or checkpoint.",
        show_default=False,
    ),
]
Ratio = Annotated[
    Opt[float],
    typer.Option(
        "--ratio",
        "-r",
        metavar="R",
        rich_help_panel=RUN,
        help="Fraction of the targets to remove (default: 0.2).",
        show_default=False,
    ),
]
Size = Annotated[
    Opt[str],
    typer.Option(
        "--size",
        metavar="SIZE",
        rich_help_panel=RUN,
        help="A GGUF within SIZE bytes (90MiB), instead of --ratio.",
    ),
]
BitsPerWeight = Annotated[
    Opt[float],
    typer.Option(
        "--bits-per-weight",
        metavar="B",
        rich_help_panel=RUN,
        help="--size as llama.cpp's bits per weight.",
    ),
]
OnlyTypes = Annotated[
    Opt[str],
    typer.Option(
        "--only-types",
        metavar="TYPES",
        rich_help_panel=RUN,
        help="Types --size may use (e.g. q4_k,q5_k,q6_k,q8_0).",
    ),
]
Rounding = Annotated[
    Opt[str],
    typer.Option(
        "--rounding",
        metavar="HOW",
        rich_help_panel=RUN,
        help="--size: nearest (default) or compensated rounding.",
    ),
]
Speed = Annotated[
    Opt[str],
    typer.Option(
        "--speed",
        metavar="SPEED",
        rich_help_panel=RUN,
        help="--size: any (default), mix (its pace) or N tokens/s.",
    ),
]
ImatrixFile = Annotated[
    Opt[str],
    typer.Option(
        "--imatrix",
        metavar="FILE",
        rich_help_panel=RUN,
        help="--size: llama.cpp's importance file (default: measured).",
    ),
]
RatioOf = Annotated[
    str,
    typer.Option("--ratio-of", metavar="WHAT", rich_help_panel=RUN, help="targets or model."),
]
Method = Annotated[
    Opt[str], typer.Option("--method", "-m", metavar="NAME", rich_help_panel=RUN, help=_methods() + ".")
]
Targets = Annotated[
    Opt[str],
    typer.Option(
        "--targets",
        metavar="WHICH",
        rich_help_panel=RUN,
        help=f"Projections: {choices('targets')} (default: {default('targets')}).",
    ),
]
RecipeFile = Annotated[
    Opt[str],
    typer.Option(
        "--recipe", metavar="FILE", rich_help_panel=RUN, help="A recipe YAML of your own (`recipes --keys`)."
    ),
]
Layout = Annotated[
    Opt[str],
    typer.Option(
        "--layout",
        metavar="SIZES",
        rich_help_panel=ATOMS,
        help="Group sizes (e.g. 1,28,1 from `inspect`)",
    ),
]

# -- the compression settings: one option each, declared as a table in cli/option_sets.py ------------------
Native = Annotated[
    bool,
    typer.Option(
        "--native",
        rich_help_panel=MLP,
        help="Engine forms only: whole heads, MLPs in 32s.",
    ),
]

# -- calibration ----------------------------------------------------------------------------------------------
Calib = Annotated[
    Opt[str],
    typer.Option(
        "--calib",
        metavar="TEXT",
        rich_help_panel=CALIBRATION,
        help="Calibration text (default: the recipe's).",
    ),
]


def calib_samples(kind=Opt[int], help: str = "Calibration windows (default: recipe's, by target)."):
    """`--calib-samples N` (`-n`) of type `kind`, with a command's own help."""
    return Annotated[
        kind,
        typer.Option("--calib-samples", "-n", min=1, metavar="N", rich_help_panel=CALIBRATION, help=help),
    ]


CalibSamples = calib_samples()


def out_dir(help: str):
    """`--out DIR` (`-o`), with a command's own help."""
    return Annotated[Opt[str], typer.Option("--out", "-o", metavar="DIR", rich_help_panel=OUTPUT, help=help)]


SeqLen = Annotated[
    Opt[int],
    typer.Option(
        "--seq-len",
        min=8,
        metavar="T",
        rich_help_panel=CALIBRATION,
        help="Calibration window length (default: the recipe's).",
    ),
]
Seed = Annotated[
    Opt[int],
    typer.Option(
        "--seed", metavar="N", rich_help_panel=CALIBRATION, help="Seed of the windows' sampling (default: 0)."
    ),
]
CalibPrecision = Annotated[
    Opt[str],
    typer.Option(
        "--calib-precision",
        metavar="P",
        rich_help_panel=CALIBRATION,
        help="model (default) or bfloat16 forward passes.",
    ),
]


# -- evaluation: `compress` names them --eval-* (its --seq-len is the calibration's), `eval` plainly ---------
def _evaluation_options(prefix: str, panel: str) -> tuple:
    """The evaluation text's split, window length and token cap, under `--{prefix}split` etc."""
    split = typer.Option(
        f"--{prefix}split", metavar="SPLIT", rich_help_panel=panel, help="test (default) or validation."
    )
    seq_len = typer.Option(
        f"--{prefix}seq-len", min=8, metavar="T", rich_help_panel=panel,
        help="Evaluation window length (default: the recipe's).",
    )  # fmt: skip
    max_tokens = typer.Option(
        f"--{prefix}max-tokens",
        min=0,
        metavar="N",
        rich_help_panel=panel,
        help="Cap on evaluated tokens (default: all).",
    )
    return Annotated[Opt[str], split], Annotated[Opt[int], seq_len], Annotated[Opt[int], max_tokens]


EvalSplit, EvalSeqLen, EvalMaxTokens = _evaluation_options("eval-", CALIBRATION)
Split, EvalWindowLen, MaxTokens = _evaluation_options("", EVALUATION)


def _compare(panel: str, reference: str):
    return Annotated[
        bool,
        typer.Option(
            "--compare/--no-compare",
            rich_help_panel=panel,
            help=f"KL and top-1 against {reference}.",
        ),
    ]


CompareInRun = _compare(CALIBRATION, "the original")
Compare = _compare(EVALUATION, "the reference (--against, else a checkpoint's source)")

# -- hardware -------------------------------------------------------------------------------------------------
BatchSize = Annotated[
    int,
    typer.Option(
        "--batch-size", min=1, metavar="N", rich_help_panel=HARDWARE, help="Windows per forward pass."
    ),
]
Device = Annotated[
    str,
    typer.Option(
        "--device",
        metavar="DEVICE",
        rich_help_panel=HARDWARE,
        help="auto (default), cpu, cuda, cuda:N or mps.",
    ),
]
Dtype = Annotated[
    str,
    typer.Option(
        "--dtype",
        metavar="DTYPE",
        rich_help_panel=HARDWARE,
        help="auto (default), float32, bfloat16 or float16.",
    ),
]

# -- output ---------------------------------------------------------------------------------------------------
Json = Annotated[
    bool, typer.Option("--json", rich_help_panel=OUTPUT, help="One JSON object on stdout; no progress.")
]
Quiet = Annotated[bool, typer.Option("--quiet", "-q", rich_help_panel=OUTPUT, help="No progress on stderr.")]
Overwrite = Annotated[
    bool, typer.Option("--overwrite", rich_help_panel=OUTPUT, help="Replace an existing output directory.")
]
