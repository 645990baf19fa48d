"""The README's command lines and snippets run as written after `make demo`.

Every `masa-compress` line of its shell blocks is parsed by the real command line (with `--help` appended, so
an unknown command or option fails here, not in a reader's terminal); the cheap ones (`plan`, `recipes`, `show`,
`--help`) run for real, on a tiny checkpoint standing in for the demo's; the quickstart's compressions of
`./my-model` run for real on a tiny model folder of that name (with a tiny calibration appended); the Python
snippets run on a tiny model. The demo's checkpoint path the README reads is the one `make demo` writes.
"""

from __future__ import annotations

import functools
import json
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
#: The quickstart's own model and its checkpoint, as the README names them.
MY_MODEL, MY_OUT = "./my-model", "out/my-model"
#: Appended to a quickstart compression so that it stays a fast test (flags `compress --help` lists).
TINY_RUN = ["--calib-samples", "4", "--seq-len", "64", "--eval-seq-len", "64", "--eval-max-tokens", "256"]


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
def test_cheap_readme_commands_run(argv, tiny_checkpoint, tmp_path, monkeypatch, capsys):
    tiny_model_dir(tmp_path / MY_MODEL)
    monkeypatch.chdir(tmp_path)
    args = [tiny_checkpoint if a in (DEMO_OUT, MY_OUT) else a for a in argv[1:]]
    try:
        main(args)
    except SystemExit as exc:
        assert exc.code in (0, None), capsys.readouterr().err
    assert capsys.readouterr().out.strip()


def _quickstart_compressions() -> list[list[str]]:
    """The README's compressions of `./my-model` on the CPU (the `.gguf` and `--device cuda` lines are parsed
    above: a GGUF of a tiny model and a GPU are not at hand in the fast tests)."""
    runs = []
    for argv in COMMANDS:
        args = argv[2:] if argv[1] == "compress" else argv[1:]
        if args[0] == MY_MODEL and "--device" not in args:
            runs.append(args)
    return runs


QUICKSTART = _quickstart_compressions()


def test_the_quickstart_compresses_a_local_folder_and_the_whole_model():
    assert [MY_MODEL, "--ratio", "0.2", "--out", MY_OUT] in QUICKSTART
    assert any("--ratio-of" in args and "attn,mlp" in args for args in QUICKSTART)
    assert any(args[1] == "plan" and args[2] == MY_MODEL for args in COMMANDS)  # `plan` comes first
    assert any(a[1].endswith(".gguf") for a in COMMANDS) and any("cuda" in a for a in COMMANDS)


@pytest.mark.parametrize("args", QUICKSTART, ids=[" ".join(a[1:5]) for a in QUICKSTART])
def test_quickstart_compressions_run_on_a_local_folder(args, tmp_path, monkeypatch, capsys):
    """The command as written, `./my-model` being a tiny model folder in the working directory; then the
    checkpoint it wrote loads, as the README's loading snippet reads it."""
    tiny_model_dir(tmp_path / MY_MODEL)
    monkeypatch.chdir(tmp_path)
    main([*args, *TINY_RUN, "--json"])
    summary = json.loads(capsys.readouterr().out)
    out = args[args.index("--out") + 1]
    assert Path(summary["out"]).resolve() == (tmp_path / out).resolve()
    assert summary["ppl_after"] > 0 and (tmp_path / out / "masa_config.json").is_file()
    if "--ratio-of" in args:
        assert summary["ratio_of"] == "model"


def test_the_families_the_readme_says_are_refused_are():
    """Architectures outside the family registry (here Qwen2-MoE and OLMoE, mixtures of experts it has no entry
    for) are refused in one line from their config alone; Phi-3 and Mixtral, in it, are not."""
    import transformers

    from compressor.api.model_loading import check_architecture
    from compressor.runtime.errors import UserError

    for config in (transformers.Qwen2MoeConfig(), transformers.OlmoeConfig()):
        with pytest.raises(UserError, match=f"unsupported architecture .*'{config.model_type}'") as err:
            check_architecture(config, "a folder")
        assert "\n" not in str(err.value)
    for config in (transformers.Phi3Config(), transformers.MixtralConfig()):
        check_architecture(config, "a folder")
    assert "Other architectures are refused before any weight is read" in README


def test_readme_python_snippets_run(tiny_checkpoint, tmp_path, monkeypatch):
    """Each snippet as written, the demo's checkpoint replaced by the tiny one and the bundled model by a tiny
    random one (with a short calibration and evaluation, so that the snippet stays a fast test)."""
    import compressor.api

    model = str(tiny_model_dir(tmp_path / "tiny"))
    # The quickstart's own model: its snippet writes out/my-model, which the loading snippet after it reads.
    tiny_model_dir(tmp_path / MY_MODEL)
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
