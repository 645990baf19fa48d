"""`--layerwise`: the layer-sequential pipeline over a model whose decoder layers stay on disk gives the very
checkpoint in-memory compression gives (same bytes), the same loss sensitivity and the same evaluation, and it
leaves nothing behind; its pieces (onloading, spilling finished layers) keep the model as it was."""

from __future__ import annotations

import collections
import hashlib
import json
import math
from pathlib import Path

import pytest
import torch
from conftest import random_windows, tiny_model, tiny_model_dir

from compressor.api.pipeline import compress_model
from compressor.checkpoint import save_compressed
from compressor.evaluation.perplexity import evaluate_against
from compressor.modeling.adapters import MLP_PROJECTIONS, PROJECTIONS, get_adapter
from compressor.modeling.offload import FusedParts, load_offloaded
from compressor.modeling.remote_code.masa_modules import LowRankLinear
from compressor.recipes.schema import CompressionSettings
from compressor.statistics.block_influence import block_influence
from compressor.statistics.capture import collect_statistics
from compressor.statistics.layer_evaluation import evaluate_layerwise, spill_original_outputs
from compressor.statistics.layer_stream import collect_sensitivity_layerwise, collect_statistics_layerwise

CPU = torch.device("cpu")


def _sha(path: Path) -> str:
    return hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()


def _offloaded(tmp_path: Path, family: str = "llama", **overrides):
    source = tmp_path / "source"
    tiny_model(family, num_hidden_layers=overrides.pop("layers", 6), **overrides).save_pretrained(source)
    return source, load_offloaded(str(source), {}, CPU, torch.float32, tmp_path / "offload")


def _both_ways(
    tmp_path: Path, settings: CompressionSettings, family: str = "llama", autocast=None, **overrides
):
    """The same compression in memory and layer by layer (the forward passes in `autocast`'s dtype, if given):
    (in-memory statistics, layerwise statistics, the offloaded model)."""
    source, om = _offloaded(tmp_path, family, **overrides)
    windows = random_windows(8, 32)
    mlp = settings.targets != "attn"
    model = type(om.model).from_pretrained(source, dtype=torch.float32).eval()
    adapter = get_adapter(model)
    stats = collect_statistics(model, adapter, windows, progress=False, mlp=mlp, autocast=autocast)
    in_memory = compress_model(model, adapter, stats, settings, 0.3, progress=False, windows=windows)
    save_compressed(model, in_memory.plan, tmp_path / "in-memory")

    sensitivity = settings.sensitivity_samples if settings.allocation == "global-loss" else 0
    spilled, tail = collect_statistics_layerwise(
        om, windows, tmp_path / "spill" / "stats", progress=False, mlp=mlp, sensitivity_windows=sensitivity,
        autocast=autocast,
    )  # fmt: skip
    if tail is not None:
        projections = PROJECTIONS + (MLP_PROJECTIONS if mlp else ())
        spilled.sensitivity = collect_sensitivity_layerwise(
            om, tail, tmp_path / "spill" / "stats", projections, progress=False, autocast=autocast
        )
    layerwise = compress_model(
        om.model, om.adapter, spilled, settings, 0.3, progress=False, windows=windows, offloaded=om,
        spill_dir=tmp_path / "spill",
    )  # fmt: skip
    on_disk = collections.ChainMap(layerwise.compressed, om.weights)
    save_compressed(om.model, layerwise.plan, tmp_path / "layerwise", on_disk=on_disk)
    return stats, spilled, om


