"""Structure and quantization types in one byte budget (`methods/masa/byte_structure.py`, `compress --size`)."""

from __future__ import annotations

import copy
import itertools

import numpy as np
import pytest
import torch
from conftest import random_windows
from test_gguf_export import VOCAB, k_quant_model, llama_cpp_log_probs, tokenizer_gguf  # noqa: F401 - a fixture

from compressor.api.pipeline import compress_model
from compressor.checkpoint.gguf_export import padded, planned_fixed_bytes, write_gguf
from compressor.methods.masa.byte_structure import (
    LEAST_TOKENS_PER_INPUT,
    SizeTarget,
    candidate_widths,
    combine,
    few_tokens_warning,
    smallest_matrices,
    trusted_targets,
)
from compressor.modeling.adapters import get_adapter
from compressor.quantize.budget_chooser import BudgetChooser
from compressor.quantize.byte_budget import rows_bytes
from compressor.recipes.schema import CompressionSettings
from compressor.runtime.errors import UserError
from compressor.statistics.capture import collect_statistics

#: `--size 76MiB` of the bundled model on 120 calibration windows (the fewest whose refits a byte budget prices), in
#: llama.cpp on the first 1,022 test tokens: at most this many times the original's perplexity (on 8 windows, before
#: structure needed enough tokens, measured 1.387 with 9.6M parameters removed; 120 windows passed on 2026-12-03).
BUNDLED_76MIB = 1.45

NATIVE = CompressionSettings(method="masa", targets="attn,mlp", attention="heads", mlp="neurons",
                             width_multiple=32, sharing="none", allocation="global")  # fmt: skip


def test_widths_offered_run_from_the_full_width_down_to_half_in_even_steps():
    assert candidate_widths(512, 32) == [512, 480, 448, 416, 384, 352, 320, 288, 256]
    widths = candidate_widths(
        8960, 32
    )  # the 1.5B model's MLP: steps of 256, so k-quants fit down_proj's rows
    assert widths[0] == 8960 and widths[-1] >= 4480 and len(widths) <= 24
    assert {w % 256 for w in widths} == {0} and np.all(np.diff(widths) == -256)


def test_a_refit_on_too_few_tokens_per_input_is_not_offered_and_the_line_says_how_many_windows_would_do():
    widths = {"attn": 576, "mlp": 1536}
    # Enough for both: 40 tokens per input of the wider.
    assert trusted_targets("attn,mlp", widths, lambda t: (120, 512)) == ("attn,mlp", [])
    # The MLP short (119 windows: 39.7 per neuron), the attention not.
    targets, lines = trusted_targets("attn,mlp", widths, lambda t: (119, 512))
    assert targets == "attn" and len(lines) == 1
    assert lines[0].startswith(
        "MLP widths not offered: 60,928 calibration tokens for 1,536 inputs per refit (39.7"
    )
    assert lines[0].endswith("40 per input (--calib-samples 120: windows of 512 tokens) let it compete")
    # Without the MLP a run reads fewer windows (`samples`, not `mlp_samples`): the attention is checked again on
    # those, and left out too when they are short.
    asked = []

    def windows_for(targets):
        asked.append(targets)
        return (100, 512) if "mlp" in targets else (40, 512)

    targets, lines = trusted_targets("attn,mlp", widths, windows_for)
    assert targets is None and asked == ["attn,mlp", "attn"]
    assert [line.split(" not offered")[0] for line in lines] == ["MLP widths", "query heads"]
    assert "(--calib-samples 45: windows of 512 tokens)" in lines[1]
    # A target not asked for is never checked nor named.
    assert trusted_targets("mlp", widths, lambda t: (256, 512)) == ("mlp", [])
    assert (
        LEAST_TOKENS_PER_INPUT * 1536 <= 256 * 512
    )  # the bundled model's default calibration offers its MLPs


