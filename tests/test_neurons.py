"""The MLP's `neurons` form: the pure math of `compressor.math.neurons` on planted data, then the form in the pipeline
on tiny random models of every supported family (budget, exact accounting, save→load identical logits)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from conftest import random_windows, reloaded_identically, tiny_model

from compressor.api.pipeline import compress_model
from compressor.checkpoint import save_compressed
from compressor.math.accounting import NEURON_READER
from compressor.math.neurons import (
    ORDERS,
    _greedy_steps,
    block_greedy_order,
    greedy_order,
    lower_product,
    neuron_order,
    order_tail,
    output_error,
    refit_down,
    regularized,
)
from compressor.math.whitening import whitening_factor
from compressor.methods.masa.mlp import RIDGE
from compressor.modeling.adapters import MLP_PROJECTIONS, get_adapter
from compressor.recipes.schema import CompressionSettings
from compressor.runtime.errors import UserError
from compressor.statistics.capture import collect_statistics


def _activations(tokens=400, neurons=24, hidden=8, seed=0):
    """Correlated activations z (tokens, I), their autocorrelation, and a down_proj D (hidden, I)."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(neurons, neurons, generator=g, dtype=torch.float64)
    z = torch.randn(tokens, neurons, generator=g, dtype=torch.float64) @ mix
    down = torch.randn(hidden, neurons, generator=g, dtype=torch.float64)
    return z, z.T @ z / tokens, down


@pytest.mark.parametrize("ridge", [0.0, 0.05])
def test_the_neuron_steps_leave_the_statistics_as_they_were(ridge):
    # The order's tail symmetrizes and damps its own copy in place: the statistics a run holds (in memory, for
    # every layer) must come out unchanged, also when the Cholesky needs damping (a dead neuron here).
    z, c, down = _activations(seed=5)
    z[:, 3] = 0.0
    c = z.T @ z / len(z)
    c[0, 1] += 1e-12  # symmetric only up to rounding, as accumulated sums are
    before = c.clone()
    found = order_tail(c, down, neuron_order("greedy-block", c, down, ridge), ridge)
    assert found.damping > 0 or ridge > 0
    refit = refit_down(c, down, found, 12, ridge)
    output_error(c, down, refit, found.kept(12), ridge, found.damping)
    assert torch.equal(c, before)


@pytest.mark.parametrize("rule", ORDERS)
@pytest.mark.parametrize("ridge", [0.0, 0.05])
def test_refit_is_the_least_squares_solution_and_the_tail_its_error(rule, ridge):
    z, c, down = _activations()
    found = order_tail(c, down, neuron_order(rule, c, down, ridge), ridge)
    assert found.damping == 0.0
    assert float(found.tail[0]) == pytest.approx(output_error(c, down, down[:, :0], torch.arange(0), ridge))
    for width in (1, 5, 13, 24):
        kept = found.kept(width)
        refit = refit_down(c, down, found, width, ridge)
        # The error at every width is the refit's (the allocation reads the tail; the model gets the refit).
        assert float(found.tail[width]) == pytest.approx(
            output_error(c, down, refit, kept, ridge), rel=1e-9, abs=1e-9
        )
        # Brute force on the activations themselves: min ‖Z Dᵀ − Z_S D'ᵀ‖² + λ m ‖D_S − D'‖² (rows appended).
        scale = (ridge * float(torch.diagonal(c).mean()) * len(z)) ** 0.5
        inputs = torch.cat([z[:, kept], scale * torch.eye(width, dtype=torch.float64)])
        targets = torch.cat([z @ down.T, scale * down[:, kept].T])
        expected = torch.linalg.lstsq(inputs, targets).solution.T
        torch.testing.assert_close(refit, expected, rtol=1e-8, atol=1e-9)
    assert float(found.tail[-1]) == pytest.approx(0.0, abs=1e-8 * float(found.tail[0]))


def test_the_error_at_width_zero_is_the_whitened_output_energy():
    """The report reads a neuron unit's output energy ‖D S‖² (S Sᵀ = C) from its tail at width 0."""
    _, c, down = _activations()
    found = order_tail(c, down, neuron_order("greedy", c, down, 0.0), 0.0)
    energy = float((down @ whitening_factor(c).S).square().sum())
    assert float(found.tail[0]) == pytest.approx(energy, rel=1e-12)