@pytest.mark.parametrize(
    "family, update",
    [
        ("llama", {}),  # the default: k/v input bases over runs of 4 layers, loss-aware allocation
        ("llama", {"sharing": "atoms", "allocation": "global-relative"}),
        ("llama", {"sharing": "none", "targets": "attn,mlp"}),
        # --native: whole query heads and narrower MLPs in multiples of 32
        ("llama", {"sharing": "none", "targets": "attn,mlp", "attention": "heads", "width_multiple": 32}),
        ("qwen2", {"method": "svd-llm"}),  # q/k/v biases, read from the original files
        ("mistral", {"method": "basis-sharing"}),
        ("gemma", {"method": "shared-mean", "groups": 2}),
        ("llama", {"method": "flap", "targets": "attn,mlp"}),  # reads the inputs' means
        # fused qkv_proj and gate_up_proj in the files: each part read as its rows of the fused tensor
        ("phi3", {"sharing": "none", "targets": "attn,mlp"}),
        # each layer's statistics on the inputs its compressed predecessors give, a group's atoms shared
        ("mistral", {"statistics": "sequential", "sharing": "atoms", "groups": 2}),
        # --native's default: o_proj and down_proj refit on the compressed model's own stream
        (
            "qwen2",
            {
                "sharing": "none",
                "targets": "attn,mlp",
                "attention": "heads",
                "mlp": "neurons",
                "width_multiple": 32,
                "refit": "stream",
            },
        ),  # fmt: skip
        ("qwen2", {"method": "modegpt", "targets": "attn,mlp"}),  # measures the block influence
    ],
)
def test_layerwise_checkpoint_is_byte_for_byte_the_in_memory_one(tmp_path, family, update):
    settings = CompressionSettings().model_copy(update=update)
    stats, spilled, _ = _both_ways(tmp_path, settings, family)
    assert spilled.input_means.keys() == stats.input_means.keys()
    for kind, means in stats.input_means.items():
        assert torch.equal(means, spilled.input_means[kind])
    for layer in range(spilled.num_layers):
        for kind in ("attn", "o"):
            assert torch.equal(stats.autocorr(kind, layer), spilled.autocorr(kind, layer))
    assert torch.equal(stats.block_output_means, spilled.block_output_means)
    assert _sha(tmp_path / "in-memory") == _sha(tmp_path / "layerwise")
    in_memory = json.loads((tmp_path / "in-memory" / "masa_config.json").read_text())
    layerwise = json.loads((tmp_path / "layerwise" / "masa_config.json").read_text())
    assert in_memory["layout"] == layerwise["layout"] and in_memory["counts"] == layerwise["counts"]


def test_layerwise_block_influence_is_the_in_memory_one_bit_for_bit(tmp_path):
    """MoDeGPT's block influence with the layers on disk: the same forward passes, one window each."""
    # Gemma: its embeddings are scaled before the first layer, which the stream's recording must keep.
    source, om = _offloaded(tmp_path, "gemma")
    model = type(om.model).from_pretrained(source, dtype=torch.float32).eval()
    windows = random_windows(3, 32)
    expected, _ = block_influence(get_adapter(model), windows, progress=False)
    influence, _ = block_influence(om.adapter, windows, held=om.onloaded, progress=False)
    assert torch.equal(influence, expected) and len(set(influence.tolist())) == len(influence)


def test_layerwise_loss_sensitivity_equals_one_backward_pass(tmp_path):
    stats, spilled, om = _both_ways(tmp_path, CompressionSettings(sensitivity_samples=4))
    # No weight took a gradient (the tied embeddings would have), and the flags are as they were.
    assert all(p.grad is None and p.requires_grad for p in om.model.parameters() if p.device.type != "meta")
    assert spilled.sensitivity.weights.keys() == stats.sensitivity.weights.keys()
    for key, value in stats.sensitivity.weights.items():
        assert spilled.sensitivity[key] == pytest.approx(value, rel=1e-9)
    assert (spilled.sensitivity.windows, spilled.sensitivity.tokens) == (4, 4 * 32)
    # The spilled layer inputs are consumed (deleted) by the backward pass.
    assert not list((tmp_path / "spill" / "stats").glob("inputs-*"))


def test_layerwise_bfloat16_forward_passes_give_the_in_memory_statistics_and_checkpoint(tmp_path):
    """`--calib-precision` computes the same way layer by layer: the statistics bit for bit, the loss sensitivity
    to rounding, the checkpoint byte for byte (the model 20% smaller's targets, the loss-aware allocation)."""
    settings = CompressionSettings(targets="attn,mlp", sensitivity_samples=4)
    stats, spilled, _ = _both_ways(tmp_path, settings, autocast=torch.bfloat16)
    assert stats.autocast == spilled.autocast == torch.bfloat16
    for layer in range(spilled.num_layers):
        for kind in ("attn", "o", "mlp", "down"):
            assert torch.equal(stats.autocorr(kind, layer), spilled.autocorr(kind, layer))
    for key, value in stats.sensitivity.weights.items():
        assert spilled.sensitivity[key] == pytest.approx(value, rel=1e-6)
    assert _sha(tmp_path / "in-memory") == _sha(tmp_path / "layerwise")


