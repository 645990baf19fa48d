"""The memory a run will need (`runtime/memory.py`, `api/memory_check.py`): terms by hand on a tiny shape, the
refusal before any weight is read, and `plan`'s line."""

import json
from pathlib import Path

import pytest

from compressor.api.memory_check import check_memory, memory_estimate, run_workload
from compressor.api.run_options import CompressOptions
from compressor.api.session import resolve_run
from compressor.runtime.errors import UserError
from compressor.runtime.memory import (
    GIB,
    Shape,
    Workload,
    activations,
    cholesky_bytes,
    conversion_peak,
    grams_all_layers,
    in_memory_peak,
    in_memory_phases,
)

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
TINY = Shape("tiny", hidden=4, heads=2, kv_heads=1, head_dim=2, intermediate=8, layers=3, vocab=10, tied=True)


def test_in_memory_terms_by_hand():
    w = Workload(windows=2, seq_len=3, sensitivity=1)
    # Every layer's fp64 autocorrelations: q/k/v's and o's inputs (4² each), 3 layers.
    assert grams_all_layers(TINY, w) == 8 * 3 * (16 + 16)
    # With the MLP: gate/up's input (4²) and down's (8²) too.
    assert grams_all_layers(TINY, Workload(2, 3, 1, mlp=True)) == 8 * 3 * (16 + 16 + 16 + 64)
    # A method that keeps gate/up's rows reads only down's.
    assert grams_all_layers(TINY, Workload(2, 3, 1, mlp=True, gate_input=False)) == 8 * 3 * (16 + 16 + 64)
    parts = in_memory_phases(TINY, w)
    act = activations(TINY, 3, 4)
    # The backward pass keeps every layer's activations and attention probabilities (2 heads × 3² × 4 bytes),
    # plus one window's logits through the head (3 tokens × 10 × (12 + 4)).
    assert parts["sensitivity"] == 3 * (act + 2 * 9 * 4) + 3 * 10 * 16
    assert parts["evaluation"] == 0  # no evaluation asked
    weights = TINY.params() * 4
    assert in_memory_peak(TINY, w, runtime=100) == 100 + weights + grams_all_layers(TINY, w) + max(
        parts.values()
    )
    # Evaluating reloads the original beside the compressed model.
    evaluated = in_memory_phases(TINY, Workload(2, 3, 1, eval_seq_len=3))["evaluation"]
    assert evaluated >= weights + 2 * 3 * 10 * 16
    # No sensitivity pass without the loss-aware allocation.
    assert in_memory_phases(TINY, Workload(2, 3, 0))["sensitivity"] == 0
    # --refit stream: a copy of the original decoder layers, four N×T×H streams, down_proj's kept stream and
    # inputs (N×T×(H + I)), one window's activations and the widest refit input's fp64 moments (down_proj's:
    # 8 × (8 + 4) per row); over the windows it reads
    assert parts["stream_refit"] == 0
    refit = in_memory_phases(TINY, Workload(2, 3, 1, mlp=True, stream_refit=2))["stream_refit"]
    assert refit == 3 * TINY.layer_params() * 4 + 4 * 2 * 3 * 4 * 4 + 2 * 3 * (4 + 8) * 4 + act + 8 * 8 * (
        8 + 4
    )
    fewer = in_memory_phases(TINY, Workload(2, 3, 1, mlp=True, stream_refit=1))["stream_refit"]
    assert refit - fewer == 4 * 3 * 4 * 4 + 3 * (4 + 8) * 4


def test_the_neuron_steps_take_more_on_a_gpu_as_measured_there():
    """2.5 I×I fp64 matrices beside the autocorrelation on the CPU, 4 on a GPU (an H200's measurement)."""
    assert cholesky_bytes(TINY, Workload(2, 3, 1, mlp=True)) == 8 * 2.5 * 8**2
    assert cholesky_bytes(TINY, Workload(2, 3, 1, mlp=True, gpu=True)) == 8 * 4 * 8**2
    assert cholesky_bytes(TINY, Workload(2, 3, 1, gpu=True)) == 8 * 2 * 4**2


def _estimate(in_memory_gib: float, layerwise_gib: float, available_gib: float, layerwise: bool) -> dict:
    return {
        "device": "cpu",
        "in_memory_bytes": int(in_memory_gib * GIB),
        "layerwise_bytes": int(layerwise_gib * GIB),
        "available_bytes": int(available_gib * GIB),
        "layerwise": layerwise,
    }


