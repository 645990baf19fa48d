"""Past experiments, each run once by hand on the validation split: one folder each, with the command that wrote
its results file (its README.md). `make bench` does not re-run them; BENCHMARKS.md section 6 renders their files."""
