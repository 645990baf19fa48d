"""Code copied into every checkpoint, so plain transformers can load it (`trust_remote_code=True`).

`modeling_masa.py` (the model classes) is data for `compressor.checkpoint`; `masa_modules.py` (the replacement
modules) is also the library's own. Both must stay self-contained (torch and transformers only, relative imports
between them), as users of lm-eval-harness and similar tools load checkpoints without masa-compress installed.
"""
