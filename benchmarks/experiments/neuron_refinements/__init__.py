"""The `neuron_refinements` experiment (README.md: the command that wrote its results)."""
