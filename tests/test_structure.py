"""The structure facts of `tests/check_structure.py` hold: no import loops, no import up the floors, at most 10
entries at the package's top, no symlink, no file over 450 lines, no function over 80 lines (option declarations
aside), nothing repeated between `remote_code/` and the library, no module path of a model family outside its
registry (`compressor/modeling/families.py`)."""

from __future__ import annotations

import check_structure


def test_structure_facts_hold():
    assert check_structure.problems() == {what: [] for what in check_structure.problems()}


def test_every_package_folder_is_installed():
    """`pyproject.toml` lists the packages by name (recipes/ and calibration/ through `package-dir`): a new
    folder of the package that is not listed would be missing from a non-editable install."""
    from pathlib import Path

    import pytest

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    root = Path(check_structure.ROOT)
    setuptools = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    mapped = {package: root / folder for package, folder in setuptools["package-dir"].items()}
    assert mapped == {"compressor.recipes": root / "recipes", "compressor.calibration": root / "calibration"}
    folders = {".".join(p.parent.relative_to(root).parts) for p in (root / "compressor").rglob("__init__.py")}
    folders |= {package for package, folder in mapped.items() if (folder / "__init__.py").exists()}
    assert folders <= listed, f"not installed: {sorted(folders - listed)}"
