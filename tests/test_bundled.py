"""The real path end to end on the bundled SmolLM2-135M and the real Wikipedia text (slow).

One compression per form (tests/bundled_runs.py), shared by the tests of that form; each run's quality is held to
the committed figures (tests/fixtures/bundled-quality.json): the original's perplexity on the same windows, and
the rise inside its committed paired interval, so that a regression of the method fails here."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from bundled_runs import COMMON, FORMS, committed_quality, compress_form

from compressor.api.model_loading import load_model
from compressor.cli import main

pytestmark = pytest.mark.slow
#: The flags of the shared runs' evaluation (tests/bundled_runs.py's COMMON).
EVAL_FLAGS = ["--max-tokens", str(COMMON["eval_max_tokens"]), "--seq-len", str(COMMON["eval_seq_len"])]


def _digest(directory) -> str:
    return hashlib.sha256((Path(directory) / "model.safetensors").read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def bundled():
    return load_model("smollm2-135m", device="cpu", dtype="float32", progress=False)


@pytest.fixture
def compressed_run(bundled_run):
    return bundled_run("attention")


def test_bundled_model_completes_paris(bundled):
    tokenizer, model = bundled.tokenizer, bundled.model
    ids = tokenizer("The capital of France is", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=3, do_sample=False)
    completion = tokenizer.decode(out[0, ids["input_ids"].shape[1] :])
    assert completion.strip().startswith("Paris")
    assert model.config.num_hidden_layers == 30 and model.config.num_key_value_heads == 3


def test_eval_cli_scores_the_original_as_committed(capsys):
    """The original on the shared runs' test windows: the committed perplexity (the scoring path unchanged)."""
    main(["eval", "smollm2-135m", *EVAL_FLAGS, "--json"])
    payload = json.loads(capsys.readouterr().out)
    assert {"ppl", "ppl_ci95", "tokens", "seq_len", "split", "seconds"} <= payload.keys()
    assert payload["ppl"] == pytest.approx(committed_quality()["attention"]["ppl_before"], rel=1e-4)
    assert payload["ppl_ci95"][0] < payload["ppl"] < payload["ppl_ci95"][1]
    seq_len = COMMON["eval_seq_len"]
    assert payload["seq_len"] == seq_len and payload["split"] == "test"
    assert payload["tokens"] == COMMON["eval_max_tokens"] // seq_len * (seq_len - 1)
    # The original itself: nothing to compare with, and the output says so.
    assert "kl_to_original" not in payload and payload["compare_note"].startswith(
        "not a compressed checkpoint"
    )


#: The sharing form's gate runs with the long checks (`make test-long`, CI), keeping `make test` within 10 minutes.
@pytest.mark.parametrize(
    "form", [pytest.param(f, marks=pytest.mark.long) if f == "sharing-atoms" else f for f in sorted(FORMS)]
)
def test_each_form_holds_its_committed_quality(bundled_run, form):
    """The rise of perplexity inside the committed run's paired 95% interval (a rise moved further than its own
    sampling error fails), the original's perplexity, the KL and the achieved ratio as committed."""
    summary, committed = bundled_run(form).summary, committed_quality()[form]
    assert summary["ppl_before"] == pytest.approx(committed["ppl_before"], rel=1e-4)
    rise = summary["ppl_after"] - summary["ppl_before"]
    low, high = committed["rise_ci95"]
    assert low <= rise <= high, f"{form}: rise {rise:.4f} outside the committed [{low:.4f}, {high:.4f}]"
    assert summary["kl_to_original"] == pytest.approx(committed["kl_to_original"], rel=0.05)
    assert summary["achieved_ratio"] == pytest.approx(committed["achieved_ratio"], abs=1e-3)
    assert summary["achieved_ratio"] >= FORMS[form]["ratio"] - 1e-12


