"""What `make bench` and `make bench-quick` run (`python -m benchmarks.suite.run`): the sections of BENCHMARKS.md
measured on the bundled model, and the helpers they share with the other benchmarks (`common.py`)."""