def test_a_ratio_run_whose_refits_read_few_tokens_per_input_is_warned_with_the_windows_that_would_do():
    """The same threshold as the byte budget's, said (not enforced) for a `--ratio` run: the 1.5B recipe's 32
    windows of 512 give its MLP refits 1.8 tokens per neuron; the bundled model's 256 give 85 (no line)."""
    line = few_tokens_warning({"mlp": 8960, "attn": 1536}, 32, 512)
    assert line.startswith(
        "the least-squares refits read few calibration tokens per input (1.8 per neuron for down_proj, 10.7 per "
        "head dimension for o_proj; 16,384 tokens in all)"
    )
    assert line.endswith("(--calib-samples 700: windows of 512 tokens)")  # 40 x 8960 / 512, rounded up
    assert few_tokens_warning({"mlp": 1536, "attn": 576}, 256, 512) is None
    assert few_tokens_warning({"mlp": 1536, "attn": 576}, 120, 512) is None  # 40.0 per neuron: enough
    only_mlp = few_tokens_warning({"mlp": 1536, "attn": 576}, 119, 512)
    assert "39.7 per neuron for down_proj;" in only_mlp and "o_proj" not in only_mlp
    assert few_tokens_warning({}, 1, 8) is None  # no refit (factored attention, FLAP): nothing to say


def test_the_run_warns_only_for_the_refits_its_forms_make():
    from compressor.api.session import refit_tokens_warning
    from compressor.methods.base import ModelShape
    from compressor.modeling.adapters import MLP_PROJECTIONS, PROJECTIONS

    model = k_quant_model(num_hidden_layers=2)
    adapter = get_adapter(model)
    few = (2, 64)  # 128 tokens: short of 40 per input for any of these widths
    both = ModelShape.from_adapter(adapter, PROJECTIONS + MLP_PROJECTIONS)
    line = refit_tokens_warning(NATIVE, both, *few)
    assert "per neuron for down_proj" in line and "per head dimension for o_proj" in line
    default = CompressionSettings(method="masa", targets="attn,mlp")  # factored attention: no o_proj refit
    line = refit_tokens_warning(default, both, *few)
    assert "per neuron for down_proj" in line and "o_proj" not in line
    attention_only = ModelShape.from_adapter(adapter, PROJECTIONS)
    assert "o_proj" in refit_tokens_warning(NATIVE, attention_only, *few)
    assert "down_proj" not in refit_tokens_warning(NATIVE, attention_only, *few)
    flap = CompressionSettings(method="flap", targets="attn,mlp")  # bias compensation, no least-squares refit
    assert refit_tokens_warning(flap, both, *few) is None
    assert refit_tokens_warning(NATIVE, both, 1, 40 * model.config.intermediate_size) is None


def test_plan_warns_before_calibration_where_the_recipe_gives_the_refits_few_tokens():
    """`plan` says it from the config and the recipe alone: the 1.5B recipe's native run warns, the bundled
    model's default calibration does not."""
    from compressor.api.preview import plan_compression as plan
    from compressor.api.run_options import CompressOptions

    native = dict(targets="attn,mlp", ratio=0.2, ratio_of="model", native=True)
    large = plan("qwen2.5-coder-1.5b", CompressOptions(**native))
    assert "1.8 per neuron for down_proj" in large["refit_warning"]
    assert "(--calib-samples 700: windows of 512 tokens)" in large["refit_warning"]
    assert plan("smollm2-135m", CompressOptions(**native))["refit_warning"] is None


def test_plan_size_says_which_structure_its_calibration_can_price():
    from compressor.api.run_options import CompressOptions
    from compressor.api.size import plan_size

    default = plan_size("smollm2-135m", CompressOptions(size="76MiB"))
    assert default["structure"] == "MLP widths and query heads" and default["candidates"]["mlp_widths"]
    few = plan_size("smollm2-135m", CompressOptions(size="76MiB", calib_samples=8))
    assert few["structure"].startswith(
        "types only; query heads not offered: 4,096 calibration tokens for 576 inputs"
    )
    assert "MLP widths not offered: 4,096 calibration tokens for 1,536 inputs" in few["structure"]
    assert few["candidates"] == {} and few["after_calibration"] == "every matrix's type"
    assert few["smallest_matrices"] > default["smallest_matrices"]  # nothing narrower to fall back on
    assert (
        plan_size("smollm2-135m", CompressOptions(size="76MiB", targets=" mlp"))["structure"] == "MLP widths"
    )
    with pytest.raises(UserError, match="unknown target 'heads': use --targets attn, mlp or attn,mlp"):
        plan_size("smollm2-135m", CompressOptions(size="76MiB", targets="heads"))


