"""Phi-3 (and Phi-3.5-mini): the Llama layers, with the projections fused in the checkpoint and LongRoPE.

* The checkpoint stores ``self_attn.qkv_proj`` and ``mlp.gate_up_proj`` whole, already in the merged layout
  sluice uses (q, k, v rows; gate, up rows). `load_weights` splits each into the per-projection tensors the
  Llama loader takes (``q_proj``, ``k_proj``, ...), so tensor-parallel ranks take their heads and rows of them
  as of any Llama checkpoint, and the check that nothing was left unloaded still holds per part.
* ``rope_scaling`` of type ``longrope`` (short and long factors): `layers.RotaryEmbedding` says how a position
  picks its factors.
* ``sliding_window``, when the config sets it, is every layer's (`layers.sliding_window_of`).

``partial_rotary_factor`` below 1 (Phi-4-mini) rotates part of each head only, which the RoPE kernels do not:
refused with a `ModelLoadError`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from sluice.core.models.errors import ModelLoadError
from sluice.core.models.layers import rope_parameters
from sluice.core.models.llama import LlamaForCausalLM
from sluice.core.models.parallel import TensorParallel

_FUSED = {
    "self_attn.qkv_proj.weight": ("q_proj", "k_proj", "v_proj"),
    "mlp.gate_up_proj.weight": ("gate_proj", "up_proj"),
}


class Phi3ForCausalLM(LlamaForCausalLM):
    def __init__(self, config, max_position: int, tp: TensorParallel | None = None) -> None:
        factor = rope_parameters(config).get("partial_rotary_factor") or 1.0
        if factor < 1.0:
            raise ModelLoadError(f"Phi-3 with partial_rotary_factor {factor} (RoPE on part of a head) is not supported")
        super().__init__(config, max_position, tp)

    def _full_sizes(self, fused: str) -> list[int]:
        """The unsharded rows of each part of a fused checkpoint tensor."""
        cfg = self.config
        if fused.startswith("self_attn"):
            head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
            kv = cfg.num_key_value_heads * head_dim
            return [cfg.num_attention_heads * head_dim, kv, kv]
        return [cfg.intermediate_size, cfg.intermediate_size]

    def _split_fused(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            fused = next((f for f in _FUSED if name.endswith(f)), None)
            if fused is None:
                yield name, tensor
                continue
            sizes = self._full_sizes(fused)
            if tensor.shape[0] != sum(sizes):
                raise ModelLoadError(f"weight {name}: {tensor.shape[0]} rows, expected {sum(sizes)} ({sizes})")
            prefix = name[: -len(fused)] + fused.split(".")[0]
            for part, chunk in zip(_FUSED[fused], tensor.split(sizes, dim=0), strict=True):
                yield f"{prefix}.{part}.weight", chunk

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self._split_fused(weights))
