"""`api/size.py` on its own: what `compress --size` decides from the options and the config alone, before any weight
is read (the runs themselves: tests/test_byte_structure.py; the command line's one-line errors:
tests/test_cli_errors.py)."""

from __future__ import annotations

import pytest
from conftest import tiny_config

from compressor.api.run_options import CompressOptions
from compressor.api.size import (
    DECIDED,
    check_size_family,
    check_size_options,
    default_out,
    native_options,
    runs_layerwise,
    structure_targets,
)
from compressor.methods.masa.byte_structure import STRUCTURE_FLOOR
from compressor.runtime.errors import UserError


def test_each_option_a_budget_decides_is_refused_by_name():
    check_size_options(CompressOptions(size="80MiB"), ratio_given=False)  # nothing to refuse
    with pytest.raises(UserError, match="--size and --ratio both set how much is removed"):
        check_size_options(CompressOptions(size="80MiB"), ratio_given=True)
    for name, flag in DECIDED.items():
        value = True if name == "uniform_mlp" else "x"
        with pytest.raises(UserError, match=f"--bits-per-weight chooses .* drop {flag}$"):
            check_size_options(CompressOptions(bits_per_weight=4.0, **{name: value}), ratio_given=False)
    with pytest.raises(UserError, match="counts bytes, not a share of the parameters: drop --ratio-of"):
        check_size_options(CompressOptions(size="80MiB", ratio_of="model"), ratio_given=False)
    with pytest.raises(UserError, match="--imatrix none: .* pass FILE"):
        check_size_options(CompressOptions(size="80MiB", imatrix="none"), ratio_given=False)


def test_the_structure_run_is_the_native_forms_down_to_the_floor_with_no_budget_of_its_own():
    options = CompressOptions(size="80MiB", targets="attn,mlp", calib_samples=8)
    run = native_options(options, "mlp")
    assert run.ratio == pytest.approx(1.0 - STRUCTURE_FLOOR) and run.targets == "mlp" and run.native
    assert run.allocation == "global" and run.size is None and run.bits_per_weight is None
    assert run.refit == "calibration" and run.calib_samples == 8  # the calibration the user asked for
    assert native_options(CompressOptions(size="80MiB", refit="stream"), "mlp").refit == "stream"


def test_families_and_configurations_llama_cpp_would_not_run_are_refused_from_the_config():
    check_size_family(tiny_config("llama"))
    check_size_family(tiny_config("gemma2", query_pre_attn_scalar=16))
    with pytest.raises(UserError, match="query_pre_attn_scalar 256: llama.cpp scales the queries"):
        check_size_family(tiny_config("gemma2"))  # transformers' default scale, for heads 256 wide
    with pytest.raises(UserError, match="a byte budget for a mixture of experts is not implemented"):
        check_size_family(tiny_config("mixtral"))
    config = tiny_config("llama")
    config.model_type = "falcon"
    with pytest.raises(UserError, match="model_type 'falcon': llama.cpp has no architecture for it here"):
        check_size_family(config)


def test_a_family_with_one_width_for_all_layers_offers_types_only():
    targets, why = structure_targets("unused", tiny_config("qwen3"), CompressOptions(size="1MB"))
    assert (
        targets is None
        and why == "qwen3: its llama.cpp architecture takes one MLP width for all layers: types only"
    )


def test_the_structure_run_goes_layer_by_layer_when_asked_or_when_only_that_fits():
    def memory(layerwise=False, free=10, in_memory=5, by_layer=2):
        return {"layerwise": layerwise, "available_bytes": free, "in_memory_bytes": in_memory,
                "layerwise_bytes": by_layer}  # fmt: skip

    assert not runs_layerwise(memory())
    assert runs_layerwise(memory(layerwise=True))
    assert runs_layerwise(memory(free=4))  # only layer by layer fits
    assert not runs_layerwise(memory(free=1))  # neither fits: the in-memory run says so itself
    assert not runs_layerwise(memory(free=0))  # free memory unknown


def test_the_default_output_is_named_after_the_model_and_the_budget():
    assert default_out("smollm2-135m", "80MiB") == "out/smollm2-135m-80MiB.gguf"
    assert default_out("/models/Qwen2.5-0.5B/", "4bpw") == "out/Qwen2.5-0.5B-4bpw.gguf"
    assert default_out("/models/q.gguf", "1GB") == "out/q-1GB.gguf"
