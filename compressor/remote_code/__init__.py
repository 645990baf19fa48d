"""Modeling code copied into every checkpoint, so plain transformers can load it (`trust_remote_code=True`).

The files here are data for `compressor.checkpoint`, not part of the library's import graph: they
must stay self-contained (torch and transformers only), as users of lm-eval-harness and similar
tools may load a checkpoint without masa-compress installed.
"""
