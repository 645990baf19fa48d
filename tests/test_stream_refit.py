"""`--refit stream` (`statistics/partly_compressed.refit_on_stream`): heads' o_proj and neurons' down_proj refit
on the compressed model's own inputs, each to bring the residual stream back to the original's."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from conftest import tiny_model

from compressor.api.pipeline import compress_model
from compressor.api.run_options import CompressOptions, resolve_settings
from compressor.methods.masa.method import refit_forms
from compressor.modeling.adapters import get_adapter
from compressor.modeling.families import FAMILIES
from compressor.recipes.schema import CompressionSettings
from compressor.runtime.errors import UserError
from compressor.statistics.capture import collect_statistics
from compressor.statistics.layer_runner import LayerRunner
from compressor.statistics.partly_compressed import _refit_down_proj

VOCAB = 96
NATIVE = dict(method="masa", targets="attn,mlp", attention="heads", mlp="neurons", sharing="none",
              allocation="global")  # fmt: skip


def compressed_pair(family: str = "llama", ratio: float = 0.3, forms: dict | None = None, **shape):
    """The same tiny model (`shape`: config values over the tiny one's) compressed in the native form (or `forms`)
    with each refit, on 32 windows of 64 tokens."""
    model = tiny_model(
        family, **{"vocab_size": VOCAB, "num_attention_heads": 8, "num_key_value_heads": 2} | shape
    )
    windows = torch.randint(0, VOCAB, (32, 64), generator=torch.Generator().manual_seed(1))
    stats = collect_statistics(model, get_adapter(model), windows, progress=False, mlp=True)
    built = {}
    for refit in ("calibration", "stream"):
        copy_ = copy.deepcopy(model)
        settings = CompressionSettings(**(forms or NATIVE), refit=refit)
        outcome = compress_model(
            copy_, get_adapter(copy_), stats, settings, ratio, progress=False, windows=windows
        )
        built[refit] = (copy_, outcome)
    return model, windows, built


def test_only_the_narrowed_matrices_change_and_the_model_moves_closer_to_the_original_on_its_calibration():
    model, windows, built = compressed_pair()
    (calibration, plain), (stream, refit) = built["calibration"], built["stream"]
    assert refit.plan.params_after() == plain.plan.params_after() and refit.seconds["stream_refit"] > 0
    before, after = calibration.state_dict(), stream.state_dict()
    assert before.keys() == after.keys()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(k.endswith(("o_proj.weight", "down_proj.weight")) for k in changed)
    with torch.no_grad():
        reference = torch.log_softmax(model(windows).logits, -1)

        def kl(m):
            log_probs = torch.log_softmax(m(windows).logits, -1)
            return float((reference.exp() * (reference - log_probs)).sum(-1).mean())

        assert kl(stream) < 0.8 * kl(calibration)


def test_the_first_layers_o_proj_is_the_least_squares_fit_of_the_original_attention_output():
    """At layer 0 the two streams are the same (the embeddings), so o_proj's target, the original stream after
    the attention less the compressed input, is the original o_proj's output: the refit is that least-squares
    fit on the kept heads' outputs."""
    model, windows, built = compressed_pair()
    stream = built["stream"][0]
    seen = {}
    hooks = [
        model.model.layers[0].self_attn.o_proj.register_forward_hook(
            lambda m, a, out: seen.setdefault("target", []).append(out.detach())
        ),
        stream.model.layers[0].self_attn.o_proj.register_forward_pre_hook(
            lambda m, a: seen.setdefault("x", []).append(a[0].detach())
        ),
    ]
    with torch.no_grad():
        for window in windows:
            model(window[None])
            stream(window[None])
    for hook in hooks:
        hook.remove()
    x = torch.cat(seen["x"]).reshape(-1, seen["x"][0].shape[-1]).double()
    target = torch.cat(seen["target"]).reshape(-1, seen["target"][0].shape[-1]).double()
    expected = torch.linalg.lstsq(x, target).solution.T
    got = stream.model.layers[0].self_attn.o_proj.weight.double()
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4 * float(expected.abs().max()))


def stream_refit_at_work():
    """A stream-refitted tiny model's (adapter, a runner over 4 windows in 2 batches, the context a refit reads,
    random targets per batch)."""
    model = compressed_pair()[2]["stream"][0]
    adapter = get_adapter(model)
    runner = LayerRunner(adapter, torch.randint(0, VOCAB, (4, 16)), batch_size=2)
    targets = [torch.randn_like(hidden) for hidden in runner.hidden]
    ctx = SimpleNamespace(
        adapter=adapter,
        compute_device=torch.device("cpu"),
        record_damping=lambda *a, **k: None,
        refitted=lambda *a: None,
    )
    return adapter, runner, ctx, targets


