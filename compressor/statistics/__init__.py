"""Stage 1, calibration statistics: fp64 input autocorrelations and block-output means captured by hooks
(`capture.py`), each projection's loss sensitivity (`sensitivity.py`), statistics of the partly compressed model
for sequential refits (`partly_compressed.py`), the same passes one layer at a time for `--layerwise`
(`layer_stream.py`), and their cache between runs (`cache.py`)."""
