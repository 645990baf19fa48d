"""The `sequential_refit` experiment (README.md: the command that wrote its results)."""
