"""`--rounding compensated` (`quantize/compensated.py`, `quantize/rounding.py`): GPTQ's error feedback into ggml's
block types. The math on matrices whose inputs are correlated (or white) by construction, as GPTQ's is tested;
a tiny model's file run by llama.cpp; the bundled model end to end in the long tests."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_gguf_export import VOCAB, byte_tokenizer_gguf, k_quant_model, llama_cpp_log_probs

from compressor.runtime.errors import NumericalError

pytest.importorskip(
    "xllamacpp", reason="llama.cpp's wheel is not installed (pip install masa-compress[gguf])"
)

from compressor.quantize.compensated import (  # noqa: E402 - after the skip: the quantizer is llama.cpp's
    DAMPING,
    ROW_SCALED_TYPES,
    compensated_quantize,
    inverse_factor,
    output_error,
)
from compressor.quantize.ggml_quantize import dequantize_with_llama_cpp, quantize_with_llama_cpp  # noqa: E402

TYPES = (
    "Q8_0",
    "Q5_0",
    "Q4_0",
    "Q4_1",
    "IQ4_NL",
    "Q6_K",
    "Q4_K",
    "Q3_K",
    "Q2_K",
    "IQ4_XS",
    "IQ3_S",
    "IQ2_XS",
)


def correlated_inputs(width: int, tokens: int = 4096, seed: int = 0) -> torch.Tensor:
    """E[x xᵀ] of inputs driven by 16 shared factors plus mixed noise: strongly correlated columns."""
    rng = np.random.default_rng(seed)
    mixing = rng.standard_normal((width, width)) * 0.3 + np.eye(width)
    x = rng.standard_normal((tokens, width)) @ mixing.T * 0.3 + rng.standard_normal((tokens, 16)) @ (
        rng.standard_normal((16, width))
    )
    return torch.from_numpy(x.T @ x / tokens)


def weights(rows: int, width: int, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, width)).astype(np.float32)


def nearest(array: np.ndarray, type_name: str, importance: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    blocks = quantize_with_llama_cpp(array, type_name, importance.astype(np.float32))
    return blocks, dequantize_with_llama_cpp(blocks, type_name, array.shape)


@pytest.mark.parametrize("type_name", TYPES)
def test_correlated_inputs_lower_the_output_error_against_nearest(type_name):
    """‖(W − W̃) X‖² with the rounding compensated is well below llama.cpp's own with the importance matrix
    (measured on this construction: 0.19x (Q4_0) to 0.60x (Q2_K)); the blocks decode to the matrix returned."""
    autocorr, array = correlated_inputs(512), weights(64, 512)
    _, plain = nearest(array, type_name, np.diag(autocorr.numpy()))
    blocks, decoded = compensated_quantize(array, type_name, inverse_factor(autocorr))
    assert np.array_equal(dequantize_with_llama_cpp(blocks, type_name, array.shape), decoded)
    assert blocks.shape == quantize_with_llama_cpp(array, type_name, np.ones(512, np.float32)).shape
    ratio = output_error(array, decoded, autocorr) / output_error(array, plain, autocorr)
    assert ratio < 0.75, ratio


@pytest.mark.parametrize("type_name", TYPES)
def test_white_inputs_round_as_nearest(type_name):
    """With H diagonal nothing is pushed anywhere and each slab's weights are H's damped diagonal: the blocks are
    llama.cpp's own with that importance vector. The types whose quantizer reads the whole row's mean square
    (`ROW_SCALED_TYPES`) get it through filler blocks, equal up to fp32 sums' rounding: a few rows differ."""
    rng = np.random.default_rng(2)
    diagonal = rng.uniform(0.1, 3.0, 512)
    autocorr = torch.diag(torch.from_numpy(diagonal))
    array = weights(64, 512)
    blocks, decoded = compensated_quantize(array, type_name, inverse_factor(autocorr))
    plain_blocks, plain = nearest(array, type_name, diagonal + DAMPING * diagonal.mean())
    if type_name not in ROW_SCALED_TYPES:
        assert np.array_equal(blocks, plain_blocks)
    else:
        assert (blocks != plain_blocks).any(1).mean() < 0.1
        error, plain_error = output_error(array, decoded, autocorr), output_error(array, plain, autocorr)
        assert abs(error - plain_error) < 1e-3 * plain_error


