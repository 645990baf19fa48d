"""The real paths on a CUDA device, on tiny random models: every method compresses there (whole model where it
can), meets its budget and reloads there to the same logits; a bfloat16 model (the GPU's default dtype) too; the
result agrees with the same run on the CPU; the CLI runs end to end with `--device cuda`.

Skipped where CUDA is absent (CI has no GPU): run `pytest tests/test_cuda.py` on a machine with one.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from conftest import random_windows, tiny_model, tiny_model_dir

from compressor.api.pipeline import compress_model
from compressor.checkpoint import load_compressed, save_compressed
from compressor.math.neurons import block_greedy_order
from compressor.methods import REGISTRY
from compressor.modeling.adapters import get_adapter
from compressor.recipes.schema import CompressionSettings
from compressor.runtime.errors import UserError
from compressor.statistics.capture import collect_statistics

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

DEVICE = torch.device("cuda")
FAMILIES = ["llama", "qwen2", "mistral", "gemma"]
#: The one method with no rule for the MLP (Algorithm 1 balances Q/K and V/O pairs): attention only.
ATTENTION_ONLY = {"masa-paper"}
#: The whole-model methods users compare (the peers of BENCHMARKS.md's table).
COMPARED = ["masa", "svd-llm", "flap", "modegpt"]


def _compress(model, method: str, ratio: float = 0.3, targets: str | None = None, **settings):
    adapter = get_adapter(model)
    windows = random_windows()
    targets = targets or ("attn" if method in ATTENTION_ONLY else "attn,mlp")
    stats = collect_statistics(model, adapter, windows, progress=False, mlp="mlp" in targets)
    settings = CompressionSettings(method=method, targets=targets, **settings)
    return compress_model(model, adapter, stats, settings, ratio, progress=False, windows=windows)


def _logits(model, device=DEVICE) -> torch.Tensor:
    with torch.no_grad():
        return model(random_windows(2, 24, seed=7).to(device)).logits.float()


def test_the_attention_only_method_refuses_the_whole_model():
    """ATTENTION_ONLY above is the method's own rule, not a guess."""
    for method in ATTENTION_ONLY:
        with pytest.raises(UserError, match="no rule for MLP"):
            _compress(tiny_model("llama").to(DEVICE), method, targets="attn,mlp")