def test_the_structure_run_of_a_byte_budget_refits_on_calibration_unless_told():
    """`--native` alone takes the stream refit in memory; a byte budget's structure run keeps `calibration` (the
    stream's refit was not measured under a byte budget), and `--refit stream` given is kept."""
    from compressor.api.run_options import CompressOptions
    from compressor.api.session import resolve_run
    from compressor.api.size import native_options

    assert (
        resolve_run("smollm2-135m", CompressOptions(targets="attn,mlp", native=True)).compression.refit
        == "stream"
    )
    for given, refit in ((None, "calibration"), ("stream", "stream")):
        structure = native_options(CompressOptions(size="76MiB", refit=given), "attn,mlp")
        assert resolve_run("smollm2-135m", structure).compression.refit == refit


@pytest.mark.parametrize("seed", range(5))
def test_combined_options_are_the_pareto_set_of_every_combination(seed):
    """One option of each matrix, summed: exactly the combinations no other beats on both bytes and rise."""
    rng = np.random.default_rng(seed)
    parts = [[(int(b), float(r), (f"m{i}t{k}",)) for k, (b, r) in enumerate(zip(rng.integers(1, 30, 5) * 32,
              rng.random(5), strict=True))] for i in range(3)]  # fmt: skip
    every = [
        (sum(o[0] for o in c), sum(o[1] for o in c), sum((o[2] for o in c), ()))
        for c in itertools.product(*parts)
    ]
    undominated = {(b, round(r, 12)) for b, r, _ in every
                   if not any(b2 <= b and r2 < r or b2 < b and r2 <= r for b2, r2, _ in every)}  # fmt: skip
    found = combine(parts)
    assert {(b, round(r, 12)) for b, r, _ in found} == undominated
    for b, r, types in found:  # each is a real combination: its types' bytes and rises add up
        assert any(t == types and b == b2 and abs(r - r2) < 1e-12 for b2, r2, t in every)


def test_the_smallest_file_from_shapes_is_every_matrix_in_its_smallest_type():
    """Nothing narrowed: Σ of each matrix's smallest candidate type, as the export's own check counts it; narrowed:
    smaller still."""
    model = k_quant_model(num_hidden_layers=2)
    adapter = get_adapter(model)
    matrices = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    expected = sum(padded(rows_bytes(w.detach().numpy(), True)) for w in matrices)
    least = smallest_matrices(adapter.geometry, 2, VOCAB, True, None, 32)
    assert least == expected
    assert smallest_matrices(adapter.geometry, 2, VOCAB, True, "attn,mlp", 32) < least


@pytest.fixture(scope="module")
def calibrated(tokenizer_gguf):  # noqa: F811
    from compressor.quantize.importance import measure_importance

    model = k_quant_model(num_hidden_layers=3)
    windows = random_windows(8, 64, vocab=VOCAB)
    stats = collect_statistics(model, get_adapter(model), windows, progress=False, mlp=True)
    importance = measure_importance(model, windows, progress=False, gradient_windows=4)
    importance.key = "test"  # the rounding errors are measured once for every budget below
    return model, windows, stats, importance, planned_fixed_bytes(model, tokenizer_gguf)


