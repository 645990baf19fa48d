"""Bad input ends in a clear one-line error (exit code 2, no traceback), checked before heavy work.

The cases below are also the source of the table in docs/bad-inputs.md: run
`MASA_WRITE_BAD_INPUTS=1 python -m pytest tests/test_cli_errors.py` to regenerate it; a test checks
that the committed table lists exactly these cases.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from compressor.cli import main

DOC = Path(__file__).resolve().parent.parent / "docs" / "bad-inputs.md"


def _gpt2_dir(tmp: Path) -> str:
    import transformers

    path = tmp / "gpt2"
    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32)
    transformers.GPT2LMHeadModel(config).save_pretrained(path)
    return str(path)


def _tiny_model_dir(tmp: Path) -> str:
    """A tiny random Llama with a byte-level tokenizer, as a user's own model folder (fast tests never load the
    bundled model's weights)."""
    from conftest import tiny_model_dir

    return str(tiny_model_dir(tmp / "tiny"))


def _family_dir(tmp: Path, family: str) -> str:
    """A tiny random model of `family` as a user's own folder."""
    from conftest import tiny_model_dir

    return str(tiny_model_dir(tmp / family, family))


def _folder_llama_cpp_takes(tmp: Path) -> str:
    """A tiny random Llama with the bundled model's tokenizer (one llama.cpp knows), context 128 tokens."""
    from conftest import tiny_model
    from test_gguf_tokenizer import bundled_tokenizer_files

    tiny_model("llama", vocab_size=49152, max_position_embeddings=128).save_pretrained(tmp / "tiny")
    return str(bundled_tokenizer_files(tmp / "tiny"))


def _text_file(tmp: Path, content: str, name: str = "text.txt") -> str:
    path = tmp / name
    path.write_text(content)
    return str(path)


def _recipe_with_typo(tmp: Path) -> str:
    path = tmp / "recipe.yaml"
    path.write_text("name: mine\nmodel: bundled:smollm2-135m\ncompression:\n  group: 3\n")
    return str(path)


def _existing_dir(tmp: Path) -> str:
    (tmp / "exists").mkdir()
    return str(tmp / "exists")


def _full_disk(tmp: Path, monkeypatch) -> str:
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**9, 10**9 - 10**6, 10**6))
    return str(tmp / "ckpt")


def _no_network(monkeypatch) -> None:
    """The hub out of reach, as the probe finds it on a machine without network (and nothing in its cache)."""
    from compressor.runtime import hub

    monkeypatch.setattr(hub, "offline_by_env", lambda: None)
    monkeypatch.setattr(hub, "_verdict", {})
    monkeypatch.setattr(hub, "_probe", lambda url, seconds: f"{url}: Name or service not known")
    monkeypatch.setattr(hub, "cached_config", lambda repo, revision: False)


def _decode_costs_known(monkeypatch) -> None:
    """Every type's decode cost as if measured on this CPU before (1 ns per weight; measuring them takes minutes)."""
    from compressor.quantize import decode_cost

    monkeypatch.setattr(decode_cost, "decode_costs", lambda types, **_: dict.fromkeys(types, 1.0))


def _damaged_checkpoint(tmp: Path, damage: str) -> str:
    """A real (tiny) compressed checkpoint, then damaged as a disk, a download or a hand edit would."""
    import json

    from conftest import random_windows, tiny_model

    from compressor.api.pipeline import compress_model
    from compressor.checkpoint import save_compressed
    from compressor.modeling.adapters import get_adapter
    from compressor.recipes.schema import CompressionSettings
    from compressor.statistics.capture import collect_statistics

    model = tiny_model("llama")
    adapter = get_adapter(model)
    windows = random_windows()
    stats = collect_statistics(model, adapter, windows, progress=False)
    outcome = compress_model(
        model, adapter, stats, CompressionSettings(), 0.3, progress=False, windows=windows
    )
    path = save_compressed(model, outcome.plan, tmp / "ckpt")
    weights, config = path / "model.safetensors", path / "masa_config.json"
    if damage == "truncated":
        weights.write_bytes(weights.read_bytes()[:-100])
    elif damage == "newer":
        data = json.loads(config.read_text())
        data["format_version"] += 1
        config.write_text(json.dumps(data))
    elif damage == "json":
        config.write_text(config.read_text()[:-20])
    return str(path)