def test_rows_round_independently_of_the_others():
    """The same inverse factor serves every row: a subset of rows (the allocation's samples) or rows in another
    order (Q/K rows permuted for llama.cpp's rope) round to the same blocks."""
    autocorr, array = correlated_inputs(256), weights(48, 256)
    factor = inverse_factor(autocorr)
    blocks, _ = compensated_quantize(array, "Q4_K", factor)
    order = np.random.default_rng(3).permutation(48)
    permuted, _ = compensated_quantize(array[order], "Q4_K", factor)
    assert np.array_equal(permuted, blocks[order])
    part, _ = compensated_quantize(array[5:17], "Q4_K", factor)
    assert np.array_equal(part, blocks[5:17])


def test_lazy_batches_change_nothing_but_the_order_of_sums():
    autocorr, array = correlated_inputs(512), weights(32, 512)
    factor = inverse_factor(autocorr)
    _, batched = compensated_quantize(array, "Q4_K", factor, lazy_columns=256)
    _, whole = compensated_quantize(array, "Q4_K", factor, lazy_columns=512)
    error = output_error(array, whole, autocorr)
    assert abs(output_error(array, batched, autocorr) - error) < 1e-3 * error


def test_the_inverse_factor_is_the_upper_cholesky_factor_of_the_damped_inverse():
    """U upper, positive diagonal, UᵀU = (H + d·mean(diag H)·I)⁻¹: the factor GPTQ's code builds (factor H, form
    its inverse, factor that), which is unique, built here from one factorization of the reversed H."""
    autocorr = correlated_inputs(256)
    factor = inverse_factor(autocorr)
    upper = factor.U
    assert torch.equal(upper, torch.triu(upper)) and bool((torch.diagonal(upper) > 0).all())
    damped = autocorr + factor.damping * float(torch.diagonal(autocorr).mean()) * torch.eye(
        256, dtype=torch.float64
    )
    gptq = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(damped)), upper=True)
    torch.testing.assert_close(upper, gptq, rtol=1e-10, atol=1e-12 * float(gptq.abs().max()))
    identity = upper @ damped @ upper.T  # U H Uᵀ = I when UᵀU = H⁻¹
    torch.testing.assert_close(identity, torch.eye(256, dtype=torch.float64), rtol=0, atol=1e-9)


def test_damping_grows_until_the_inverse_factors_and_is_reported():
    """Not positive definite (an eigenvalue of −0.5, mean diagonal 0.25): relative damping 0.01, 0.1 and 1 fail,
    10 factors (the fourth attempt); all zero: None (no output error to compensate); not finite: one error."""
    factor = inverse_factor(torch.diag(torch.tensor([1.0, -0.5], dtype=torch.float64)))
    assert factor.attempts == 4 and factor.damping == pytest.approx(10.0)
    assert inverse_factor(torch.zeros(4, 4, dtype=torch.float64)) is None
    with pytest.raises(NumericalError, match="non-finite"):
        inverse_factor(torch.full((4, 4), float("nan"), dtype=torch.float64))


#: A llama layer's GGUF roles and the module each one is (tests may name the family's paths).
ROLES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
         "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
         "ffn_down": "mlp.down_proj"}  # fmt: skip


def correlated_model():
    """A tiny llama (hidden 256) whose embedding is rank 8 plus a little noise: its layers' inputs are correlated,
    as a trained model's are and a random model's are not."""
    model = k_quant_model(num_hidden_layers=2)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        low_rank = torch.randn(VOCAB, 8, generator=generator) @ torch.randn(8, 256, generator=generator)
        model.model.embed_tokens.weight.copy_(
            0.3 * low_rank + 0.02 * torch.randn(VOCAB, 256, generator=generator)
        )
    return model


def input_grams(model, ids) -> dict[str, torch.Tensor]:
    """Σ x xᵀ of every nn.Linear's input over `ids` (fp64), by module path."""
    grams, hooks = {}, []
    for path, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):

            def add(_, args, path=path):
                x = args[0].reshape(-1, args[0].shape[-1]).double()
                grams[path] = grams.get(path, 0) + x.T @ x

            hooks.append(module.register_forward_pre_hook(add))
    with torch.no_grad():
        model(ids)
    for hook in hooks:
        hook.remove()
    return grams


