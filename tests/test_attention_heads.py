"""The attention's `heads` form (`--attention heads`, part of `--native`): the pure math of `compressor.math.heads`
on planted data, then the form in the pipeline on tiny random models (budget, exact error, save→load identical
logits), and in llama.cpp (per-layer head counts: the `deci` layout)."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from conftest import random_windows, reloaded_identically, tiny_model

from compressor.api.pipeline import compress_model
from compressor.checkpoint import load_compressed, save_compressed
from compressor.math.accounting import HEADS_READER
from compressor.math.heads import head_columns, head_tail, refit_o
from compressor.modeling.adapters import get_adapter
from compressor.recipes.schema import CompressionSettings
from compressor.runtime.errors import UserError
from compressor.statistics.capture import collect_statistics

HEADS, KV_HEADS, HEAD_DIM, HIDDEN = 6, 2, 4, 10


def _outputs(tokens=500, seed=0, planted_copy: tuple[int, int] | None = None):
    """Head outputs z (tokens, H·d), their autocorrelation and an o_proj O (hidden, H·d); `planted_copy` (a, b):
    head b's output is exactly head a's."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(tokens, HEADS * HEAD_DIM, generator=g, dtype=torch.float64)
    z = z @ torch.randn(HEADS * HEAD_DIM, HEADS * HEAD_DIM, generator=g, dtype=torch.float64)
    if planted_copy:
        a, b = planted_copy
        z[:, head_columns([b], HEAD_DIM)] = z[:, head_columns([a], HEAD_DIM)]
    o = torch.randn(HIDDEN, HEADS * HEAD_DIM, generator=g, dtype=torch.float64)
    return z, z.T @ z / tokens, o


def _error(z, o, refit, kept) -> float:
    return float((z @ o.T - z[:, head_columns(kept, HEAD_DIM)] @ refit.T).square().sum(-1).mean())


