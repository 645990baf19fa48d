#!/usr/bin/env bash
# The GPU checks in one command, for a lent machine with a GPU whose python3 has torch but not the rest of our
# dependencies, and no network: tests/test_cuda.py, then `make bench-gpu`'s three runs at the 1.5B shapes.
#
#   bash benchmarks/engines/gpu_checks.sh OUT_DIR [WHEELS_DIR]
#
# OUT_DIR receives the logs and gpu.json, gpu-native-stream.json, gpu-native-layerwise.json (copy those into
# benchmarks/results/ and commit them). WHEELS_DIR holds wheels of what that python lacks, fetched beforehand on
# a machine that reaches the registry (Python 3.12 there; each at the version our .venv has), e.g.
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d WHEELS \
#     transformers huggingface_hub kernels httpx2 httpcore2 truststore tomlkit click typer gguf pydantic \
#     pydantic_core annotated-types typing-inspection mwparserfromhell xllamacpp
# (54 MB with xllamacpp, which only the byte-budget case needs). Each step has its own time limit, so one that
# hangs costs its limit and not the lease: about 6 minutes in all on an H200.
set -uo pipefail
out=$(realpath -m "${1:?usage: gpu_checks.sh OUT_DIR [WHEELS_DIR]}")
wheels=${2:-}
repo=$(cd "$(dirname "$0")/../.." && pwd)
mkdir -p "$out"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
site=$(mktemp -d)
if [ -n "$wheels" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$site/deps" "$wheels"/*.whl || exit 1
fi
# The package itself, installed (not run from the checkout): its recipes and calibration folders are mapped into
# it by pyproject.toml, which a plain path to the checkout would not do.
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target "$site/pkg" "$repo" || exit 1
export PYTHONPATH="$site/pkg:$site/deps:$repo"
cd "$site"  # not the checkout: its compressor/ folder would shadow the installed package
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$out/env.txt" 2>&1
python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)" >> "$out/env.txt" 2>&1
status=0
timeout 190 python3 -m pytest "$repo/tests/test_cuda.py" -q -p no:cacheprovider > "$out/test_cuda.log" 2>&1 || status=1
tail -3 "$out/test_cuda.log"
run() {  # NAME [COMPRESS OPTIONS]
  local name=$1
  shift
  timeout 200 python3 -m benchmarks.engines.gpu_scale --out "$out/$name.json" -- "$@" > "$out/$name.log" 2>&1 || status=1
  echo "$name: $(tail -c 300 "$out/$name.log" | tr '\n' ' ')"
}
run gpu
run gpu-native-stream --native --refit stream
run gpu-native-layerwise --native --layerwise
exit $status