# (description, argv builder, expected substring of the one-line error)
CASES = [
    ("unknown model alias", lambda t, mp: ["smollm9-1t"], "unknown model 'smollm9-1t'"),
    ("missing model path", lambda t, mp: ["eval", "./no/such/model"], "does not exist"),
    (
        "a hub model without network",
        lambda t, mp: _no_network(mp) or ["llama-3.2-1b", "--ratio", "0.2"],
        "llama-3.2-1b needs 'meta-llama/Llama-3.2-1B' from the Hugging Face hub, which cannot be reached",
    ),
    (
        "a hub text without network",
        lambda t, mp: _no_network(mp) or [_tiny_model_dir(t), "--calib", "wikitext2", "--no-save"],
        "the Hugging Face hub cannot be reached",
    ),
    ("unsupported architecture", lambda t, mp: ["eval", _gpt2_dir(t)], "unsupported architecture"),
    ("ratio of 0", lambda t, mp: ["smollm2-135m", "--ratio", "0"], "outside (0, 1)"),
    ("ratio of 1.5", lambda t, mp: ["smollm2-135m", "--ratio", "1.5"], "outside (0, 1)"),
    ("unknown method", lambda t, mp: ["smollm2-135m", "--method", "magic"], "unknown --method 'magic'"),
    (
        "MoDeGPT on a family whose q/k RMSNorm would rescale what it keeps",
        lambda t, mp: [_family_dir(t, "qwen3"), "--method", "modegpt", "--out", str(t / "out")],
        "--method modegpt on qwen3",
    ),
    (
        "--native removing query heads where q/k norms span all heads",
        lambda t, mp: [
            _family_dir(t, "olmo2"),
            "--targets",
            "attn,mlp",
            "--ratio",
            "0.5",
            "--ratio-of",
            "model",
            "--native",
            "--out",
            str(t / "out"),
        ],  # fmt: skip
        "--native on olmo2",
    ),
    (
        "FLAP (whole query heads) where q/k norms span all heads",
        lambda t, mp: [_family_dir(t, "olmo2"), "--method", "flap", "--out", str(t / "out")],
        "--method flap on olmo2",
    ),
    (
        "the MLP of a mixture of experts as a target",
        lambda t, mp: [_family_dir(t, "mixtral"), "--targets", "attn,mlp", "--out", str(t / "out")],
        "--targets attn,mlp on mixtral",
    ),
    (
        "--native removing query heads of a fused qkv_proj",
        lambda t, mp: [
            _family_dir(t, "phi3"),
            "--targets",
            "attn,mlp",
            "--ratio",
            "0.5",
            "--ratio-of",
            "model",
            "--native",
            "--out",
            str(t / "out"),
        ],  # fmt: skip
        "--native on phi3",
    ),
    ("empty evaluation text", lambda t, mp: ["eval", "smollm2-135m", "--text", _text_file(t, "")], "empty"),
    (
        "unknown evaluation split",
        lambda t, mp: ["eval", "smollm2-135m", "--split", "train"],
        "invalid --split",
    ),
    (
        "the same text for calibration and evaluation",
        lambda t, mp: [
            "smollm2-135m",
            "--calib",
            _text_file(t, "Some text. " * 2000),
            "--eval-text",
            _text_file(t, "Some text. " * 2000),
            "--no-save",
        ],
        "is the calibration text",
    ),
    (
        "evaluation text shorter than one window",
        lambda t, mp: ["eval", _tiny_model_dir(t), "--text", _text_file(t, "Too short."), "--seq-len", "512"],
        "tokens",
    ),
    (
        "calibration text too short for the requested windows",
        lambda t, mp: [
            _tiny_model_dir(t),
            "--calib",
            _text_file(t, "Hello world. " * 50),
            "--no-save",
            "--no-eval",
        ],
        "tokens",
    ),
    (
        "a stream refit with nothing to refit",
        lambda t, mp: ["smollm2-135m", "--refit", "stream"],
        "--refit stream refits --attention heads' o_proj and --mlp neurons' down_proj: this run has neither",
    ),
    (
        "missing text file",
        lambda t, mp: ["eval", "smollm2-135m", "--text", "./missing.txt"],
        "does not exist",
    ),
    (
        "unknown recipe key",
        lambda t, mp: ["smollm2-135m", "--recipe", _recipe_with_typo(t)],
        "unknown recipe key 'compression.group'",
    ),
    ("missing recipe file", lambda t, mp: ["smollm2-135m", "--recipe", "nope.yaml"], "does not exist"),
    (
        "output directory exists",
        lambda t, mp: ["smollm2-135m", "--out", _existing_dir(t)],
        "already exists: pass --overwrite",
    ),
    (
        "not enough free disk for the checkpoint",
        lambda t, mp: [_tiny_model_dir(t), "--out", _full_disk(t, mp), "--no-eval"],
        "not enough free disk",
    ),
    (
        "truncated checkpoint weights",
        lambda t, mp: ["eval", _damaged_checkpoint(t, "truncated")],
        "model.safetensors",
    ),
    (
        "checkpoint written by a newer version",
        lambda t, mp: ["eval", _damaged_checkpoint(t, "newer")],
        "newer version",
    ),
    (
        "checkpoint config that is not valid JSON",
        lambda t, mp: ["show", _damaged_checkpoint(t, "json")],
        "JSON",
    ),
    ("unknown device", lambda t, mp: ["eval", "smollm2-135m", "--device", "tpu9"], "device"),
    (
        "CUDA requested without a GPU",
        lambda t, mp: ["eval", "smollm2-135m", "--device", "cuda"],
        "CUDA is not available",
    ),
    ("unknown dtype", lambda t, mp: ["eval", "smollm2-135m", "--dtype", "float8"], "unknown dtype"),
    (
        "per-item scores asked without tasks",
        lambda t, mp: ["eval", "smollm2-135m", "--items", str(t / "items.jsonl")],
        "--items writes the per-item scores of lm-eval tasks: add --tasks",
    ),
    (
        "an option the method does not read",
        lambda t, mp: ["smollm2-135m", "--method", "svd-llm", "--groups", "4"],
        "--groups has no effect with --method svd-llm",
    ),
    (
        "an option a preset pins otherwise",
        lambda t, mp: ["smollm2-135m", "--method", "masa-paper", "--allocation", "global"],
        "--method masa-paper pins allocation",
    ),
    ("unknown --targets", lambda t, mp: ["smollm2-135m", "--targets", "ffn"], "invalid --targets"),
    (
        "MLP targets with Algorithm 1",
        lambda t, mp: ["smollm2-135m", "--targets", "attn,mlp", "--method", "masa-paper"],
        "no rule for MLP projections",
    ),
    ("unknown --sharing", lambda t, mp: ["smollm2-135m", "--sharing", "layers"], "invalid --sharing"),
    (
        "an option of another form of sharing",
        lambda t, mp: ["smollm2-135m", "--sharing", "basis", "--bases", "2"],
        "--bases has no effect with --method masa --sharing basis: drop it, or use --sharing atoms",
    ),
    (
        "a shared basis with Algorithm 1",
        lambda t, mp: ["smollm2-135m", "--sharing", "basis", "--allocation", "paper"],
        "has no rule for a basis shared across layers",
    ),
    (
        "group sizes for a form without KL groups",
        lambda t, mp: ["plan", "smollm2-135m", "--layout", "1,28,1"],
        "--layout gives the sizes of KL groups, which --method masa --sharing none does not use",
    ),
    (
        "a model ratio the targets cannot hold",
        lambda t, mp: ["plan", "smollm2-135m", "--ratio", "0.3", "--ratio-of", "model"],
        "--ratio 0.3 --ratio-of model removes",
    ),
    (
        "an unknown --ratio-of",
        lambda t, mp: ["plan", "smollm2-135m", "--ratio-of", "file"],
        "--ratio-of 'file' is not one of: targets, model",
    ),
    (
        "a byte budget with a --type",
        lambda t, mp: ["export", "smollm2-135m", str(t / "m.gguf"), "--size", "90MiB", "--type", "q4_k_m"],
        "--size chooses every matrix's type: drop --type q4_k_m",
    ),
    (
        "a byte budget for a file that is not a GGUF",
        lambda t, mp: ["export", "smollm2-135m", str(t / "m.bin"), "--size", "90MiB"],
        "a GGUF file's name ends in .gguf",
    ),
    (
        "a byte budget given twice",
        lambda t, mp: [
            "export",
            "smollm2-135m",
            str(t / "m.gguf"),
            "--size",
            "90MiB",
            "--bits-per-weight",
            "5",
        ],
        "--bits-per-weight and --size both set the file's bytes: keep one",
    ),
    (
        "bits per weight with a --type",
        lambda t, mp: [
            "export",
            "smollm2-135m",
            str(t / "m.gguf"),
            "--bits-per-weight",
            "5",
            "--type",
            "q4_k_m",
        ],
        "--bits-per-weight chooses every matrix's type: drop --type q4_k_m",
    ),
    (
        "bits per weight out of range",
        lambda t, mp: ["export", "smollm2-135m", str(t / "m.gguf"), "--bits-per-weight", "0.5"],
        "--bits-per-weight 0.5: must lie between 1 and 32",
    ),
    (
        "--only-types without a byte budget",
        lambda t, mp: ["export", "smollm2-135m", str(t / "m.gguf"), "--only-types", "q4_k"],
        "--only-types restricts the types a --size file chooses from: add --size (or drop it)",
    ),
    (
        "--speed without a byte budget",
        lambda t, mp: ["export", "smollm2-135m", str(t / "m.gguf"), "--speed", "mix"],
        "--speed mix: the decode speed of a --size file: add --size (or drop --speed)",
    ),
    (
        "a --speed no file of those bytes reaches (refused before the calibration)",
        lambda t, mp: (
            _decode_costs_known(mp)
            or ["export", "smollm2-135m", str(t / "m.gguf"), "--size", "80MiB", "--speed", "1000"]
        ),
        "--speed: the fastest file of these bytes is predicted at 7.4 tokens/s on this CPU (1 thread), short of the",
    ),
    (
        "--speed that is not a speed",
        lambda t, mp: ["plan", "smollm2-135m", "--size", "80MiB", "--speed", "fast"],
        "--speed fast: not a speed: write any, mix (no slower than llama.cpp's mix of the same bytes), or tokens",
    ),
    (
        "llama.cpp's flash attention with the transformers engine",
        lambda t, mp: ["eval", "smollm2-135m", "--flash-attention"],
        "--flash-attention is llama.cpp's: add --engine llama.cpp (or drop it)",
    ),
    (
        "a llama.cpp mix as one of --only-types",
        lambda t, mp: ["plan", "smollm2-135m", "--size", "80MiB", "--only-types", "q4_k_m,q6_k"],
        "--only-types q4_k_m,q6_k: q4_k_m is not a type a matrix can take: choose among q2_k, iq3_s, q3_k",
    ),
    (
        "--only-types whose blocks a model's rows do not fill",
        lambda t, mp: ["compress", "smollm2-135m", "--size", "80MiB", "--only-types", "q4_k", "--dry-run"],
        "--only-types q4_k: a matrix with rows of 576 takes none of them (its rows fit q8_0, q4_0, q4_1",
    ),
    (
        "an imatrix file not named .gguf",
        lambda t, mp: ["export", "smollm2-135m", str(t / "m.gguf"), "--imatrix-out", str(t / "imatrix.dat")],
        "/imatrix.dat: llama.cpp's imatrix file is a GGUF: name it FILE.gguf",
    ),
    (
        "an imatrix file at the model's own path",
        lambda t, mp: ["export", "smollm2-135m", str(t / "m.gguf"), "--imatrix-out", str(t / "m.gguf")],
        "the model's own path: name the imatrix file differently",
    ),
    (
        "an imatrix file with --format hf",
        lambda t, mp: [
            "export",
            "smollm2-135m",
            str(t / "dense"),
            "--format",
            "hf",
            "--imatrix-out",
            str(t / "imatrix.gguf"),
        ],  # fmt: skip
        "--imatrix-out writes llama.cpp's importance matrix: use --format gguf (OUT.gguf)",
    ),
    (
        "a size that is not one",
        lambda t, mp: ["export", "smollm2-135m", str(t / "m.gguf"), "--size", "ninety"],
        "--size ninety: not a size",
    ),
    (
        "a byte budget without importance weights",
        lambda t, mp: ["export", "smollm2-135m", str(t / "m.gguf"), "--size", "90MiB", "--imatrix", "none"],
        "--size weighs each type's rounding by the calibration: drop --imatrix none",
    ),
    (
        "compensated rounding of a float type",
        lambda t, mp: [
            "export",
            "smollm2-135m",
            str(t / "m.gguf"),
            "--type",
            "f16",
            "--rounding",
            "compensated",
        ],
        "--rounding compensated: --type f16 is not rounded into blocks: choose a quantized --type",
    ),
    (
        "compensated rounding without the calibration",
        lambda t, mp: [
            "export",
            "smollm2-135m",
            str(t / "m.gguf"),
            "--type",
            "q4_k_m",
            "--imatrix",
            "none",
            "--rounding",
            "compensated",
        ],  # fmt: skip
        "--rounding compensated reads the calibration's input statistics: drop --imatrix none",
    ),
    (
        "an unknown rounding",
        lambda t, mp: ["export", "smollm2-135m", str(t / "m.gguf"), "--type", "q4_k_m", "--rounding", "gptq"],
        "--rounding gptq: unknown: choose nearest or compensated",
    ),
    (
        "an unknown GGUF type",
        lambda t, mp: ["export", "smollm2-135m", str(t / "m.gguf"), "--type", "q3_q"],
        "--type q3_q: unknown GGUF type",
    ),
    (
        "importance weights for a type that ignores them",
        lambda t, mp: [
            "export",
            "smollm2-135m",
            str(t / "m.gguf"),
            "--type",
            "q8_0",
            "--imatrix",
            "calibration",
        ],
        "--type q8_0 does not use importance weights",
    ),
    (
        "an importance file that is not there",
        lambda t, mp: [
            "export",
            "smollm2-135m",
            str(t / "m.gguf"),
            "--type",
            "q4_k_m",
            "--imatrix",
            str(t / "no.dat"),
        ],
        "no.dat: no such file: pass llama.cpp's importance file (imatrix.gguf or .dat)",
    ),
    (
        "an importance file that is not one",
        lambda t, mp: [
            "export",
            "smollm2-135m",
            str(t / "m.gguf"),
            "--type",
            "q4_k_m",
            "--imatrix",
            str(_junk(t / "junk.dat")),
        ],  # fmt: skip
        "not an importance file llama.cpp writes",
    ),
    (
        "an importance file read and another written",
        lambda t, mp: [
            "export",
            "smollm2-135m",
            str(t / "m.gguf"),
            "--type",
            "q4_k_m",
            "--imatrix",
            str(_junk(t / "w.dat")),
            "--imatrix-out",
            str(t / "i.gguf"),
        ],  # fmt: skip
        "--imatrix-out writes the calibration's weights, --imatrix",
    ),
    (
        "a recipe at the model's own path",
        lambda t, mp: ["export", "smollm2-135m", str(t / "m.gguf"), "--tensor-types-out", str(t / "m.gguf")],
        "--tensor-types-out",
    ),
    (
        "tensor types of a file that is not a GGUF",
        lambda t, mp: ["show", str(t / "m.bin"), "--tensor-types"],
        "not a GGUF file: pass FILE.gguf",
    ),
    (
        "a 2-bit i-quant without importance weights",
        lambda t, mp: ["export", "smollm2-135m", str(t / "m.gguf"), "--type", "iq2_xs", "--imatrix", "none"],
        "--type iq2_xs needs importance weights",
    ),
    (
        "a byte budget and a ratio",
        lambda t, mp: ["smollm2-135m", "--size", "80MiB", "--ratio", "0.3"],
        "--size and --ratio both set how much is removed: keep one",
    ),
    (
        "a byte budget written to a file that is not a GGUF",
        lambda t, mp: ["smollm2-135m", "--size", "80MiB", "--out", str(t / "m.bin")],
        "a GGUF file's name ends in .gguf",
    ),
    (
        "an importance file for a run that writes no GGUF",
        lambda t, mp: ["smollm2-135m", "--imatrix", str(t / "imatrix.gguf")],
        "weighs a GGUF's rounding: add --size (or use export --imatrix)",
    ),
    (
        "a byte budget without importance weights",
        lambda t, mp: ["smollm2-135m", "--size", "80MiB", "--imatrix", "none"],
        "--size weighs each type's rounding by the calibration (the default) or by llama.cpp's importance file",
    ),
    (
        "a byte budget weighed by an importance file that is not there",
        lambda t, mp: [
            "smollm2-135m",
            "--size",
            "80MiB",
            "--imatrix",
            str(t / "missing.gguf"),
            "--out",
            str(t / "m.gguf"),
        ],  # fmt: skip
        "missing.gguf: no such file: pass llama.cpp's importance file",
    ),
    (
        "a byte budget with a form it chooses itself",
        lambda t, mp: ["smollm2-135m", "--size", "80MiB", "--method", "flap"],
        "--size chooses the engine-native forms and their sizes itself: drop --method",
    ),
    (
        "a byte budget below the smallest file the model can make",
        lambda t, mp: ["smollm2-135m", "--size", "10MiB", "--out", str(t / "m.gguf")],
        "the smallest file this model can make is more than 46,407,168 bytes",
    ),
    (
        "a byte budget for a configuration llama.cpp's architecture computes differently",
        lambda t, mp: [_family_dir(t, "gemma2"), "--size", "10MiB", "--out", str(t / "m.gguf")],
        "query_pre_attn_scalar 256: llama.cpp scales the queries by 1/sqrt(16)",
    ),
    (
        "a byte budget for a folder whose tokenizer llama.cpp would not take",
        lambda t, mp: [_tiny_model_dir(t), "--bits-per-weight", "4", "--out", str(t / "m.gguf")],
        "its BPE pre-tokenizer is not one llama.cpp recognizes",
    ),
    (
        "a byte budget scored on windows longer than the model's context",
        lambda t, mp: [_folder_llama_cpp_takes(t), "--size", "6MiB", "--out", str(t / "m.gguf")],
        "the evaluation windows (512 tokens) are longer than the model's context (128 tokens)",
    ),
    (
        "a dry run cannot choose G and B",
        lambda t, mp: ["smollm2-135m", "--dry-run", "--sharing", "atoms", "--auto-groups"],
        "cannot plan with --auto-groups",
    ),
    (
        "ratio the groups/atoms cannot meet",
        lambda t, mp: [
            _tiny_model_dir(t),
            "--ratio",
            "0.99",
            "--sharing",
            "atoms",
            "--groups",
            "3",
            "--no-save",
            "--no-eval",
            "--calib-samples",
            "2",
            "--seq-len",
            "64",
        ],
        "infeasible",
    ),  # fmt: skip
]


