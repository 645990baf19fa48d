"""The method interface: a new method is one class plus one `register(...)` line, and it then runs through
the same entry points as the built-in ones (the run's `compress_model`, the preview's `plan_from_config`).

The example below is complete: a plain truncated SVD that keeps the same fraction of every targeted matrix.
"""

from __future__ import annotations

import pytest
import torch
from conftest import random_windows, tiny_config, tiny_model

from compressor.api.pipeline import compress_model
from compressor.api.preview import plan_from_config
from compressor.math.accounting import CompressionPlan, lowrank_plan
from compressor.methods import REGISTRY, Method, MethodContext, register
from compressor.modeling.adapters import get_adapter
from compressor.modeling.remote_code.masa_modules import LowRankLinear
from compressor.recipes.schema import CompressionSettings
from compressor.runtime.errors import UserError
from compressor.statistics.capture import collect_statistics


class ExampleSvd(Method):
    """The whole example method: its accounting (`plan`) and its modules (`apply`)."""

    name = "example-svd"
    summary = "plain truncated SVD, written as the example of a method"

    def plan(self, shape, settings, ratio, groups_of=None, check_feasible=True) -> CompressionPlan:
        return lowrank_plan(
            self.name,
            ratio,
            shape.params_before,
            shape.geometry,
            shape.num_layers,
            shape.biases,
            shape.targets,
        )

    def apply(self, ctx: MethodContext) -> CompressionPlan:
        plan = self.plan(ctx.shape, ctx.settings, ctx.ratio)
        for pp in plan.projections:
            u, s, vh = torch.linalg.svd(ctx.weight(pp.layer, pp.projection), full_matrices=False)
            a, b = u[:, : pp.rank] * s[: pp.rank], vh[: pp.rank]
            module = LowRankLinear.from_factors(
                a, b, ctx.bias(pp.layer, pp.projection), ctx.model_dtype, ctx.model_device
            )
            ctx.install(pp.layer, pp.projection, module)
        return plan


@pytest.fixture
def example_method():
    method = register(ExampleSvd())  # the one registry line a new method adds
    yield method
    del REGISTRY[method.name]


def test_a_registered_method_runs_and_holds_its_budget(example_method):
    model = tiny_model("qwen2")  # q/k/v biases: the budget counts them
    adapter = get_adapter(model)
    stats = collect_statistics(model, adapter, random_windows(), progress=False)
    outcome = compress_model(
        model, adapter, stats, CompressionSettings(method="example-svd"), 0.3, progress=False
    )
    assert outcome.plan.method == "example-svd"
    assert outcome.plan.params_after() <= outcome.plan.budget
    assert isinstance(adapter.projection(0, "q_proj"), LowRankLinear)
    with torch.no_grad():
        assert torch.isfinite(model(torch.arange(8)[None]).logits).all()


def test_the_preview_plans_a_registered_method_as_the_run_does(example_method):
    planned = plan_from_config(tiny_config("qwen2"), 0.3, CompressionSettings(method="example-svd"))
    model = tiny_model("qwen2")
    adapter = get_adapter(model)
    stats = collect_statistics(model, adapter, random_windows(), progress=False)
    outcome = compress_model(
        model, adapter, stats, CompressionSettings(method="example-svd"), 0.3, progress=False
    )
    assert planned["target_params_after"] == outcome.plan.params_after()
    assert planned["method"] == "example-svd"


def test_options_a_method_does_not_read_are_refused(example_method):
    with pytest.raises(UserError, match="--groups has no effect with --method example-svd"):
        example_method.refuse_unread({"groups": 4}, CompressionSettings())
    example_method.refuse_unread(
        {"targets": "attn", "method": "example-svd"}, CompressionSettings()
    )  # read by every method


def test_a_name_is_registered_once(example_method):
    with pytest.raises(ValueError, match="registered twice"):
        register(ExampleSvd())