def test_keeping_every_neuron_reproduces_down_proj():
    _, c, down = _activations()
    found = order_tail(c, down, neuron_order("energy", c, down, 0.0), 0.0)
    torch.testing.assert_close(refit_down(c, down, found, down.shape[1], 0.0), down, rtol=1e-9, atol=1e-9)


def test_greedy_adds_the_best_neuron_at_every_step():
    _, c, down = _activations(neurons=12)
    order = greedy_order(c, down, dtype=torch.float64)  # the algorithm, exactly (the default selects in fp32)
    assert sorted(order.tolist()) == list(range(12))
    for step in range(11):
        prefix = order[:step].tolist()

        def error_with(j, prefix=prefix, step=step):
            candidate = torch.tensor(prefix + [j] + [i for i in range(12) if i not in prefix and i != j])
            return float(order_tail(c, down, candidate, 0.0).tail[step + 1])

        rest = [j for j in range(12) if j not in prefix]
        assert error_with(int(order[step])) == pytest.approx(min(error_with(j) for j in rest), rel=1e-9)


def test_greedy_in_float32_loses_nothing_measurable():
    _, c, down = _activations(neurons=48, tokens=2000)
    exact = order_tail(c, down, greedy_order(c, down, dtype=torch.float64), 0.0).tail
    single = order_tail(c, down, greedy_order(c, down), 0.0).tail
    torch.testing.assert_close(single, exact, rtol=1e-3, atol=1e-9 * float(exact[0]))


def test_the_greedy_on_numpy_arrays_and_on_tensors_is_one_order():
    """The CPU runs the greedy's loop on numpy arrays, an accelerator on torch tensors: the same steps, the same
    order (in fp64, 200 neurons: the working arrays drop the kept neurons five times on the way)."""
    _, c, down = _activations(neurons=200, tokens=3000, hidden=16)
    on_tensors = _greedy_steps(
        c, down, lambda *shape: torch.zeros(shape, dtype=torch.float64), torch.finfo(torch.float64).eps
    )
    assert greedy_order(c, down, dtype=torch.float64).tolist() == on_tensors
    assert sorted(on_tensors) == list(range(200))


def test_a_singular_autocorrelation_in_float32_never_divides_by_rounding():
    """Fewer tokens than neurons, a few massive channels, float32: the pivots of exhausted neurons are rounding
    (zero or negative when recomputed). They are marked exhausted, never divided by: no inf, no NaN, and the
    neurons the tokens span explain them."""
    g = torch.Generator().manual_seed(2)  # a case whose recomputed pivot was once exactly 0
    z = torch.nn.functional.silu(3 * torch.randn(300, 1536, generator=g)) * torch.randn(
        300, 1536, generator=g
    )
    z[:, :5] *= 100
    c = regularized(z.T.double() @ z.double() / 300, 0.0)
    down = torch.randn(64, 1536, generator=g, dtype=torch.float64)
    with np.errstate(divide="raise", invalid="raise", over="raise"):
        order = greedy_order(c, down)
    assert sorted(order.tolist()) == list(range(1536))
    tail = order_tail(c, down, order, 0.0).tail
    assert float(tail[300]) <= 1e-3 * float(tail[0])  # 300 tokens: 300 neurons span them


def test_the_block_greedy_of_one_neuron_per_block_is_the_greedy():
    _, c, down = _activations(neurons=40, tokens=1000)
    exact = greedy_order(c, down, dtype=torch.float64)
    assert torch.equal(block_greedy_order(c, down, block=1, dtype=torch.float64), exact)


def test_the_block_greedy_of_independent_neurons_is_the_greedy():
    """With uncorrelated inputs no choice changes another neuron's gain: blocks lose nothing."""
    g = torch.Generator().manual_seed(3)
    c = torch.diag(torch.rand(64, generator=g, dtype=torch.float64) + 0.1)
    down = torch.randn(8, 64, generator=g, dtype=torch.float64)
    assert torch.equal(
        block_greedy_order(c, down, block=16, dtype=torch.float64), greedy_order(c, down, dtype=torch.float64)
    )


def test_a_block_skips_a_neuron_its_earlier_members_already_explain():
    """Two identical neurons have the same gain and land in one block: the copy adds nothing and goes last."""
    z, _, down = _activations(neurons=24, tokens=600)
    z[:, 5] = z[:, 2]
    down[:, 5] = down[:, 2]
    c = z.T @ z / len(z)
    order = block_greedy_order(c, down, block=24, dtype=torch.float64).tolist()
    first, second = sorted((order.index(2), order.index(5)))
    assert sorted(order) == list(range(24)) and second == 23


