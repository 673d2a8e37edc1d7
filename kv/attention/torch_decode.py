"""Decode attention in plain torch that reads only tensors: what a compiled CPU decode step traces
(`core/worker/cpu_compiled.py`).

The torch reference (`torch_ref.py`) plans each step from host lists (sequence lengths, query starts) and loops
over groups of sequences: fine eagerly, but a compiler would specialize on every list it reads. This backend
serves pure decode steps only (one query per sequence, every row with a KV slot) and takes each step's shape
from its tensors: the block table is cut by the caller to the step's longest context (its width a dynamic
dimension), K and V of those blocks are gathered, positions past a row's length masked, and the softmax taken in
fp32. Attention over the padded width costs a gather of the longest row's blocks for every row: at the batch
sizes a compiled step serves (a few rows) that is small against the weights a step reads.
"""

from __future__ import annotations

import torch
from sluice.kv.attention.base import AttentionBackend, AttentionMetadata, DecodeRope


class TorchDecodeAttentionBackend(AttentionBackend):
    name = "torch-decode"

    def write_kv(self, key, value, kv_cache, slot_mapping, kv_scale=None) -> None:
        """Every row of a decode step has a slot (no ``-1`` padding rows): no host check of the slots. One
        ``index_put_`` on the cache tensor itself, not on a view of it: a compiler then writes the rows in place
        (a write through a view of a graph input is compiled as a copy of the whole cache)."""
        assert kv_scale is None, "the compiled CPU decode step serves 16- and 32-bit KV caches"
        block, offset = slot_mapping // kv_cache.shape[2], slot_mapping % kv_cache.shape[2]
        which = torch.arange(2, device=key.device)[:, None].expand(2, key.shape[0])
        rows = torch.stack((key, value)).to(kv_cache.dtype)  # [2, T, Hk, D]
        kv_cache.index_put_((which, block.expand(2, -1), offset.expand(2, -1)), rows)

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
        assert rope is None and kv_scale is None
        b, hq, d = query.shape
        hk, block = kv_cache.shape[3], kv_cache.shape[2]
        tables = meta.block_tables  # [B, nb], nb covering the step's longest context
        length = tables.shape[1] * block
        # [B, nb, block, Hk, D] -> [B, Hk, L, D]: indexed by the 2-D table and flattened, never reshaped from the
        # flat [B * nb] rows of a 1-D gather (a split of a product of two dynamic sizes, which inductor's
        # indexing of unbacked sizes gets wrong)
        k = kv_cache[0][tables.long()].flatten(1, 2).transpose(1, 2).float()
        v = kv_cache[1][tables.long()].flatten(1, 2).transpose(1, 2).float()
        q = query.float().view(b, hk, hq // hk, d)  # each KV head with its group of query heads
        # products and sums written out, not matmuls: a compiler fuses them with the gather, the mask and the
        # softmax (one query row per head: a matmul call's fixed cost is most of its time)
        logits = (q[:, :, :, None, :] * k[:, :, None, :, :]).sum(-1) * scale  # [B, Hk, G, L]
        if softcap:
            logits = softcap * torch.tanh(logits / softcap)
        keys = torch.arange(length, device=query.device)
        last = meta.seq_lens.long()[:, None] - 1  # the query's own position
        visible = keys[None, :] <= last
        if window:
            visible = visible & (keys[None, :] > last - window)
        logits = logits.masked_fill(~visible[:, None, None, :], float("-inf"))
        out = (torch.softmax(logits, dim=-1)[..., None] * v[:, :, None, :, :]).sum(-2)  # [B, Hk, G, D]
        return out.view(b, hq, d).to(query.dtype)