def test_a_tiny_models_compensated_file_holds_matrices_closer_in_output(tmp_path):
    """`write_gguf` with the compensated rounder: the same types as `nearest`, a file llama.cpp runs, and its layer
    matrices, read back from the file and decoded by ggml, have well below the summed output error on the
    calibration tokens of llama.cpp's own rounding with the same importance weights (q4_0; attn_v, rounded
    `nearest` in both, counted in both). The Q/K rows are permuted for llama.cpp's rope in the file: the error is
    the same for rows in any order."""
    import gguf

    from compressor.checkpoint.gguf_export import write_gguf
    from compressor.checkpoint.gguf_families import permute_for_rope
    from compressor.quantize.importance import measure_importance
    from compressor.quantize.rounding import compensated_blocks

    tokenizer = byte_tokenizer_gguf(tmp_path / "bytes.gguf")
    model = correlated_model()
    ids = torch.randint(0, VOCAB, (8, 64), generator=torch.Generator().manual_seed(0))
    importance = measure_importance(model, ids, progress=False).weights
    records = []

    def rounder(matrices):
        blocks, record = compensated_blocks(model, ids, matrices, progress=False)
        records.append(record)
        return blocks

    written = {
        name: write_gguf(model, tokenizer, tmp_path / f"{name}.gguf", tensor_type="q4_0", importance=importance,
                         rounding=rounder if name == "compensated" else None)
        for name in ("nearest", "compensated")
    }  # fmt: skip
    assert written["compensated"].types == written["nearest"].types
    assert (
        records[0].matrices == 2 * 6 and records[0].windows == 8 and not records[0].damped
    )  # attn_v: nearest
    grams, modules = input_grams(model, ids), dict(model.named_modules())
    errors = dict.fromkeys(written, 0.0)
    for name, result in written.items():
        for tensor in gguf.GGUFReader(str(result.path)).tensors:
            if not tensor.name.startswith("blk.") or len(tensor.shape) != 2:
                continue
            _, layer, role, _ = tensor.name.split(".")
            path = f"model.layers.{layer}.{ROLES[role]}"
            original = modules[path].weight.detach().numpy()
            if role in ("attn_q", "attn_k"):
                original = permute_for_rope(original, 4 if role == "attn_q" else 2)
            decoded = dequantize_with_llama_cpp(
                np.array(tensor.data), tensor.tensor_type.name, original.shape
            )
            errors[name] += output_error(original, decoded, grams[path])
    assert errors["compensated"] < 0.5 * errors["nearest"], errors
    ids_scored = ids[:1, :32]
    with torch.no_grad():
        expected = torch.log_softmax(model(ids_scored).logits.float(), dim=-1)
    assert (llama_cpp_log_probs(written["compensated"].path, ids_scored) - expected).abs().max() < 0.5


def test_a_q8_0_file_rounded_compensated_measures_no_importance_weights(tmp_path, monkeypatch):
    """q8_0 reads no importance weights: `export --type q8_0 --rounding compensated` measures none (no backward
    pass) and compensates from the calibration windows alone."""
    from conftest import tiny_model_dir

    import compressor.api.export as export_module

    folder = tiny_model_dir(tmp_path / "tiny")
    tokenizer = byte_tokenizer_gguf(tmp_path / "bytes.gguf")
    monkeypatch.setattr(
        export_module, "measure_for_export", lambda *a, **k: pytest.fail("importance measured")
    )
    result = export_module.export(str(folder), tmp_path / "m.gguf", tensor_type="q8_0", rounding="compensated",
                                  tokenizer_from=str(tokenizer), progress=False)  # fmt: skip
    assert result.details["imatrix"] == "none" and result.details["rounding"]["matrices"] > 0


def test_statistics_on_the_quantized_stream_change_the_layers_above_the_first_only():
    """`stream="quantized"`: layer 0 reads the same inputs either way (its blocks are the same); the layers above
    read what the rounded layers below produce (other blocks); the model's weights are restored afterwards."""
    from compressor.quantize.rounding import compensated_blocks, layer_projections

    model = correlated_model()
    ids = torch.randint(0, VOCAB, (4, 32), generator=torch.Generator().manual_seed(0))
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    role_of = {suffix: role for role, suffix in ROLES.items()}
    matrices = [
        (f"blk.{layer}.{role_of[f'{block}.{name}']}.weight", m.weight.detach().numpy(), path, "Q4_0")
        for path, m in model.named_modules() if path in layer_projections(model)
        for layer, block, name in [path.split(".")[2:5]]
    ]  # fmt: skip
    original, _ = compensated_blocks(model, ids, matrices, progress=False)
    quantized, record = compensated_blocks(model, ids, matrices, progress=False, stream="quantized")
    assert record.stream == "quantized" and record.matrices == len(original) == 12  # attn_v: nearest
    for name in original:
        assert np.array_equal(original[name], quantized[name]) == name.startswith("blk.0."), name
    for name, parameter in model.named_parameters():
        assert torch.equal(parameter, before[name]), name


