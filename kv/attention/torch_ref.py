"""Reference paged attention in plain torch: correct everywhere, fast enough for the CPU.

Sequences with the same short query length (decodes: one query; speculative verification: 1 + k) are
batched into one padded SDPA call over K/V gathered through their block tables; longer prefill chunks
run one sequence at a time with an offset causal mask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kv.attention import fp8
from kv.attention.base import AttentionBackend, AttentionMetadata

# Query lengths up to this are batched across sequences (padding costs little at these lengths).
MAX_BATCHED_QUERY_LEN = 17


def gather_kv(kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V ``[..., seq_len, num_kv_heads, head_dim]`` read through ``block_tables`` (``[nb]`` for one
    sequence, ``[B, nb]`` for a batch padded to ``seq_len``).

    One ``index_select`` per K and V over whole blocks (each block a contiguous run of memory): several
    times faster on the CPU than advanced indexing of the ``[2, num_blocks, ...]`` tensor, which copies
    element by element and is most of the reference path's time at long contexts."""
    block_size, heads, dim = kv_cache.shape[2], kv_cache.shape[3], kv_cache.shape[4]
    nb = -(-seq_len // block_size)
    tables = block_tables[..., :nb]
    idx = tables.reshape(-1).long()
    shape = (*tables.shape[:-1], nb * block_size, heads, dim)
    k = kv_cache[0].index_select(0, idx).view(shape)[..., :seq_len, :, :]
    v = kv_cache[1].index_select(0, idx).view(shape)[..., :seq_len, :, :]
    return k, v


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def forward(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        kv_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if fp8.is_fp8(kv_cache):
            fp8.require_scale(kv_scale)
        out = torch.empty_like(query)
        qsl, lens = meta.query_start_loc_host, meta.seq_lens_host
        by_len: dict[int, list[int]] = {}
        for i in range(meta.num_seqs):
            by_len.setdefault(qsl[i + 1] - qsl[i], []).append(i)
        for q_len, rows in by_len.items():
            if len(rows) > 1 and q_len <= MAX_BATCHED_QUERY_LEN:
                self._same_len_batch(query, kv_cache, meta, scale, rows, q_len, out, kv_scale)
                continue
            for i in rows:
                s, e = qsl[i], qsl[i + 1]
                out[s:e] = self._one_seq(query[s:e], kv_cache, meta.block_tables[i], lens[i], scale, kv_scale)
        return out

    @staticmethod
    def _one_seq(
        q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int, scale: float, kv_scale
    ):
        k, v = _upcast(*gather_kv(kv_cache, block_table, seq_len), kv_scale, q.dtype)
        nq = q.shape[0]
        qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
        if nq == seq_len:
            o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=True)
        else:
            # query j sits at position seq_len - nq + j and may see keys 0..that position
            qpos = torch.arange(seq_len - nq, seq_len, device=q.device)[:, None]
            mask = torch.arange(seq_len, device=q.device)[None, :] <= qpos
            o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=True)
        return o.transpose(0, 1)

    @staticmethod
    def _same_len_batch(
        query, kv_cache, meta: AttentionMetadata, scale, rows: list[int], q_len: int, out, kv_scale
    ) -> None:
        """Sequences with ``q_len`` queries each, in one padded SDPA call."""
        lens = [meta.seq_lens_host[i] for i in rows]
        max_len = max(lens)
        idx = torch.tensor(rows, device=query.device)
        k, v = gather_kv(kv_cache, meta.block_tables[idx], max_len)  # [B, L, H, D]
        # Strided [B, H, L, D] views: SDPA reads them in place (a contiguous copy would cost more).
        k, v = _upcast(k, v, kv_scale, query.dtype)
        k, v = k.transpose(1, 2), v.transpose(1, 2)
        seq_lens = torch.tensor(lens, device=query.device)
        # query j of a row sits at position seq_len - q_len + j and sees keys up to there
        j = torch.arange(q_len, device=query.device)
        last_visible = seq_lens[:, None] - q_len + j[None, :]  # [B, q_len]
        mask = torch.arange(max_len, device=query.device)[None, None, :] <= last_visible[:, :, None]
        rows_q = meta.query_start_loc[idx].long()[:, None] + j[None, :]  # [B, q_len]
        q = query[rows_q].transpose(1, 2)  # [B, Hq, q_len, D]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], scale=scale, enable_gqa=True)
        out[rows_q] = o.transpose(1, 2)


def _upcast(k: torch.Tensor, v: torch.Tensor, kv_scale: torch.Tensor | None, dtype: torch.dtype):
    """Gathered K/V ``[..., num_kv_heads, head_dim]`` in the compute dtype (fp8: times the head's scale)."""
    if fp8.is_fp8(k):
        return fp8.dequantize(k, kv_scale[0], dtype), fp8.dequantize(v, kv_scale[1], dtype)
    return k.to(dtype), v.to(dtype)
