"""What every compression method shares: the model's shape (all planning needs), the run context (weights,
statistics, whitening), and the `Method` interface with its registry.

A method is one class: `plan()` gives the exact parameter accounting (`plan.CompressionPlan`) from the shape,
the settings and a way to get groups — the run passes the calibrated KL grouping, `plan` / `--dry-run` /
`inspect` pass assumed groups — and `apply()` builds and installs the replacement modules. Adding a method is
one file with such a class plus one `register(...)` line in `compressor/methods/__init__.py`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import nn

from compressor.math.accounting import CompressionPlan, layer_dense_params
from compressor.math.grouping import Grouping, consecutive_kl, group_layers, logit_lens_distributions
from compressor.math.whitening import WhiteningFactor, whitening_factor
from compressor.modeling.adapters import (
    INPUT_OF,
    PROJECTIONS,
    DecoderAdapter,
    ProjectionGeometry,
    geometry_from_config,
)
from compressor.modeling.families import family_of
from compressor.recipes.schema import CompressionSettings
from compressor.runtime.device import statistics_device
from compressor.runtime.errors import NumericalError, UserError, all_finite
from compressor.statistics.block_influence import block_influence
from compressor.statistics.capture import CalibrationStats

#: Groups for a group count: the calibrated KL grouping in a run, assumed groups in a preview.
GroupsOf = Callable[[int], list[list[int]]]

#: Settings every method reads.
COMMON_SETTINGS = frozenset({"method", "targets"})


@contextmanager
def numerical_context(where: str):
    """Prefix numerical failures with the layer/projection they happened in (never hide them)."""
    try:
        yield
    except NumericalError as err:
        raise NumericalError(f"{where}: {err}") from err


@dataclass(frozen=True)
class ModelShape:
    """What planning needs of a model, from its modules or from its config alone (no weights)."""

    geometry: ProjectionGeometry
    num_layers: int
    biases: dict[tuple[int, str], int]  # (layer, projection) -> numel of its bias, targeted projections only
    targets: tuple[str, ...]
    params_before: int  # numbers stored by the targeted projections: the ratio's denominator

    @classmethod
    def from_adapter(cls, adapter: DecoderAdapter, targets: tuple[str, ...]) -> ModelShape:
        biases = {
            (layer, p): adapter.projection(layer, p).bias.numel()
            for layer in range(adapter.num_layers)
            for p in targets
            if adapter.projection(layer, p).bias is not None
        }
        return cls(
            adapter.geometry, adapter.num_layers, biases, targets, adapter.target_parameter_count(targets)
        )

    @classmethod
    def from_config(cls, config, targets: tuple[str, ...] = PROJECTIONS) -> ModelShape:
        geometry = geometry_from_config(config)
        with_bias = set(bias_projections(config))
        biases = {
            (layer, p): geometry.shape(p)[0]
            for layer in range(config.num_hidden_layers)
            for p in targets
            if p in with_bias
        }
        before = config.num_hidden_layers * layer_dense_params(geometry, targets) + sum(biases.values())
        return cls(geometry, config.num_hidden_layers, biases, targets, before)


def bias_projections(config) -> tuple[str, ...]:
    """Projections with a bias: a family with q/k/v biases by construction (Qwen2: `Family.qkv_bias`) has those;
    the other supported families have them on all four attention projections exactly when `attention_bias` is
    set, and on the MLP's with `mlp_bias`."""
    mlp = ("gate_proj", "up_proj", "down_proj") if getattr(config, "mlp_bias", False) else ()
    family = family_of(getattr(config, "model_type", None))
    if family is not None and family.qkv_bias:
        return ("q_proj", "k_proj", "v_proj", *mlp)
    return (PROJECTIONS if getattr(config, "attention_bias", False) else ()) + mlp


