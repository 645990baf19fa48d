"""`--speed`: a byte budget's file held to a decode time (`quantize/speed.py`)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from test_gguf_export import VOCAB, k_quant_model, llama_cpp_log_probs, tokenizer_gguf  # noqa: F401 - a fixture

from compressor.checkpoint.gguf_export import write_gguf
from compressor.quantize.budget_chooser import BudgetChooser
from compressor.quantize.byte_budget import Option, allocate
from compressor.quantize.decode_cost import LayerShape
from compressor.quantize.ggml_quantize import K_QUANT_MIXES, padded, row_bytes
from compressor.quantize.gguf_types import GGUF_TYPES
from compressor.quantize.speed import (
    REFERENCE_MIXES,
    SpeedPlan,
    SpeedTarget,
    allocate_within_time,
    describe_speed,
    matrix_seconds,
    mix_of_budget,
    parse_speed,
    plan_seconds,
    speed_plan,
)
from compressor.runtime.errors import UserError


def test_speed_is_any_mix_or_tokens_per_second_else_one_line():
    assert parse_speed(None) is None and parse_speed("any") is None and parse_speed(" ANY ") is None
    assert parse_speed("mix") == SpeedTarget(mix=True)
    assert parse_speed("40") == SpeedTarget(tokens_per_second=40.0) == parse_speed("40tok/s")
    assert parse_speed("mix").describe() == "mix" and parse_speed("12.5").describe() == "12.5 tokens/s"
    for bad in ("fast", "0", "-3", "inf", ""):
        with pytest.raises(UserError, match=r"not a speed: write any, mix .* or tokens per second"):
            parse_speed(bad)
    with pytest.raises(UserError, match=r"--speed mix: the decode speed of a --size file: add --size"):
        parse_speed("mix", budget_given=False)
    assert parse_speed("any", budget_given=False) is None  # the default, given or not, needs no budget
    assert [describe_speed(t) for t in (None, "any", "mix", "40")] == ["any", "any", "mix", "40 tokens/s"]


def _options(losses: list[tuple[float, float]]) -> dict[str, list[Option]]:
    """Matrices of one size, each a slow accurate type (SLOW) and a fast lossier one (FAST) of the same bytes."""
    return {
        f"m{i}": [Option("SLOW", 1024, slow), Option("FAST", 1024, fast)]
        for i, (slow, fast) in enumerate(losses)
    }


#: Seconds per token of each matrix in each type: every matrix saves the same time in FAST.
SECONDS = {f"m{i}": {"SLOW": 3e-3, "FAST": 1e-3} for i in range(5)}
LOSSES = [(0.010, 0.050), (0.020, 0.021), (0.001, 0.100), (0.030, 0.034), (0.005, 0.015)]


def test_a_limit_the_plain_allocation_meets_changes_nothing():
    options = _options(LOSSES)
    plain = allocate(options, 0, 10_000)
    assert plain.types == {f"m{i}": "SLOW" for i in range(5)}  # SLOW loses less in every matrix
    plan, penalty = allocate_within_time(options, SECONDS, 0, 10_000, plan_seconds(plain.types, SECONDS))
    assert penalty == 0.0 and plan.types == plain.types


@pytest.mark.parametrize("fast_ones", [1, 2, 3, 5])
def test_the_limit_is_met_at_the_least_loss(fast_ones):
    """Each matrix saves 2 ms in FAST: a limit that needs k of them FAST is met by the k whose loss rises least,
    the optimum of the constrained problem (enumerated), its predicted loss the plain loss of those types."""
    options = _options(LOSSES)
    limit = 5 * 3e-3 - fast_ones * 2e-3 + 1e-6
    plan, penalty = allocate_within_time(options, SECONDS, 0, 10_000, limit)
    assert plan_seconds(plan.types, SECONDS) <= limit and penalty > 0
    loss = {name: {o.type_name: o.predicted for o in opts} for name, opts in options.items()}
    feasible = [
        dict(zip(options, types, strict=True))
        for types in itertools.product(("SLOW", "FAST"), repeat=5)
        if plan_seconds(dict(zip(options, types, strict=True)), SECONDS) <= limit
    ]
    best = min(feasible, key=lambda t: sum(loss[n][x] for n, x in t.items()))
    assert plan.types == best
    assert plan.predicted == pytest.approx(sum(loss[n][t] for n, t in best.items()))
    rises = sorted(range(5), key=lambda i: LOSSES[i][1] - LOSSES[i][0])
    assert {n for n, t in plan.types.items() if t == "FAST"} == {f"m{i}" for i in rises[:fast_ones]}


def test_a_limit_of_exactly_the_fastest_time_is_met_by_the_fastest_plan():
    options = _options(LOSSES)
    fastest = {f"m{i}": "FAST" for i in range(5)}
    for limit in (plan_seconds(fastest, SECONDS), sum([1e-3] * 5), 5e-3):
        plan, _ = allocate_within_time(options, SECONDS, 0, 10_000, limit)
        assert plan.types == fastest
        assert plan.predicted == pytest.approx(sum(fast for _, fast in LOSSES))


def test_the_bytes_still_bind_under_a_time_limit():
    """A fast type of more bytes than the budget allows is not taken, however fast."""
    options = {"m0": [Option("SMALL", 1024, 0.01), Option("BIG", 4096, 0.0)]}
    seconds = {"m0": {"SMALL": 2e-3, "BIG": 1e-3}}
    plan, _ = allocate_within_time(options, seconds, 0, 4096, 1.5e-3)
    assert plan.types == {"m0": "BIG"}
    with pytest.raises(UserError, match=r"the fastest file of these bytes is predicted at 500\.0 tokens/s .* short "
                       r"of the 666\.7 asked: ask for at most that, or for more bytes"):  # fmt: skip
        allocate_within_time(options, seconds, 0, 2048, 1.5e-3)


def test_an_untied_embedding_is_a_lookup_a_tied_one_the_output_product():
    matrices = [("token_embd.weight", np.zeros((10, 4)), "e"), ("blk.0.ffn_up.weight", np.zeros((8, 4)), "u")]
    costs = {"F16": 2.0, "Q4_K": 1.0}
    untied, tied = matrix_seconds(matrices, costs, False), matrix_seconds(matrices, costs, True)
    assert untied["token_embd.weight"] == {"F16": 0.0, "Q4_K": 0.0}
    assert tied["token_embd.weight"] == {"F16": 40 * 2e-9, "Q4_K": 40e-9}
    assert untied["blk.0.ffn_up.weight"] == tied["blk.0.ffn_up.weight"] == {"F16": 32 * 2e-9, "Q4_K": 32e-9}


def test_the_mix_of_a_budget_is_the_one_nearest_its_bytes():
    """Of llama.cpp's mixes and its files of one type (q8_0 included), the one whose file comes nearest."""
    matrices = [(f"blk.{i}.ffn_up.weight", np.zeros((64, 256), np.float32), "") for i in range(3)]

    def base_type(name, array, mix):
        return K_QUANT_MIXES[mix].base if mix in K_QUANT_MIXES else GGUF_TYPES[mix][0]

    def size(mix):
        return 100 + 3 * padded(64 * row_bytes(base_type("", None, mix), 256))

    for budget_mix in ("q8_0", "q4_k_m", "q2_k", "q6_k"):
        for off in (-10, 0, 10):  # a few bytes either side (the tool's own metadata): still that mix's bytes
            mix, types = mix_of_budget(matrices, 100, size(budget_mix) + off, base_type)
            assert size(mix) == size(budget_mix) and set(types.values()) == {base_type("", None, mix)}
    assert mix_of_budget(matrices, 100, size("q8_0"), base_type)[0] == "q8_0"
    mix, _ = mix_of_budget(matrices, 100, 50, base_type)  # below every mix: the smallest is the nearest
    assert size(mix) == min(size(m) for m in REFERENCE_MIXES)
    between = (size("q4_k_m") + 3 * size("q6_k")) // 4  # nearer q6_k's bytes than q4_k_m's or q5_k_m's
    assert size(mix_of_budget(matrices, 100, between, base_type)[0]) == size("q6_k")


