"""masa-compress: training-free cross-layer weight sharing for pretrained LLM attention."""

__version__ = "0.1.0"
