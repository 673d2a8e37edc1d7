"""Reference paged attention in plain torch: correct everywhere, fast enough for the CPU.

Sequences with the same short query length (decodes: one query; speculative verification: 1 + k) are
batched into padded SDPA calls over K/V gathered through their block tables; longer prefill chunks run one
sequence at a time with an offset causal mask.

The step's plan (which sequences share a call, their gather indices and masks) depends only on the
metadata, so it is made once per step and reused by every layer. Sequences are grouped by context length:
one call padded to a 1,800-token context for a batch whose median is 300 would gather and attend over
several times the real K/V, which is most of a CPU decode step's time at long contexts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from sluice.kv.attention import fp8
from sluice.kv.attention.base import AttentionBackend, AttentionMetadata, DecodeRope

# Query lengths up to this are batched across sequences (padding costs little at these lengths).
MAX_BATCHED_QUERY_LEN = 17
# A batched call closes once the padding it would gather exceeds this many tokens: about what one more
# call costs on the CPU (a few small ops per layer) in gathered K/V.
MAX_PADDING_TOKENS = 1024
# Batched decode calls of this many sequences or more run in bf16 with GQA folded into the query rows
# (`_decode_folded`); fewer keep the fp32 path.
FOLD_MIN_SEQS = 2


def gather_kv(kv_cache: torch.Tensor, block_ids: torch.Tensor, shape: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    """K and V of whole blocks ``block_ids`` (int64, flattened), viewed as ``shape`` (``[..., tokens, H, D]``).

    One ``index_select`` per K and V over whole blocks (each a contiguous run of memory): several times
    faster on the CPU than advanced indexing of the ``[2, num_blocks, ...]`` tensor, which copies element
    by element."""
    return kv_cache[0].index_select(0, block_ids).view(shape), kv_cache[1].index_select(0, block_ids).view(shape)


@dataclass(slots=True)
class _BatchedCall:
    """Sequences with ``q_len`` queries each, in one padded SDPA call."""

    rows_q: torch.Tensor  # [B, q_len] query rows of the flattened batch
    block_ids: torch.Tensor  # [B * nb] their blocks, each sequence padded to nb blocks
    num_blocks: int
    max_len: int
    mask: torch.Tensor  # [B, 1, q_len, max_len]: query j of a row sees keys up to its own position
    last_visible: torch.Tensor  # [B, q_len]: that position (a sliding window's mask is cut below it)


@dataclass(slots=True)
class _Plan:
    meta: AttentionMetadata  # held so the plan is reused only for this very step's metadata
    block_size: int
    calls: list[_BatchedCall]
    singles: list[int]  # sequences attended one at a time (long prefill chunks)


def _split_by_padding(lens: list[int], max_padding: int) -> list[tuple[int, int]]:
    """Split ascending ``lens`` into runs ``[start, end)`` whose padding to their longest stays within
    ``max_padding`` tokens (a run always takes at least one sequence)."""
    runs, start, total = [], 0, 0
    for i, n in enumerate(lens):
        if i > start and (i - start + 1) * n - (total + n) > max_padding:
            runs.append((start, i))
            start, total = i, 0
        total += n
    runs.append((start, len(lens)))
    return runs


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def __init__(self) -> None:
        self._plan: _Plan | None = None

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
        assert rope is None, "the torch reference takes no RoPE (`takes_rope` is False)"
        if fp8.is_fp8(kv_cache):
            fp8.require_scale(kv_scale)
        plan = self._plan
        if plan is None or plan.meta is not meta or plan.block_size != kv_cache.shape[2]:
            plan = self._plan = self._make_plan(meta, kv_cache.shape[2], query.device)
        out = torch.empty_like(query)
        variant = _Variant(window, softcap) if window or softcap else None
        for call in plan.calls:
            self._batched(query, kv_cache, call, scale, out, kv_scale, variant)
        qsl, lens = meta.query_start_loc_host, meta.seq_lens_host
        for i in plan.singles:
            s, e = qsl[i], qsl[i + 1]
            out[s:e] = self._one_seq(query[s:e], kv_cache, meta.block_tables[i], lens[i], scale, kv_scale, variant)
        return out

    @staticmethod
    def _make_plan(meta: AttentionMetadata, block_size: int, device: torch.device) -> _Plan:
        qsl, lens = meta.query_start_loc_host, meta.seq_lens_host
        by_q_len: dict[int, list[int]] = {}
        singles = []
        for i in range(meta.num_seqs):
            q_len = qsl[i + 1] - qsl[i]
            if q_len <= MAX_BATCHED_QUERY_LEN:
                by_q_len.setdefault(q_len, []).append(i)
            else:
                singles.append(i)
        calls = []
        for q_len, rows in by_q_len.items():
            rows.sort(key=lambda i: lens[i])
            for start, end in _split_by_padding([lens[i] for i in rows], MAX_PADDING_TOKENS):
                part = rows[start:end]
                max_len = lens[part[-1]]
                nb = -(-max_len // block_size)
                idx = torch.tensor(part, device=device)
                seq_lens = torch.tensor([lens[i] for i in part], device=device)
                j = torch.arange(q_len, device=device)
                last_visible = seq_lens[:, None] - q_len + j[None, :]  # [B, q_len]
                mask = torch.arange(max_len, device=device)[None, None, :] <= last_visible[:, :, None]
                calls.append(
                    _BatchedCall(
                        rows_q=meta.query_start_loc[idx].long()[:, None] + j[None, :],
                        block_ids=meta.block_tables[idx, :nb].reshape(-1).long(),
                        num_blocks=nb,
                        max_len=max_len,
                        mask=mask[:, None],
                        last_visible=last_visible,
                    )
                )
        return _Plan(meta, block_size, calls, singles)

    @staticmethod
    def _batched(
        query, kv_cache, call: _BatchedCall, scale: float, out: torch.Tensor, kv_scale=None, variant=None
    ) -> None:
        b = call.rows_q.shape[0]
        shape = (b, call.num_blocks * kv_cache.shape[2], kv_cache.shape[3], kv_cache.shape[4])
        k, v = gather_kv(kv_cache, call.block_ids, shape)
        mask = call.mask
        if variant is not None and variant.window:
            keys = torch.arange(call.max_len, device=query.device)
            mask = mask & (keys > (call.last_visible - variant.window)[:, :, None])[:, None]
        if _folds(query, kv_cache, call, kv_scale, variant):
            _decode_folded(query, k[:, : call.max_len], v[:, : call.max_len], call.rows_q[:, 0], mask, scale, out)
            return
        # bf16 on the CPU: in fp32, whose SDPA kernel is several times faster there at these few query rows
        cdt = torch.float32 if query.dtype == torch.bfloat16 and query.device.type == "cpu" else query.dtype
        k, v = _upcast(k[:, : call.max_len], v[:, : call.max_len], kv_scale, cdt)
        # Strided [B, H, L, D] views: SDPA reads them in place (a contiguous copy would cost more).
        k, v = k.transpose(1, 2), v.transpose(1, 2)
        q = query[call.rows_q].transpose(1, 2).to(cdt)  # [B, Hq, q_len, D]
        o = _attention(q, k, v, mask, scale, variant)
        out[call.rows_q] = o.transpose(1, 2).to(out.dtype)

    @staticmethod
    def _one_seq(
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        block_table: torch.Tensor,
        seq_len: int,
        scale: float,
        kv_scale=None,
        variant=None,
    ):
        nb = -(-seq_len // kv_cache.shape[2])
        k, v = gather_kv(kv_cache, block_table[:nb].long(), (nb * kv_cache.shape[2], *kv_cache.shape[3:]))
        k, v = _upcast(k[:seq_len], v[:seq_len], kv_scale, q.dtype)
        nq = q.shape[0]
        # 4-D [1, H, L, D]: given 3-D inputs SDPA falls back to its unfused math path on the CPU (~5x slower)
        qh = q.transpose(0, 1)[None]
        kh = k.transpose(0, 1)[None]
        vh = v.transpose(0, 1)[None]
        if nq == seq_len and (variant is None or variant.plain):
            o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=True)
        else:
            # query j sits at position seq_len - nq + j and may see keys 0..that position (the last window of them)
            qpos = torch.arange(seq_len - nq, seq_len, device=q.device)[:, None]
            keys = torch.arange(seq_len, device=q.device)[None, :]
            mask = keys <= qpos
            if variant is not None and variant.window:
                mask = mask & (keys > qpos - variant.window)
            o = _attention(qh, kh, vh, mask, scale, variant)
        return o[0].transpose(0, 1)


def _folds(query: torch.Tensor, kv_cache: torch.Tensor, call: _BatchedCall, kv_scale, variant) -> bool:
    """Whether a batched call runs `_decode_folded`: decodes (one query each) of several bf16 sequences on the
    CPU, K/V of the query's dtype, no soft-cap. One sequence keeps the fp32 path (the batch-1 decode step's)."""
    return (
        query.dtype == torch.bfloat16
        and query.device.type == "cpu"
        and kv_cache.dtype == query.dtype
        and kv_scale is None
        and call.rows_q.shape[1] == 1
        and call.rows_q.shape[0] >= FOLD_MIN_SEQS
        and (variant is None or not variant.softcap)
    )


def _decode_folded(query, k, v, rows: torch.Tensor, mask: torch.Tensor, scale: float, out: torch.Tensor) -> None:
    """One decode query per sequence (query rows ``rows``) over its gathered K/V ``[B, L, Hk, D]``, in bf16, with
    each KV head's group of query heads as that head's query rows (``[B, Hk, group, D]``): SDPA then needs no GQA
    expansion, and K/V go in as gathered, without the fp32 copy the other path makes (at a batch of decodes that
    copy and SDPA's per-head work over one query row cost more than the attention itself). SDPA's CPU kernel
    accumulates in fp32; the output is rounded to bf16 as the other path's is."""
    b, hk, d = k.shape[0], k.shape[2], k.shape[3]
    q = query[rows].view(b, hk, -1, d)  # query head h reads KV head h // group
    mask = mask.view(b, 1, 1, mask.shape[-1])  # one query row a sequence: its keys, for every head's group
    o = F.scaled_dot_product_attention(q, k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=scale)
    out[rows] = o.reshape(b, -1, d)


@dataclass(slots=True)
class _Variant:
    """A layer's sliding window (0: none) and logit soft-cap (0: none)."""

    window: int
    softcap: float

    @property
    def plain(self) -> bool:
        return not self.window and not self.softcap


def _attention(q, k, v, mask: torch.Tensor, scale: float, variant: _Variant | None) -> torch.Tensor:
    """SDPA over ``[B, H, L, D]`` (K/V with fewer heads: GQA); with a soft-cap, the same in plain torch, since
    SDPA has no hook between the logits and the softmax (the softmax in fp32, as transformers' eager path)."""
    if variant is None or not variant.softcap:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    logits = (q @ k.transpose(-1, -2)) * scale
    logits = variant.softcap * torch.tanh(logits / variant.softcap)
    logits = logits.masked_fill(~mask, float("-inf"))
    return torch.softmax(logits.float(), dim=-1).to(q.dtype) @ v


def _upcast(k: torch.Tensor, v: torch.Tensor, kv_scale: torch.Tensor | None, dtype: torch.dtype):
    """Gathered K/V ``[..., num_kv_heads, head_dim]`` in the compute dtype (fp8: times the head's scale)."""
    if fp8.is_fp8(k):
        return fp8.dequantize(k, kv_scale[0], dtype), fp8.dequantize(v, kv_scale[1], dtype)
    return k.to(dtype), v.to(dtype)