#: ns per weight in which the i-quants and Q3_K decode slowly, as on a CPU: what makes `any` slower than the mix.
COSTS = {"F16": 0.40, "Q8_0": 0.25, "Q6_K": 0.20, "Q5_K": 0.19, "Q4_K": 0.15, "Q3_K": 0.45, "Q2_K": 0.20,
         "IQ4_XS": 0.60, "IQ3_S": 0.90, "IQ3_XXS": 0.80, "IQ2_XS": 0.70, "IQ2_XXS": 0.70, "Q4_0": 0.15,
         "Q4_1": 0.16, "Q5_0": 0.20, "Q5_1": 0.21, "IQ4_NL": 0.60}  # fmt: skip


def test_a_speed_mix_file_is_predicted_no_slower_than_the_mix_and_runs(tmp_path, tokenizer_gguf):  # noqa: F811
    """Through `write_gguf`: at q3_k_m's bytes the plain allocation takes types these costs make slow; held to
    the mix it is predicted no slower than q3_k_m (the mix of those bytes), still within the bytes, and runs."""
    pytest.importorskip("xllamacpp")
    import gguf

    from compressor.quantize.importance import measure_importance

    model = k_quant_model(num_hidden_layers=4)
    ids = torch.randint(0, VOCAB, (4, 32), generator=torch.Generator().manual_seed(0))
    importance = measure_importance(model, ids, progress=False, gradient_windows=2)
    mix = write_gguf(
        model, tokenizer_gguf, tmp_path / "mix.gguf", tensor_type="q3_k_m", importance=importance.weights
    )
    asked = []

    def costs_of(types, shape):
        asked.extend(types)
        assert shape == LayerShape(hidden=256, heads=4, kv_heads=2, head_dim=64, intermediate=512)
        return {t: COSTS[t] for t in types}

    plain = BudgetChooser(model, importance, mix.bytes, progress=False)
    write_gguf(
        model, tokenizer_gguf, tmp_path / "any.gguf", importance=importance.weights, choose_types=plain
    )
    held = BudgetChooser(
        model, importance, mix.bytes, progress=False, speed=SpeedTarget(mix=True), costs=costs_of
    )
    written = write_gguf(model, tokenizer_gguf, tmp_path / "mix-speed.gguf", importance=importance.weights,
                         choose_types=held)  # fmt: skip
    speed = held.speed_plan
    stored = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(mix.path)).tensors if len(t.shape) == 2}
    assert speed.mix == "q3_k_m" and set(asked) >= set(stored.values())  # the mix's own types priced
    seconds = _seconds(mix.path)
    assert speed.mix_seconds == pytest.approx(plan_seconds(stored, seconds))
    assert speed.unlimited_seconds > speed.mix_seconds >= speed.seconds  # `any` was slower; the limit binds
    assert speed.seconds == pytest.approx(plan_seconds(held.plan.types, seconds))
    assert held.plan.predicted >= plain.plan.predicted  # speed costs predicted loss, never buys it
    assert written.bytes == held.plan.bytes <= mix.bytes
    assert torch.isfinite(llama_cpp_log_probs(written.path, ids[:1])).all()
    assert speed.to_dict()["mix_tokens_per_second"] == pytest.approx(1 / speed.mix_seconds)