def test_a_fused_projections_parts_are_read_as_its_rows_under_their_own_names():
    store = {"l.0.qkv_proj.weight": torch.arange(12.0).view(6, 2), "l.0.qkv_proj.bias": torch.arange(6.0),
             "l.0.norm.weight": torch.ones(2)}  # fmt: skip
    parts = FusedParts(store, {"qkv_proj": {"q_proj": 2, "k_proj": 1, "v_proj": 3}})
    assert set(parts) == {"l.0.norm.weight"} | {
        f"l.0.qkv_proj.{p}.{kind}" for p in ("q_proj", "k_proj", "v_proj") for kind in ("weight", "bias")
    }
    assert len(parts) == len(set(parts)) == 7
    assert torch.equal(parts["l.0.qkv_proj.k_proj.weight"], store["l.0.qkv_proj.weight"][2:3])
    assert torch.equal(parts["l.0.qkv_proj.v_proj.bias"], torch.tensor([3.0, 4.0, 5.0]))
    assert "l.0.qkv_proj.weight" not in parts and torch.equal(parts["l.0.norm.weight"], torch.ones(2))


def test_onloaded_materialises_a_layer_and_gives_back_the_same_meta_tensors(tmp_path):
    source, om = _offloaded(tmp_path)
    reference = type(om.model).from_pretrained(source, dtype=torch.float32)
    layer = om.adapter.layers[2]
    before = {name: p for name, p in layer.named_parameters()}
    assert all(p.device.type == "meta" for p in before.values())
    with om.onloaded(2) as onloaded:
        q = onloaded.self_attn.q_proj.weight
        assert q.device == CPU and torch.equal(q, reference.model.layers[2].self_attn.q_proj.weight)
    after = {name: p for name, p in layer.named_parameters()}
    assert after.keys() == before.keys() and all(after[k] is before[k] for k in before)
    # transformers kernelizes layers that device_map places on a GPU with kernels fetched from the Hub, offline
    # an error (seen on an H200: tests/test_cuda.py); the tool loads with them off wherever it places the model
    assert om.model.use_kernels is False


def test_a_shared_tensor_stays_one_tensor_through_spilling_and_onloading(tmp_path):
    from compressor.methods.offloaded_context import CompressedLayers

    _, om = _offloaded(tmp_path, layers=2)
    shared = torch.nn.Parameter(torch.randn(3, 64), requires_grad=False)
    for layer in (0, 1):
        module = LowRankLinear.from_factors(torch.randn(64, 3), shared, None, torch.float32, CPU)
        module.lowrank_b = shared  # both layers' q_proj read the same tensor
        om.adapter.set_projection(layer, "q_proj", module)
    store = CompressedLayers(tmp_path / "compressed", om, ("q_proj",))
    store.spill([0, 1])
    b0, b1 = (om.adapter.projection(i, "q_proj").lowrank_b for i in (0, 1))
    assert b0 is b1 and b0.device.type == "meta"  # one (meta) Parameter: the checkpoint still sees the tie
    assert torch.equal(store["model.layers.1.self_attn.q_proj.lowrank_b"], shared)
    with om.onloaded(1, store) as layer:
        assert torch.equal(layer.self_attn.q_proj.lowrank_b, shared)
    assert om.adapter.projection(1, "q_proj").lowrank_b is b0
    with pytest.raises(AssertionError, match="already written to disk"):
        store.check_open(0)


def test_layerwise_evaluation_equals_evaluate_against(tmp_path):
    source, om = _offloaded(tmp_path)
    calibration, windows, settings = (
        random_windows(8, 32),
        random_windows(5, 24, seed=3),
        CompressionSettings(),
    )
    reference = type(om.model).from_pretrained(source, dtype=torch.float32).eval()
    model = type(om.model).from_pretrained(source, dtype=torch.float32).eval()
    adapter = get_adapter(model)
    stats = collect_statistics(model, adapter, calibration, progress=False)
    compress_model(model, adapter, stats, settings, 0.3, progress=False, windows=calibration)
    ref, scored = evaluate_against(reference, {"compressed": model}, windows, progress=False)
    after, faith = scored["compressed"]

    spill_original_outputs(om, windows, tmp_path / "eval", chunk_windows=2, progress=False)
    spilled, tail = collect_statistics_layerwise(
        om, calibration, tmp_path / "stats", progress=False, sensitivity_windows=settings.sensitivity_samples
    )
    spilled.sensitivity = collect_sensitivity_layerwise(om, tail, tmp_path / "stats", PROJECTIONS, False)
    outcome = compress_model(
        om.model, om.adapter, spilled, settings, 0.3, progress=False, windows=calibration, offloaded=om,
        spill_dir=tmp_path,
    )  # fmt: skip
    before2, after2, faith2 = evaluate_layerwise(
        om, windows, outcome.compressed, tmp_path / "eval", chunk_windows=2, progress=False
    )
    assert before2.window_nll == pytest.approx(ref.window_nll, rel=1e-6)
    assert after2.window_nll == pytest.approx(after.window_nll, rel=1e-6)
    assert (before2.ppl, after2.ppl) == (pytest.approx(ref.ppl, rel=1e-6), pytest.approx(after.ppl, rel=1e-6))
    assert faith2.kl_to_original == pytest.approx(faith.kl_to_original, rel=1e-5, abs=1e-9)
    assert faith2.top1_agreement == faith.top1_agreement
    # the per-window KL (paired intervals) and the per-token percentiles, as llama.cpp reports them
    assert (
        faith2.window_kl == pytest.approx(faith.window_kl, rel=1e-5, abs=1e-9) and len(faith.window_kl) == 5
    )
    assert faith2.kl_percentiles == pytest.approx(faith.kl_percentiles, rel=1e-5, abs=1e-9)


