"""Perplexity equals a hand computation on a tiny model; non-finite losses are errors."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import random_windows, tiny_model

from compressor.errors import NumericalError
from compressor.evaluate import evaluate_perplexity


def test_perplexity_equals_hand_computation():
    model = tiny_model("llama")
    windows = random_windows(3, 20)
    result = evaluate_perplexity(model, windows, batch_size=2, progress=False)
    total, count = 0.0, 0
    with torch.no_grad():
        for window in windows:
            logits = model(input_ids=window[None]).logits[0].double()
            log_probs = torch.log_softmax(logits, dim=-1)
            for t in range(window.numel() - 1):
                total -= log_probs[t, window[t + 1]].item()
                count += 1
    assert result.tokens == count == 3 * 19
    assert result.ppl == pytest.approx(math.exp(total / count), rel=1e-6)
    assert result.windows == 3 and result.seq_len == 20


def test_non_finite_loss_is_an_error_not_dropped():
    model = tiny_model("llama")
    with torch.no_grad():
        model.model.layers[0].self_attn.v_proj.weight.fill_(float("nan"))
    with pytest.raises(NumericalError, match="non-finite loss"):
        evaluate_perplexity(model, random_windows(2, 8), progress=False)