def test_a_cost_the_noise_outweighed_is_refused_not_allocated_by(tmp_path, monkeypatch):
    monkeypatch.setenv("MASA_CACHE", str(tmp_path))
    matrices = [("blk.0.ffn_up.weight", np.zeros((8, 256), np.float32), "")]
    options = {"blk.0.ffn_up.weight": [Option("Q2_K", 100, 0.2), Option("Q4_K", 200, 0.1)]}
    with pytest.raises(
        UserError, match=rf"decode cost of Q2_K came out at or below zero .* remove {tmp_path}"
    ):
        speed_plan(SpeedTarget(tokens_per_second=10.0), options, matrices, lambda types: {"Q2_K": -0.003,
                   "Q4_K": 0.05}, 0, 1000, False, None)  # fmt: skip


def _seconds(path) -> dict[str, dict[str, float]]:
    """Each matrix of the file at `path`: seconds per type at `COSTS`, an untied embedding free (a lookup)."""
    import gguf

    tensors = {t.name: int(np.prod(t.shape)) for t in gguf.GGUFReader(str(path)).tensors if len(t.shape) == 2}
    free = {"token_embd.weight"} if "output.weight" in tensors else set()
    return {n: {t: 0.0 if n in free else w * c * 1e-9 for t, c in COSTS.items()} for n, w in tensors.items()}


