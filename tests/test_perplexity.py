"""Perplexity equals a hand computation on a tiny model; non-finite losses are errors."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import random_windows, tiny_model

from compressor.evaluation.perplexity import evaluate_against, evaluate_perplexity
from compressor.runtime.errors import NumericalError


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


def test_kl_and_top1_agreement_equal_a_hand_computation():
    """One pass over original and compressed gives both perplexities, KL(p_orig ‖ p_comp) and top-1 agreement,
    each equal (1e-6) to a window-by-window, position-by-position computation in fp64."""
    original, changed = tiny_model("llama", seed=0), tiny_model("llama", seed=0)
    with torch.no_grad():
        changed.model.layers[2].self_attn.v_proj.weight.mul_(0.5)  # a perturbed "compressed" model
    windows = random_windows(3, 20)
    ref, scored = evaluate_against(original, {"c": changed}, windows, batch_size=2, progress=False)
    result, faith = scored["c"]
    kl, agree, nll_ref, nll_c, count = 0.0, 0, 0.0, 0.0, 0
    with torch.no_grad():
        for window in windows:
            p = torch.log_softmax(original(input_ids=window[None]).logits[0].double(), dim=-1)
            q = torch.log_softmax(changed(input_ids=window[None]).logits[0].double(), dim=-1)
            for t in range(window.numel() - 1):
                kl += float((p[t].exp() * (p[t] - q[t])).sum())
                agree += int(p[t].argmax() == q[t].argmax())
                nll_ref -= float(p[t, window[t + 1]])
                nll_c -= float(q[t, window[t + 1]])
                count += 1
    assert faith.kl_to_original == pytest.approx(kl / count, abs=1e-6)
    assert faith.kl_to_original > 1e-4  # the perturbation is visible: the check can fail
    assert faith.top1_agreement == pytest.approx(agree / count, abs=1e-6)
    assert ref.ppl == pytest.approx(math.exp(nll_ref / count), rel=1e-6)
    assert result.ppl == pytest.approx(math.exp(nll_c / count), rel=1e-6)
    assert faith.ppl_ratio == pytest.approx(result.ppl / ref.ppl, rel=1e-12)


def test_a_model_against_itself_has_zero_kl_and_full_agreement():
    model = tiny_model("llama")
    ref, scored = evaluate_against(model, {"same": model}, random_windows(2, 16), progress=False)
    result, faith = scored["same"]
    assert faith.kl_to_original == pytest.approx(0.0, abs=1e-7)
    assert faith.top1_agreement == 1.0
    assert result.ppl == ref.ppl


def test_perplexity_interval_contains_the_perplexity_and_is_reproducible():
    model = tiny_model("llama")
    result = evaluate_perplexity(model, random_windows(12, 16), progress=False)
    lo, hi = result.ppl_ci95
    assert lo < result.ppl < hi
    again = evaluate_perplexity(model, random_windows(12, 16), progress=False)
    assert again.ppl_ci95 == result.ppl_ci95
