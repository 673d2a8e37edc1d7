"""Qwen3 (dense): the Llama layers with an RMSNorm over each head of q and k before RoPE.

The rest is configuration Llama already reads: no qkv bias (``attention_bias``), ``head_dim`` from the config
(Qwen3's need not be hidden / heads), a tied or untied head (``tie_word_embeddings``). Checkpoint names are
Llama's plus ``self_attn.q_norm.weight`` and ``self_attn.k_norm.weight``, which are this module's own names, so
the loader maps nothing new.

The norms run in `Qwen3Attention.split_heads`, before the layer chooses how RoPE and the KV write run, so every
path rotates and stores normed keys: the torch RoPE, the fused RoPE/KV-write kernel, and a decode step whose RoPE
the attention kernel does (`DecodeRope` carries the normed keys). With the fused kernels on, both norms are one
kernel in place over the q and k heads of the qkv output (`fused.rmsnorm_qk_`); no fused path is bypassed.
"""

from __future__ import annotations

import torch
from sluice.core.models.errors import ModelLoadError
from sluice.core.models.layers import HeadNorms, RMSNorm
from sluice.core.models.llama import LlamaAttention, LlamaForCausalLM
from sluice.core.models.parallel import TensorParallel


class Qwen3Attention(LlamaAttention, HeadNorms):
    def __init__(self, config, layer_idx: int, qkv_bias: bool, tp: TensorParallel | None = None) -> None:
        super().__init__(config, layer_idx, qkv_bias, tp)
        # one weight per head dimension, shared by every head: the same on each tensor-parallel rank
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def split_heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        norm = self.fused_qk_norm
        if norm is not None and qkv.stride(-1) == 1 and self.q_norm.weight.dtype == qkv.dtype:
            # both norms in one launch, in place over q and k's heads
            norm(qkv, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, self.num_heads, self.num_kv_heads)
            return super().split_heads(qkv)
        q, k, v = super().split_heads(qkv)
        return self.q_norm(q), self.k_norm(k), v


class Qwen3ForCausalLM(LlamaForCausalLM):
    attention_cls = Qwen3Attention

    def __init__(self, config, max_position: int, tp: TensorParallel | None = None) -> None:
        layer_types = getattr(config, "layer_types", None) or []
        if getattr(config, "use_sliding_window", False) or "sliding_attention" in layer_types:
            raise ModelLoadError("Qwen3 with sliding-window layers is not supported (use_sliding_window)")
        super().__init__(config, max_position, tp)