def test_down_projs_refit_advances_the_stream_exactly_as_a_pass_through_its_layer():
    """The refit of down_proj returns the layer's output from what its own pass kept (the stream after the
    attention plus down_proj on its inputs), in place of a third pass: the same numbers as running the layer."""
    adapter, runner, ctx, targets = stream_refit_at_work()
    before = adapter.projection(1, "down_proj").weight.clone()
    with torch.no_grad():
        runner.advance(0)
        advanced = _refit_down_proj(ctx, 1, runner, targets)
        expected = [runner._run(1, batch) for batch in range(len(runner.hidden))]
    assert not torch.equal(adapter.projection(1, "down_proj").weight, before)  # refitted, then run
    assert len(advanced) == len(expected) == 2
    assert all(torch.equal(got, want) for got, want in zip(advanced, expected, strict=True))


def test_a_run_with_nothing_to_refit_on_the_stream_is_refused_before_calibration():
    assert refit_forms(CompressionSettings(**NATIVE)) == ("o_proj", "down_proj")
    assert refit_forms(CompressionSettings(method="masa", targets="attn,mlp")) == ("down_proj",)
    factored = CompressionSettings(method="masa", targets="attn", refit="stream")
    from compressor.methods import get_method

    with pytest.raises(UserError, match="has neither"):
        get_method("masa").check_settings(factored)


@pytest.mark.parametrize("family", [f.model_type for f in FAMILIES.values() if f.block_output_norm])
def test_a_family_that_normalizes_its_blocks_outputs_is_refused_with_the_reason(family):
    """OLMo 2 adds norm(mlp(x)) to the stream, not down_proj's output (Gemma 2 and 3 too): the target would be
    wrong. The registry's flag, which keeps `--native` on `--refit calibration` there, is what the check finds
    (every other dense family runs `--native` with the stream refit in tests/test_families.py)."""
    mlp_only = dict(method="masa", targets="mlp", mlp="neurons", allocation="global")
    with pytest.raises(UserError, match="normalizes the attention's or the MLP's output"):
        compressed_pair(family, forms=mlp_only)


def test_native_takes_the_stream_refit_where_it_runs_and_says_why_where_not():
    def refit(model_type, layerwise=False, targets="attn,mlp", **given):
        options = CompressOptions(targets=targets, native=True, layerwise=layerwise, **given)
        resolved = resolve_settings(options, None, {"model_type": model_type})
        return resolved.compression.refit, resolved.sources["compression"]["refit"]

    assert (
        refit("llama")
        == refit("llama", layerwise=True)
        == ("stream", "option (--native: chosen on validation)")
    )
    assert refit("olmo2")[0] == refit("gemma2")[0] == "calibration" and "normalizes" in refit("olmo2")[1]
    assert refit("mixtral") == ("calibration", "option (--native: Mixtral's experts are kept whole)")
    assert refit("llama", refit="calibration") == ("calibration", "option")
    # chosen on validation with both targeted and with the MLP alone; the attention alone measured better with
    # calibration
    assert refit("llama", targets="mlp") == ("stream", "option (--native: chosen on validation)")
    assert refit("llama", targets="attn") == (
        "calibration",
        "option (--native: the attention alone: calibration measured better on validation)",
    )
    plain = resolve_settings(CompressOptions(targets="attn,mlp"), None, {"model_type": "llama"})
    assert plain.compression.refit == "calibration"  # without --native: the schema's default


def test_a_layer_that_kept_nothing_is_left_out_of_the_stream_refit():
    """Nearly all of a tiny model's MLPs removed in whole neurons: its layers keep none (0-wide down_projs, no
    column to refit); the o_projs are still refit on the stream, and the model runs."""
    model, windows, built = compressed_pair(ratio=0.88, forms=NATIVE, num_hidden_layers=2)
    (calibration, _), (stream, _) = built["calibration"], built["stream"]
    assert [layer.mlp.down_proj.in_features for layer in stream.model.layers] == [0, 0]
    for before, after in zip(calibration.model.layers, stream.model.layers, strict=True):
        assert not torch.equal(before.self_attn.o_proj.weight, after.self_attn.o_proj.weight)
    with torch.no_grad():
        assert torch.isfinite(stream(windows).logits).all()


def test_the_stream_refit_reads_at_most_its_windows_evenly_spaced(monkeypatch):
    """`stream_refit_windows`: all windows while the cap is None or above their count; else the cap's number,
    evenly spaced from the first to the last, each once and in order."""
    from compressor.statistics import partly_compressed

    windows = torch.arange(256 * 3).reshape(256, 3)
    monkeypatch.setattr(partly_compressed, "STREAM_REFIT_WINDOWS", None)
    assert partly_compressed.stream_refit_windows(windows) is windows
    monkeypatch.setattr(partly_compressed, "STREAM_REFIT_WINDOWS", 300)
    assert partly_compressed.stream_refit_windows(windows) is windows
    monkeypatch.setattr(partly_compressed, "STREAM_REFIT_WINDOWS", 64)
    chosen = partly_compressed.stream_refit_windows(windows)[:, 0] // 3
    assert len(chosen) == 64 and chosen[0] == 0 and chosen[-1] == 255
    assert torch.all(torch.diff(chosen) >= 3) and torch.all(torch.diff(chosen) <= 5)