def test_the_summary_line_says_the_limit_the_prediction_and_what_it_cost():
    from compressor.cli.gguf_report import speed_line

    record = SpeedPlan(SpeedTarget(mix=True), 1 / 100, "q2_k", 1 / 100, 1 / 104, 1 / 85, 3.0).to_dict()
    assert speed_line(record) == (
        "Decode predicted on this CPU (1 thread): 104.0 tokens/s, held to llama.cpp's q2_k mix of these bytes, 100.0 "
        "tokens/s; 85.0 tokens/s without the limit. The matrices' time alone: llama.cpp measures fewer tokens/s for "
        "every file alike."
    )
    within = SpeedPlan(SpeedTarget(tokens_per_second=40), 1 / 40, None, None, 1 / 50, 1 / 50, 0.0).to_dict()
    assert "50.0 tokens/s, held to 40.0 tokens/s; the allocation was already within it" in speed_line(within)
    assert within["mix_tokens_per_second"] is None and within["threads"] == 1


@pytest.mark.parametrize("command", ["export", "compress"])
def test_a_limit_out_of_reach_is_refused_before_any_weight_or_statistic(tmp_path, monkeypatch, command):
    """`export --size S --speed N` on a folder, and `compress --size S --speed N` where it chooses types alone
    (Gemma 3: one MLP width for all layers): a limit faster than the fastest file of those bytes (the config's
    every candidate type priced at `COSTS`, measured on the config's layer shape) is refused in one line before the
    weights are read; a limit within reach goes on to them."""
    pytest.importorskip("xllamacpp")
    from conftest import tiny_model
    from test_gguf_tokenizer import OVERRIDES, bundled_tokenizer_files

    import compressor.api.export as export_module
    import compressor.api.size as size_module
    from compressor.api import size_time
    from compressor.api.export import export
    from compressor.api.run_options import CompressOptions
    from compressor.api.size import compress_to_size
    from compressor.quantize import decode_cost
    from compressor.quantize.speed import check_reachable, config_layer_shape

    family = "llama" if command == "export" else "gemma3_text"
    model = tiny_model(family, vocab_size=49152, **OVERRIDES.get(family, {}))
    folder = tmp_path / family
    model.save_pretrained(folder)
    bundled_tokenizer_files(folder)
    shapes = []

    def costs(type_names, shape, threads, progress):
        shapes.append(shape)
        return {t: COSTS[t] for t in type_names}

    monkeypatch.setattr(decode_cost, "decode_costs", costs)
    monkeypatch.setattr(
        size_time, "measurement_seconds", lambda *a, **k: 0.0
    )  # `plan`'s price: test_size_time
    layer, budget = config_layer_shape(model.config), 6 << 20
    with pytest.raises(UserError, match=r"predicted at ([0-9.]+) tokens/s") as refused:
        check_reachable(model.config, layer, budget, SpeedTarget(tokens_per_second=1e9), None, lambda t: costs(
            t, layer, 1, False))  # fmt: skip
    fastest = float(refused.value.args[0].split("predicted at ")[1].split(" ")[0])

    class WeightsRead(Exception):
        pass

    def read(*args, **kwargs):
        raise WeightsRead

    for module in (export_module, size_module):
        monkeypatch.setattr(module, "load_model", read)
    monkeypatch.setattr(size_module, "measure_original", read)

    def run(speed: str):
        if command == "export":
            return export(str(folder), tmp_path / "m.gguf", size="6MiB", speed=speed, progress=False)
        return compress_to_size(str(folder), CompressOptions(size="6MiB", speed=speed, out=str(tmp_path / "m.gguf"),
                                                             evaluate=False), progress=False)  # fmt: skip

    with pytest.raises(
        UserError, match=rf"the fastest file of these bytes is predicted at {fastest:.1f} tokens/s"
    ):
        run(f"{2 * fastest:.1f}")
    assert shapes[-1] == layer == LayerShape(64, 4, 2, 16, model.config.intermediate_size)
    with pytest.raises(WeightsRead):  # within reach: on to the weights
        run(f"{fastest / 2:.1f}")
    assert not (tmp_path / "m.gguf").exists()


def test_a_mixture_of_experts_is_refused_from_its_config():
    from conftest import tiny_config

    from compressor.quantize.speed import config_layer_shape

    with pytest.raises(UserError, match=r"--speed: a mixture of experts' decode cost is not measured"):
        config_layer_shape(tiny_config("mixtral"))
    assert config_layer_shape(tiny_config("llama")).intermediate == tiny_config("llama").intermediate_size
