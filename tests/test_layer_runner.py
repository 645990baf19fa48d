"""`statistics/layer_runner.LayerRunner`: the one walk over the decoder layers that `--layerwise`, the sequential
statistics, the stream refit, the compensated rounding and the block influence all take."""

from __future__ import annotations

import pytest
import torch
from conftest import random_windows, tiny_model

from compressor.modeling.adapters import get_adapter
from compressor.statistics.capture import captured_inputs, collect_statistics
from compressor.statistics.layer_runner import LayerRunner


@pytest.mark.parametrize("family, shape", [("llama", {}), ("gemma2", {"sliding_window": 4})])
def test_walking_every_layer_gives_the_models_own_log_probabilities(family, shape):
    model = tiny_model(family, vocab_size=256, **shape)
    adapter = get_adapter(model)
    windows = random_windows(5, 16)
    runner = LayerRunner(adapter, windows, batch_size=2)
    for index in range(adapter.num_layers):
        runner.advance(index)
    with torch.no_grad():
        for b, batch in enumerate(runner.batches):
            expected = torch.log_softmax(model(input_ids=batch).logits[:, :-1].float(), dim=-1)
            # gemma2's sliding-window layers (4 tokens of 16) get their own masks: a walk that gave every layer
            # the same would differ
            torch.testing.assert_close(runner.log_probs(b, runner.hidden[b]), expected, rtol=0, atol=1e-5)


def test_the_moments_measured_in_a_layers_pass_are_the_in_memory_captures_bit_for_bit():
    model = tiny_model("llama", vocab_size=256)
    adapter = get_adapter(model)
    windows = random_windows(6, 16)
    stats = collect_statistics(model, adapter, windows, batch_size=2, progress=False, mlp=True)
    runner = LayerRunner(adapter, windows, batch_size=3)
    for index in range(adapter.num_layers):
        measured = runner.advance_measuring(index, captured_inputs(mlp=True))
        assert set(measured) == set(stats.inputs)
        for kind, moments in measured.items():
            assert torch.equal(moments.autocorr, stats.autocorr(kind, index)), (index, kind)
            assert torch.equal(moments.mean, stats.input_mean(kind, index)), (index, kind)
        # advanced past the layer: the block-output means grouping reads, as the capture took them
        means = torch.cat([h.float().mean(dim=1) for h in runner.hidden])
        assert torch.equal(means, stats.block_output_means[index])


def test_measuring_without_advancing_leaves_the_hidden_states_and_keep_first_drops_the_rest():
    model = tiny_model("llama", vocab_size=256)
    runner = LayerRunner(get_adapter(model), random_windows(4, 16))
    before = [h.clone() for h in runner.hidden]
    runner.advance_measuring(0, {"attn": "q_proj"}, advance=False)
    assert all(torch.equal(a, b) for a, b in zip(before, runner.hidden, strict=True))
    runner.keep_first(2)
    assert len(runner.hidden) == len(runner.batches) == len(runner.windows) == 2
    with pytest.raises(ValueError, match="batches of one window"):
        LayerRunner(get_adapter(model), random_windows(4, 16), batch_size=2).keep_first(1)
