"""lm-evaluation-harness loads a compressed checkpoint with its own `hf` model (trust_remote_code) and scores
a task defined on local files, offline; the score equals a hand computation; unreachable task data is a
one-line error."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import byte_tokenizer, random_windows, tiny_model

pytest.importorskip("lm_eval", reason="the [eval] extra (lm-eval) is part of `make install`")

from compressor.api.pipeline import compress_model  # noqa: E402
from compressor.checkpoint import load_compressed, save_compressed  # noqa: E402
from compressor.evaluation.lm_eval_tasks import run_tasks  # noqa: E402
from compressor.modeling.adapters import get_adapter  # noqa: E402
from compressor.recipes.schema import CompressionSettings  # noqa: E402
from compressor.runtime.errors import UserError  # noqa: E402
from compressor.statistics.capture import collect_statistics  # noqa: E402

VOCAB = 260  # 256 bytes + end of text, within the tiny model's embedding

TASK_YAML = """task: masa_last_word
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{target}}}}"
metric_list:
  - metric: perplexity
    aggregation: perplexity
    higher_is_better: false
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    model = tiny_model("llama", vocab_size=VOCAB)
    adapter = get_adapter(model)
    windows = random_windows(8, 32, vocab=VOCAB)
    stats = collect_statistics(model, adapter, windows, progress=False)
    outcome = compress_model(
        model, adapter, stats, CompressionSettings(), 0.3, progress=False, windows=windows
    )
    path = tmp_path_factory.mktemp("harness") / "ckpt"
    save_compressed(model, outcome.plan, path, tokenizer=byte_tokenizer(), metadata={"method": "masa"})
    return path


@pytest.fixture(scope="module")
def last_word_task(tmp_path_factory):
    """Last-word prediction on sentences of the test split of the bundled Wikipedia text."""
    from compressor.calibration.sources import load_documents

    folder = tmp_path_factory.mktemp("task")
    text = load_documents("wikipedia", "test").documents[0]
    sentences = [s.strip() for s in text.replace("\n", " ").split(". ") if 40 < len(s.strip()) < 160][:4]
    docs = [{"context": s.rsplit(" ", 1)[0], "target": " " + s.rsplit(" ", 1)[1]} for s in sentences]
    assert len(docs) == 4
    data = folder / "last_word.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    (folder / "masa_last_word.yaml").write_text(TASK_YAML.format(data=data))
    return folder, docs


@pytest.fixture
def offline(monkeypatch):
    import datasets
    import huggingface_hub.constants

    # The libraries read these variables once, at import; the constants are what they consult afterwards.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


def _hand_scores(checkpoint, docs) -> tuple[float, float]:
    """Perplexity over documents (exp of minus the mean log-likelihood) and greedy accuracy, by hand."""
    model = load_compressed(checkpoint)
    tokenizer = byte_tokenizer()
    lls, greedy = [], []
    with torch.no_grad():
        for doc in docs:
            context = tokenizer(doc["context"], add_special_tokens=False)["input_ids"]
            target = tokenizer(doc["target"], add_special_tokens=False)["input_ids"]
            ids = torch.tensor([context + target])
            log_probs = torch.log_softmax(model(input_ids=ids[:, :-1]).logits[0].double(), dim=-1)
            positions = range(len(context) - 1, len(context) + len(target) - 1)
            lls.append(sum(float(log_probs[p, t]) for p, t in zip(positions, target, strict=True)))
            greedy.append(
                all(int(log_probs[p].argmax()) == t for p, t in zip(positions, target, strict=True))
            )
    return math.exp(-sum(lls) / len(lls)), sum(greedy) / len(greedy)


def test_lm_eval_scores_a_local_task_on_the_checkpoint_like_a_hand_computation(
    checkpoint, last_word_task, offline
):
    folder, docs = last_word_task
    scores = run_tasks(str(checkpoint), ["masa_last_word"], include_path=str(folder))
    metrics = scores["masa_last_word"]
    perplexity, accuracy = _hand_scores(checkpoint, docs)
    assert math.isfinite(metrics["perplexity"]) and metrics["perplexity"] > 1
    assert metrics["perplexity"] == pytest.approx(perplexity, rel=1e-4)
    assert metrics["acc"] == pytest.approx(accuracy)


def test_unreachable_task_data_and_unknown_tasks_are_one_line_errors(checkpoint, offline, tmp_path):
    with pytest.raises(UserError) as excinfo:
        run_tasks(str(checkpoint), ["lambada_openai"])
    message = str(excinfo.value)
    assert "cannot be fetched" in message and "--tasks-path" in message and "\n" not in message
    with pytest.raises(UserError, match="unknown lm-eval task 'no_such_task'"):
        run_tasks(str(checkpoint), ["no_such_task"])
    with pytest.raises(UserError, match="not a directory"):
        run_tasks(str(checkpoint), ["masa_last_word"], include_path=str(tmp_path / "missing"))
