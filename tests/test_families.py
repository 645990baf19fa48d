"""Every family of the registry (`compressor/modeling/families.py`) in every form of the README's support matrix,
through the CLI from a local folder: a tiny random model of the family, calibrated on 4 windows of 64 tokens.

A form the registry accepts succeeds, and its checkpoint reloads in plain transformers
(`AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)`) with the logits the run's own model had
when it was saved; a form it refuses (`families.refusal_of`) exits with status 2 and one line on stderr, no
traceback, nothing written. The README's support matrix is rendered from the same registry
(`benchmarks/report/readme.py`), so this test is what makes each of its cells true.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import random_windows, tiny_model, tiny_model_dir

import compressor.api.run
from compressor.cli import main
from compressor.modeling.families import FAMILIES, FORMS, SUPPORTED_MODEL_TYPES, refusal_of

ROOT = Path(__file__).resolve().parents[1]
#: A fixed English text of the checkout as the calibration text: tokenizing the bundled Wikipedia text would take
#: most of each run's time, and these runs check structure, not quality.
CALIBRATION = ROOT / "LICENSE"
FAST = ["--calib", str(CALIBRATION), "--calib-samples", "4", "--seq-len", "64", "--no-eval", "--quiet"]
#: Each form of the matrix as the command line asks for it (`--native` at 20% and at 50% of the model: at 20% a
#: tiny model keeps every head, at 50% whole heads must go).
ARGV = {
    "attention": [["--ratio", "0.2"]],
    "model": [["--targets", "attn,mlp", "--ratio-of", "model", "--ratio", "0.2"]],
    "native": [
        ["--targets", "attn,mlp", "--ratio-of", "model", "--ratio", ratio, "--native"]
        for ratio in ("0.2", "0.5")
    ],
    "flap": [["--method", "flap", "--ratio", "0.2"]],
    "modegpt": [["--method", "modegpt", "--ratio", "0.2"]],
    "svd-llm": [["--method", "svd-llm", "--ratio", "0.2"]],
    "layerwise": [["--layerwise", "--ratio", "0.2"]],
}
TOKENS = random_windows(2, 40, vocab=256, seed=3)  # beyond the longrope case's original context (32)
CASES = [
    (family, form.key, i)
    for family in SUPPORTED_MODEL_TYPES
    for form in FORMS
    for i in range(len(ARGV[form.key]))
]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """One tiny random model folder per family (two layers: every form still has layers to allocate across)."""
    root = tmp_path_factory.mktemp("families")
    return {
        family: tiny_model_dir(root / family, family, num_hidden_layers=2) for family in SUPPORTED_MODEL_TYPES
    }


@pytest.fixture
def saved_logits(monkeypatch):
    """The logits on `TOKENS` of every model the run saves, computed as it is saved (None for `--layerwise`,
    whose layers are on disk then)."""
    seen: list = []
    save = compressor.api.run.save_compressed

    def recording(model, *args, **kwargs):
        if kwargs.get("on_disk") is None:
            with torch.no_grad():
                seen.append(model(TOKENS).logits.clone())
        else:
            seen.append(None)
        return save(model, *args, **kwargs)

    monkeypatch.setattr(compressor.api.run, "save_compressed", recording)
    return seen


def _run(argv, capsys) -> tuple[int, str]:
    capsys.readouterr()
    try:
        main(argv)
        code = 0
    except SystemExit as exit_:
        code = exit_.code
    return code, capsys.readouterr().err.strip()


def _reloaded_logits(out: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    with torch.no_grad():
        return model(TOKENS).logits


@pytest.mark.parametrize(("family", "form", "variant"), CASES, ids=[f"{f}-{k}-{i}" for f, k, i in CASES])
def test_every_family_takes_every_form_or_refuses_it_in_one_line(
    family, form, variant, folders, saved_logits, tmp_path, capsys
):
    out = tmp_path / "out"
    refusal = refusal_of(family, next(f for f in FORMS if f.key == form))
    code, err = _run([str(folders[family]), *ARGV[form][variant], *FAST, "--out", str(out)], capsys)
    if refusal is not None:
        assert code == 2 and "Traceback" not in err, err
        assert 1 <= len(err.splitlines()) <= 3 and family in err, err
        assert err.removeprefix("error: ").replace("\n", " ").startswith(refusal.split(":")[0]), err
        assert not out.exists()
        return
    assert code == 0, err
    reloaded = _reloaded_logits(out)
    if saved_logits[0] is None:  # --layerwise: the same checkpoint as the run in memory, byte for byte
        _, err = _run(
            [str(folders[family]), *ARGV["attention"][0], *FAST, "--out", str(tmp_path / "mem")], capsys
        )
        expected = saved_logits[1]
        assert (out / "model.safetensors").read_bytes() == (
            tmp_path / "mem" / "model.safetensors"
        ).read_bytes()
    else:
        expected = saved_logits[0]
    torch.testing.assert_close(reloaded, expected, rtol=0, atol=1e-5)


def test_the_remote_code_names_the_registry_families():
    """The checkpoint's remote code carries its own copy of the registry's class names (it runs without
    masa-compress): the two agree."""
    from compressor.modeling.remote_code import modeling_masa

    assert modeling_masa.FAMILIES == {
        name: (family.config_class, family.model_class) for name, family in FAMILIES.items()
    }
    for family in FAMILIES.values():
        assert family.attention == modeling_masa.ATTENTION and family.mlp == modeling_masa.MLP


HIDDEN = """
import sys, torch
sys.modules["transformers.models.olmo2.modeling_olmo2"] = None  # a transformers without OLMo 2's model code
sys.modules["transformers.models.olmo2"] = None
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True).eval()
with torch.no_grad():
    torch.save(model(torch.load(sys.argv[2])).logits, sys.argv[3])
