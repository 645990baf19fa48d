"""Shared fixtures: tiny random decoder models built in-process (no downloads), per family."""

from __future__ import annotations

import pytest
import torch

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
    raise ValueError(family)


def tiny_model(family: str = "llama", seed: int = 0, **overrides):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, **overrides))
    return model.eval()


@pytest.fixture
def tiny_llama():
    return tiny_model("llama")


def random_windows(n: int = 8, seq_len: int = 32, vocab: int = 256, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n, seq_len), generator=g)


def plant_identical_layers(model, projections) -> None:
    """Copy layer 0's weights of `projections` into every other layer: a sharing one atom holds exactly."""
    from compressor.adapters import get_adapter

    adapter = get_adapter(model)
    for layer in range(1, adapter.num_layers):
        for p in projections:
            adapter.projection(layer, p).weight.data.copy_(adapter.projection(0, p).weight.data)


def relative_whitened_error(original, compressed, stats, projections) -> float:
    """Σ over layers and `projections` of ‖(W − Ŵ) S‖² / ‖W S‖², computed independently of the pipeline as
    tr(E C Eᵀ) / tr(W C Wᵀ) with C = S Sᵀ the input autocorrelation (exact when no damping was needed)."""
    from compressor.adapters import INPUT_OF, get_adapter
    from compressor.modules import dense_weight

    before, after = get_adapter(original), get_adapter(compressed)
    total = 0.0
    for layer in range(before.num_layers):
        for p in projections:
            c = stats.autocorr(INPUT_OF[p], layer)
            w = before.projection(layer, p).weight.detach().double()
            e = w - dense_weight(after.projection(layer, p)).detach().double()
            total += float(torch.trace(e @ c @ e.T) / torch.trace(w @ c @ w.T))
    return total
