"""Settings that follow the model: chosen on validation as a function of the model's shapes, and derived from
those shapes for every model (an alias, a local Hugging Face folder, a `.gguf`, a hub id alike), not carried by
one recipe file.

`model_defaults` is the one rule. A run takes its values where neither an option nor the recipe sets the setting
(`run_options.resolve_settings`: option > the recipe's explicit value > the model's shapes > the schema default),
and `plan` names the reason beside each.
"""

from __future__ import annotations

from collections.abc import Mapping

#: Calibration windows when an MLP projection is targeted (`calibration.mlp_samples`). The MLP's least-squares
#: refits (down_proj on the neurons kept) and its neuron orders read down_proj's input, as wide as the MLP (1536
#: on the bundled model: 2.7x the attention's input), and gain from more tokens. Chosen on the bundled model's
#: validation split (benchmarks/results/choices/calibration-windows-mlp-validation.json): against 64 windows, 256
#: gained the most at the model 20% smaller (-1.20 [-1.49, -0.94] perplexity; 128: -0.70; 512 no more than 256)
#: and 30% smaller (-1.98 [-2.54, -1.46]; 128: -1.00). A wider MLP reads wider inputs: never fewer windows. A run
#: of the attention alone keeps `samples` (more windows were not measured for it).
MLP_CALIBRATION_WINDOWS = 256

#: MLP width (intermediate_size) from which the neuron order is `greedy-block` instead of `greedy`. The greedy is
#: kept where it is cheap: at width 1536 (the bundled model) it orders 30 MLPs in about 11 s on 2 cores, as fast
#: as the block, and the block tied it at 75% of the neurons kept but lost +0.183 [+0.022, +0.355] perplexity at
#: 60% (benchmarks/results/choices/neuron-order-block-validation.json). The greedy's matrix-vector steps are bound
#: by memory traffic and grow with the cube of the width: 69 s per layer measured at 8960 against the block's
#: 18 s (docs/options.md; minutes per layer on the 1.5B model, its recipe said), and a 0.5B model's (4864)
#: selection took 22 minutes (`math.neurons.block_greedy_order`); by the cube about 1.6 s per layer at 2560 and
#: 6.6 s at 4096. From 4096 the greedy costs minutes per model on a CPU and the block is several times faster:
#: 2560 (SmolLM2-360M) keeps the greedy, 4864 and wider take the block.
BLOCK_ORDER_MIN_WIDTH = 4096


def model_defaults(shapes: Mapping[str, object]) -> dict[str, tuple[object, str]]:
    """The settings that follow the model, for a model of these shapes (its config's names: `intermediate_size`,
    `hidden_size`, `num_hidden_layers`, ...): setting name -> (value, the reason in a few words). A setting whose
    shape is missing is left out (the schema's default applies)."""
    width = shapes.get("intermediate_size")
    if not isinstance(width, int) or width < 1:
        return {}
    wide = width >= BLOCK_ORDER_MIN_WIDTH
    windows = MLP_CALIBRATION_WINDOWS
    return {
        "mlp_samples": (windows, f"MLP {width} wide: {windows} windows to refit it"),
        "neuron_order": (
            "greedy-block" if wide else "greedy",
            f"MLP {width} wide, {'from' if wide else 'under'} {BLOCK_ORDER_MIN_WIDTH}",
        ),
    }


def config_shapes(config) -> dict[str, object]:
    """The shapes `model_defaults` reads, from a transformers config (those it has)."""
    names = ("model_type", "num_hidden_layers", "hidden_size", "intermediate_size")
    return {name: getattr(config, name) for name in names if getattr(config, name, None) is not None}
