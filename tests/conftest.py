"""Shared fixtures: tiny random decoder models built in-process (no downloads), per family."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

#: Every test runs on this many threads, whatever the machine (CI's has 2 cores): float32 reductions, and so the
#: last bits of every number, depend on how the work is split; subprocesses inherit it through the environment.
THREADS = 2
for _variable in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ[_variable] = str(THREADS)
torch.set_num_threads(THREADS)

#: The rule the autouse fixture below enforces.
FAST_TESTS_RULE = (
    "fast tests must not load the bundled SmolLM2-135M's weights (on a fresh machine its one-time GGUF "
    "conversion is slow and draws progress bars on stderr): use a tiny random model directory "
    "(conftest.tiny_model_dir) or mark the test @pytest.mark.slow"
)

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=128,
)


def tiny_config(family: str, **overrides):
    import transformers

    kwargs = {**TINY, **overrides}
    if family == "llama":
        return transformers.LlamaConfig(**kwargs)
    if family == "qwen2":
        return transformers.Qwen2Config(**kwargs)
    if family == "gemma":
        return transformers.GemmaConfig(head_dim=16, **kwargs)
    if family == "mistral":
        return transformers.MistralConfig(**kwargs)
    if family in ("qwen3", "olmo2", "gemma2", "gemma3_text"):  # the other families the tool names
        return transformers.CONFIG_MAPPING[family](head_dim=16, **kwargs)
    # Their defaults name token ids beyond a tiny vocabulary (SmolLM3's 128004, Phi-3's 32000).
    ids = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
    if family == "smollm3":
        return transformers.CONFIG_MAPPING[family](head_dim=16, **{**ids, **kwargs})
    if family == "phi3":  # fused qkv_proj and gate_up_proj; head_dim is hidden_size / heads
        return transformers.Phi3Config(**{**ids, **kwargs})
    if family == "mixtral":  # mixture of experts: 4 experts, 2 per token
        return transformers.MixtralConfig(**{"num_local_experts": 4, "num_experts_per_tok": 2, **kwargs})
    if family == "qwen3_moe":  # mixture of experts with per-head q/k norms
        moe = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "head_dim": 16}
        return transformers.Qwen3MoeConfig(**{**moe, **kwargs})
    raise ValueError(family)


def tiny_model(family: str = "llama", seed: int = 0, **overrides):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, **overrides))
    return model.eval()


def byte_tokenizer():
    """A byte-level BPE without merges: any text, 256 ids, plus an end-of-text token (id 256; no downloads)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {symbol: i for i, symbol in enumerate(sorted(alphabet))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend)
    tokenizer.add_special_tokens({"eos_token": "<|endoftext|>"})
    return tokenizer


def tiny_model_dir(path, family: str = "llama", seed: int = 0, **overrides):
    """A tiny random model saved as a local Hugging Face directory with a byte-level tokenizer: what a user's
    own model folder looks like, for CLI and `load_model` tests that must not touch the bundled model."""
    overrides.setdefault("vocab_size", 260)  # the byte tokenizer's 256 bytes and its end-of-text token
    tiny_model(family, seed, **overrides).save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return path


_running: dict = {"item": None}


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Note the test about to run, before any of its fixtures (module- or session-scoped ones included)."""
    _running["item"] = item


@pytest.fixture(autouse=True, scope="session")
def no_bundled_weights_in_fast_tests():
    """Outside `@pytest.mark.slow`, loading (or converting) the bundled model's weights fails the test.

    Every load of the bundled weights goes through `compressor.api.model_loading.bundled_model_dir` (`load_model` calls it
    for the bundled model, as do `eval --tasks` and the benchmarks; all look it up on the module at call time),
    so it is replaced here for the whole session by a guard that lets slow tests through and fails any other.
    Reading the bundled model's config only (`read_config`) stays allowed. The guard decides by the test that
    is running (noted by `pytest_runtest_setup` above), so a module-scoped fixture that loads the model is
    caught too. It raises pytest's `Failed`, a BaseException: the CLI's error handling (`except Exception`)
    does not turn it into a one-line user error.
    """
    import compressor.api.model_loading

    original = compressor.api.model_loading.bundled_model_dir

    def guarded(*args, **kwargs):
        item = _running["item"]
        if item is not None and item.get_closest_marker("slow") is not None:
            return original(*args, **kwargs)
        where = item.nodeid if item is not None else "a test"
        pytest.fail(f"{where} loads the bundled model's weights: {FAST_TESTS_RULE}")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(compressor.api.model_loading, "bundled_model_dir", guarded)
        yield


@pytest.fixture
def tiny_llama():
    return tiny_model("llama")


def random_windows(n: int = 8, seq_len: int = 32, vocab: int = 256, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n, seq_len), generator=g)


def plant_identical_layers(model, projections) -> None:
    """Copy layer 0's weights of `projections` into every other layer: a sharing one atom holds exactly."""
    from compressor.modeling.adapters import get_adapter

    adapter = get_adapter(model)
    for layer in range(1, adapter.num_layers):
        for p in projections:
            adapter.projection(layer, p).weight.data.copy_(adapter.projection(0, p).weight.data)