def test_check_memory_names_the_option_that_fits():
    check_memory(_estimate(10, 3, 20, layerwise=False))  # fits: nothing said
    with pytest.raises(UserError) as err:
        check_memory(_estimate(34.3, 6.2, 19.8, layerwise=False))
    message = str(err.value)
    assert "34.3 GiB" in message and "19.8 GiB is available" in message and "add --layerwise" in message
    assert "\n" not in message
    check_memory(_estimate(34.3, 6.2, 19.8, layerwise=True))  # --layerwise given: fits
    with pytest.raises(UserError, match="even with --layerwise"):
        check_memory(_estimate(80, 30, 19.8, layerwise=True))
    with pytest.raises(UserError, match="about 30.0 GiB with --layerwise"):
        check_memory(_estimate(80, 30, 19.8, layerwise=False))
    # Unknown availability or a GPU run: no refusal on a guess.
    check_memory(_estimate(80, 30, 19.8, False) | {"available_bytes": None})
    check_memory(_estimate(80, 30, 19.8, False) | {"device": "gpu"})


def test_the_large_recipe_needs_layerwise_for_the_whole_model():
    """The 1.5B recipe's shapes (no weights): attention alone fits 24 GB in memory; the model 20% smaller holds
    28 × 8960² fp64 autocorrelations of down_proj's input (17 GiB) on top of the weights, so only --layerwise fits."""
    from compressor.api.preview import read_model_config

    for targets, ratio_of in (("attn", "targets"), ("attn,mlp", "model")):
        options = CompressOptions.from_values({"ratio": 0.2, "targets": targets, "ratio_of": ratio_of})
        run = resolve_run("qwen2.5-coder-1.5b", options)
        config, _ = read_model_config(run.source)
        estimate = memory_estimate(config, run, options)
        work = run_workload(run, options, gpu=False)
        assert work.mlp == (targets == "attn,mlp") and work.dtype_bytes == 4 and work.eval_seq_len == 512
        shape = Shape.from_config(config)
        assert (shape.hidden, shape.intermediate, shape.layers, shape.kv) == (1536, 8960, 28, 256)
        assert estimate["layerwise_bytes"] < estimate["in_memory_bytes"]
        if targets == "attn":
            assert estimate["in_memory_bytes"] < 24e9
        else:
            assert grams_all_layers(shape, work) > 28 * 8 * 8960**2
            assert estimate["in_memory_bytes"] > 24e9 > 2 * estimate["layerwise_bytes"]


def test_first_use_conversion_is_counted_and_refused_when_it_cannot_fit(monkeypatch, tmp_path, capsys):
    """A packaged model not converted yet in this cache: the conversion holds the fp32 model, the mapped GGUF and
    one dequantization buffer of the largest tensor; `plan` says so, and `compress` refuses in one line when only
    the conversion does not fit (the run itself would)."""
    from compressor.api.model_loading import needs_conversion
    from compressor.api.preview import read_model_config

    assert conversion_peak(TINY, gguf_bytes=7, runtime=100) == 100 + 4 * TINY.params() + 7 + 4 * 10 * 4
    monkeypatch.setenv("MASA_CACHE", str(tmp_path / "empty-cache"))
    options = CompressOptions.from_values({"ratio": 0.2})
    run = resolve_run("qwen2.5-coder-1.5b", options)
    assert needs_conversion(run.source)
    estimate = memory_estimate(read_model_config(run.source)[0], run, options)
    # 1.78B fp32 parameters and the 1.04 GiB GGUF: about 9 GiB, above the attention run's --layerwise peak.
    assert 8.5 * GIB < estimate["first_use_bytes"] < 9.5 * GIB
    assert estimate["first_use_bytes"] > estimate["layerwise_bytes"]
    fits_but_conversion = _estimate(5, 3, 8, layerwise=False) | {"first_use_bytes": int(9 * GIB)}
    with pytest.raises(UserError, match="first use converts its GGUF") as err:
        check_memory(fits_but_conversion)
    assert "9.0 GiB" in str(err.value) and "\n" not in str(err.value)
    check_memory(fits_but_conversion | {"available_bytes": int(10 * GIB)})
    assert not (tmp_path / "empty-cache").exists()  # planning wrote nothing

    from compressor.cli.inspect import show_plan

    show_plan("qwen2.5-coder-1.5b", options, None, as_json=False)
    assert "first use: about 9.0 GiB" in " ".join(capsys.readouterr().out.split())


def test_plan_prints_the_memory(capsys):
    from compressor.cli.inspect import show_plan

    show_plan("smollm2-135m", CompressOptions.from_values({"ratio": 0.2}), None, as_json=False)
    out = capsys.readouterr().out
    assert "memory: about" in out and "with --layerwise" in out