@pytest.mark.parametrize(
    "form",
    [
        [],
        ["--native", "--targets", "attn,mlp", "--ratio-of", "model", "--refit", "calibration"],
        ["--native", "--targets", "attn,mlp", "--ratio-of", "model"],  # the stream refit, --native's default
        ["--method", "modegpt", "--targets", "attn,mlp"],
    ],
)
def test_cli_layerwise_writes_the_in_memory_checkpoint_and_leaves_no_temporary_files(tmp_path, capsys, form):
    """The default form; `--native` (whole query heads, narrower MLPs in multiples of 32) with either refit; a
    peer that measures its own statistics of the model (MoDeGPT's block influence)."""
    from compressor.cli import main

    model = str(tiny_model_dir(tmp_path / "tiny"))
    text = tmp_path / "calib.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 400)
    common = [model, "--ratio", "0.3", "--calib", str(text), "--calib-samples", "4", "--seq-len", "32",
              "--no-eval", *form]  # fmt: skip
    main([*common, "--out", str(tmp_path / "in-memory"), "--json", "--no-stats-cache"])
    capsys.readouterr()
    offload = tmp_path / "offload"
    main(
        [
            *common,
            "--out",
            str(tmp_path / "layerwise"),
            "--json",
            "--layerwise",
            "--offload-dir",
            str(offload),
        ]
    )
    summary = json.loads(capsys.readouterr().out)
    assert summary["layerwise"] is True
    assert _sha(tmp_path / "in-memory") == _sha(tmp_path / "layerwise")
    assert summary["model_params_before"] - summary["model_params_after"] == (
        summary["target_params_before"] - summary["target_params_after"]
    )
    assert list(offload.iterdir()) == []  # the run's temporary folder is gone


def test_too_little_disk_for_the_temporary_files_is_refused_before_any_pass(tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    from compressor.api.layerwise import check_spill_disk, spill_disk_needed
    from compressor.methods import ModelShape
    from compressor.runtime.errors import UserError, cli_wording

    _, om = _offloaded(tmp_path)
    shape = ModelShape.from_adapter(om.adapter, PROJECTIONS)
    common = dict(per_layer=16 * 32, final=8 * 32, kinds=("attn", "o"))
    needed = spill_disk_needed(om, shape, 4, **common)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**12, 10**12 - 10**6, 10**6))
    with pytest.raises(UserError, match="pass an offload_dir on a larger disk"):
        check_spill_disk(tmp_path, needed)
    with cli_wording(), pytest.raises(UserError, match="pass --offload-dir on a larger disk"):
        check_spill_disk(tmp_path, needed)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**12, 0, 10**12))
    check_spill_disk(tmp_path, needed)
    # The stream refit writes o_proj and down_proj again: at most their whole size, in every layer.
    refits = om.adapter.num_layers * sum(
        math.prod(om.adapter.geometry.shape(p)) for p in ("o_proj", "down_proj")
    )
    grown = spill_disk_needed(om, shape, 4, **common, stream_refit=True) - needed
    assert grown == pytest.approx(1.05 * 4 * refits, abs=1)


def test_device_map_puts_every_decoder_layer_on_disk_and_the_rest_on_the_device():
    from accelerate import init_empty_weights
    from conftest import tiny_config
    from transformers import AutoModelForCausalLM

    from compressor.modeling.offload import layer_device_map

    with init_empty_weights():
        skeleton = AutoModelForCausalLM.from_config(tiny_config("llama", num_hidden_layers=3))
    device_map = layer_device_map(skeleton, CPU)
    assert {k: v for k, v in device_map.items() if v == "disk"} == {
        f"model.layers.{i}": "disk" for i in range(3)
    }
    assert {k for k, v in device_map.items() if v == "cpu"} == {
        "model.embed_tokens", "model.norm", "model.rotary_emb", "lm_head",
    }  # fmt: skip
