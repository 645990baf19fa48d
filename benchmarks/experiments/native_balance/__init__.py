"""The `native_balance` experiment (README.md: the command that wrote its results)."""