def relative_whitened_error(original, compressed, stats, projections) -> float:
    """Σ over layers and `projections` of ‖(W − Ŵ) S‖² / ‖W S‖², computed independently of the pipeline as
    tr(E C Eᵀ) / tr(W C Wᵀ) with C = S Sᵀ the input autocorrelation (exact when no damping was needed)."""
    from compressor.modeling.adapters import INPUT_OF, get_adapter
    from compressor.modeling.remote_code.masa_modules import dense_weight

    before, after = get_adapter(original), get_adapter(compressed)
    total = 0.0
    for layer in range(before.num_layers):
        for p in projections:
            c = stats.autocorr(INPUT_OF[p], layer)
            w = before.projection(layer, p).weight.detach().double()
            e = w - dense_weight(after.projection(layer, p)).detach().double()
            total += float(torch.trace(e @ c @ e.T) / torch.trace(w @ c @ w.T))
    return total


def reloaded_identically(model, path, seq_len: int = 12) -> list:
    """Both loaders of a saved checkpoint (ours and transformers' remote code): each reproduces `model`'s
    logits and holds as many parameters (a shared tensor stored once is loaded once). Returns the two models."""
    from transformers import AutoModelForCausalLM

    from compressor.checkpoint import load_compressed

    x = random_windows(2, seq_len)
    reloaded = [load_compressed(path), AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)]
    with torch.no_grad():
        expected = model(x).logits
        for other in reloaded:
            torch.testing.assert_close(other(x).logits, expected, rtol=0, atol=1e-5)
            assert sum(p.numel() for p in other.parameters()) == sum(p.numel() for p in model.parameters())
    return reloaded


@pytest.fixture(scope="session")
def bundled_run(tmp_path_factory):
    """`bundled_run(form)`: the bundled model compressed in `form` (tests/bundled_runs.py), once per session, shared
    by every end-to-end test of that form. Only slow tests may ask for it (it loads the bundled weights)."""
    from bundled_runs import compress_form

    runs: dict = {}

    def get(form: str):
        if form not in runs:
            runs[form] = compress_form(form, tmp_path_factory.mktemp(form) / "ckpt")
        return runs[form]

    return get


def cache_of_its_own(path: Path, shared: tuple[str, ...] = ("models", "text", "zero-shot", "rates")) -> Path:
    """`benchmarks.suite.common.cache_of_its_own`, with the real cache's rates folder made first, so that the rates
    a test's run measures are linked in and kept."""
    from benchmarks.suite.common import cache_of_its_own as fresh_cache
    from compressor.runtime.cache_root import cache_dir

    (cache_dir() / "rates").mkdir(parents=True, exist_ok=True)
    return fresh_cache(path, shared)


@pytest.fixture(scope="session")
def llama_cpp_sources() -> Path:
    """The llama.cpp sources the installed xllamacpp vendors (its sdist from the registry, unpacked once into the
    cache): the converter and the command-line tools the long tests compare with."""
    from benchmarks.engines.llama_cpp_tools import llama_cpp_sources

    return llama_cpp_sources()


@pytest.fixture(scope="session")
def llama_cpp_tools(llama_cpp_sources) -> Path:
    """`llama-quantize` and `llama-imatrix` built from those sources (about 4 minutes on 2 cores, once per
    version): the folder holding both."""
    from benchmarks.engines.llama_cpp_tools import llama_cpp_tools

    try:
        return llama_cpp_tools()
    except RuntimeError as error:
        pytest.fail(str(error))
