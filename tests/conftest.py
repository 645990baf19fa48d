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