def test_errors_the_allocation_prices_are_the_compensated_roundings_own():
    """`compensated_errors`: with every row sampled (rows ≤ SAMPLE_ROWS), each type's error is exactly the
    output error of the matrix rounded compensated, on the autocorrelation of its input over the windows."""
    from compressor.quantize.compensated import DAMPING
    from compressor.quantize.rounding import compensated_errors

    model = correlated_model()
    ids = torch.randint(0, VOCAB, (4, 32), generator=torch.Generator().manual_seed(0))
    down = model.model.layers[1].mlp.down_proj
    array = down.weight.detach().numpy().copy()
    matrices = [("blk.1.ffn_down.weight", array, "model.layers.1.mlp.down_proj")]
    errors = compensated_errors(model, ids, matrices, lambda a: ["Q4_K", "Q8_0", "F16"], progress=False)
    autocorr = input_grams(model, ids)["model.layers.1.mlp.down_proj"] / ids.numel()
    _, decoded = compensated_quantize(array, "Q4_K", inverse_factor(autocorr, DAMPING))
    expected = output_error(array, decoded, autocorr)
    assert errors["blk.1.ffn_down.weight"]["Q4_K"] == pytest.approx(expected, rel=1e-2)  # H: fp32 products
    assert 0 < errors["blk.1.ffn_down.weight"]["F16"] < errors["blk.1.ffn_down.weight"]["Q8_0"] < expected


def test_a_budget_priced_on_compensated_errors_fits_and_predicts_less(tmp_path):
    """A byte budget whose allocation prices the compensated errors: the file fits, its layer matrices are the
    rounder's, and at the same bytes the predicted rise is below the plan that prices `nearest`'s errors (inputs
    correlated: compensation lowers every quantized type's error)."""
    from compressor.checkpoint.gguf_export import write_gguf
    from compressor.quantize.budget_chooser import BudgetChooser
    from compressor.quantize.importance import measure_importance
    from compressor.quantize.rounding import compensated_blocks, compensated_errors

    tokenizer = byte_tokenizer_gguf(tmp_path / "bytes.gguf")
    model = correlated_model()
    ids = torch.randint(0, VOCAB, (4, 32), generator=torch.Generator().manual_seed(0))
    importance = measure_importance(model, ids, progress=False, gradient_windows=2)
    budget = 700_000
    plans = {}

    def errors(matrices, types_of):
        return compensated_errors(model, ids, matrices, types_of, progress=False)

    for name in ("nearest", "compensated"):
        chooser = BudgetChooser(model, importance, budget, progress=False,
                                compensated=errors if name == "compensated" else None)  # fmt: skip
        rounder = (
            (lambda m: compensated_blocks(model, ids, m, progress=False)[0])
            if name == "compensated"
            else None
        )
        written = write_gguf(model, tokenizer, tmp_path / f"{name}.gguf", importance=importance.weights,
                             choose_types=chooser, rounding=rounder)  # fmt: skip
        assert written.bytes <= budget
        plans[name] = chooser.plan
    assert plans["compensated"].predicted < 0.8 * plans["nearest"].predicted, plans


def test_the_rounding_after_the_allocation_reads_the_statistics_its_walk_kept(tmp_path, monkeypatch):
    """`kept`: the errors' walk keeps each layer's autocorrelations; the rounding then reads them (no walk: the
    runner refuses to start) and writes the blocks it writes after a walk of its own, bit for bit."""
    from compressor.quantize import rounding
    from compressor.quantize.rounding import KeptAutocorrelations, compensated_blocks, compensated_errors

    model = correlated_model()
    ids = torch.randint(0, VOCAB, (4, 32), generator=torch.Generator().manual_seed(0))
    role_of = {suffix: role for role, suffix in ROLES.items()}
    matrices = [
        (f"blk.{layer}.{role_of[f'{block}.{name}']}.weight", m.weight.detach().numpy(), path, "Q4_0")
        for path, m in model.named_modules() if path in rounding.layer_projections(model)
        for layer, block, name in [path.split(".")[2:5]]
    ]  # fmt: skip
    walked, record = compensated_blocks(model, ids, matrices, progress=False)
    assert not record.kept_statistics
    kept = KeptAutocorrelations(tmp_path)
    compensated_errors(model, ids, [m[:3] for m in matrices], lambda a: ["Q4_0"], progress=False, kept=kept)
    assert kept.inputs == {0: {"attn", "o", "mlp", "down"}, 1: {"attn", "o", "mlp", "down"}}
    kept_numbers = sum(t.numel() for layer in kept.inputs for t in kept.read(layer).values())
    assert rounding.autocorrelation_bytes(model, matrices) == 8 * kept_numbers
    monkeypatch.setattr(rounding, "LayerRunner", lambda *a, **k: pytest.fail("walked again"))
    read, record = compensated_blocks(model, ids, matrices, progress=False, kept=kept)
    assert record.kept_statistics and read.keys() == walked.keys()
    assert all(np.array_equal(read[name], walked[name]) for name in walked)
    with pytest.raises(ValueError, match="original stream"):
        compensated_blocks(model, ids, matrices, progress=False, stream="quantized", kept=kept)


