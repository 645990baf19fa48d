"""The renderer of BENCHMARKS.md (`python -m benchmarks.report`, no measurement): the page (`page.py`), its
sections, the validation choices of section 6 and the plots, read from `benchmarks/results/`."""
