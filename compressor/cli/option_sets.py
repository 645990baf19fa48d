"""The options several commands take together, each set listed once: a command names a set where its options go
in its signature (a parameter whose default is the set) and receives their values as keyword arguments.

    @with_option_sets
    def plan_command(model: o.Model, the_run: OptionSet = THE_RUN, ..., **given) -> None:
        options = CompressOptions.from_values(given)

A compression setting's option is built from its schema field (`setting`: the type, the flag, the values and the
default the help names), so a new setting is its field in `CompressionSettings`, one line in
`COMPRESSION_SETTINGS` and its explanation in docs/options.md; `compress` and `plan` take it from that line, in
the same place of their `--help`, and `CompressOptions` has it as a field already.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Optional, get_args

import typer

import compressor.cli.options as o
from compressor.cli.help import ATOMS, MLP, SHARING
from compressor.recipes.schema import CompressionSettings


@dataclass(frozen=True)
class OptionSet:
    """Options taken together: (parameter name, annotated type, default), in their `--help` order."""

    options: tuple[tuple[str, Any, Any], ...]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _, _ in self.options)

    def annotation(self, name: str) -> Any:
        """The annotated type of option `name`, for a command that takes it alone."""
        return next(annotation for option, annotation, _ in self.options if option == name)


#: What a run compresses and by how much: the first options of `compress` and `plan`.
THE_RUN = OptionSet(
    (
        ("ratio", o.Ratio, None),
        ("ratio_of", o.RatioOf, "targets"),
        ("method", o.Method, None),
        ("targets", o.Targets, None),
        ("recipe_file", o.RecipeFile, None),
    )
)


def setting(
    name: str,
    metavar: str | None,
    panel: str,
    text: str | None = None,
    *,
    flags: tuple[str, ...] = (),
    minimum: int | None = None,
    default_text: str | None = None,
) -> tuple[str, Any, Any]:
    """The option of the compression setting `name` (a field of `CompressionSettings`), as a set lists it: its
    type read from the schema, its flag `--name` (a switch: `--name/--no-name`) and `flags` beside it, and its help
    `text` (a choice's values when not given), with the schema's default (or `default_text`) after it. None: the
    recipe's value."""
    field = CompressionSettings.model_fields[name]
    types = (field.annotation, *get_args(field.annotation))  # `int | None` is an int setting
    kind = next((t for t in (bool, int) if t in types), str)
    flag = "--" + name.replace("_", "-")
    if kind is bool and not flags:
        flags = (f"{flag}/--no-{flag[2:]}",)
    elif not any(f.startswith("--") for f in flags):
        flags = (flag, *flags)
    help_text = f"{text or o.choices(name)} (default: {default_text or o.default(name)})."
    option = typer.Option(*flags, metavar=metavar, min=minimum, rich_help_panel=panel, help=help_text)
    return name, Annotated[Optional[kind], option], None  # noqa: UP045 (typer reads Optional on Python 3.10)


#: The compression settings that `compress` and `plan` take, one option each: a new setting is its schema field,
#: one line here, and its explanation in docs/options.md.
COMPRESSION_SETTINGS = OptionSet(
    (
        setting("sharing", "FORM", SHARING),
        setting("basis_layers", "N", SHARING, "Consecutive layers per shared basis", minimum=2),
        setting("allocation", "RULE", SHARING, "How ranks are allocated"),
        setting("sensitivity_samples", "N", SHARING, "Windows for global-loss's gradients", minimum=1),
        setting("statistics", "WHICH", SHARING),
        setting("attention", "FORM", MLP),
        ("native", o.Native, False),  # not a setting: several at once (NATIVE_FORMS)
        setting("mlp", "FORM", MLP),
        setting(
            "uniform_mlp", None, MLP, "One MLP width in every layer", flags=("--uniform-mlp/--per-layer-mlp",)
        ),
        setting("width_multiple", "N", MLP, "MLP widths in multiples of N", minimum=1),
        setting("neuron_order", "ORDER", MLP, ", ".join(o.values("neuron_order")), default_text="auto"),
        setting("refit", "HOW", MLP, default_text="auto"),
        setting("groups", "G", ATOMS, "Groups of consecutive layers", flags=("-g",), minimum=1),
        setting("bases", "B", ATOMS, "Atoms per group and projection", flags=("-b",), minimum=0),
        setting(
            "largest_group_bases", "B", ATOMS, "Atoms of the largest group", minimum=0, default_text="--bases"
        ),
        setting("end_boundaries", None, ATOMS, "End layers may be groups alone"),
        setting("logit_lens", "LENS", ATOMS),
        setting("atoms", "KIND", ATOMS),
        setting("singletons", "WHAT", ATOMS),
    )
)

#: The settings only `compress` takes (`plan` cannot choose G and B: that needs the calibration).
AUTO_GROUPS = OptionSet(
    (
        setting(
            "auto_groups", None, ATOMS, "Choose G and B by a proxy", flags=("--auto-groups/--fixed-groups",)
        ),
    )
)

#: A GGUF within a byte budget instead of a ratio (`compress --size`, `plan --size`).
BYTE_BUDGET = OptionSet(
    (
        ("size", o.Size, None),
        ("bits_per_weight", o.BitsPerWeight, None),
        ("only_types", o.OnlyTypes, None),
        ("speed", o.Speed, None),
    )
)

#: Where and how a command that runs the model computes (`compress`, `inspect`, `eval`).
COMPUTE = OptionSet(
    (
        ("device", o.Device, "auto"),
        ("dtype", o.Dtype, "auto"),
        ("batch_size", o.BatchSize, 1),
    )
)


def with_option_sets(command: Callable) -> Callable:
    """`command` as typer reads it: each parameter whose default is an `OptionSet` replaced, in place, by the set's
    options; typer then passes their values to the command's `**given`."""
    signature = inspect.signature(command, eval_str=True)
    parameters, variadic, places = [], None, []
    for parameter in signature.parameters.values():
        if parameter.kind is parameter.VAR_KEYWORD:
            variadic = parameter
        elif isinstance(parameter.default, OptionSet):
            places.append(parameter.name)  # named like an option, it would take that option's value
            parameters += [
                inspect.Parameter(name, parameter.POSITIONAL_OR_KEYWORD, annotation=annotation, default=value)
                for name, annotation, value in parameter.default.options
            ]
        else:
            parameters.append(parameter)
    if variadic is None:
        raise TypeError(f"{command.__name__} takes option sets: it needs a **given to receive them")
    names = [p.name for p in parameters] + places
    repeated = {name for name in names if names.count(name) > 1}
    if repeated:
        raise TypeError(f"{command.__name__}: options taken twice: {', '.join(sorted(repeated))}")
    command.__signature__ = signature.replace(parameters=parameters)
    return command
