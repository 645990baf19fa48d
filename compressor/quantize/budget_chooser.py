"""`write_gguf`'s `choose_types` for a byte budget: each matrix's options measured (or read from the cache), then
one allocation among them (`byte_budget.allocate`), within a decode speed where `--speed` asks one (`speed.py`)."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import numpy as np

from compressor.modeling.adapters import geometry_from_config
from compressor.quantize.byte_budget import (
    BytePlan,
    Option,
    allocate,
    candidate_types,
    check_fits,
    matrix_options,
    rows_bytes,
    within,
)
from compressor.quantize.decode_cost import decode_costs, matrices_layer_shape
from compressor.quantize.ggml_quantize import padded
from compressor.quantize.options_cache import load_options, save_options
from compressor.quantize.speed import SPEED_THREADS, MixTypeOf, SpeedPlan, SpeedTarget, speed_plan


class BudgetChooser:
    """`write_gguf`'s `choose_types` for a byte budget: every matrix's options measured (progress per matrix), the
    allocation made among the types in `allowed` (None: every candidate); `plan` holds it afterwards."""

    def __init__(
        self, model, importance, budget: int, progress: bool = True, allowed: frozenset[str] | None = None,
        compensated=None, speed: SpeedTarget | None = None, costs: Callable | None = None,
    ):  # fmt: skip
        """`compensated`: (matrices, their candidate types) → each decoder-layer matrix's output error per type
        when rounded compensated (`rounding.compensated_errors`), priced instead of `nearest`'s. `speed`: the
        `--speed` target the plan is made within; `costs`: (types, `LayerShape`) → their decode ns per weight
        (default: measured in llama.cpp on this CPU, `decode_cost.decode_costs`)."""
        if importance.gradients is None:
            raise ValueError("a byte budget needs the output sensitivities: measure with gradient_windows")
        self.importance, self.budget, self.progress, self.allowed = importance, budget, progress, allowed
        self.compensated, self.speed, self.costs = compensated, speed, costs
        self.config = model.config  # its heads' width: the layer shape decode costs are measured on (`speed`)
        self.speed_plan: SpeedPlan | None = None
        names = {id(m): n for n, m in model.named_modules()}
        output, embedding = model.get_output_embeddings(), model.get_input_embeddings()
        self.head_path = names.get(id(output))
        self.embedding_path = names[id(embedding)]
        self.tied = output is not None and output.weight is embedding.weight
        self.plan: BytePlan | None = None
        self.reused = 0  # matrices whose options came from the cache (`options_cache.py`)

    def options(self, array: np.ndarray, module_path: str, weighted: dict | None = None) -> list[Option]:
        imp = self.importance
        vector = imp.weights.get(module_path)
        vector = None if vector is None else vector.numpy().astype(np.float32)
        if module_path != self.embedding_path:
            return matrix_options(array, vector, imp.gradients.get(module_path, 0.0), weighted=weighted)
        lookup = (imp.gradients.get(self.embedding_path, 0.0), imp.token_share.numpy())
        head_gradient = imp.gradients.get(self.head_path, 0.0) if self.tied else 0.0
        return matrix_options(array, vector, head_gradient, lookup)

    def __call__(
        self,
        matrices: list[tuple[str, np.ndarray, str]],
        fixed_bytes: int,
        mix_type_of: MixTypeOf | None = None,
    ) -> dict[str, str]:
        """Each matrix's type; `mix_type_of` (what a llama.cpp mix stores each matrix in) for `--speed mix`."""
        from compressor.runtime.progress import note, progress_bar

        smallest = fixed_bytes + sum(  # refused before any rounding is measured
            padded(rows_bytes(array, self.importance.weights.get(path) is not None, self.allowed, name))
            for name, array, path in matrices
        )
        check_fits(smallest, self.budget)
        rounding = "nearest" if self.compensated is None else "compensated"
        key = self.importance.key
        known = (
            {n: [Option(*row) for row in rows] for n, rows in load_options(key, rounding).items()}
            if key
            else {}
        )
        missing = [m for m in matrices if m[0] not in known]
        compensated = {}
        if self.compensated is not None and missing:
            compensated = self.compensated(missing, lambda a: candidate_types(a.shape[1], True))
        options = {name: known[name] for name, _, _ in matrices if name in known}
        if options:
            note(
                f"Rounding errors per type: {len(options)} of {len(matrices)} matrices from cache",
                self.progress,
            )
        with progress_bar(
            "Rounding errors per type", total=len(missing), enabled=self.progress and missing
        ) as bar:
            for tensor_name, array, module_path in missing:
                options[tensor_name] = self.options(array, module_path, compensated.get(tensor_name))
                bar.advance(1)
        if key and missing:
            rows = {n: [(o.type_name, o.bytes, o.predicted) for o in options[n]] for n, _, _ in missing}
            save_options(key, rounding, rows)
        self.reused = len(matrices) - len(missing)
        if self.allowed is not None:  # measured for every type (kept for other budgets), chosen among these
            for name, opts in options.items():
                kept = within(name, [o.type_name for o in opts], self.allowed)
                options[name] = [o for o in opts if o.type_name in kept]
        if self.speed is None:
            self.plan = allocate(options, fixed_bytes, self.budget)
        else:
            if mix_type_of is None and self.speed.mix:
                raise ValueError("--speed mix prices llama.cpp's mix: pass mix_type_of (write_gguf does)")
            shape = matrices_layer_shape(matrices, geometry_from_config(self.config))
            costs = self.costs or partial(decode_costs, threads=SPEED_THREADS, progress=self.progress)
            self.plan, self.speed_plan = speed_plan(
                self.speed, options, matrices, lambda types: costs(types, shape), fixed_bytes, self.budget,
                self.tied, mix_type_of,
            )  # fmt: skip
        return self.plan.types
