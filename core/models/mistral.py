"""Mistral: the Llama layers, with an optional sliding window (``sliding_window``: each query sees its last
that many keys, in every layer; None = global attention, as Mistral 7B v0.2 on).

The window is configuration the attention layer reads itself (`layers.sliding_window_of`), so this class only
names the architecture; checkpoint names are Llama's.
"""

from __future__ import annotations

from sluice.core.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    pass
