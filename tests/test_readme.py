"""The README's command lines and snippets run as written after `make demo`.

Every `masa-compress` line of its shell blocks is parsed by the real command line (with `--help` appended, so
an unknown command or option fails here, not in a reader's terminal); the cheap ones (`plan`, `recipes`, `show`,
`--help`) run for real, on a tiny checkpoint standing in for the demo's; the Python snippets run on a tiny
model. The demo's checkpoint path the README reads is the one `make demo` writes.
"""

from __future__ import annotations

import functools
import re
import shlex
from pathlib import Path

import pytest
from conftest import tiny_model_dir

from compressor.api.session import default_output_dir
from compressor.cli import main

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text()
DEMO_OUT = default_output_dir("smollm2-135m", "masa", 0.2)
CHEAP = ("plan", "recipes", "show", "--help", "--version")


def _blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README, flags=re.S)


def _commands() -> list[list[str]]:
    lines = [line.strip() for block in _blocks("bash") for line in block.splitlines()]
    return [shlex.split(line, comments=True) for line in lines if line.startswith("masa-compress ")]


COMMANDS = _commands()


def test_the_readme_reads_the_checkpoint_make_demo_writes():
    makefile = (REPO / "Makefile").read_text()
    demo = re.search(r"^demo:.*\n\t(.+)$", makefile, flags=re.M).group(1)
    assert "masa-compress smollm2-135m --ratio $(RATIO)" in demo and re.search(
        r"^RATIO \?= 0\.2$", makefile, re.M
    )
    assert "--out" not in demo  # so it writes to the default directory, which is:
    assert DEMO_OUT == "out/smollm2-135m-masa-r0.2" and DEMO_OUT in README
    assert len(COMMANDS) >= 10


@pytest.mark.parametrize("argv", COMMANDS, ids=[" ".join(c[1:4]) for c in COMMANDS])
def test_every_readme_command_parses(argv, capsys):
    try:
        main([*argv[1:], "--help"])
    except SystemExit as exc:
        assert exc.code in (0, None), capsys.readouterr().err
    assert "Usage" in capsys.readouterr().out


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory) -> str:
    from compressor.api import CompressOptions, compress

    tmp = tmp_path_factory.mktemp("readme")
    model = str(tiny_model_dir(tmp / "tiny"))
    options = CompressOptions(ratio=0.2, calib_samples=4, seq_len=64, evaluate=False, out=str(tmp / "ckpt"))
    return compress(model, options, progress=False).summary["out"]


@pytest.mark.parametrize(
    "argv", [c for c in COMMANDS if c[1] in CHEAP], ids=[" ".join(c[1:3]) for c in COMMANDS if c[1] in CHEAP]
)
def test_cheap_readme_commands_run(argv, tiny_checkpoint, capsys):
    args = [tiny_checkpoint if a == DEMO_OUT else a for a in argv[1:]]
    try:
        main(args)
    except SystemExit as exc:
        assert exc.code in (0, None), capsys.readouterr().err
    assert capsys.readouterr().out.strip()


def test_readme_python_snippets_run(tiny_checkpoint, tmp_path, monkeypatch):
    """Each snippet as written, the demo's checkpoint replaced by the tiny one and the bundled model by a tiny
    random one (with a short calibration and evaluation, so that the snippet stays a fast test)."""
    import compressor.api

    model = str(tiny_model_dir(tmp_path / "tiny"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(
        compressor.api,
        "CompressOptions",
        functools.partial(compressor.api.CompressOptions, calib_samples=4, seq_len=64, eval_max_tokens=1024),
    )
    snippets = _blocks("python")
    assert snippets
    for snippet in snippets:
        code = snippet.replace(f'"{DEMO_OUT}"', repr(tiny_checkpoint)).replace('"smollm2-135m"', repr(model))
        exec(compile(code, "README.md", "exec"), {})