loaded = sorted(m for m, v in sys.modules.items() if v is not None and m.startswith("transformers.models.") and m.count(".") == 3)
print(" ".join(loaded))
"""


def test_a_checkpoint_loads_where_another_family_cannot_be_imported(folders, saved_logits, tmp_path, capsys):
    """The remote code imports the checkpoint's family alone: with OLMo 2's modules hidden (as on a transformers
    release without them), a Llama checkpoint still loads, with the run's logits."""
    out = tmp_path / "out"
    code, err = _run([str(folders["llama"]), "--ratio", "0.2", *FAST, "--out", str(out)], capsys)
    assert code == 0, err
    torch.save(TOKENS, tmp_path / "tokens.pt")
    script = tmp_path / "hidden.py"
    script.write_text(HIDDEN)
    done = subprocess.run(
        [sys.executable, str(script), str(out), str(tmp_path / "tokens.pt"), str(tmp_path / "logits.pt")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    families = {m.split(".")[2] for m in done.stdout.split()}
    assert "llama" in families and "olmo2" not in families and "mistral" not in families, done.stdout
    torch.testing.assert_close(torch.load(tmp_path / "logits.pt"), saved_logits[0], rtol=0, atol=1e-5)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_an_moe_keeps_its_router_and_experts_and_counts_them(family, tmp_path):
    """The attention of a mixture of experts compressed through the Python API: saved, reloaded with the same
    logits, its router and experts bit for bit the original's, and `--ratio-of model` counting every expert."""
    from compressor.api import CompressOptions, compress
    from compressor.api.preview import model_parameter_count
    from compressor.checkpoint import read_masa_config
    from compressor.math.accounting import targets_ratio

    folder = tiny_model_dir(tmp_path / family, family, num_hidden_layers=2)
    original = tiny_model(family, vocab_size=260, num_hidden_layers=2)
    total = sum(p.numel() for p in original.parameters())
    assert (
        model_parameter_count(original.config) == total
    )  # `plan` counts every expert, from the config alone
    options = CompressOptions(
        ratio=0.2,
        out=str(tmp_path / "out"),
        calib=str(CALIBRATION),
        calib_samples=4,
        seq_len=64,
        evaluate=False,
    )
    run = compress(str(folder), options, progress=False)
    counts = read_masa_config(tmp_path / "out")["counts"]
    attention = sum(
        p.numel() for n, p in original.named_parameters() if any(f".{x}_proj." in n for x in "qkvo")
    )
    assert counts["target_params_before"] == attention
    assert counts["total_params"] == total - attention + counts["target_params_after"]
    state = original.state_dict()
    reloaded = dict(run.model.state_dict())
    experts = [name for name in state if ".mlp." in name]
    assert experts and all(torch.equal(reloaded[name], state[name]) for name in experts)
    torch.testing.assert_close(
        _reloaded_logits(tmp_path / "out"), run.model(TOKENS).logits.detach(), rtol=0, atol=1e-5
    )
    # --ratio-of model: the share of every parameter, experts included, that the attention must give up
    assert targets_ratio(0.01, "model", total, attention, "attn") == pytest.approx(0.01 * total / attention)


def test_phi3_is_split_into_projections_and_joined_again_for_a_dense_export(
    folders, saved_logits, tmp_path, capsys
):
    """Phi-3's fused qkv_proj and gate_up_proj are compressed as q/k/v and gate/up (`FusedLinear` views); the
    dense export fuses them back, so the plain Phi3ForCausalLM (no remote code) loads it with the same logits."""
    from transformers import AutoModelForCausalLM

    from compressor.checkpoint.export import export_dense

    out = tmp_path / "out"
    argv = [str(folders["phi3"]), "--targets", "attn,mlp", "--ratio", "0.3", "--uniform-mlp"]
    code, err = _run([*argv, *FAST, "--out", str(out)], capsys)
    assert code == 0, err
    export_dense(out, tmp_path / "dense")
    dense = AutoModelForCausalLM.from_pretrained(tmp_path / "dense").eval()
    assert type(dense).__name__ == "Phi3ForCausalLM"
    assert dense.config.intermediate_size < tiny_model("phi3").config.intermediate_size
    with torch.no_grad():
        torch.testing.assert_close(dense(TOKENS).logits, saved_logits[0], rtol=0, atol=1e-5)


#: Phi-3.5-mini's and Phi-4-mini's rotary embedding: `longrope` (short and long factors per frequency, switched
#: beyond the original context), Phi-4-mini's partial rotary factor 0.75 (12 of a head's 16 dimensions rotate).
LONGROPE = {
    "rope_parameters": {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.75,
        "short_factor": [1.0, 1.1, 1.2, 1.3, 1.4, 1.5],
        "long_factor": [2.0, 2.5, 3.0, 3.5, 4.0, 4.5],
    },
    "original_max_position_embeddings": 32,  # calibration windows of 64 tokens take the long factors
}


@pytest.mark.parametrize("form", ["attention", "model"])
def test_phi3_with_longrope_and_a_partial_rotary_factor(form, saved_logits, tmp_path, capsys):
    folder = tiny_model_dir(tmp_path / "phi3", "phi3", num_hidden_layers=2, **LONGROPE)
    code, err = _run([str(folder), *ARGV[form][0], *FAST, "--out", str(tmp_path / "out")], capsys)
    assert code == 0, err
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (
        config["rope_parameters"]["rope_type"] == "longrope"
        and config["original_max_position_embeddings"] == 32
    )
    torch.testing.assert_close(_reloaded_logits(tmp_path / "out"), saved_logits[0], rtol=0, atol=1e-5)


def test_gguf_export_is_refused_in_one_line_for_a_family_llama_cpp_has_no_mapping_for():
    """The GGUF column of the support matrix: a family without a llama.cpp architecture in the registry."""
    from compressor.checkpoint.gguf_export import UNIFORM_ARCHITECTURE, choose_architecture
    from compressor.runtime.errors import UserError

    assert UNIFORM_ARCHITECTURE == {name: f.llama_cpp for name, f in FAMILIES.items() if f.llama_cpp}
    for name, family in FAMILIES.items():
        if family.llama_cpp:
            assert choose_architecture(name, [128, 128], [4, 4], [2, 2]) == family.llama_cpp
            continue
        with pytest.raises(UserError) as err:
            choose_architecture(name, [128, 128], [4, 4], [2, 2])
        assert name in str(err.value) and "\n" not in str(err.value)
