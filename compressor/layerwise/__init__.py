"""`--layerwise`: compression of a model larger than memory, its decoder layers on disk and every pass run one
layer at a time (memory flat in depth; the same checkpoint as in memory).

- `offload.py`: the model loaded with its layers on disk (transformers' / accelerate's disk offload), one layer
  materialised at a time;
- `passes.py`: the statistics, the loss sensitivity and the evaluation, layer by layer;
- `spill.py`: the method's context over an offloaded model; finished layers written to disk;
- `run.py`: the `compress --layerwise` run.
"""