def test_compress_cli_end_to_end_writes_the_api_runs_checkpoint(bundled_run, capsys, tmp_path):
    """The command line with the shared attention run's settings, its statistics captured afresh (no cache):
    byte for byte the same checkpoint (same inputs and seed, same checkpoint) and the same numbers."""
    out = tmp_path / "ckpt"
    main(
        [
            "smollm2-135m", "--ratio", "0.2", "--calib-samples", str(FORMS["attention"]["calib_samples"]),
            "--seq-len", str(FORMS["attention"]["seq_len"]), "--eval-seq-len", str(COMMON["eval_seq_len"]),
            "--eval-max-tokens", str(COMMON["eval_max_tokens"]), "--no-stats-cache", "--out", str(out), "--json",
        ]
    )  # fmt: skip
    summary = json.loads(capsys.readouterr().out)
    required = {
        "method", "ratio_requested", "achieved_ratio", "target_params_before", "target_params_after",
        "model_params_before", "model_params_after", "ppl_before", "ppl_after", "seconds", "out",
        "kl_to_original", "top1_agreement", "split",
    }  # fmt: skip
    assert required <= summary.keys()
    assert summary["split"] == "test"
    shared = bundled_run("attention").summary
    assert _digest(out) == _digest(shared["out"])
    for key in ("ppl_before", "ppl_after", "kl_to_original", "top1_agreement", "model_params_after"):
        assert summary[key] == shared[key], key
    # 1 − ⌊0.8·P⌋/P: at least 0.2 up to float rounding (the budget itself is checked exactly below).
    assert summary["achieved_ratio"] >= 0.2 - 1e-12
    assert summary["target_params_after"] <= 0.8 * summary["target_params_before"]
    assert summary["model_params_before"] - summary["model_params_after"] == (
        summary["target_params_before"] - summary["target_params_after"]
    )
    assert {"calibration", "residual_svd"} <= summary["seconds"].keys()
    # The default form (`--sharing none`, chosen on validation): nothing shared, every projection its own
    # whitened factors, or kept whole where the allocation finds factors would cost more than the matrix.
    assert summary["report"]["effective_settings"]["sharing"] == "none"
    assert not summary["report"]["sharing"]["bases"]
    projections = json.loads((out / "report.json").read_text())["plan"]["projections"]
    assert {pp["mode"] for pp in projections} <= {"lowrank", "dense"}
    assert any(pp["mode"] == "lowrank" for pp in projections)
    assert (out / "masa_config.json").is_file()


