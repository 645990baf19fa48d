"""masa-compress: training-free compression of LLM weights (`SUMMARY` says how).

The package reads as the pipeline, bottom to top: `runtime/` (device, cache, progress, errors) → `modeling/`
(adapters, compressed modules) → `math/` and `evaluation/` → `statistics/` (calibration) → `checkpoint/`,
`report/` → `methods/` → `api/` (one run, and the public entry point `compressor.api`) → `cli/`.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

__version__ = "0.1.0"

SUMMARY = (
    "Training-free compression of LLM weights: whitened low-rank factors and narrower MLPs under one "
    "loss-aware budget; weights shared across layers (MASA) on request, where it pays: from about half of "
    "the attention removed."
)

#: Modules moved when the package was laid out by stage (0.1.0); the old paths import the new modules, with a
#: FutureWarning, until the next release. Checkpoints are unaffected: they carry their own copy of the remote code.
MOVED_MODULES = {
    "compressor.adapters": "compressor.modeling.adapters",
    "compressor.allocation": "compressor.math.allocation",
    "compressor.calibration.cache": "compressor.runtime.cache_root",
    "compressor.capture": "compressor.statistics.capture",
    "compressor.config": "compressor.api.run_options",
    "compressor.device": "compressor.runtime.device",
    "compressor.errors": "compressor.runtime.errors",
    "compressor.evaluate": "compressor.evaluation.perplexity",
    "compressor.grouping": "compressor.math.grouping",
    "compressor.harness": "compressor.evaluation.lm_eval_tasks",
    "compressor.hub": "compressor.runtime.hub",
    "compressor.inspection": "compressor.api.inspection",
    "compressor.intervals": "compressor.evaluation.intervals",
    "compressor.layerwise.offload": "compressor.modeling.offload",
    "compressor.layerwise.passes": "compressor.statistics.layer_stream",
    "compressor.layerwise.run": "compressor.api.layerwise",
    "compressor.layerwise.spill": "compressor.methods.offloaded_context",
    "compressor.methods.allocators": "compressor.methods.allocation_policies",
    "compressor.models": "compressor.api.model_loading",
    "compressor.neurons": "compressor.math.neurons",
    "compressor.pca": "compressor.math.pca",
    "compressor.pipeline": "compressor.api.pipeline",
    "compressor.plan": "compressor.math.accounting",
    "compressor.planning": "compressor.api.preview",
    "compressor.progress": "compressor.runtime.progress",
    "compressor.remote_code": "compressor.modeling.remote_code",
    "compressor.remote_code.masa_modules": "compressor.modeling.remote_code.masa_modules",
    "compressor.remote_code.modeling_masa": "compressor.modeling.remote_code.modeling_masa",
    "compressor.sensitivity": "compressor.statistics.sensitivity",
    "compressor.sequential": "compressor.statistics.partly_compressed",
    "compressor.session": "compressor.api.session",
    "compressor.stats_cache": "compressor.statistics.cache",
    "compressor.whitening": "compressor.math.whitening",
}

#: Packages whose modules moved to several places: the old name is an empty package, so that the old paths of its
#: modules (above) still import.
SPLIT_PACKAGES = {"compressor.layerwise"}


class _MovedModule(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports a moved module under its old name as the very same module object (one class identity, one state)."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname in SPLIT_PACKAGES:
            return importlib.util.spec_from_loader(fullname, self, is_package=True)
        if fullname not in MOVED_MODULES:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        if spec.name in SPLIT_PACKAGES:
            return None  # an empty package: its submodules come through `MOVED_MODULES`
        new = MOVED_MODULES[spec.name]
        warnings.warn(
            f"{spec.name} moved to {new}: import it from there ({spec.name} goes in the next release)",
            FutureWarning,
            stacklevel=2,
        )
        module = importlib.import_module(new)
        # importlib gives the module this alias spec next; its own is put back in `exec_module`.
        spec.loader_state = module.__spec__
        return module

    def exec_module(self, module) -> None:
        """A moved module is the new one, already executed: only its own spec goes back (importlib replaced it
        with the alias's, which would make a package look like a plain module). A split package holds nothing."""
        if module.__spec__.loader_state is not None:
            module.__spec__ = module.__spec__.loader_state
        elif module.__name__ in SPLIT_PACKAGES:
            module.__path__ = []


# First on the path: the old `compressor.remote_code` resolves to the new package, and its submodules must
# come through here too rather than be loaded a second time from that package's folder.
if not any(isinstance(finder, _MovedModule) for finder in sys.meta_path):
    sys.meta_path.insert(0, _MovedModule())
