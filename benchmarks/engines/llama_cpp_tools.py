"""llama.cpp's own command-line tools, built from the sources the installed xllamacpp vendors, for the checks that
compare the tool with them (the long tests, `llama_quantize_port.py`): no wheel ships `llama-quantize`,
`llama-imatrix` or the converter, so the sources come from xllamacpp's sdist in the registry (unpacked once into
the cache) and the tools are built there once per version (about 4 minutes on 2 cores; cmake and a C++ compiler)."""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

TOOLS = ("llama-quantize", "llama-imatrix")


def llama_cpp_sources() -> Path:
    """The vendored llama.cpp tree (`convert_hf_to_gguf.py`, `tools/`, `src/`) of the installed xllamacpp."""
    from compressor.runtime.cache_root import cache_dir

    version = importlib.metadata.version("xllamacpp")
    root = cache_dir() / "llama-cpp-sources" / version
    tree = root / f"xllamacpp-{version}" / "thirdparty" / "llama.cpp"
    if not (tree / "CMakeLists.txt").is_file():
        root.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--quiet"]
        subprocess.run([*command, "--dest", str(root), f"xllamacpp=={version}"], check=True)
        with tarfile.open(next(root.glob(f"xllamacpp-{version}.tar.gz"))) as archive:
            members = [m for m in archive.getmembers() if "/thirdparty/llama.cpp/" in m.name]
            archive.extractall(root, members=members, filter="data")
    return tree


def llama_cpp_tools() -> Path:
    """The folder holding `llama-quantize` and `llama-imatrix` built from `llama_cpp_sources()`."""
    sources = llama_cpp_sources()
    build = sources.parent.parent.parent / "build"
    tools = build / "bin"
    if all((tools / tool).is_file() for tool in TOOLS):
        return tools
    if shutil.which("cmake") is None:
        raise RuntimeError(
            "building llama.cpp's tools needs cmake and a C++ compiler (apt install cmake g++)"
        )
    flags = ["-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
             "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF"]  # fmt: skip
    subprocess.run(["cmake", "-S", str(sources), "-B", str(build), *flags], check=True, capture_output=True)
    subprocess.run(["cmake", "--build", str(build), "--target", *TOOLS, "-j", str(os.cpu_count() or 2)],
                   check=True, capture_output=True)  # fmt: skip
    return tools