def test_a_compensated_budget_walks_the_calibration_once_and_leaves_no_temporary_files(tmp_path, monkeypatch):
    """`export --size --rounding compensated` on a tiny model folder: one walk (the allocation's), the rounding
    from the statistics it kept, the temporary folder beside the output gone after, and gone also when the
    rounding fails."""
    from conftest import cache_of_its_own, tiny_model_dir

    import compressor.api.export as export_module
    from compressor.quantize import rounding

    monkeypatch.setenv(
        "MASA_CACHE", str(cache_of_its_own(tmp_path / "cache"))
    )  # no errors from an earlier test
    folder = tiny_model_dir(tmp_path / "tiny", hidden_size=256, intermediate_size=512)
    tokenizer = byte_tokenizer_gguf(tmp_path / "bytes.gguf")
    out = tmp_path / "out"
    out.mkdir()
    walks = []
    runner = rounding.LayerRunner
    monkeypatch.setattr(rounding, "LayerRunner", lambda *a, **k: walks.append(1) or runner(*a, **k))
    options = dict(
        bits_per_weight=5.5, rounding="compensated", calib_samples=4, tokenizer_from=str(tokenizer)
    )
    result = export_module.export(str(folder), out / "m.gguf", **options, progress=False)
    assert len(walks) == 1 and result.details["rounding"]["kept_statistics"]
    assert sorted(p.name for p in out.iterdir()) == ["m.gguf"]

    def failing(*args, **kwargs):
        raise RuntimeError("the rounding failed")

    monkeypatch.setattr(rounding, "compensated_quantize", failing)
    monkeypatch.setattr(rounding, "compensated_errors", lambda *a, kept=None, **k: _keep_one(kept) or {})
    with pytest.raises(RuntimeError, match="the rounding failed"):
        export_module.export(str(folder), out / "n.gguf", **options, progress=False)
    assert sorted(p.name for p in out.iterdir()) == ["m.gguf"]


def _keep_one(kept) -> None:
    """Keep one layer's statistics in `kept`: the folder then holds a file when the failure comes."""
    kept.keep(0, {"attn": torch.eye(2, dtype=torch.float64)})


@pytest.mark.slow
@pytest.mark.long
def test_bundled_q2_k_mix_compensated_is_closer_to_the_original_in_llama_cpp(tmp_path):
    """The bundled model's q2_k mix, rounded compensated on 16 calibration windows: the same types, and on held-out
    validation windows scored by llama.cpp a mean KL to the original below llama.cpp's own rounding with the same
    importance weights (the 64-window validation runs: benchmarks/results/choices/compensated-rounding-*.json)."""
    from compressor.api import EvalSettings, evaluate
    from compressor.api.export import export

    written = {
        rounding: export("smollm2-135m", tmp_path / f"{rounding}.gguf", tensor_type="q2_k", calib_samples=16,
                         rounding=rounding, progress=False).details
        for rounding in ("nearest", "compensated")
    }  # fmt: skip
    assert written["compensated"]["type_counts"] == written["nearest"]["type_counts"]
    assert written["compensated"]["rounding"]["matrices"] == 30 * 6  # attn_v: nearest
    settings = EvalSettings(split="validation", seq_len=512, max_tokens=2048, engine="llama.cpp")
    kl = {
        rounding: evaluate(
            str(tmp_path / f"{rounding}.gguf"), settings, progress=False
        ).faithfulness.kl_to_original
        for rounding in written
    }
    assert kl["compensated"] < kl["nearest"], kl
