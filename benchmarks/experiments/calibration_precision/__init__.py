"""The `calibration_precision` experiment (README.md: the command that wrote its results)."""
