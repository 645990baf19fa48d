"""The structure facts of `tests/check_structure.py` hold: no import loops, no file over 450 lines, no function
over 80 lines (option declarations aside), nothing repeated between `remote_code/` and the library."""

from __future__ import annotations

import check_structure


def test_structure_facts_hold():
    assert check_structure.problems() == {what: [] for what in check_structure.problems()}
