"""Gemma 3 (text): Gemma 2's layers (`core/models/gemma2.py`) with q/k norms and two RoPE tables.

* Local (sliding-window) and global layers follow ``layer_types`` (five local, one global in the released
  models; transformers derives the list from ``sliding_window_pattern`` in older configs).
* Local layers rotate with their own base (``rope_local_base_freq``: the ``sliding_attention`` entry of
  ``rope_parameters``), global ones with ``rope_theta`` and its scaling (``full_attention``): one table each,
  every layer given its own.
* q and k are normed per head, ``(1 + w)`` as every Gemma norm, before RoPE (in `split_heads`, so every RoPE path
  sees the normed keys, as Qwen 3's).
* No soft-capping unless the config asks (``attn_logit_softcapping`` / ``final_logit_softcapping``).
"""

from __future__ import annotations

import torch
from sluice.core.models.gemma2 import Gemma2ForCausalLM, GemmaAttention, GemmaRMSNorm
from sluice.core.models.layers import RotaryEmbedding
from sluice.core.models.parallel import TensorParallel


class Gemma3Attention(GemmaAttention):
    def __init__(self, config, layer_idx: int, qkv_bias: bool, tp: TensorParallel | None = None) -> None:
        super().__init__(config, layer_idx, qkv_bias, tp)
        self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)

    def split_heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = super().split_heads(qkv)
        return self.q_norm(q), self.k_norm(k), v


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    attention_cls = Gemma3Attention

    def __init__(self, config, max_position: int, tp: TensorParallel | None = None) -> None:
        super().__init__(config, max_position, tp)
        # `self.rotary` (Llama's) reads the ``full_attention`` parameters of a per-layer-type config
        self.rotary_local = RotaryEmbedding(config, self.head_dim, max_position, layer_type="sliding_attention")
        self.layer_rotary = [
            self.rotary_local if layer.self_attn.sliding_window else self.rotary for layer in self.model.layers
        ]