@dataclass
class MethodContext:
    """What `Method.apply` gets: the model, its statistics, the effective settings, and where to record."""

    model: nn.Module
    adapter: DecoderAdapter
    stats: CalibrationStats
    settings: CompressionSettings
    ratio: float
    compute_device: torch.device
    progress: bool
    shape: ModelShape
    windows: torch.Tensor | None = None  # calibration token windows (sequential statistics only)
    # A byte budget (`methods.masa.byte_structure.SizeTarget`): widths and types in one allocation under it
    size: object | None = None
    seconds: dict[str, float] = field(default_factory=dict)
    report: dict = field(default_factory=dict)
    # Whitening factors of the current layer only (the stages go layer by layer, so memory stays flat with
    # depth; a later pass recomputes them: one Cholesky per input, cheap next to the SVDs).
    _whitening: dict[tuple[int, str], WhiteningFactor] = field(default_factory=dict)
    _output_energy: dict[tuple[int, str], float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # The fp64 work (Cholesky, SVDs) runs where fp64 exists: a model on MPS is compressed on the CPU.
        self.compute_device = statistics_device(self.compute_device)

    @property
    def projections(self) -> tuple[str, ...]:
        """The projection types compressed (`targets`): q/k/v/o by default."""
        return self.shape.targets

    def weight(self, layer: int, projection: str) -> torch.Tensor:
        """The original (out, in) weight in fp64 on the compute device; non-finite weights are an error."""
        weight = self.adapter.projection(layer, projection).weight.detach()
        # Moved, then widened: an MPS weight cannot be made fp64 where it is (the compute device is the CPU then).
        w = weight.to(self.compute_device).to(torch.float64)
        if not all_finite(w):
            raise NumericalError(
                f"non-finite weights in {self.adapter.projection_path(layer, projection)}: the model file is damaged"
            )
        return w

    def bias(self, layer: int, projection: str) -> torch.Tensor | None:
        b = self.adapter.projection(layer, projection).bias
        return None if b is None else b.detach().clone()

    def autocorr(self, layer: int, projection: str) -> torch.Tensor:
        """Input autocorrelation of a projection: the layer input for q/k/v, the attention output for o, the
        post-attention-norm hidden state for gate/up, the gated activation for down."""
        return self.stats.autocorr(INPUT_OF[projection], layer)

    def whitening(self, layer: int, projection: str) -> WhiteningFactor:
        """Cholesky factor of the projection's input autocorrelation (q/k/v share one per layer, gate/up too)."""
        key = (layer, INPUT_OF[projection])
        if any(cached[0] != layer for cached in self._whitening):
            self._whitening.clear()
        if key not in self._whitening:
            with numerical_context(f"the {key[1]} input autocorrelation of layer {layer}"):
                factor = whitening_factor(self.stats.autocorr(key[1], layer).to(self.compute_device))
            self._whitening[key] = factor
            self.record_damping(factor, layer=layer, input=key[1])
        return self._whitening[key]

    def record_damping(self, factor: WhiteningFactor, **where) -> None:
        """Report a Cholesky that needed damping (once per place): the whitening is then approximate; and an input
        that was zero at every calibration token (its readers get nothing to approximate)."""
        if factor.input_is_zero:
            if where not in self.report.setdefault("zero_inputs", []):
                self.report["zero_inputs"].append(where)
            return
        entry = {**where, "damping": factor.damping, "attempts": factor.attempts}
        if factor.damping > 0 and entry not in self.report.setdefault("damping", []):
            self.report["damping"].append(entry)

    def output_energy(self, layer: int, projection: str) -> float:
        """‖W S‖²: the whitened output energy of the original weight, the scale of `global-relative` errors.
        Memoized: the G/B search allocates once per candidate, over the same matrices."""
        key = (layer, projection)
        if key not in self._output_energy:
            w = self.weight(layer, projection)
            self._output_energy[key] = float(((w @ self.whitening(layer, projection).S) ** 2).sum())
        return self._output_energy[key]

    def error_weight(self, layer: int, projection: str) -> float:
        """What one unit of the matrix's whitened error ‖(W − Ŵ) S‖² costs in the global allocation's objective:
        1 (`global`), 1 / ‖W S‖² (`global-relative`: its share of the output energy; an all-zero weight has
        nothing to approximate and keeps weight 1 rather than 1/0), or the mean squared loss gradient at the
        matrix's output (`global-loss`: `compressor.statistics.sensitivity`)."""
        allocation = self.settings.allocation
        if allocation == "global-loss":
            if self.stats.sensitivity is None:
                raise ValueError(
                    "--allocation global-loss needs the loss sensitivity: collect_sensitivity(...)"
                )
            return self.stats.sensitivity[(layer, projection)]
        if allocation == "global-relative":
            return 1.0 / (self.output_energy(layer, projection) or 1.0)
        return 1.0

    def grouping(self, n_groups: int) -> Grouping:
        """Consecutive layers grouped by the KL of their logit-lens distributions (recorded in the report)."""
        start = time.perf_counter()
        p = logit_lens_distributions(
            self.stats.block_output_means,
            self.adapter.final_norm,
            self.adapter.unembedding,
            apply_final_norm=self.settings.logit_lens == "final_norm",
        )
        grouping = group_layers(consecutive_kl(p), n_groups, end_boundaries=self.settings.end_boundaries)
        self.seconds["grouping"] = self.seconds.get("grouping", 0.0) + time.perf_counter() - start
        self.report["grouping"] = {
            "kl": grouping.kl,
            "boundaries": grouping.boundaries,
            "groups": grouping.groups,
            "rule": grouping.rule,
            "logit_lens": self.settings.logit_lens,
            "end_boundaries": self.settings.end_boundaries,
        }
        return grouping

    def groups_of(self, n_groups: int) -> list[list[int]]:
        return self.grouping(n_groups).groups

    def block_influence(self, windows: torch.Tensor) -> tuple[torch.Tensor, float]:
        """Each layer's block influence on `windows` and the seconds it took (`statistics.block_influence`), each
        layer run as `held` holds it."""
        return block_influence(self.adapter, windows, self.held, self.progress)

    @contextmanager
    def held(self, layer: int, original: nn.Module | None = None) -> Iterator[nn.Module]:
        """Decoder layer `layer` ready to run for the block: the model's own, as compressed so far, or `original`,
        a copy made before anything was installed (`partly_compressed.original_layers`), with the original
        weights. In memory both are there already; over an offloaded model they are materialised for the block."""
        yield self.adapter.layers[layer] if original is None else original

    def refitted(self, layer: int, projection: str) -> None:
        """A method changed the weight of an installed module in place (the stream refit, inside `held`): with
        `--layerwise` the stored tensor is rewritten (`OffloadedContext`)."""

    def install(self, layer: int, projection: str, module: nn.Module) -> None:
        self.adapter.set_projection(layer, projection, module)

    def finished(self, layers: Iterable[int]) -> None:
        """A method says it will install nothing more into `layers` (and that no later module shares a tensor
        with theirs): with `--layerwise` they are written to disk then (`methods.offloaded_context.OffloadedContext`)."""

    @property
    def model_dtype(self) -> torch.dtype:
        return self.adapter.unembedding.weight.dtype

    @property
    def model_device(self) -> torch.device:
        return self.adapter.unembedding.weight.device


class Method:
    """A compression method. Subclasses set the class attributes and implement `plan` and `apply`."""

    name: ClassVar[str]
    summary: ClassVar[str]  # one line for `--help` and the docs
    #: The settings it reads besides `method` and `targets`; an option it does not read is refused when given.
    settings_read: ClassVar[frozenset[str]] = frozenset()
    #: Settings it pins whatever the recipe says (a preset such as `masa-paper`).
    preset: ClassVar[dict] = {}
    #: Whether its plan depends on the calibrated grouping (then `plan` shows assumed groups).
    uses_groups: ClassVar[bool] = False

    def effective_settings(self, settings: CompressionSettings) -> CompressionSettings:
        """The settings the method runs with: its preset applied, then checked (`check_settings`)."""
        settings = settings.model_copy(update=self.preset) if self.preset else settings
        self.check_settings(settings)
        return settings

    def settings_read_for(self, settings: CompressionSettings) -> frozenset[str]:
        """The settings read with these settings (a method whose forms read different settings overrides it)."""
        return self.settings_read

    def refuse_unread(self, given: dict[str, object], settings: CompressionSettings) -> None:
        """A one-line error for an option the user gave that this method does not read with the resolved
        `settings`, or pins otherwise."""
        read = self.settings_read_for(settings)
        for key in sorted(given):
            flag = "--" + key.replace("_", "-")
            if key in self.preset and given[key] != self.preset[key]:
                raise UserError(
                    f"{flag}: --method {self.name} pins {key} = {self.preset[key]!r}: drop {flag} or use --method masa"
                )
            if key not in read | COMMON_SETTINGS | set(self.preset):
                raise UserError(
                    f"{flag} has no effect with {self.describe(settings)}: {self.instead(settings, key)}"
                )

    def uses_groups_for(self, settings: CompressionSettings) -> bool:
        """Whether the plan depends on the calibrated grouping with these settings."""
        return self.uses_groups

    def reads_gate_input(self, settings: CompressionSettings) -> bool:
        """Whether it reads gate/up's input autocorrelation with these settings: a method that factors them does;
        one that keeps their rows (neuron selection) does not, and the capture then leaves it out."""
        return True

    def groups_rule(self, settings: CompressionSettings) -> str:
        """How the layers are grouped when the grouping does not come from calibration."""
        return "no groups: every projection low rank"

    def describe(self, settings: CompressionSettings) -> str:
        """How errors name this method (with the form that decides what is read)."""
        return f"--method {self.name}"

    def instead(self, settings: CompressionSettings, key: str) -> str:
        """What to do about an option `key` this method does not read with `settings`."""
        return "drop it or use --method masa"

    def check_settings(self, settings: CompressionSettings) -> None:
        """Refuse, before any heavy work, settings the method has no rule for (default: none)."""

    def check_before_calibration(
        self, shape: ModelShape, settings: CompressionSettings, ratio: float
    ) -> None:
        """Fail before calibration when the ratio cannot be met (default: plan without groups)."""
        self.plan(shape, settings, ratio, groups_of=None)

    def plan(
        self,
        shape: ModelShape,
        settings: CompressionSettings,
        ratio: float,
        groups_of: GroupsOf | None,
        check_feasible: bool = True,
    ) -> CompressionPlan:
        """The exact accounting: what every targeted projection will store (ranks where they do not depend on
        calibration statistics). `check_feasible=False` returns an over-budget layout instead of refusing it."""
        raise NotImplementedError

    def largest_ratio(self, plan: CompressionPlan, shape: ModelShape) -> float:
        """The largest ratio `plan`'s layout can reach: everything not stored whatever the ranks removed (a method
        that bounds what a module may lose says less)."""
        return 1.0 - plan.fixed_params() / plan.params_before

    def apply(self, ctx: MethodContext) -> CompressionPlan:
        """Build and install the replacement modules; return the plan with every rank allocated."""
        raise NotImplementedError


REGISTRY: dict[str, Method] = {}


def register(method: Method) -> Method:
    if method.name in REGISTRY:
        raise ValueError(f"method '{method.name}' is registered twice")
    REGISTRY[method.name] = method
    return method


def get_method(name: str) -> Method:
    if name not in REGISTRY:
        raise UserError(f"unknown --method '{name}': use one of {', '.join(REGISTRY)}")
    return REGISTRY[name]
