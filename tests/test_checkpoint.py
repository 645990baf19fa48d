"""Checkpoints on tiny hand-compressed models: save→load round trips (ours and plain transformers with remote
code), dense export, determinism, atomic writes, and a one-line CheckpointError for each kind of corruption."""

from __future__ import annotations

import ast
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import safetensors.torch
import torch
from torch import nn

from compressor.checkpoint import (
    ATOMS_KEY,
    BASIS_KEY,
    MASA_CONFIG,
    WEIGHTS_INDEX,
    WEIGHTS_NAME,
    export_dense,
    load_compressed,
    save_compressed,
)
from compressor.checkpoint import files as checkpoint_files
from compressor.math.accounting import CompressionPlan, GroupPlan, ProjectionPlan
from compressor.modeling.adapters import PROJECTIONS, SUPPORTED_MODEL_TYPES, get_adapter
from compressor.modeling.remote_code.masa_modules import LowRankLinear, SharedBasisLinear
from compressor.runtime.errors import CheckpointError, UserError

REMOTE_CODE_DIR = Path(__file__).parents[1] / "compressor" / "modeling" / "remote_code"
REMOTE_CODE_FILES = [REMOTE_CODE_DIR / "modeling_masa.py", REMOTE_CODE_DIR / "masa_modules.py"]
VOCAB = 128
# Residual / low-rank ranks per (layer, projection), rank 0 included; layer 0 stays dense, 1-2 share atoms.
RANKS = {
    (1, "q_proj"): 5, (1, "k_proj"): 0, (1, "v_proj"): 3, (1, "o_proj"): 8,
    (2, "q_proj"): 2, (2, "k_proj"): 4, (2, "v_proj"): 0, (2, "o_proj"): 1,
    (3, "q_proj"): 6, (3, "k_proj"): 2, (3, "v_proj"): 0, (3, "o_proj"): 7,
}  # fmt: skip
N_ATOMS = 2


def tiny_model(family: str) -> nn.Module:
    """Llama with tied embeddings, Qwen2 (q/k/v biases) without: both storage paths are exercised."""
    import transformers

    kwargs = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        bos_token_id=1,
        eos_token_id=2,
    )
    config = {
        "llama": lambda: transformers.LlamaConfig(tie_word_embeddings=True, **kwargs),
        "qwen2": lambda: transformers.Qwen2Config(tie_word_embeddings=False, **kwargs),
    }[family]()
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def compress_by_hand(model: nn.Module, seed: int = 0) -> CompressionPlan:
    """Layer 0 dense (a singleton group), layers 1-2 share one atoms Parameter per projection type, layer 3
    low rank; random coefficients and factors. Returns the matching plan."""
    gen = torch.Generator().manual_seed(seed)
    adapter = get_adapter(model)
    geometry = adapter.geometry
    before = adapter.target_parameter_count()

    def rand(*shape: int) -> torch.Tensor:
        return 0.05 * torch.randn(*shape, generator=gen)

    projections = []
    for p in PROJECTIONS:
        out, inp = geometry.shape(p)
        biases = [
            None if (b := adapter.projection(layer, p).bias) is None else b.detach() for layer in range(4)
        ]
        sizes = [0 if b is None else b.numel() for b in biases]
        projections.append(ProjectionPlan(0, p, out, inp, "dense", group=0, bias=sizes[0]))
        atoms = nn.Parameter(rand(N_ATOMS, out, inp), requires_grad=False)
        for layer in (1, 2):
            rank = RANKS[(layer, p)]
            module = SharedBasisLinear(atoms, rank, bias=biases[layer] is not None)
            module.coefficients.data.copy_(torch.randn(N_ATOMS, generator=gen))
            module.lowrank_a.data.copy_(rand(out, rank))
            module.lowrank_b.data.copy_(rand(rank, inp))
            if module.bias is not None:
                module.bias.data.copy_(biases[layer])
            projections.append(ProjectionPlan(layer, p, out, inp, "shared", 1, N_ATOMS, rank, sizes[layer]))
            adapter.set_projection(layer, p, module)
        rank = RANKS[(3, p)]
        module = LowRankLinear.from_factors(rand(out, rank), rand(rank, inp), biases[3], torch.float32, "cpu")
        projections.append(ProjectionPlan(3, p, out, inp, "lowrank", None, 0, rank, sizes[3]))
        adapter.set_projection(3, p, module)
    groups = [GroupPlan(0, [0], 0), GroupPlan(1, [1, 2], N_ATOMS)]
    plan = CompressionPlan(
        "masa", 0.3, before, geometry, groups, sorted(projections, key=lambda pp: pp.layer)
    )
    assert plan.params_after() == adapter.target_parameter_count()
    return plan


def tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny matrices gain nothing from threads, and on a busy machine OpenMP's waiting makes each one slower
    by orders of magnitude (15 ms for a 64x64 matmul with 2 threads here, 10 µs with 1)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@dataclass
class Saved:
    family: str
    model: nn.Module
    plan: CompressionPlan
    path: Path


INPUT = torch.randint(3, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
METADATA = {"method": "masa", "source": {"spec": "tiny", "revision": None}, "calibration": {"windows": 8}}


def save(model: nn.Module, plan: CompressionPlan, path: Path, **kwargs) -> Path:
    return save_compressed(model, plan, path, tokenizer=tiny_tokenizer(), metadata=METADATA, **kwargs)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def saved(request, tmp_path_factory) -> Saved:
    model = tiny_model(request.param)
    plan = compress_by_hand(model)
    path = save(model, plan, tmp_path_factory.mktemp(request.param) / "ckpt")
    return Saved(request.param, model, plan, path)


def param_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def assert_same_model(reloaded: nn.Module, saved: Saved) -> None:
    """Identical logits, identical greedy generation with a KV cache, the compressed parameter count."""
    with torch.no_grad():
        expected, actual = saved.model(INPUT).logits, reloaded(INPUT).logits
        assert (expected - actual).abs().max().item() <= 1e-5
        kwargs = dict(max_new_tokens=8, use_cache=True, do_sample=False, pad_token_id=0)
        assert torch.equal(reloaded.generate(INPUT, **kwargs), saved.model.generate(INPUT, **kwargs))
    assert param_count(reloaded) == param_count(saved.model)


# ------------------------------------------------------------------------------------------------------
# Round trips


def test_load_compressed_round_trip(saved: Saved) -> None:
    model, tokenizer = load_compressed(saved.path, with_tokenizer=True)
    assert_same_model(model, saved)
    layers = model.model.layers
    for p in PROJECTIONS:
        assert type(layers[0].self_attn.get_submodule(p)) is nn.Linear
        assert layers[1].self_attn.get_submodule(p).atoms is layers[2].self_attn.get_submodule(p).atoms
        assert isinstance(layers[3].self_attn.get_submodule(p), LowRankLinear)
    assert not model.training
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    assert tied == model.config.tie_word_embeddings
    assert tokenizer("w5 w6").input_ids == [5, 6]


def test_both_loaders_reproduce_long_prefills_bit_for_bit(saved: Saved) -> None:
    from transformers import AutoModelForCausalLM

    # 2 × 48 tokens: shared projections with a residual (64 × 64, rank ≥ 1) take the materialized-weight path,
    # which the remote code must mirror; tensors must not stay views into the file mapping (misaligned).
    long_input = torch.randint(3, VOCAB, (2, 48), generator=torch.Generator().manual_seed(2))
    q_proj = saved.model.model.layers[1].self_attn.q_proj
    assert q_proj.rank > 0 and long_input.numel() * (q_proj.in_features + q_proj.out_features) > 64 * 64
    with torch.no_grad():
        expected = saved.model(long_input).logits
        for reloaded in (
            load_compressed(saved.path),
            AutoModelForCausalLM.from_pretrained(saved.path, trust_remote_code=True),
        ):
            assert torch.equal(reloaded(long_input).logits, expected)
            assert all(p.data_ptr() % 64 == 0 for p in reloaded.parameters())


def test_masa_config_describes_the_checkpoint(saved: Saved) -> None:
    config = json.loads((saved.path / MASA_CONFIG).read_text())
    assert config["format_version"] == 1 and config["metadata"] == METADATA
    counts = config["counts"]
    attention = get_adapter(saved.model).target_parameter_count()
    assert counts["target_params_after"] == attention == saved.plan.params_after()
    assert counts["total_params"] == param_count(saved.model)
    spec = next(s for s in config["layout"]["projections"] if s["layer"] == 1 and s["projection"] == "k_proj")
    assert spec == {
        "layer": 1, "projection": "k_proj", "mode": "shared", "group": 1, "n_atoms": N_ATOMS, "rank": 0,
        "bias": saved.family == "qwen2", "out_features": 32, "in_features": 64,
    }  # fmt: skip
    # Atoms stored once per group and projection; tied embeddings once.
    names = set(config["tensors"])
    assert ATOMS_KEY.format(group=1, projection="q_proj") in names
    assert not any(name.endswith(".atoms") and name.startswith("model.") for name in names)
    assert ("lm_head.weight" in names) == (saved.family == "qwen2")


def test_transformers_loads_it_with_remote_code(saved: Saved) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(saved.path, trust_remote_code=True)
    assert_same_model(model, saved)
    layers = model.model.layers
    assert layers[1].self_attn.q_proj.atoms is layers[2].self_attn.q_proj.atoms
    assert layers[1].self_attn.q_proj.atoms is model.masa.groups["1"].q_proj.atoms


def test_transformers_without_remote_code_refuses_rather_than_guess(saved: Saved) -> None:
    from transformers import AutoModelForCausalLM

    with pytest.raises(ValueError):
        AutoModelForCausalLM.from_pretrained(saved.path, trust_remote_code=False)


def test_load_in_another_dtype(saved: Saved) -> None:
    model = load_compressed(saved.path, dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert param_count(model) == param_count(saved.model)


def test_export_dense_gives_the_same_logits(saved: Saved, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    export = export_dense(saved.path, tmp_path / "dense")
    config = json.loads((export.path / "config.json").read_text())
    assert "auto_map" not in config and "masa" not in config
    dense = AutoModelForCausalLM.from_pretrained(export.path).eval()
    with torch.no_grad():
        assert (dense(INPUT).logits - saved.model(INPUT).logits).abs().max().item() <= 1e-5
    assert export.dense_bytes > export.compressed_bytes and export.dense_params > export.compressed_params


def test_attention_takes_fewer_bytes_on_disk_than_dense(saved: Saved) -> None:
    tensors = json.loads((saved.path / MASA_CONFIG).read_text())["tensors"]
    stored = sum(
        4 * torch.Size(spec["shape"]).numel()
        for name, spec in tensors.items()
        if ".self_attn." in name or name.startswith("masa.")
    )
    geometry = get_adapter(saved.model).geometry
    dense = 4 * 4 * sum(out * inp for out, inp in map(geometry.shape, PROJECTIONS))  # 4 layers, fp32
    assert stored < dense


# ------------------------------------------------------------------------------------------------------
# Writing


def test_saving_twice_gives_identical_weight_files(saved: Saved, tmp_path: Path) -> None:
    again = save(saved.model, saved.plan, tmp_path / "again")
    assert (again / WEIGHTS_NAME).read_bytes() == (saved.path / WEIGHTS_NAME).read_bytes()


def test_sharded_checkpoint_reloads_identically(saved: Saved, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    path = save(saved.model, saved.plan, tmp_path / "sharded", max_shard_bytes=40_000)
    shards = sorted(p.name for p in path.glob("*.safetensors"))
    assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((path / WEIGHTS_INDEX).read_text())
    assert set(index["weight_map"].values()) == set(shards)
    assert_same_model(load_compressed(path), saved)
    assert_same_model(AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True), saved)


def test_existing_out_dir_is_refused_unless_overwrite(saved: Saved, tmp_path: Path) -> None:
    out = tmp_path / "out"
    save(saved.model, saved.plan, out)
    with pytest.raises(UserError, match="already exists"):
        save(saved.model, saved.plan, out)
    (out / "stale.txt").write_text("from the previous checkpoint")
    save(saved.model, saved.plan, out, overwrite=True)
    assert not (out / "stale.txt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    # A directory that is not a checkpoint is never replaced.
    other = tmp_path / "notes"
    other.mkdir()
    (other / "thesis.tex").write_text("...")
    with pytest.raises(UserError, match="not a model checkpoint"):
        save(saved.model, saved.plan, other, overwrite=True)


@pytest.mark.parametrize("overwrite", [False, True])
def test_failure_mid_write_leaves_nothing_behind(
    saved: Saved, tmp_path: Path, monkeypatch, overwrite
) -> None:
    out = tmp_path / "out"
    if overwrite:
        shutil.copytree(saved.path, out)

    def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint_files, "_save_aligned", fail)
    with pytest.raises(OSError, match="disk full"):
        save(saved.model, saved.plan, out, overwrite=overwrite)
    assert sorted(p.name for p in tmp_path.iterdir()) == (["out"] if overwrite else [])
    if overwrite:  # the previous checkpoint is intact
        assert (out / WEIGHTS_NAME).read_bytes() == (saved.path / WEIGHTS_NAME).read_bytes()


# ------------------------------------------------------------------------------------------------------
# Corruption: each one raises a CheckpointError naming the file


def _truncate(path: Path) -> Path:
    file = path / WEIGHTS_NAME
    file.write_bytes(file.read_bytes()[:-100])
    return file


def _remove_tensor(path: Path) -> Path:
    file = path / WEIGHTS_NAME
    tensors = safetensors.torch.load_file(file)
    del tensors["model.layers.2.self_attn.v_proj.coefficients"]
    safetensors.torch.save_file(tensors, file)
    return file


def _add_tensor(path: Path) -> Path:
    file = path / WEIGHTS_NAME
    tensors = safetensors.torch.load_file(file)
    tensors["model.layers.0.self_attn.q_proj.atoms"] = torch.zeros(2, 64, 64)
    safetensors.torch.save_file(tensors, file)
    return file


def _edit_shape(path: Path) -> Path:
    file = path / WEIGHTS_NAME
    tensors = safetensors.torch.load_file(file)
    tensors["model.layers.3.self_attn.o_proj.lowrank_a"] = torch.zeros(64, 6)
    safetensors.torch.save_file(tensors, file)
    return file


def _bump_format_version(path: Path) -> Path:
    file = path / MASA_CONFIG
    config = json.loads(file.read_text())
    config["format_version"] += 1
    file.write_text(json.dumps(config))
    return file


def _break_json(path: Path) -> Path:
    file = path / MASA_CONFIG
    file.write_text(file.read_text()[:-20])
    return file


def _remove_config(path: Path) -> Path:
    file = path / MASA_CONFIG
    file.unlink()
    return file


CORRUPTIONS = {
    "truncated safetensors": (_truncate, "corrupt or truncated"),
    "tensor removed": (_remove_tensor, "is missing"),
    "tensor added": (_add_tensor, "unexpected tensor"),
    "shape edited": (_edit_shape, "has shape"),
    "format_version bumped": (_bump_format_version, "a newer version: upgrade"),
    "invalid JSON": (_break_json, "invalid JSON"),
    "masa_config.json removed": (_remove_config, "not a masa-compress checkpoint"),
}


@pytest.mark.parametrize("corruption", CORRUPTIONS)
def test_corruption_raises_a_one_line_error_naming_the_file(saved: Saved, tmp_path: Path, corruption) -> None:
    corrupt, expected = CORRUPTIONS[corruption]
    path = shutil.copytree(saved.path, tmp_path / "ckpt")
    file = corrupt(path)
    with pytest.raises(CheckpointError, match=expected) as info:
        load_compressed(path)
    message = str(info.value)
    assert str(file) in message and "\n" not in message


def test_verify_catches_bytes_changed_in_place(saved: Saved, tmp_path: Path) -> None:
    path = shutil.copytree(saved.path, tmp_path / "ckpt")
    load_compressed(path, verify=True)
    file = path / WEIGHTS_NAME
    data = bytearray(file.read_bytes())
    data[-3] ^= 0xFF  # inside the last tensor: the header and the size are unchanged
    file.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="sha256") as info:
        load_compressed(path, verify=True)
    assert str(file) in str(info.value)


def test_missing_directory_is_a_checkpoint_error(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="no such checkpoint directory"):
        load_compressed(tmp_path / "nowhere")


# ------------------------------------------------------------------------------------------------------
# The remote code


@pytest.mark.parametrize(
    "model_type", ["mistral", "qwen3", "gemma", "gemma2", "gemma3_text", "olmo2", "smollm3"]
)
def test_every_other_family_round_trips(model_type: str, tmp_path: Path) -> None:
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    config = CONFIG_MAPPING[model_type](
        hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, vocab_size=VOCAB, max_position_embeddings=64, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    path = save(model, compress_by_hand(model), tmp_path / "ckpt")
    for reloaded in load_compressed(path), AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True):
        with torch.no_grad():
            assert (reloaded(INPUT).logits - model(INPUT).logits).abs().max().item() <= 1e-5
        assert param_count(reloaded) == param_count(model)


def test_remote_code_is_self_contained_and_covers_every_family(tmp_path) -> None:
    """The files copied into a checkpoint import torch, transformers and each other only, and load as the
    package transformers' remote-code loader makes of them."""
    copied = {path.stem for path in REMOTE_CODE_FILES}
    for path in REMOTE_CODE_FILES:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:  # relative: another copied file
                assert node.level == 1 and node.module in copied, (path.name, node.module)
            elif isinstance(node, ast.Import | ast.ImportFrom):
                names = [node.module] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
                assert {n.split(".")[0] for n in names} <= {"__future__", "torch", "transformers"}, path.name
    import importlib
    import shutil
    import sys

    package = tmp_path / "remote_under_test"
    package.mkdir()
    (package / "__init__.py").write_text("")
    for path in REMOTE_CODE_FILES:
        shutil.copy(path, package)
    sys.path.insert(0, str(tmp_path))
    try:
        remote = importlib.import_module("remote_under_test.modeling_masa")
    finally:
        sys.path.remove(str(tmp_path))
    # the remote code names a group's shared tensors exactly as the library stores them
    spec = {"group": 3, "projection": "v_proj", "n_atoms": 1, "rank": 2, "out_features": 4, "in_features": 8}
    assert remote.group_tensor({**spec, "mode": "shared"})[0] == ATOMS_KEY.format(
        group=3, projection="v_proj"
    )
    assert remote.group_tensor({**spec, "mode": "basis", "basis": "qkv"})[0] == BASIS_KEY.format(
        group=3, basis="qkv"
    )
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    for model_type in SUPPORTED_MODEL_TYPES:
        config_class = getattr(remote, f"Masa{CONFIG_MAPPING[model_type].__name__}")
        model_class = getattr(remote, f"Masa{MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]}")
        assert config_class.model_type == f"masa_{model_type}" and model_class.config_class is config_class


def test_tensors_are_written_64_byte_aligned(saved: Saved) -> None:
    """Memory-mapped loading then hands out aligned views of every tensor whose size allows it: no copies."""
    file = saved.path / WEIGHTS_NAME
    raw = file.read_bytes()
    header_size = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + header_size])
    aligned = [
        name
        for name, entry in header.items()
        if name != "__metadata__" and (entry["data_offsets"][1] - entry["data_offsets"][0]) % 64 == 0
    ]
    others = set(header) - set(aligned) - {"__metadata__"}
    assert others and all(name.endswith(".coefficients") for name in others)  # only those are odd-sized here
    for name in aligned:
        assert (8 + header_size + header[name]["data_offsets"][0]) % 64 == 0, name
    # A standard file: safetensors itself reads every tensor back, equal to the model's.
    state = saved.model.state_dict()
    for name, tensor in safetensors.torch.load_file(file).items():
        if name in state:
            assert torch.equal(tensor, state[name]), name


def test_a_narrowed_matrix_records_the_original_columns_it_reads_compactly():
    """`layout.kept_mask`: one bit per original input column (a 1.5B model's MLP in about 2 KiB of hex), read back
    by module path as the original's width and the kept columns; columns not increasing are a bug upstream."""
    from conftest import tiny_model

    from compressor.checkpoint.layout import kept_columns, kept_mask

    kept = [0, 3, 4, 8959]
    record = kept_mask(kept, 8960)
    assert record["of"] == 8960 and len(record["mask"]) == 8960 // 4
    spec = {"layer": 1, "projection": "down_proj", "kept_inputs": record}
    found = kept_columns(tiny_model("llama"), {"projections": [spec, {"layer": 0, "projection": "o_proj"}]})
    assert list(found) == ["model.layers.1.mlp.down_proj"]
    width, columns = found["model.layers.1.mlp.down_proj"]
    assert width == 8960 and columns.tolist() == kept
    with pytest.raises(ValueError, match="must increase"):
        kept_mask([3, 1], 8)
