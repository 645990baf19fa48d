"""lm-evaluation-harness on a checkpoint: `masa-compress eval CKPT --tasks ...`.

A masa-compress checkpoint carries its modelling code, so lm-eval's own `hf` model loads it with
`trust_remote_code=True`, exactly as a user would outside this tool. This module only adds what a tool
needs around that: one-line errors for the failures users meet (lm-eval missing, unknown task, task data
that cannot be fetched offline) and plain JSON results. `lm-eval` is an optional dependency
(`pip install masa-compress[eval]`) and is imported only here, when asked for: it is slow to import.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from compressor.runtime.cache_root import atomic_write_bytes
from compressor.runtime.errors import UserError

_LOCAL_TASK_HINT = (
    "define a task on local files (a YAML with `dataset_path: json` and `dataset_kwargs: {data_files: ...}`) "
    "and pass its folder with --tasks-path"
)


def import_lm_eval():
    try:
        import lm_eval
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise UserError(
            "lm-evaluation-harness is not installed: `pip install masa-compress[eval]` (or `pip install lm-eval`)"
        ) from None
    return lm_eval, TaskManager


def _one_line(err: BaseException) -> str:
    first = next((line.strip() for line in str(err).splitlines() if line.strip()), "")
    return f"{type(err).__name__}: {first[:160]}" if first else type(err).__name__


def _plain_metrics(metrics: dict) -> dict:
    """lm-eval's per-task dict without its bookkeeping: `acc,none` -> `acc`, numbers only."""
    plain = {}
    for key, value in metrics.items():
        if key == "alias" or not isinstance(value, (int, float)) or isinstance(value, bool):
            continue
        name, _, filter_name = key.partition(",")
        plain[name if filter_name in ("", "none") else f"{name} ({filter_name})"] = (
            float(value) if math.isfinite(value) else None
        )
    return plain


def load_tasks(task_manager, tasks: list[str]) -> None:
    """Load the tasks' data before any model is loaded; an unreachable data set is a one-line UserError."""
    import logging

    # Looked up outside the `try` below, which reads any failure as unreachable data: an lm-eval API change
    # must surface as itself. `TaskManager.load` is lm-eval >= 0.4.12, which deprecates `get_task_dict`;
    # `get_task_dict` is what older releases (and their `simple_evaluate`) use.
    load = getattr(task_manager, "load", None)
    if load is None:
        from lm_eval.tasks import get_task_dict

        def load(names):
            return get_task_dict(names, task_manager)

    # `huggingface_hub` logs each failed request before `datasets` raises: the error below says it in one line.
    hub_logger = logging.getLogger("huggingface_hub")
    level = hub_logger.level
    hub_logger.setLevel(logging.CRITICAL)
    try:
        load(tasks)
    except Exception as err:
        # `datasets` raises many types when the hub cannot be reached (ConnectionError, OSError,
        # DatasetNotFoundError, ...); the fix is the same for all, and the cause's first line tells them apart.
        raise UserError(
            f"the data of lm-eval task(s) {', '.join(tasks)} cannot be fetched ({_one_line(err)}): no network? "
            f"Run where the data sets are reachable, or {_LOCAL_TASK_HINT}"
        ) from None
    finally:
        hub_logger.setLevel(level)


def run_tasks(
    model_path: str,
    tasks: list[str],
    *,
    device: str = "cpu",
    dtype: str = "float32",
    batch_size: int = 1,
    limit: int | None = None,
    include_path: str | list[str] | None = None,
    items_out: Path | None = None,
) -> dict[str, dict[str, float | None]]:
    """Score a model directory (a masa-compress checkpoint or any HF folder) on lm-eval tasks.

    Returns ``{task: {metric: value}}`` (with `items`: how many were scored). Runs lm-eval's `hf` model with `trust_remote_code=True`, so the
    checkpoint is loaded the way any lm-eval user would load it. With `items_out`, every item's scores are written
    there too (`write_items`): what a paired comparison of two models on the same items reads.
    """
    if not tasks:
        raise UserError("no lm-eval task named: pass --tasks NAME[,NAME...]")
    for folder in [include_path] if isinstance(include_path, str) else include_path or []:
        if not Path(folder).is_dir():
            raise UserError(f"--tasks-path {folder} is not a directory: pass the folder of your task YAMLs")
    lm_eval, TaskManager = import_lm_eval()
    manager = TaskManager(include_path=include_path) if include_path else TaskManager()
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        raise UserError(
            f"unknown lm-eval task '{unknown[0]}': see `lm-eval ls tasks` for the names, or {_LOCAL_TASK_HINT}"
        )
    load_tasks(manager, tasks)
    results = lm_eval.simple_evaluate(
        model="hf",
        model_args={"pretrained": model_path, "trust_remote_code": True, "dtype": dtype},
        tasks=tasks,
        batch_size=batch_size,
        device=device,
        limit=limit,
        task_manager=manager,
        log_samples=items_out is not None,
    )
    if items_out is not None:
        write_items(items_out, results.get("samples", {}))
    counts = results.get("n-samples", {})
    return {
        task: _plain_metrics(metrics) | ({"items": counts[task]["effective"]} if task in counts else {})
        for task, metrics in results["results"].items()
    }


def item_scores(samples: dict[str, list[dict]]) -> list[dict]:
    """lm-eval's logged samples reduced to what a paired comparison needs: per task and item (`doc_id`), its
    accuracies (`acc`, `acc_norm`: the per-item metrics that are plain numbers)."""
    rows = []
    for task, logged in samples.items():
        for sample in logged:
            scores = {
                metric: float(sample[metric])
                for metric in sample.get("metrics", ())
                if metric in ("acc", "acc_norm") and isinstance(sample.get(metric), (int, float))
            }
            rows.append({"task": task, "doc_id": int(sample["doc_id"]), **scores})
    return rows


def write_items(path: Path, samples: dict[str, list[dict]]) -> None:
    """`item_scores` as JSON lines at `path`, written whole or not at all."""
    rows = "".join(json.dumps(row) + "\n" for row in item_scores(samples))
    atomic_write_bytes(Path(path), rows.encode())
