"""The method's mathematics, without model code: grouping by KL divergence (`grouping.py`), Matrix PCA (`pca.py`),
Cholesky whitening and low-rank factors (`whitening.py`), the MLP's neuron selection (`neurons.py`), rank
allocation (`allocation.py`) and exact parameter accounting (`accounting.py`)."""
