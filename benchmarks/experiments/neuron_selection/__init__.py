"""The `neuron_selection` experiment (README.md: the command that wrote its results)."""
