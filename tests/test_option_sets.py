"""`cli/option_sets.py`: the options several commands take together, listed once, reach each command's `--help`
in place and its `**given` with their values; `CompressOptions.from_values` reads them."""

from __future__ import annotations

from dataclasses import fields

import click
import pytest
import typer
from click.testing import CliRunner

import compressor.cli.option_sets as sets
import compressor.cli.options as o
from compressor.api.run_options import DEFAULT_RATIO, NATIVE_FORMS, CompressOptions, resolve_settings
from compressor.cli import app
from compressor.cli.commands import register
from compressor.recipes.schema import CompressionSettings


def _command(function) -> click.Command:
    single = typer.Typer(add_completion=False)
    single.command()(function)
    return typer.main.get_command(single)


def _names(command: click.Command) -> list[str]:
    return [p.name for p in command.params]


def test_a_set_takes_the_place_of_its_parameter_and_its_values_reach_the_command():
    received = {}

    @sets.with_option_sets
    def command(
        model: o.Model, compute: sets.OptionSet = sets.COMPUTE, as_json: o.Json = False, **given
    ) -> None:
        received.update(given, as_json=as_json, model=model)

    assert _names(_command(command)) == ["model", "device", "dtype", "batch_size", "as_json"]
    result = CliRunner().invoke(_command(command), ["M", "--batch-size", "3", "--json"])
    assert result.exit_code == 0, result.output
    assert received == {"device": "auto", "dtype": "auto", "batch_size": 3, "as_json": True, "model": "M"}


def test_a_command_without_somewhere_to_receive_a_set_or_taking_an_option_twice_is_refused():
    def no_given(model: o.Model, compute: sets.OptionSet = sets.COMPUTE) -> None: ...

    def twice(
        model: o.Model, batch_size: o.BatchSize = 1, compute: sets.OptionSet = sets.COMPUTE, **given
    ) -> None: ...

    with pytest.raises(TypeError, match=r"\*\*given"):
        sets.with_option_sets(no_given)
    with pytest.raises(TypeError, match="taken twice: batch_size"):
        sets.with_option_sets(twice)


def test_compress_and_plan_take_the_same_sets_in_the_same_order():
    register(app)
    commands = typer.main.get_command(app).commands
    compress, plan = _names(commands["compress"]), _names(commands["plan"])
    for option_set in (sets.THE_RUN, sets.COMPRESSION_SETTINGS, sets.BYTE_BUDGET):
        for names in (compress, plan):
            start = names.index(option_set.names[0])
            assert tuple(names[start : start + len(option_set.names)]) == option_set.names
    assert set(sets.COMPUTE.names) <= set(compress) and set(sets.COMPUTE.names) <= set(
        _names(commands["inspect"])
    )


def test_every_compression_setting_is_an_option_of_the_same_name():
    options = {f.name for f in fields(CompressOptions)}
    shorthand = {"native"}  # sets several of them at once (NATIVE_FORMS), each an option of the set too
    assert set(NATIVE_FORMS) <= set(sets.COMPRESSION_SETTINGS.names) and shorthand <= options
    assert set(sets.COMPRESSION_SETTINGS.names) - shorthand <= set(CompressionSettings.model_fields) & options
    # what compress takes beside the set, and what only a recipe sets (a setting no run should change)
    beside, recipe_only = {"method", "targets", "auto_groups"}, {"dense_when_cheaper"}
    assert (
        set(CompressionSettings.model_fields)
        == set(sets.COMPRESSION_SETTINGS.names) - shorthand | beside | recipe_only
    )
    assert beside | recipe_only <= options


def test_options_from_values_read_none_as_the_default_where_the_default_is_a_value():
    given = {"ratio": None, "ratio_of": None, "groups": None, "bases": 2, "batch_size": None, "model": "M"}
    options = CompressOptions.from_values(given)
    assert options.ratio == DEFAULT_RATIO and options.ratio_of == "targets" and options.batch_size == 1
    assert options.groups is None and options.bases == 2  # None here is "the recipe's value"
    assert CompressOptions.from_values({"ratio": 0.3}).ratio == 0.3


def test_a_setting_is_one_line_from_its_schema_field_to_the_run():
    """A setting no command takes yet (`dense_when_cheaper`, a recipe's key), given its one line in a set: the
    command parses its switch, and the run's resolved settings take the value, named as the user's."""
    received = {}
    the_line = sets.OptionSet((sets.setting("dense_when_cheaper", None, "Sharing", "Whole where cheaper"),))

    @sets.with_option_sets
    def command(model: o.Model, settings: sets.OptionSet = the_line, **given) -> None:
        received.update(given)

    for argv, expected in ((["M"], None), (["M", "--no-dense-when-cheaper"], False)):
        result = CliRunner().invoke(_command(command), argv)
        assert result.exit_code == 0, result.output
        assert received == {"dense_when_cheaper": expected}
    resolved = resolve_settings(CompressOptions.from_values(received), None)
    assert resolved.compression.dense_when_cheaper is False
    assert resolved.sources["compression"]["dense_when_cheaper"] == "option"


def test_a_set_s_place_named_like_one_of_its_options_is_refused():
    """Named like an option, the place would take that option's value instead of `**given`."""

    def clash(model: o.Model, batch_size: sets.OptionSet = sets.COMPUTE, **given) -> None: ...

    with pytest.raises(TypeError, match="taken twice: batch_size"):
        sets.with_option_sets(clash)
