"""Where and how a run runs, below every stage: the device and dtype (`device.py`), whether the Hugging Face hub
can be reached (`hub.py`), the project's cache root (`cache_root.py`), progress lines (`progress.py`) and the
errors a user can fix (`errors.py`). Imports nothing else of the package."""
