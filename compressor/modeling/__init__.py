"""Reaching into a model: architecture adapters (`adapters.py`: no module path is hard-coded elsewhere), a model
with its decoder layers kept on disk (`offload.py`, for `--layerwise`), and the modules a compressed model is made
of (`remote_code/`, copied into every checkpoint)."""