def test_the_block_greedy_leaves_a_float32_input_unless_told_to_overwrite_it():
    """Its Schur complement is updated in place: on an input already in its dtype, in a copy unless `overwrite`
    (what `neuron_order` passes for the copy it made); the same order either way."""
    _, c, down = _activations(neurons=96, tokens=2000, hidden=12)
    c32 = c.float()
    before = c32.clone()
    order = block_greedy_order(c32, down, block=8)
    assert torch.equal(c32, before)
    assert torch.equal(block_greedy_order(c32, down, block=8, overwrite=True), order)
    assert not torch.equal(c32, before)  # overwritten, as asked


@pytest.mark.parametrize("n", [1, 511, 512, 1100])
def test_the_lower_triangular_product_is_the_full_product(n):
    g = torch.Generator().manual_seed(n)
    lower = torch.randn(n, n, generator=g, dtype=torch.float64).tril()
    a = torch.randn(7, n, generator=g, dtype=torch.float64)
    torch.testing.assert_close(lower_product(a, lower), a @ lower, rtol=1e-12, atol=1e-12)


def test_the_block_greedy_explains_nearly_what_the_greedy_does():
    _, c, down = _activations(neurons=128, tokens=4000, hidden=16)
    greedy = order_tail(c, down, greedy_order(c, down), 0.0).tail
    blocked = order_tail(c, down, block_greedy_order(c, down, block=16), 0.0).tail
    energy = order_tail(c, down, neuron_order("energy", c, down, 0.0), 0.0).tail
    widths = slice(16, 112)
    assert bool((blocked[widths] <= 1.10 * greedy[widths]).all())
    assert float(blocked[widths].sum()) < float(energy[widths].sum())  # and better than the cheap order


def test_planted_dead_neurons_go_last():
    """Neurons that never fire (zero activations) explain nothing: every order keeps them last."""
    z, _, down = _activations()
    z[:, [3, 7]] = 0.0
    c = z.T @ z / len(z) + 1e-9 * torch.eye(z.shape[1], dtype=torch.float64)  # damped: C itself is singular
    for rule in ORDERS:
        order = neuron_order(rule, c, down, 0.0)
        assert set(order[-2:].tolist()) == {3, 7}, rule


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_every_order_is_a_permutation_with_fewer_tokens_than_neurons(dtype):
    """A short calibration (tokens < neurons) leaves C singular: the greedy order runs out of energy to explain
    part-way and must still return every neuron exactly once (the rest in index order), undamped."""
    z, c, down = _activations(tokens=10, neurons=48)
    for rule in ORDERS:
        order = greedy_order(c, down, dtype=dtype) if rule == "greedy" else neuron_order(rule, c, down, 0.0)
        assert sorted(order.tolist()) == list(range(48)), rule
    tail = order_tail(c, down, greedy_order(c, down, dtype=dtype), 0.0).tail
    # Ten neurons span the ten tokens' activations (up to the damping the singular C needs).
    assert float(tail[10]) <= 1e-3 * float(tail[0])


def _compress(model, ratio=0.3, **settings):
    adapter = get_adapter(model)
    windows = random_windows()
    stats = collect_statistics(model, adapter, windows, progress=False, mlp=True)
    settings = CompressionSettings(**{"targets": "attn,mlp", **settings})
    outcome = compress_model(model, adapter, stats, settings, ratio, progress=False, windows=windows)
    return outcome, stats, windows


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "gemma"])
@pytest.mark.parametrize("uniform", [False, True])
def test_neurons_form_meets_the_budget_and_reloads_exactly(family, uniform, tmp_path):
    model = tiny_model(family)
    outcome, _, _ = _compress(model, uniform_mlp=uniform)
    plan, adapter = outcome.plan, get_adapter(model)
    assert plan.params_after() <= plan.budget
    widths = []
    for layer in range(adapter.num_layers):
        gate, up, down = (adapter.projection(layer, p) for p in MLP_PROJECTIONS)
        assert all(isinstance(m, torch.nn.Linear) for m in (gate, up, down))  # a plain, narrower MLP
        assert gate.out_features == up.out_features == down.in_features == plan.get(layer, NEURON_READER).rank
        widths.append(down.in_features)
    assert min(widths) < 128  # the MLPs did shrink
    if uniform:
        assert len(set(widths)) == 1
    reloaded_identically(model, save_compressed(model, plan, tmp_path / "ckpt"))


