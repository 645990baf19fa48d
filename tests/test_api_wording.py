"""Errors name the fix in the caller's words: `overwrite=True` for a Python caller of `compressor.api`,
`--overwrite` on the command line (which runs every command inside `errors.cli_wording`)."""

from __future__ import annotations

import pytest

from compressor.api import CompressOptions, compress
from compressor.api.session import check_output_dir
from compressor.cli import main
from compressor.runtime.errors import UserError, cli_wording, wording


def test_the_api_names_its_arguments(tmp_path):
    from conftest import tiny_model_dir

    model = tiny_model_dir(tmp_path / "tiny")
    (tmp_path / "exists").mkdir()
    with pytest.raises(UserError) as excinfo:
        compress(str(model), CompressOptions(out=str(tmp_path / "exists")), progress=False)
    message = str(excinfo.value)
    assert "pass overwrite=True or choose another out" in message
    assert "--" not in message


def test_the_command_line_names_its_flags(tmp_path, capsys):
    (tmp_path / "exists").mkdir()
    with pytest.raises(SystemExit):
        main(["smollm2-135m", "--out", str(tmp_path / "exists")])
    assert "pass --overwrite or choose another --out" in capsys.readouterr().err


def test_the_wording_follows_the_caller(tmp_path):
    (tmp_path / "exists").mkdir()
    with pytest.raises(UserError, match="overwrite=True"):
        check_output_dir(str(tmp_path / "exists"), overwrite=False)
    with cli_wording(), pytest.raises(UserError, match="--overwrite"):
        check_output_dir(str(tmp_path / "exists"), overwrite=False)
    assert wording("--a", "a=True") == "a=True"  # and back to Python's words after the block
