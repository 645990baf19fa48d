"""The options several commands take together, each set listed once: a command names a set where its options go
in its signature (a parameter whose default is the set) and receives their values as keyword arguments.

    @with_option_sets
    def plan_command(model: o.Model, the_run: OptionSet = THE_RUN, ..., **given) -> None:
        options = CompressOptions.from_values({**locals(), **given})

So a new compression setting is its schema field (`CompressionSettings`), its annotated type (`cli/options.py`)
and one line here; `compress` and `plan` take it from that line, in the same place of their `--help`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import compressor.cli.options as o


@dataclass(frozen=True)
class OptionSet:
    """Options taken together: (parameter name, annotated type, default), in their `--help` order."""

    options: tuple[tuple[str, Any, Any], ...]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _, _ in self.options)


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

#: The compression settings (`CompressionSettings`' fields of the same names) that `compress` and `plan` take.
COMPRESSION_SETTINGS = OptionSet(
    (
        ("sharing", o.Sharing, None),
        ("basis_layers", o.BasisLayers, None),
        ("allocation", o.Allocation, None),
        ("sensitivity_samples", o.SensitivitySamples, None),
        ("statistics", o.Statistics, None),
        ("attention", o.Attention, None),
        ("native", o.Native, False),
        ("mlp", o.Mlp, None),
        ("uniform_mlp", o.UniformMlp, None),
        ("width_multiple", o.WidthMultiple, None),
        ("neuron_order", o.NeuronOrder, None),
        ("refit", o.Refit, None),
        ("groups", o.Groups, None),
        ("bases", o.Bases, None),
        ("largest_group_bases", o.LargestGroupBases, None),
        ("end_boundaries", o.EndBoundaries, None),
        ("logit_lens", o.LogitLens, None),
        ("atoms", o.Atoms, None),
        ("singletons", o.Singletons, None),
    )
)

#: A GGUF within a byte budget instead of a ratio (`compress --size`, `plan --size`).
BYTE_BUDGET = OptionSet(
    (
        ("size", o.Size, None),
        ("bits_per_weight", o.BitsPerWeight, None),
        ("only_types", o.OnlyTypes, None),
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
    parameters, variadic = [], None
    for parameter in signature.parameters.values():
        if parameter.kind is parameter.VAR_KEYWORD:
            variadic = parameter
        elif isinstance(parameter.default, OptionSet):
            parameters += [
                inspect.Parameter(name, parameter.POSITIONAL_OR_KEYWORD, annotation=annotation, default=value)
                for name, annotation, value in parameter.default.options
            ]
        else:
            parameters.append(parameter)
    if variadic is None:
        raise TypeError(f"{command.__name__} takes option sets: it needs a **given to receive them")
    names = [p.name for p in parameters]
    repeated = {name for name in names if names.count(name) > 1}
    if repeated:
        raise TypeError(f"{command.__name__}: options taken twice: {', '.join(sorted(repeated))}")
    command.__signature__ = signature.replace(parameters=parameters)
    return command
