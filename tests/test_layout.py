"""The package's layout by stage: the public entry point, the moved modules' old import paths (kept one release),
the one-line description, and a fresh clone without symlink support installing `compressor.calibration` and
`compressor.recipes` from their top-level folders."""

from __future__ import annotations

import importlib
import subprocess
import sys
import warnings
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


@pytest.mark.parametrize("old", sorted(compressor.MOVED_MODULES))
def test_an_old_import_path_is_the_new_module_with_a_warning(old):
    new = importlib.import_module(compressor.MOVED_MODULES[old])
    sys.modules.pop(old, None)
    with pytest.warns(FutureWarning, match=f"{old} moved to {new.__name__}"):
        moved = importlib.import_module(old)
    assert moved is new  # one module object: one class identity, one state
    assert new.__spec__.name == new.__name__  # its own spec, not the alias's (a package stays a package)
    if hasattr(new, "__path__"):
        assert new.__spec__.submodule_search_locations


def test_an_old_submodule_path_is_not_loaded_twice():
    """`compressor.remote_code.masa_modules` through the old package must be the library's module, not a second
    copy read from the new folder (two `LowRankLinear` classes would fail isinstance checks)."""
    from compressor.modeling.remote_code.masa_modules import LowRankLinear

    for name in ("compressor.remote_code", "compressor.remote_code.masa_modules"):
        sys.modules.pop(name, None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        from compressor.remote_code.masa_modules import LowRankLinear as old_path_class
    assert old_path_class is LowRankLinear


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
