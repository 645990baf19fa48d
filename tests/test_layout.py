"""The package's layout by stage: the public entry point, no aliases of module paths, the one-line
description, and a fresh clone without symlink support installing `compressor.calibration` and
`compressor.recipes` from their top-level folders."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import compressor

ROOT = Path(__file__).resolve().parents[1]


def test_the_api_exports_the_four_entry_points():
    import compressor.api as api
    from compressor.api.inspection import inspect_model
    from compressor.api.preview import plan_compression
    from compressor.api.run import compress, evaluate

    assert (api.compress, api.evaluate, api.plan, api.inspect) == (
        compress,
        evaluate,
        plan_compression,
        inspect_model,
    )
    assert {"compress", "evaluate", "plan", "inspect", "CompressOptions", "EvalSettings"} <= set(api.__all__)
    with pytest.raises(AttributeError, match="no attribute 'planning'"):
        api.planning  # noqa: B018


def test_the_package_aliases_no_module_path():
    """Nothing released ever used the paths of the layout before 0.1.0: the package installs no import hook, and
    an old path is simply not there (checkpoints carry their own copy of the remote code)."""
    assert not [f for f in sys.meta_path if type(f).__module__.startswith("compressor")]
    for old in ("compressor.adapters", "compressor.remote_code", "compressor.layerwise"):
        sys.modules.pop(old, None)
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(old)


def test_one_description_true_to_the_default():
    """The package summary, the CLI's help and pyproject say the same, and none claims that the default shares."""
    from typer.testing import CliRunner

    from compressor.cli import app

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    described = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["description"]
    assert described == compressor.SUMMARY
    shown = CliRunner().invoke(app, ["--help"], terminal_width=200).output
    assert " ".join(compressor.SUMMARY.split()[:6]) in " ".join(shown.split())
    assert "on request" in compressor.SUMMARY  # the default is --sharing none


@pytest.mark.slow
@pytest.mark.long
def test_a_fresh_clone_without_symlinks_installs_calibration_and_recipes(tmp_path):
    """What is committed (HEAD), cloned with `core.symlinks=false`, installed (no build isolation: the
    environment's setuptools), imported from outside the checkout."""
    setuptools = pytest.importorskip("setuptools")
    if int(setuptools.__version__.split(".")[0]) < 68:
        pytest.skip(
            f"setuptools {setuptools.__version__} here; the build needs >= 68 (pyproject's build-system)"
        )
    clone, target = tmp_path / "clone", tmp_path / "site"
    subprocess.run(["git", "clone", "-q", "-c", "core.symlinks=false", str(ROOT), str(clone)], check=True)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(target),
        ]
        + ["--disable-pip-version-check", str(clone)],
        check=True,
    )
    probe = (
        "import compressor, compressor.calibration.windows, compressor.recipes.schema as s; "
        "print(compressor.__file__); print(sorted(s.builtin_recipe_names())[0])"
    )
    shown = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=tmp_path,
        env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert shown[0].startswith(str(target))
    assert (target / "compressor" / "recipes" / "smollm2-135m.yaml").is_file()
    assert (target / "compressor" / "calibration" / "windows.py").is_file()
    assert shown[1]  # the recipes' YAML files were installed and read
