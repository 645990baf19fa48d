"""The configuration class of a DeciLM / Nemotron-NAS checkpoint (`export --format hf --layout deci`), shipped
beside its weights: engines that run this layout (vLLM's `DeciLMForCausalLM`) read it through `auto_map`.

A Llama configuration plus `block_configs`, one entry per layer: `attention` (`no_op`, `n_heads_in_group`: query
heads per KV head) and `ffn` (`no_op`, `intermediate_size`: the layer's MLP width). Entries are dictionaries that
also answer attribute access (`block.ffn.intermediate_size`), as the engines read them, and save as JSON.
"""

from transformers import LlamaConfig


class BlockEntry(dict):
    """A dictionary whose keys read as attributes too; nested dictionaries become entries."""

    def __init__(self, values=None, **more):
        super().__init__()
        for key, value in {**(values or {}), **more}.items():
            self[key] = BlockEntry(value) if isinstance(value, dict) else value

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


class DeciLMConfig(LlamaConfig):
    model_type = "nemotron-nas"

    def __init__(self, block_configs=None, **kwargs):
        self.block_configs = [BlockEntry(block) for block in block_configs or []]
        super().__init__(**kwargs)