def compress_to(calibrated, budget: int, weight: float = 1.0, allowed: frozenset[str] | None = None):
    model, windows, stats, importance, fixed = calibrated
    copied = copy.deepcopy(model)
    outcome = compress_model(copied, get_adapter(copied), stats, NATIVE, 0.5, progress=False, windows=windows,
                             size=SizeTarget(budget, fixed, importance, weight, allowed))  # fmt: skip
    return copied, outcome


def test_an_ample_budget_removes_nothing_and_keeps_every_weight(calibrated):
    """'Remove nothing' is always a candidate: with bytes to spare every unit stays whole (its predicted structure
    rise exactly 0), every matrix f16, every weight untouched."""
    original = calibrated[0]
    f16 = 2 * sum(p.numel() for p in original.parameters())
    model, outcome = compress_to(calibrated, 3 * f16)
    report = outcome.report["byte_budget"]
    assert report["structure_loss_rise"] == 0.0 and set(report["forecast_types"].values()) == {"F16"}
    assert set(report["mlp_widths"]) == {512} and set(report["heads_per_kv_group"]) == {2}
    assert outcome.plan.achieved_ratio() == 0.0
    for (name, a), b in zip(original.state_dict().items(), model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_a_tight_budget_narrows_and_its_file_fits_and_runs(calibrated, tokenizer_gguf, tmp_path):  # noqa: F811
    """Just above the smallest file: the allocation narrows some MLPs or heads, its forecast fits the budget, and
    the export of what it built (types allocated again on the weights as written) fits it too and runs in
    llama.cpp with per-layer shapes (`deci`)."""
    pytest.importorskip("xllamacpp")
    from compressor.quantize.importance import measure_importance

    original, windows, _, _, fixed = calibrated
    geometry = get_adapter(original).geometry
    least = fixed + smallest_matrices(geometry, 3, VOCAB, True, None, 32)  # the smallest file of types alone
    model, outcome = compress_to(calibrated, least)
    report = outcome.report["byte_budget"]
    assert report["predicted_bytes"] <= least
    assert min(report["mlp_widths"]) < 512 or min(report["heads_per_kv_group"]) < 2
    assert report["structure_loss_rise"] > 0 and outcome.plan.achieved_ratio() > 0
    importance = measure_importance(model, windows, progress=False, gradient_windows=4)
    chooser = BudgetChooser(model, importance, least, progress=False)
    written = write_gguf(model, tokenizer_gguf, tmp_path / "tight.gguf", importance=importance.weights,
                         choose_types=chooser)  # fmt: skip
    assert written.bytes <= least and written.architecture == "deci"
    assert written.mlp_widths == [w for w in report["mlp_widths"]]
    assert torch.isfinite(llama_cpp_log_probs(written.path, windows[:1, :32])).all()


def test_more_bytes_buy_a_lower_predicted_rise_and_a_heavy_structure_weight_keeps_it(calibrated):
    """Predicted rise falls as the budget grows; the same budget and inputs give the same plan; with the
    structure's rise weighed far above rounding's, nothing is removed where types alone fit."""
    original, _, _, _, fixed = calibrated
    least = fixed + smallest_matrices(get_adapter(original).geometry, 3, VOCAB, True, None, 32)
    rises = [compress_to(calibrated, int(least * f))[1].report["byte_budget"]["predicted_loss_rise"]
             for f in (0.95, 1.1, 1.5)]  # fmt: skip
    assert rises[0] > rises[1] > rises[2]
    first, again = (compress_to(calibrated, least)[1].report["byte_budget"] for _ in range(2))
    assert first == again
    heavy = compress_to(calibrated, int(least * 1.1), weight=1e6)[1].report["byte_budget"]
    assert heavy["structure_loss_rise"] == 0.0


def test_only_types_hold_for_every_unit_and_their_smallest_file_is_larger(calibrated):
    """`--only-types` under a byte budget: every matrix of every unit (narrowed or whole, the embedding included)
    takes an allowed type; the smallest file of types alone within them is larger than with every type; the
    allocation at that file's bytes fits them, narrowing."""
    original, _, _, _, fixed = calibrated
    geometry = get_adapter(original).geometry
    allowed = frozenset({"Q4_K", "Q6_K", "Q8_0", "F16"})
    least = smallest_matrices(geometry, 3, VOCAB, True, None, 32)  # types alone
    least_allowed = smallest_matrices(geometry, 3, VOCAB, True, None, 32, allowed)
    assert least_allowed > least
    report = compress_to(calibrated, fixed + least_allowed, allowed=allowed)[1].report["byte_budget"]
    assert set(report["forecast_types"].values()) <= allowed
    assert report["predicted_bytes"] <= fixed + least_allowed
    assert min(report["mlp_widths"]) < 512 or min(report["heads_per_kv_group"]) < 2


@pytest.mark.slow
@pytest.mark.long
def test_bundled_compress_to_size_through_the_cli(tmp_path, capsys):
    """The real path: `masa-compress smollm2-135m --size 76MiB` writes a GGUF within the budget whose structure
    the allocation chose (below the bytes where types alone stop paying, it narrows), llama.cpp scores it against
    the original, and `show` prints what was chosen. Bounds: see `BUNDLED_76MIB`."""
    pytest.importorskip("xllamacpp")
    import json

    from compressor.cli import main

    out = tmp_path / "m.gguf"
    # 120 windows: the least whose refits the byte budget prices (40 calibration tokens per MLP neuron).
    main(["smollm2-135m", "--size", "76MiB", "--out", str(out), "--calib-samples", "120", "--eval-max-tokens",
          "1024", "--json"])  # fmt: skip
    summary = json.loads(capsys.readouterr().out)
    assert summary["bytes"] <= 76 * 2**20 == summary["budget"] and out.stat().st_size == summary["bytes"]
    assert summary["architecture"] == "deci" and summary["structure"]["removed_parameters"] > 0
    quality = summary["quality"]
    assert quality["tokens"] == 1022 and quality["ppl"] < BUNDLED_76MIB * quality["ppl_original"], quality
    main(["show", str(out), "--json"])
    shown = json.loads(capsys.readouterr().out)
    assert shown["structure"]["removed_parameters"] == summary["structure"]["removed_parameters"]
    assert [row["mlp_width"] for row in shown["layers"]] == summary["mlp_widths"]


@pytest.mark.slow
def test_a_size_run_that_goes_layer_by_layer_by_itself_writes_the_in_memory_file(
    tmp_path, monkeypatch, capsys
):
    """`compress --size` whose structure run fits in memory only layer by layer switches to `--layerwise` by
    itself (said in a line) and writes the very file the in-memory run writes; its summary sets `plan --size`'s
    time beside the stages it took."""
    import json

    pytest.importorskip("xllamacpp")
    from conftest import tiny_model
    from test_gguf_tokenizer import bundled_tokenizer_files

    import compressor.api.memory_check as memory_check
    from compressor.cli import main

    folder = tmp_path / "tiny"
    tiny_model("llama", vocab_size=49152).save_pretrained(folder)
    bundled_tokenizer_files(folder)
    common = ["--size", "5800KiB", "--calib-samples", "80", "--seq-len", "64", "--no-eval"]
    main(
        [str(folder), *common, "--dry-run", "--json"]
    )  # `plan --size`: the run carries its time beside its own
    planned = json.loads(capsys.readouterr().out)["time"]
    main([str(folder), "--out", str(tmp_path / "memory.gguf"), *common, "--json"])
    captured = capsys.readouterr()
    assert "layer by layer" not in captured.err
    summary = json.loads(captured.out.strip().splitlines()[-1])
    assert summary["seconds_planned"] == planned["stages"] | {"total": planned["total"]}
    assert set(planned["stages"]) <= set(summary["seconds"]), (planned["stages"], summary["seconds"])
    estimate_of = memory_check.run_memory

    def little_memory(*args, **kwargs):  # a byte less than the in-memory peak, which layer by layer fits
        estimate = estimate_of(*args, **kwargs)  # (on a model this tiny the runtime outweighs its statistics)
        less = estimate["in_memory_bytes"] - 1
        return estimate | {"available_bytes": less, "layerwise_bytes": less}

    monkeypatch.setattr(memory_check, "run_memory", little_memory)
    main([str(folder), "--out", str(tmp_path / "layerwise.gguf"), *common])
    assert "compressing layer by layer" in " ".join(capsys.readouterr().err.split())
    assert (tmp_path / "layerwise.gguf").read_bytes() == (tmp_path / "memory.gguf").read_bytes()
    import gguf

    fields = gguf.GGUFReader(
        str(tmp_path / "memory.gguf")
    ).fields  # the structure removed something: per-layer
    assert bytes(fields["general.architecture"].parts[-1]).decode() == "deci"  # shapes, llama.cpp's `deci`


@pytest.mark.slow
def test_compress_to_size_weighs_by_an_importance_file_of_the_original(tmp_path, monkeypatch, capsys):
    """`compress --size --imatrix FILE`: the file's weights serve the structure's allocation and the export; the
    narrowed down/o of the structure read the original's entries at the columns they keep (the checkpoint
    records them, `layout.kept_mask`), found here independently as the original's gate and q rows kept."""
    pytest.importorskip("xllamacpp")
    import json

    from conftest import tiny_model
    from test_gguf_tokenizer import bundled_tokenizer_files

    import compressor.api.export as export_module
    from compressor.checkpoint.imatrix_file import gguf_tensors_of, write_imatrix
    from compressor.cli import main

    folder = tmp_path / "tiny"
    original = tiny_model("llama", vocab_size=49152)
    original.save_pretrained(folder)
    bundled_tokenizer_files(folder)
    rng = np.random.default_rng(0)
    entries = {name: rng.uniform(0.1, 10.0, array.shape[-1]) for name, array, _ in gguf_tensors_of(original)[1]
               if array.ndim == 2 and "token_embd" not in name}  # fmt: skip
    file = write_imatrix(
        tmp_path / "theirs.gguf", entries, tokens=1, chunks=1, chunk_size=1, dataset="x"
    ).path
    handed = []  # (model, weights) of every importance file read
    read = export_module.importance_from_file

    def reading(model, data, kept=None):
        handed.append((model, read(model, data, kept)))
        return handed[-1][1]

    monkeypatch.setattr(export_module, "importance_from_file", reading)
    out = tmp_path / "m.gguf"
    main([str(folder), "--out", str(out), "--size", "5800KiB", "--calib-samples", "80", "--seq-len", "64",
          "--no-eval", "--imatrix", str(file), "--json"])  # fmt: skip
    summary = json.loads(capsys.readouterr().out)
    assert summary["structure"]["removed_parameters"] > 0 and summary["importance"]["file"].startswith(
        "theirs.gguf"
    )
    assert len(handed) == 2  # the original's (the allocation's), the structure checkpoint's (the export's)
    for name, module_path in ((n, p) for n, a, p in gguf_tensors_of(original)[1] if n in entries):
        assert np.array_equal(handed[0][1][module_path].numpy(), entries[name].astype(np.float32)), name
    compressed, weights = handed[1]
    narrowed = 0
    for layer, (before, after) in enumerate(zip(original.model.layers, compressed.model.layers, strict=True)):
        for rows_of, reader, name in (("mlp.gate_proj", "mlp.down_proj", "ffn_down"),
                                      ("self_attn.q_proj", "self_attn.o_proj", "attn_output")):  # fmt: skip
            kept_rows = before.get_submodule(rows_of).weight.detach()
            now = after.get_submodule(rows_of).weight.detach()
            kept = [int(torch.nonzero((kept_rows == row).all(dim=1))[0]) for row in now]
            vector = weights[f"model.layers.{layer}.{reader}"].numpy()
            assert np.array_equal(vector, entries[f"blk.{layer}.{name}.weight"][kept].astype(np.float32))
            narrowed += len(kept) < kept_rows.shape[0]
    assert narrowed > 0