def test_the_allocated_error_is_the_built_mlps():
    """Each layer's MLP output, measured on the calibration windows, is off by exactly the tail the allocation
    read at the width it chose (the sensitivity-weighted sum of those is the allocation's objective)."""
    model = tiny_model("llama")
    original = copy.deepcopy(model)
    outcome, stats, windows = _compress(model, targets="mlp")
    before, after = get_adapter(original), get_adapter(model)
    for layer in range(before.num_layers):
        inputs: list[torch.Tensor] = []
        handle = before.layers[layer].mlp.register_forward_pre_hook(
            lambda m, a, seen=inputs: seen.append(a[0])
        )
        with torch.no_grad():
            for window in windows:
                original(input_ids=window[None])
        handle.remove()
        x = torch.cat([t.reshape(-1, t.shape[-1]) for t in inputs])
        with torch.no_grad():
            error = (
                (before.layers[layer].mlp(x).double() - after.layers[layer].mlp(x).double()).square().sum(-1)
            )
        width = outcome.plan.get(layer, NEURON_READER).rank
        c = stats.autocorr("down", layer)
        down = before.projection(layer, NEURON_READER).weight.detach().double()
        tail = order_tail(
            c, down, neuron_order(CompressionSettings().neuron_order, c, down, RIDGE), RIDGE
        ).tail
        # fp32 model against the fp64 tail: agreement to float32 rounding of the outputs.
        assert float(error.mean()) == pytest.approx(float(tail[width]), rel=2e-3, abs=1e-7)


def test_mlp_lowrank_keeps_the_former_form():
    model = tiny_model("llama")
    outcome, _, _ = _compress(model, mlp="lowrank")
    assert {pp.mode for pp in outcome.plan.projections if pp.projection in MLP_PROJECTIONS} <= {
        "lowrank",
        "dense",
    }


