"""The `embedding_target` experiment (README.md: the command that wrote its results)."""