@pytest.mark.parametrize("method", sorted(REGISTRY))
@pytest.mark.parametrize("family", FAMILIES)
def test_every_method_compresses_on_cuda_and_reloads_there_identically(family, method, tmp_path):
    model = tiny_model(family, num_attention_heads=8, num_key_value_heads=2).to(DEVICE)
    outcome = _compress(model, method)
    plan = outcome.plan
    assert plan.params_after() <= plan.budget
    assert all(p.device.type == DEVICE.type for p in model.parameters())
    path = save_compressed(model, plan, tmp_path / "ckpt")
    reloaded = load_compressed(path, device=DEVICE)
    assert all(p.device.type == DEVICE.type for p in reloaded.parameters())
    assert (_logits(reloaded) - _logits(model)).abs().max().item() <= 1e-5
    prompt = random_windows(1, 8, seed=3).to(DEVICE)
    kwargs = dict(max_new_tokens=6, use_cache=True, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        assert torch.equal(reloaded.generate(prompt, **kwargs), model.generate(prompt, **kwargs))


@pytest.mark.parametrize("family", FAMILIES)
def test_a_bfloat16_model_compresses_on_cuda_and_reloads_identically(family, tmp_path):
    model = tiny_model(family).to(DEVICE, torch.bfloat16)
    plan = _compress(model, "masa").plan
    assert plan.params_after() <= plan.budget
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    reloaded = load_compressed(save_compressed(model, plan, tmp_path / "ckpt"), device=DEVICE)
    assert all(p.dtype == torch.bfloat16 for p in reloaded.parameters())
    assert torch.equal(_logits(reloaded), _logits(model))


@pytest.mark.parametrize("method", COMPARED)
def test_cuda_and_cpu_compress_to_the_same_model(method):
    """Same statistics' numbers up to summation order: the same plan (ranks and widths), and logits as close as
    float32 arithmetic in another order allows (near-tied neurons could order otherwise; none do here)."""
    original = tiny_model("llama", num_attention_heads=8, num_key_value_heads=2)
    on_cpu, on_cuda = copy.deepcopy(original), copy.deepcopy(original).to(DEVICE)
    plan_cpu, plan_cuda = _compress(on_cpu, method).plan, _compress(on_cuda, method).plan
    assert [(p.layer, p.projection, p.mode, p.rank) for p in plan_cpu.projections] == [
        (p.layer, p.projection, p.mode, p.rank) for p in plan_cuda.projections
    ]
    cpu_logits = _logits(on_cpu, torch.device("cpu"))
    torch.testing.assert_close(_logits(on_cuda).cpu(), cpu_logits, rtol=1e-3, atol=1e-3)


def test_the_block_greedy_neuron_order_is_the_same_on_cuda():
    generator = torch.Generator().manual_seed(0)
    width, hidden, tokens = 512, 96, 4096
    activations = torch.nn.functional.silu(
        torch.randn(tokens, width, generator=generator, dtype=torch.float64)
    )
    autocorr = activations.T @ activations / tokens + 1e-3 * torch.eye(width, dtype=torch.float64)
    down = torch.randn(hidden, width, generator=generator, dtype=torch.float64)
    on_cpu = block_greedy_order(autocorr, down)
    on_cuda = block_greedy_order(autocorr.to(DEVICE), down.to(DEVICE)).cpu()
    assert sorted(on_cuda.tolist()) == list(range(width))
    # float32 on two devices: the first quarter, where the gains are far apart, is the same order
    assert torch.equal(on_cuda[: width // 4], on_cpu[: width // 4])


def test_the_cli_compresses_and_evaluates_on_cuda(tmp_path, capsys):
    from compressor.cli import main

    model = str(tiny_model_dir(tmp_path / "tiny"))
    text = tmp_path / "calib.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 400)
    out = tmp_path / "out"
    common = ["--calib", str(text), "--calib-samples", "4", "--seq-len", "32", "--device", "cuda"]
    main(
        [
            model,
            "--targets",
            "attn,mlp",
            "--ratio",
            "0.2",
            "--ratio-of",
            "model",
            *common,
            "--out",
            str(out),
            "--no-eval",
            "--json",
            "--no-stats-cache",
        ]
    )
    report = json.loads(capsys.readouterr().out)
    assert report["device"].startswith("cuda")
    main(["eval", str(out), "--text", str(text), "--max-tokens", "512", *common[-2:], "--json"])
    scored = json.loads(capsys.readouterr().out)
    assert scored["device"].startswith("cuda") and scored["ppl"] > 1 and scored["kl_to_original"] >= 0


#: The engine-native form (`--native`): whole query heads, narrower MLPs, one global allocation.
NATIVE = dict(attention="heads", mlp="neurons", sharing="none", allocation="global")


@pytest.mark.parametrize("refit", ["calibration", "stream"])
def test_the_native_form_and_its_stream_refit_compress_on_cuda_as_on_the_cpu(refit):
    """`--native`, with `--refit stream` too (added after the first GPU runs): the same widths and heads on both
    devices, logits as close as float32 in another summation order allows, every weight left on the device."""
    original = tiny_model("llama", num_attention_heads=8, num_key_value_heads=2)
    on_cpu, on_cuda = copy.deepcopy(original), copy.deepcopy(original).to(DEVICE)
    plan_cpu = _compress(on_cpu, "masa", refit=refit, **NATIVE).plan
    outcome = _compress(on_cuda, "masa", refit=refit, **NATIVE)
    assert [(p.layer, p.projection, p.mode, p.rank) for p in plan_cpu.projections] == [
        (p.layer, p.projection, p.mode, p.rank) for p in outcome.plan.projections
    ]
    assert all(p.device.type == DEVICE.type for p in on_cuda.parameters())
    assert (refit == "stream") == ("stream_refit" in outcome.seconds)
    cpu_logits = _logits(on_cpu, torch.device("cpu"))
    torch.testing.assert_close(_logits(on_cuda).cpu(), cpu_logits, rtol=1e-3, atol=1e-3)


def test_the_cli_native_layerwise_run_on_cuda_writes_the_in_memory_checkpoint(tmp_path, capsys):
    """`--layerwise` (decoder layers on disk, one at a time on the device) gives the very checkpoint the
    in-memory run gives, on the GPU as on the CPU (tests/test_layerwise.py)."""
    import hashlib

    from compressor.cli import main

    model = str(tiny_model_dir(tmp_path / "tiny"))
    text = tmp_path / "calib.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 400)
    common = [model, "--native", "--targets", "attn,mlp", "--ratio-of", "model", "--ratio", "0.3", "--calib",
              str(text), "--calib-samples", "4", "--seq-len", "32", "--no-eval", "--device", "cuda", "--json"]  # fmt: skip
    main([*common, "--out", str(tmp_path / "in-memory"), "--no-stats-cache"])
    assert json.loads(capsys.readouterr().out)["device"].startswith("cuda")
    main([*common, "--out", str(tmp_path / "layerwise"), "--layerwise", "--offload-dir", str(tmp_path / "o")])
    assert json.loads(capsys.readouterr().out)["layerwise"] is True

    def sha(name: str) -> str:
        return hashlib.sha256((tmp_path / name / "model.safetensors").read_bytes()).hexdigest()

    assert sha("in-memory") == sha("layerwise")


def test_a_byte_budget_measured_on_cuda_chooses_the_cpu_types_and_llama_cpp_runs_the_file(tmp_path):
    """`--size`'s device half: importance weights measured on the GPU, every candidate type's error quantized by
    ggml on the CPU from them, the file written from a model on the GPU: the same types as the CPU's run."""
    pytest.importorskip("xllamacpp")
    from test_gguf_export import byte_tokenizer_gguf, k_quant_model, llama_cpp_log_probs

    from compressor.checkpoint.gguf_export import write_gguf
    from compressor.quantize.budget_chooser import BudgetChooser
    from compressor.quantize.importance import measure_importance

    tokenizer = byte_tokenizer_gguf(tmp_path / "bytes.gguf")
    original = k_quant_model(num_hidden_layers=4)
    ids = torch.randint(0, 96, (4, 32), generator=torch.Generator().manual_seed(0))
    chosen, files = {}, {}
    for device in ("cpu", "cuda"):
        model = copy.deepcopy(original).to(device)
        importance = measure_importance(model, ids.to(device), progress=False, gradient_windows=2)
        chooser = BudgetChooser(model, importance, 1_400_000, progress=False)
        written = write_gguf(model, tokenizer, tmp_path / f"{device}.gguf", importance=importance.weights,
                             choose_types=chooser)  # fmt: skip
        assert written.bytes == chooser.plan.bytes <= 1_400_000
        chosen[device], files[device] = chooser.plan.types, written.path
    assert chosen["cuda"] == chosen["cpu"]
    assert torch.isfinite(llama_cpp_log_probs(files["cuda"], ids[:1])).all()