@pytest.mark.parametrize("uniform", [True, False])
def test_export_dense_of_a_neurons_checkpoint_is_a_standard_model(uniform, tmp_path):
    """With one width in every layer, export-dense writes the base architecture with a smaller intermediate_size
    (loads without remote code, same logits); with widths per layer, every MLP is padded to the widest."""
    from transformers import AutoModelForCausalLM

    from compressor.checkpoint import export_dense, load_compressed

    model = tiny_model("llama")
    outcome, _, _ = _compress(model, targets="mlp", ratio=0.3, uniform_mlp=uniform)
    path = save_compressed(model, outcome.plan, tmp_path / "ckpt")
    export = export_dense(path, tmp_path / "dense")
    dense = AutoModelForCausalLM.from_pretrained(export.path)  # no trust_remote_code
    widths = [outcome.plan.get(layer, NEURON_READER).rank for layer in range(get_adapter(model).num_layers)]
    assert dense.config.intermediate_size == max(widths) < 128
    assert len(set(widths)) == 1 if uniform else len(set(widths)) > 1
    if uniform:  # nothing padded: the export stores exactly the compressed model's numbers
        assert sum(p.numel() for p in dense.parameters()) == sum(p.numel() for p in model.parameters())
    x = random_windows(2, 12)
    with torch.no_grad():
        torch.testing.assert_close(dense(x).logits, load_compressed(path)(x).logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize("uniform", [False, True])
def test_width_multiple_keeps_every_width_a_multiple_within_the_budget(uniform, tmp_path):
    """`--width-multiple 32`: every layer's width a multiple of 32 (blocks a quantized GGUF row fills), the budget
    kept, the checkpoint reloading to the same logits; the allocated error is the tail at that width."""
    model = tiny_model("llama")
    outcome, _, _ = _compress(model, targets="mlp", ratio=0.3, width_multiple=32, uniform_mlp=uniform)
    plan = outcome.plan
    readers = [plan.get(layer, NEURON_READER) for layer in range(get_adapter(model).num_layers)]
    # A layer whose MLP the allocation keeps whole is `dense`, at its full width (128, a multiple too).
    widths = [pp.rank if pp.mode == "neurons" else pp.in_features for pp in readers]
    assert all(w % 32 == 0 for w in widths) and min(widths) < 128
    assert plan.params_after() <= plan.budget
    assert plan.to_dict()["width_multiple"] == 32
    reloaded_identically(model, save_compressed(model, plan, tmp_path / "ckpt"))


def test_width_multiple_one_is_the_per_neuron_allocation():
    """The default (1) allocates exactly as before the option existed: one neuron per step."""
    a, b = tiny_model("llama"), tiny_model("llama")
    plan_default = _compress(a, targets="mlp")[0].plan
    plan_one = _compress(b, targets="mlp", width_multiple=1)[0].plan
    assert [pp.rank for pp in plan_default.projections] == [pp.rank for pp in plan_one.projections]
    assert "width_multiple" not in plan_default.to_dict()  # plans written before the option read the same


def test_width_multiple_must_divide_the_mlp():
    from compressor.runtime.errors import UserError

    with pytest.raises(UserError, match="--width-multiple 48: the MLP's width 128 is not a multiple"):
        _compress(tiny_model("llama"), targets="mlp", width_multiple=48)


def test_deci_layout_keeps_per_layer_widths_with_its_configuration_class(tmp_path):
    """`export --format hf --layout deci`: the DeciLM layout vLLM serves (its greedy output measured equal to
    transformers', benchmarks/results/vllm.md): one block entry per layer with that layer's MLP width, the
    configuration class shipped beside the weights, and weights that ARE the checkpoint's (a Llama model built
    with those per-layer widths gives its logits)."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, LlamaConfig, LlamaForCausalLM

    from compressor.checkpoint import export_dense, load_compressed

    model = tiny_model("llama")
    outcome, _, _ = _compress(model, targets="mlp", ratio=0.3)
    path = save_compressed(model, outcome.plan, tmp_path / "ckpt")
    folder = export_dense(path, tmp_path / "deci", layout="deci").path
    widths = [outcome.plan.get(layer, NEURON_READER).rank for layer in range(get_adapter(model).num_layers)]
    assert len(set(widths)) > 1
    config = AutoConfig.from_pretrained(folder, trust_remote_code=True)
    assert config.model_type == "nemotron-nas" and config.architectures == ["DeciLMForCausalLM"]
    assert [block.ffn.intermediate_size for block in config.block_configs] == widths
    assert {block.attention.n_heads_in_group for block in config.block_configs} == {
        config.num_attention_heads // config.num_key_value_heads
    }
    assert not hasattr(config.block_configs[0].ffn, "ffn_mult")  # engines read intermediate_size then
    state = load_file(folder / "model.safetensors")
    assert [state[f"model.layers.{i}.mlp.down_proj.weight"].shape[1] for i in range(len(widths))] == widths
    plain = {
        k: v for k, v in config.to_dict().items() if k not in ("block_configs", "auto_map", "model_type")
    }
    rebuilt = LlamaForCausalLM(LlamaConfig(**plain))
    for layer, width in zip(rebuilt.model.layers, widths, strict=True):
        layer.mlp.gate_proj = torch.nn.Linear(config.hidden_size, width, bias=False)
        layer.mlp.up_proj = torch.nn.Linear(config.hidden_size, width, bias=False)
        layer.mlp.down_proj = torch.nn.Linear(width, config.hidden_size, bias=False)
    rebuilt.load_state_dict(state, strict=False)
    rebuilt.tie_weights()
    x = random_windows(2, 12)
    with torch.no_grad():
        torch.testing.assert_close(
            rebuilt.eval()(x).logits, load_compressed(path)(x).logits, rtol=0, atol=1e-5
        )


def test_unknown_layout_is_refused(tmp_path):
    from compressor.checkpoint import export_dense

    with pytest.raises(UserError, match="--layout wide: unknown layout: choose one of padded, deci"):
        export_dense(tmp_path / "ckpt", tmp_path / "out", layout="wide")


def test_deci_layout_of_a_family_it_cannot_hold_is_refused_before_writing(tmp_path):
    from compressor.checkpoint import export_dense

    model = tiny_model("qwen2")  # q/k/v biases: vLLM's DeciLM reads one attention_bias for q/k/v/o
    outcome, _, _ = _compress(model, targets="mlp", ratio=0.3)
    path = save_compressed(model, outcome.plan, tmp_path / "ckpt")
    with pytest.raises(
        UserError, match="--layout deci: .* a qwen2 model has no form in it: use --layout padded"
    ):
        export_dense(path, tmp_path / "deci", layout="deci")
    assert not (tmp_path / "deci").exists()
