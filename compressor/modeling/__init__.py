"""Reaching into a model: the registry of model families (`families.py`: where each keeps its blocks, projections
and norms, and which forms it takes; no module path of a family is written anywhere else in the library,
`tests/check_structure.py` checks), the adapter that reads it (`adapters.py`), a model with its decoder layers
kept on disk (`offload.py`, for `--layerwise`), and the modules a compressed model is made of (`remote_code/`,
copied into every checkpoint, with its own copy of the few names it needs)."""