def _files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")} if root.exists() else set()


def _run_case(build, tmp_path, capsys, monkeypatch) -> tuple[int, str, list[str], dict[str, set[str]]]:
    """Build the case's files, then run it on a cache of its own (the packaged models and texts linked in): its
    exit code, stderr, argv, and the paths it left in the case's folder and in the cache."""
    from conftest import cache_of_its_own

    cache = cache_of_its_own(tmp_path / "cache")
    monkeypatch.setenv("MASA_CACHE", str(cache))
    argv = build(tmp_path, monkeypatch)
    capsys.readouterr()  # drop what building the fixture printed
    before = {"folder": _files(tmp_path), "cache": _files(cache)}
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    left = {"folder": _files(tmp_path) - before["folder"], "cache": _files(cache) - before["cache"]}
    return exit_info.value.code, capsys.readouterr().err.strip(), argv, left


@pytest.mark.parametrize(("description", "build", "expected"), CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_a_one_line_error(description, build, expected, tmp_path, capsys, monkeypatch):
    """One line, exit code 2, and nothing written: no output, no temporary sibling, nothing in the cache."""
    code, err, _, left = _run_case(build, tmp_path, capsys, monkeypatch)
    assert code == 2, err
    assert "Traceback" not in err
    assert len(err.splitlines()) == 1, err
    assert expected in err, err
    assert not {p for p in left["folder"] if not p.startswith("cache")} and not left["cache"], left


def test_bad_input_table_is_up_to_date(tmp_path, capsys, monkeypatch):
    """docs/bad-inputs.md lists every case above, whatever ran before (regenerate it with
    MASA_WRITE_BAD_INPUTS=1: this test then runs every case itself and writes the table)."""
    if os.environ.get("MASA_WRITE_BAD_INPUTS"):
        lines = [
            "# Bad input and what the user sees",
            "",
            "Generated from `tests/test_cli_errors.py` (`MASA_WRITE_BAD_INPUTS=1 python -m pytest "
            "tests/test_cli_errors.py`). Every case exits with status 2 and one line on stderr, no traceback.",
            "",
            "| case | command | what the user sees |",
            "|---|---|---|",
        ]
        for i, (description, build, _) in enumerate(CASES):
            tmp = tmp_path / str(i)
            tmp.mkdir()
            with monkeypatch.context() as patch:
                _, err, argv, _ = _run_case(build, tmp, capsys, patch)
            shown = " ".join("<tmp>/" + Path(a).name if str(tmp) in a else a for a in argv)
            escaped = err.replace(str(tmp), "<tmp>").replace("|", "\\|")
            lines.append(f"| {description} | `masa-compress {shown}` | `{escaped}` |")
        DOC.parent.mkdir(exist_ok=True)
        DOC.write_text("\n".join(lines) + "\n")
    text = DOC.read_text()
    for description, _, _ in CASES:
        assert f"| {description} |" in text, f"docs/bad-inputs.md lacks '{description}': regenerate it"


# Usage errors, caught by the command-line parser before any of our code runs: whatever typer/click version
# is installed (typer ≥ 0.25 raises its vendored click's classes), each ends in at most 3 lines, exit code 2.
USAGE_CASES = [
    ["compress", "smollm2-135m", "--groups", "0"],
    ["compress", "smollm2-135m", "--ratio", "abc"],
    ["smollm2-135m", "--ratio"],
    ["--bogus-flag"],
    ["compress", "smollm2-135m", "--bogus-flag"],
    ["compress"],
    ["eval"],
    ["plan", "--ratio", "0.2"],
    ["show"],
    ["recipes", "--no-such-option"],
    ["eval", "smollm2-135m", "--seq-len", "4"],
    ["export-dense", "only-one-argument"],
]


@pytest.mark.parametrize("argv", USAGE_CASES, ids=[" ".join(a) for a in USAGE_CASES])
def test_usage_error_is_short(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2, err
    assert "Traceback" not in err
    lines = err.splitlines()
    assert 1 <= len(lines) <= 3, err
    assert lines[0].startswith("error: "), err
    assert "--help" in lines[-1], err


def _junk(path):
    """A file that is no importance file (two bytes)."""
    path.write_bytes(b"\x05\x00")
    return path