def test_tail_is_the_refit_error_at_every_count_and_zero_at_all_heads():
    z, c, o = _outputs()
    found = head_tail(c, o, KV_HEADS, HEAD_DIM)
    per_group = HEADS // KV_HEADS
    assert len(found.tail) == per_group and found.damping == 0.0
    for r in range(1, per_group + 1):
        kept = found.kept(r)
        assert len(kept) == r * KV_HEADS
        # engines map query head i to KV head i // r: exactly r heads of each group, in group order
        assert [h // per_group for h in kept] == [g for g in range(KV_HEADS) for _ in range(r)]
        refit = refit_o(c, o, kept, HEAD_DIM, found.damping)
        assert float(found.tail[r - 1]) == pytest.approx(_error(z, o, refit, kept), rel=1e-8, abs=1e-9)
    assert float(found.tail[-1]) == pytest.approx(0.0, abs=1e-8 * float(found.tail[0]))
    torch.testing.assert_close(refit_o(c, o, list(range(HEADS)), HEAD_DIM, 0.0), o, rtol=1e-8, atol=1e-8)
    assert all(a >= b - 1e-9 for a, b in itertools.pairwise(found.tail.tolist()))  # nested sets


def test_refit_is_the_least_squares_solution():
    z, c, o = _outputs(seed=1)
    kept = [0, 4]
    inputs = z[:, head_columns(kept, HEAD_DIM)]
    expected = torch.linalg.lstsq(inputs, z @ o.T).solution.T
    torch.testing.assert_close(refit_o(c, o, kept, HEAD_DIM, 0.0), expected, rtol=1e-8, atol=1e-9)


def test_a_planted_duplicate_head_is_dropped_first_at_no_cost():
    """Head 2 outputs exactly what head 1 does (same KV group): keeping two heads per group, the greedy keeps one
    of the pair, whose refit o_proj columns carry both; dropping the other costs nothing."""
    z, c, o = _outputs(seed=2, planted_copy=(1, 2))
    found = head_tail(c, o, KV_HEADS, HEAD_DIM)
    assert found.damping > 0  # the duplicate makes C singular: damped, and reported by the caller
    kept = found.kept(2)
    assert not {1, 2} <= set(kept)
    # the other of the pair would explain nothing more: keeping it too leaves the same error
    other = ({1, 2} - set(kept)).pop()
    with_both = sorted([*kept, other])
    error = _error(z, o, refit_o(c, o, kept, HEAD_DIM, found.damping), kept)
    error_both = _error(z, o, refit_o(c, o, with_both, HEAD_DIM, found.damping), with_both)
    assert error == pytest.approx(error_both, rel=1e-6, abs=1e-9 * float(found.tail[0]))


# ---------------------------------------------------------------------------------------------------------
# the form in the pipeline


def _compress(model, ratio=0.3, **settings):
    adapter = get_adapter(model)
    windows = random_windows()
    stats = collect_statistics(model, adapter, windows, progress=False, mlp=True)
    settings = CompressionSettings(**{"targets": "attn", "attention": "heads", **settings})
    return (
        compress_model(model, adapter, stats, settings, ratio, progress=False, windows=windows),
        stats,
        windows,
    )


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_heads_form_meets_the_budget_and_reloads_exactly(family, tmp_path):
    model = tiny_model(family, num_attention_heads=8, num_key_value_heads=2)
    outcome, _, _ = _compress(model, targets="attn,mlp", width_multiple=32)
    plan, adapter = outcome.plan, get_adapter(model)
    assert plan.params_after() <= plan.budget
    assert plan.params_after() == sum(p.numel() for p in model.parameters()) - plan_untargeted(model, plan)
    counts = []
    for layer in range(adapter.num_layers):
        attention = adapter.layers[layer].self_attn
        assert all(isinstance(getattr(attention, p), torch.nn.Linear) for p in ("q_proj", "k_proj", "v_proj"))
        per_group = plan.get(layer, HEADS_READER).rank
        assert attention.q_proj.out_features == attention.o_proj.in_features == per_group * 2 * 8
        assert attention.k_proj.out_features == 2 * 8  # the KV heads stay
        assert attention.num_key_value_groups == per_group
        counts.append(per_group)
    assert min(counts) < 4  # some layer kept fewer heads
    path = save_compressed(model, plan, tmp_path / "ckpt")
    reloaded_identically(model, path)
    reloaded = load_compressed(path)
    assert [layer.self_attn.num_key_value_groups for layer in reloaded.model.layers] == counts


def plan_untargeted(model, plan) -> int:
    """The model's numbers outside the plan's projections (embeddings, norms)."""
    adapter = get_adapter(model)
    inside = sum(adapter.projection(pp.layer, pp.projection).weight.numel() for pp in plan.projections)
    biases = sum(
        adapter.projection(pp.layer, pp.projection).bias.numel()
        for pp in plan.projections
        if adapter.projection(pp.layer, pp.projection).bias is not None
    )
    return sum(p.numel() for p in model.parameters()) - inside - biases


def test_the_allocated_error_is_the_built_attentions():
    """Each layer's attention output on the calibration windows is off by exactly the tail the allocation read at
    the heads it kept (the KV heads and the kept heads' outputs are unchanged, o_proj refit)."""
    model = tiny_model("llama", num_attention_heads=8, num_key_value_heads=2)
    original = copy.deepcopy(model)
    outcome, stats, windows = _compress(model)
    before, after = get_adapter(original), get_adapter(model)
    for layer in range(before.num_layers):
        captured: dict[str, list] = {"before": [], "after": []}
        hooks = [
            before.layers[layer].self_attn.register_forward_hook(
                lambda m, a, out, seen=captured["before"]: seen.append(out[0])
            ),
            after.layers[layer].self_attn.register_forward_hook(
                lambda m, a, out, seen=captured["after"]: seen.append(out[0])
            ),
        ]
        # the compressed model's own layer inputs differ after layer 0: feed both the original's hidden states
        inputs: list = []
        pre = before.layers[layer].register_forward_pre_hook(
            lambda m, a, kw, seen=inputs: seen.append((a, kw)), with_kwargs=True
        )
        with torch.no_grad():
            for window in windows:
                original(input_ids=window[None])
            pre.remove()
            for args, kwargs in inputs:
                after.layers[layer](*args, **kwargs)
        for hook in hooks:
            hook.remove()
        b = torch.cat([t.reshape(-1, t.shape[-1]) for t in captured["before"][: len(inputs)]]).double()
        a = torch.cat([t.reshape(-1, t.shape[-1]) for t in captured["after"]]).double()
        planned = outcome.plan.get(layer, HEADS_READER)
        per_group = planned.rank if planned.mode == "heads" else 4  # kept whole by the allocation: all 4
        c = stats.autocorr("o", layer)
        tail = head_tail(c, before.projection(layer, HEADS_READER).weight.detach(), 2, 8).tail
        assert float((b - a).square().sum(-1).mean()) == pytest.approx(
            float(tail[per_group - 1]), rel=2e-3, abs=1e-7
        )


def test_heads_refuse_what_they_cannot_do():
    with pytest.raises(UserError, match="--attention heads keeps whole heads.*--sharing none"):
        _compress(tiny_model("llama"), sharing="basis")


def test_native_sets_the_engine_forms_of_what_is_targeted():
    from compressor.api.run_options import CompressOptions, resolve_run_settings

    _, _, both = resolve_run_settings(CompressOptions(targets="attn,mlp", native=True), None)
    assert (both.attention, both.mlp, both.width_multiple, both.sharing) == ("heads", "neurons", 32, "none")
    _, _, mlp = resolve_run_settings(CompressOptions(targets="mlp", native=True, width_multiple=64), None)
    assert (mlp.attention, mlp.width_multiple) == ("factors", 64)  # attention untargeted: untouched
    with pytest.raises(UserError, match="--native takes --attention heads"):
        resolve_run_settings(CompressOptions(native=True, attention="factors"), None)
    with pytest.raises(UserError, match="--native: --method svd-llm writes factored projections"):
        resolve_run_settings(CompressOptions(native=True, method="svd-llm"), None)


def test_per_layer_heads_run_in_llama_cpp(tmp_path):
    """A layer count of heads per layer is llama.cpp's `deci` layout: its log-probabilities equal transformers'."""
    pytest.importorskip(
        "xllamacpp", reason="llama.cpp's wheel is not installed (pip install masa-compress[gguf])"
    )
    from test_gguf_export import VOCAB, byte_tokenizer_gguf, llama_cpp_log_probs

    from compressor.checkpoint.gguf_export import write_gguf

    model = tiny_model("llama", num_attention_heads=8, num_key_value_heads=2, vocab_size=VOCAB)
    _compress(model, targets="attn,mlp", width_multiple=32)
    result = write_gguf(
        model, byte_tokenizer_gguf(tmp_path / "tok.gguf"), tmp_path / "m.gguf", tensor_type="f32"
    )
    assert result.architecture == "deci" and len(set(result.heads)) > 1 and set(result.kv_heads) == {2}
    ids = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = torch.log_softmax(model(ids).logits.float(), dim=-1)
    assert (llama_cpp_log_probs(result.path, ids) - expected).abs().max() < 1e-3


def test_reports_count_the_kept_share_of_heads():
    """`show` and the run report's allocation read the kept share of a layer's heads, not a rank's factors."""
    from compressor.report.records import kept_fractions

    model = tiny_model("llama", num_attention_heads=8, num_key_value_heads=2)
    plan = _compress(model)[0].plan
    kept = kept_fractions(plan.to_dict()["projections"])
    for layer in range(get_adapter(model).num_layers):
        planned = plan.get(layer, HEADS_READER)
        share = planned.rank / 4 if planned.mode == "heads" else 1.0
        assert kept[(layer, "q_proj")] == pytest.approx(share) and kept[(layer, "o_proj")] == pytest.approx(
            share
        )
        assert kept[(layer, "k_proj")] == 1.0


def test_dense_export_gives_every_head_back_exactly(tmp_path):
    """`export --format hf` of a heads checkpoint: the standard architecture (no remote code), the missing heads
    zero, the same logits."""
    from transformers import AutoModelForCausalLM

    from compressor.checkpoint import export_dense

    model = tiny_model("qwen2", num_attention_heads=8, num_key_value_heads=2)  # q biases too
    outcome, _, _ = _compress(model)
    assert any(pp.mode == "heads" and pp.rank < 4 for pp in outcome.plan.projections)
    path = save_compressed(model, outcome.plan, tmp_path / "ckpt")
    dense = AutoModelForCausalLM.from_pretrained(export_dense(path, tmp_path / "dense").path)
    x = random_windows(2, 12)
    with torch.no_grad():
        torch.testing.assert_close(dense(x).logits, load_compressed(path)(x).logits, rtol=0, atol=1e-5)
