"""The `calibration_size` experiment (README.md: the command that wrote its results)."""
