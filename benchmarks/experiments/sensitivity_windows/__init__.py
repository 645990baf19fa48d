"""The `sensitivity_windows` experiment (README.md: the command that wrote its results)."""