def test_checkpoint_round_trip_with_both_loaders(compressed_run):
    from transformers import AutoModelForCausalLM

    from compressor.checkpoint import load_compressed

    out = compressed_run.summary["out"]
    ids = compressed_run.tokenizer("The capital of France is Paris. It is", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        expected = compressed_run.model(input_ids=ids).logits
        ours = load_compressed(out)
        remote = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
        reloaded_logits = [reloaded(input_ids=ids).logits for reloaded in (ours, remote)]
        # The bound is 1e-5 in fp32. Both loaders copy tensors out of the file mapping into aligned
        # memory (MKL rounds differently on misaligned operands: 1.9e-5 before), so they agree bit for bit.
        for logits in reloaded_logits:
            assert (logits - expected).abs().max().item() <= 1e-5
            assert torch.equal(logits, expected)
        for reloaded in (ours, remote):
            assert (
                sum(p.numel() for p in reloaded.parameters()) == compressed_run.summary["model_params_after"]
            )
        # generation with a KV cache works on the reloaded model
        generated = ours.generate(ids, max_new_tokens=5, do_sample=False, use_cache=True)
        assert generated.shape[1] == ids.shape[1] + 5


def test_loading_the_checkpoints_tokenizer_logs_no_warning(compressed_run):
    """transformers, reading config.json's `masa_llama` type for the tokenizer, warns that it instantiates "a
    model of type ``" (with the bundled model's tokenizer, not with the tests' tiny ones): `eval CHECKPOINT`
    must not show a user that."""
    import logging

    from compressor.checkpoint import load_compressed

    class Collect(logging.Handler):
        def __init__(self):
            super().__init__(logging.WARNING)
            self.records: list[str] = []

        def emit(self, record):
            self.records.append(record.getMessage())

    handler = Collect()
    library = logging.getLogger("transformers")  # the library's root: it does not propagate further
    library.addHandler(handler)
    try:
        load_compressed(compressed_run.summary["out"], with_tokenizer=True)
    finally:
        library.removeHandler(handler)
    assert not [m for m in handler.records if "model of type" in m], handler.records


def test_eval_of_the_checkpoint_matches_the_run(compressed_run, capsys):
    out = compressed_run.summary["out"]
    main(["eval", out, *EVAL_FLAGS, "--json"])
    payload = json.loads(capsys.readouterr().out)
    summary = compressed_run.summary
    assert f"{payload['ppl']:.4g}" == f"{summary['ppl_after']:.4g}"
    # Compared with the checkpoint's recorded source (the bundled model), on the same test windows as the run.
    keys = {"ppl", "ppl_ci95", "tokens", "seq_len", "split", "seconds", "kl_to_original", "top1_agreement"}
    assert keys <= payload.keys() and payload["split"] == "test"
    assert payload["kl_to_original"] == pytest.approx(summary["kl_to_original"], rel=1e-6)
    assert payload["top1_agreement"] == pytest.approx(summary["top1_agreement"], rel=1e-9)
    assert payload["ppl_ci95"] == pytest.approx(summary["quality"]["ppl_after_ci95"], rel=1e-9)
    main(["eval", out, "--max-tokens", "512", "--seq-len", "256", "--json", "--no-compare"])
    assert "kl_to_original" not in json.loads(capsys.readouterr().out)


def test_checkpoint_attention_bytes_on_disk_shrink(compressed_run):
    from safetensors import safe_open

    out = Path(compressed_run.summary["out"])
    summary = compressed_run.summary
    attention_bytes = 0
    for file in out.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            for key in f.keys():
                if ".self_attn." in key or key.startswith("masa."):
                    attention_bytes += _numel(f, key) * 4
    assert attention_bytes == summary["target_params_after"] * 4
    assert attention_bytes <= (1 - 0.2) * summary["target_params_before"] * 4
    # The default form has no KL groups to draw: the report and the ranks (basis sizes included).
    assert (out / "report.json").is_file() and (out / "ranks.png").is_file()


def _numel(handle, key: str) -> int:
    shape = handle.get_slice(key).get_shape()
    n = 1
    for d in shape:
        n *= d
    return n


def test_export_dense_cli_writes_a_plain_checkpoint_that_is_not_smaller(compressed_run, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "dense"
    main(["export-dense", compressed_run.summary["out"], str(out), "--json"])
    payload = json.loads(capsys.readouterr().out)
    assert payload["dense_bytes"] > payload["compressed_bytes"]
    dense = AutoModelForCausalLM.from_pretrained(out)
    ids = compressed_run.tokenizer("Paris is the capital of", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        difference = (dense(input_ids=ids).logits - compressed_run.model(input_ids=ids).logits).abs().max()
    assert difference.item() <= 1e-4


def test_the_whole_model_end_to_end(bundled_run):
    """`--targets attn,mlp --ratio-of model` on the real model: MLP statistics, the budget over every parameter, a
    checkpoint that reloads to the same logits and the planned parameter count, narrower plain MLPs."""
    from compressor.checkpoint import load_compressed

    run = bundled_run("whole-model")
    summary = run.summary
    assert summary["targets"] == "attn,mlp" and summary["ratio_of"] == "model"
    # 30 layers × (q/k/v/o + gate/up/down) of SmolLM2-135M: 106,168,320 numbers before.
    assert summary["target_params_before"] == 106_168_320
    removed = summary["model_params_before"] - summary["model_params_after"]
    assert removed == summary["target_params_before"] - summary["target_params_after"]
    assert removed >= 0.2 * summary["model_params_before"] - 1
    reloaded = load_compressed(summary["out"])
    ids = run.tokenizer("The capital of France is Paris. It is", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=ids).logits, run.model(input_ids=ids).logits)
    assert sum(p.numel() for p in reloaded.parameters()) == summary["model_params_after"]
    # The MLP's default form keeps a subset of neurons: plain, narrower Linear layers in some layer.
    widths = [layer.mlp.down_proj.in_features for layer in reloaded.model.layers]
    assert min(widths) < 1536 and all(w <= 1536 for w in widths)
    assert all(
        layer.mlp.gate_proj.out_features == layer.mlp.down_proj.in_features for layer in reloaded.model.layers
    )


@pytest.mark.long
def test_layerwise_run_writes_the_same_checkpoint_and_measures_the_same(compressed_run, tmp_path):
    """`--layerwise` on the real model and text: the bytes of the in-memory run's checkpoint, and its numbers."""
    out = tmp_path / "layerwise"
    run = compress_form("attention", out, layerwise=True, offload_dir=str(tmp_path / "offload"))
    assert _digest(out) == _digest(compressed_run.summary["out"])
    expected = compressed_run.summary
    for key in ("ppl_before", "ppl_after", "kl_to_original"):
        assert run.summary[key] == pytest.approx(expected[key], rel=1e-5)
    assert run.summary["top1_agreement"] == expected["top1_agreement"]
    assert run.summary["model_params_after"] == expected["model_params_after"]
    assert list((tmp_path / "offload").iterdir()) == []


@pytest.mark.long
def test_a_local_copy_of_the_bundled_folder_writes_the_aliass_checkpoint(tmp_path, capsys):
    """A user's own folder, no recipe: the settings chosen on validation follow the model's shapes (256 calibration
    windows with the MLP targeted, the neuron order by its width), so a copy of the bundled model's folder writes
    the checkpoint `smollm2-135m` writes, byte for byte. Windows of 32 tokens keep the 256 windows' capture short."""
    import os
    import shutil

    from compressor.api.model_loading import bundled_model_dir, resolve_model

    folder = tmp_path / "my-model"
    shutil.copytree(
        bundled_model_dir(resolve_model("smollm2-135m"), progress=False), folder, copy_function=os.link
    )
    (folder / ".complete").unlink(missing_ok=True)  # the cache's marker: a user's folder has none
    flags = ["--targets", "attn,mlp", "--ratio", "0.2", "--ratio-of", "model", "--seq-len", "32"]
    summaries = {}
    for name, model in (("alias", "smollm2-135m"), ("folder", str(folder))):
        out = tmp_path / name
        main([model, *flags, "--no-eval", "--no-stats-cache", "--out", str(out), "--json"])
        summaries[name] = json.loads(capsys.readouterr().out)
        assert summaries[name]["report"]["effective_settings"]["neuron_order"] == "greedy"
    windows = [summaries[name]["settings"]["calibration"]["samples"] for name in ("alias", "folder")]
    assert windows == [256, 256]
    assert _digest(tmp_path / "alias") == _digest(tmp_path / "folder")
