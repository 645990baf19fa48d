"""Quantization into llama.cpp's types, the stage between the calibration statistics and the files written.

`ggml_quantize.py` (llama.cpp's own quantizer and dequantizer through ctypes, `llama-quantize`'s type per tensor
for each mix), `gguf_types.py` (the `--type` values, `--imatrix`, each matrix's type in a file of one type, what a
GGUF holds), `importance.py` (the importance weights and output sensitivities measured on the calibration text,
cached), `byte_budget.py` (a GGUF within a size: every matrix's type chosen by one loss-aware allocation),
`compensated.py` (`--rounding compensated`: each slab of columns rounded by ggml, its error pushed onto the
columns not yet rounded through the inputs' autocorrelation, as GPTQ does). `checkpoint/` writes the files."""
