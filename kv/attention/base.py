"""The contract between the model's attention layers and the paged KV cache.

KV layout, one tensor per layer: ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (index 0 = K,
1 = V). Token ``t`` of a step writes its K/V to ``slot_mapping[t] = block_id * block_size + offset``
(``-1`` = do not write). Queries are a flattened batch ``[num_tokens, num_heads, head_dim]``: sequence
``i`` owns rows ``query_start_loc[i]:query_start_loc[i+1]``, which are the *last* rows of its context of
``seq_lens[i]`` tokens (context = cached prefix + earlier chunks + this step's tokens), so query ``j`` of
a ``q``-token sequence sits at position ``seq_lens[i] - q + j`` and sees keys ``0..`` that position.

A step's metadata is built anew for each step, never edited in place once a forward has used it: a backend
may derive per-step state from it on first use and keep it for every layer (the torch reference plans its
batched calls once per step). Only graph-safe backends, whose captured metadata is refilled in place for
each replay, read every tensor afresh in each call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from sluice.kv.attention import fp8


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    block_tables: torch.Tensor  # [num_seqs, max_num_blocks] int32 (padding entries are 0)
    max_query_len: int
    max_seq_len: int
    # Host copies, so backends that loop over sequences never sync the device.
    query_start_loc_host: list[int]
    seq_lens_host: list[int]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)

    @property
    def is_pure_decode(self) -> bool:
        return self.max_query_len == 1


@dataclass(slots=True)
class DecodeRope:
    """What `paged_decode` needs to rotate a decode step's queries and keys itself and store its keys and values:
    the rows' positions, their unrotated keys and their values (``[num_tokens, num_kv_heads, head_dim]``, views of
    the qkv projection), the neox cos/sin tables (``[max_position, head_dim]``, each half the same) and the slot
    of each row (-1: none)."""

    positions: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    slot_mapping: torch.Tensor


class AttentionBackend:
    name = "base"
    # True when `forward` reads only device tensors and the host values fixed at capture (``num_seqs``,
    # ``max_query_len``, ``max_seq_len``), so a decode step can be captured in a CUDA graph.
    graph_safe = False

    def takes_rope(self, meta: AttentionMetadata) -> bool:
        """Whether this step's RoPE and KV write go to `forward` (``rope``) instead of running before it."""
        return False

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        kv_scale: torch.Tensor | None = None,
    ) -> None:
        """Store this step's K/V ``[num_tokens, num_kv_heads, head_dim]`` at their slots (``-1``: skipped).
        An fp8 cache needs the layer's ``kv_scale [2, num_kv_heads]`` (`kv/attention/fp8.py`)."""
        keep = slot_mapping >= 0
        # A host sync, paid only by the torch reference; the Triton kernel skips -1 slots on the device.
        if not bool(keep.all()):
            key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
        num_slots = kv_cache.shape[1] * kv_cache.shape[2]
        flat = kv_cache.view(2, num_slots, kv_cache.shape[3], kv_cache.shape[4])
        if fp8.is_fp8(kv_cache):
            scale = fp8.require_scale(kv_scale)
            # index_copy_ has no fp8 kernel on the CPU: copy the bytes
            flat = flat.view(torch.uint8)
            key = fp8.quantize(key, scale[0]).view(torch.uint8)
            value = fp8.quantize(value, scale[1]).view(torch.uint8)
        flat[0].index_copy_(0, slot_mapping, key.to(flat.dtype))
        flat[1].index_copy_(0, slot_mapping, value.to(flat.dtype))

    def forward(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        kv_scale: torch.Tensor | None = None,
        rope: DecodeRope | None = None,
        window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor:
        """Attention of ``query [num_tokens, num_heads, head_dim]`` over the paged context (``kv_scale``: as in
        `write_kv`). With ``rope`` (only where `takes_rope` says, 16-bit caches), ``query`` is not yet rotated and
        the step's keys and values not yet written: the backend does both first. ``window`` > 0 (a sliding-window
        layer): a query at position ``p`` sees only keys ``p - window < key <= p``; ``softcap`` > 0: the scaled
        logits are soft-capped, ``softcap * tanh(logit / softcap)``, before the softmax.

        KV blocks are never freed for leaving every layer's window, even for window-only models: a sequence keeps
        all its blocks, so the prefix cache (whose hits share whole blocks from position 0) stays exact, and
        windows only narrow which keys a kernel reads."""
        raise NotImplementedError


def allocate_kv_cache(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> list[torch.Tensor]:
    shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]


def kv_bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
