"""The `budget_split` experiment (README.md: the command that wrote its results)."""
