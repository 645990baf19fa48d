"""Benchmarks run by hand beside `make bench`: the model in llama.cpp (`llama_cpp.py`, `make bench-engines`) and
vLLM (`vllm_check.py`, `make bench-vllm`), zero-shot accuracy beside the peers (`zero_shot_peers.py`,
`make bench-zero-shot`), the real 1.5B model (`large.py`, `make bench-large`) and its shapes on a GPU
(`gpu_scale.py`, `make bench-gpu`)."""