def test_compress_refuses_before_reading_a_weight(monkeypatch, tmp_path):
    """With 10 GiB available the 1.5B model 20% smaller does not fit in memory: `compress` says so in one line
    naming --layerwise, before the model is fetched or loaded (neither is patched: reaching them would fail or
    take minutes)."""
    import compressor.api.memory_check as memory_check
    from compressor.api.run import compress

    monkeypatch.setattr(memory_check, "available_memory", lambda: 10 * GIB)
    options = CompressOptions.from_values(
        {"ratio": 0.2, "targets": "attn,mlp", "ratio_of": "model", "out": str(tmp_path / "out")}
    )
    with pytest.raises(UserError, match=r"add --layerwise \(about [0-9.]+ GiB"):
        compress("qwen2.5-coder-1.5b", options, progress=False)
    assert not (tmp_path / "out").exists()


def test_available_memory_reads_meminfo_and_a_containers_limit(monkeypatch, tmp_path):
    """MemAvailable (kB) from /proc/meminfo, lowered to what a cgroup's limit leaves (its inactive page cache
    counted as free); no limit ("max") changes nothing."""
    import compressor.runtime.memory as memory

    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemAvailable:   20000000 kB\n")
    limit, usage, stat = (tmp_path / name for name in ("memory.max", "memory.current", "memory.stat"))
    limit.write_text("max\n")
    usage.write_text(str(6 * GIB))
    stat.write_text("anon 123\ninactive_file 1073741824\n")
    real_open = open
    absent = tmp_path / "absent"  # no cgroup v1 files: the machine's own must not enter the test
    paths = {
        "/proc/meminfo": meminfo,
        "/sys/fs/cgroup/memory.max": limit,
        "/sys/fs/cgroup/memory.current": usage,
        "/sys/fs/cgroup/memory.stat": stat,
        "/sys/fs/cgroup/memory/memory.limit_in_bytes": absent,
        "/sys/fs/cgroup/memory/memory.usage_in_bytes": absent,
    }
    monkeypatch.setattr(
        memory, "open", lambda path, *a, **k: real_open(paths.get(path, path), *a, **k), raising=False
    )
    assert memory.available_memory() == 20000000 * 1024
    limit.write_text(str(8 * GIB))  # 8 GiB limit, 6 GiB used of which 1 GiB reclaimable: 3 GiB left
    assert memory.available_memory() == 3 * GIB


@pytest.mark.parametrize(
    ("values", "layers"),
    [
        ({}, 1),  # --sharing none, the default: one layer at a time (masa.basis.runs_of)
        ({"sharing": "basis", "basis_layers": 8}, 8),  # a run sharing a basis holds its layers together
        ({"method": "svd-llm"}, 1),
        (
            {"method": "basis-sharing"},
            4,
        ),  # shares within groups whatever --sharing says: the --basis-layers proxy
    ],
)
def test_the_estimate_holds_the_layers_a_run_compresses_together(values, layers):
    options = CompressOptions.from_values({"ratio": 0.2, "targets": "attn,mlp", **values})
    run = resolve_run("qwen2.5-coder-1.5b", options)
    assert run_workload(run, options, gpu=False).basis_layers == layers


@pytest.mark.parametrize("name", ["gpu", "gpu-native-stream", "gpu-native-layerwise"])
def test_the_gpu_plan_holds_what_an_h200_allocated_at_the_large_shapes(name):
    """`make bench-gpu`'s runs on an NVIDIA H200 (the 1.5B model's shapes, random bfloat16 weights, 64 × 512
    calibration tokens, evaluation on): the plan of the same options, with today's formulas, is at least the peak
    memory PyTorch allocated there, and within 30% of it (the CUDA context and the allocator's reserve are left
    out, as `plan` says)."""
    from compressor.api.preview import read_model_config

    measured = json.loads((RESULTS / f"{name}.json").read_text())
    flags = measured["options"]
    options = CompressOptions.from_values(
        {"ratio": 0.2, "targets": "attn,mlp", "ratio_of": "model", "calib_samples": 64, "seq_len": 512,
         "native": "--native" in flags, "layerwise": "--layerwise" in flags,
         "refit": "stream" if "stream" in flags else None}
    )  # fmt: skip
    run = resolve_run("qwen2.5-coder-1.5b", options)
    config, _ = read_model_config(run.source)
    assert {k: getattr(config, k) for k in ("hidden_size", "intermediate_size", "num_hidden_layers")} == {
        k: measured["config"][k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers")
    }
    estimate = memory_estimate(config, run, options, gpu=True)
    planned = estimate["layerwise_bytes" if options.layerwise else "in_memory_bytes"] / GIB
    allocated = measured["peak_gpu_allocated_gib"]
    assert allocated <= planned <= 1.3 * allocated, (planned, allocated)
