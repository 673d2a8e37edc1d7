"""Paged attention through the Triton kernels of `kv/attention/triton_kernels.py`.

Pure decode batches (``max_query_len == 1``) take the split-K decode kernel; everything else (prefill,
chunked prefill, prefill mixed with decode rows) the prefill kernel. ``forward`` never syncs the device:
grid sizes come from the query's size, ``meta.num_seqs`` and (decode) ``meta.max_seq_len`` (host values).

CUDA graphs (decode): the grid is ``(num_seqs, num_kv_heads, num_splits)`` and ``num_splits`` depends only
on ``num_seqs`` and ``meta.max_seq_len`` rounded up to a power of two, so capture with the largest context
the graph must serve; the split count is correct for every shorter context (empty splits are no-ops), it
only stops being the best one. Query row ``i`` of a decode batch is read at ``query_start_loc[i]``.
"""

from __future__ import annotations

import torch
import triton
from sluice.kv.attention import triton_kernels as tk
from sluice.kv.attention.base import AttentionBackend, AttentionMetadata, DecodeRope

# (sequence, KV head) pairs the fused reduce's counters cover; a larger decode batch takes the reduce kernel
MAX_SPLIT_COUNTERS = 1 << 16
# most sequences in a decode step whose RoPE and KV write the decode kernel does (`takes_rope`)
DECODE_ROPE_MAX_SEQS = 16


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    graph_safe = True

    def __init__(
        self,
        decode_num_splits: int | None = None,
        min_tokens_per_split: int = 256,
        max_splits: int = 32,
        num_sms: int | None = None,
        fused_reduce: bool = True,
        decode_block_n: int = 128,
        rope_in_decode: bool = True,
    ) -> None:
        """The last three are switches for side-by-side timing (the engine sets them from ``SLUICE_FUSED_REDUCE``,
        ``SLUICE_DECODE_BLOCK_N`` and ``SLUICE_DECODE_ROPE``, `core/envs.py`)."""
        self.decode_num_splits = decode_num_splits  # fixed split count; None = heuristic below
        # the decode splits merged by their last program, not a reduce kernel (False: the kernel)
        self.fused_reduce = fused_reduce
        self._counters: torch.Tensor | None = None
        # keys per tile of the decode kernel (`paged_decode`'s default, 128: the attention sweep timed the tiles
        # at 64 and 128 sequences, before the fused reduce; other values time them again)
        self.decode_block_n = decode_block_n
        # a decode step's RoPE and KV write done by the decode kernel (`forward`'s ``rope``; False: their own
        # kernel before it) for steps of at most `DECODE_ROPE_MAX_SEQS` sequences: one launch fewer per
        # layer and step (on the H200 it paid at 1-16 running and cost at 32-256: docs/benchmarks.md)
        self.rope_in_decode = rope_in_decode
        self.min_tokens_per_split = min_tokens_per_split
        self.max_splits = max_splits
        self._num_sms = num_sms

    def num_sms(self, device: torch.device) -> int:
        if self._num_sms is None:
            if device.type == "cuda":
                self._num_sms = torch.cuda.get_device_properties(device).multi_processor_count
            else:
                self._num_sms = 132  # H100/H200; only matters for the interpreter's split choice
        return self._num_sms

    def decode_splits(self, max_seq_len: int, num_seqs: int, num_kv_heads: int, device: torch.device) -> int:
        """Split count from static bounds only: enough programs to fill the GPU ~4x over, each split
        at least ``min_tokens_per_split`` keys of the bucketed context, a power of two, <= ``max_splits``."""
        if self.decode_num_splits is not None:
            return self.decode_num_splits
        bucket = triton.next_power_of_2(max(max_seq_len, 1))
        by_len = max(1, bucket // self.min_tokens_per_split)
        by_occupancy = max(1, triton.cdiv(4 * self.num_sms(device), max(1, num_seqs * num_kv_heads)))
        splits = max(1, min(by_len, by_occupancy, self.max_splits))
        return 1 << (splits.bit_length() - 1)  # round down to a power of two: few kernel variants

    def takes_rope(self, meta: AttentionMetadata) -> bool:
        """Pure decode steps of up to `DECODE_ROPE_MAX_SEQS` sequences (host values, fixed when a graph is
        captured: a graph and its replays take one path)."""
        return self.rope_in_decode and meta.max_query_len == 1 and meta.num_seqs <= DECODE_ROPE_MAX_SEQS

    def split_counters(self, device: torch.device) -> torch.Tensor | None:
        """The fused reduce's arrival counters (None: the reduce kernel): int32 zeros, one per (sequence, KV head)
        of any decode batch up to `MAX_SPLIT_COUNTERS` pairs, this backend's own (one model's layers run one after
        another; two engines' steps may not). Allocated once and never replaced, since a captured CUDA graph keeps
        their address; the first decode step runs eagerly (graphs are warmed up before capture), so the allocation
        never lands in a graph's memory."""
        if not self.fused_reduce:
            return None
        if self._counters is None:
            self._counters = torch.zeros(MAX_SPLIT_COUNTERS, dtype=torch.int32, device=device)
        return self._counters

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        kv_scale: torch.Tensor | None = None,
    ) -> None:
        tk.write_kv(key, value, kv_cache, slot_mapping, kv_scale)

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
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        num_seqs = meta.num_seqs
        if num_seqs == 0 or query.shape[0] == 0:
            return out
        if meta.max_query_len == 1:
            splits = self.decode_splits(meta.max_seq_len, num_seqs, kv_cache.shape[3], query.device)
            tk.paged_decode(
                query, kv_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, out, scale,
                num_seqs, splits, block_n=self.decode_block_n, kv_scale=kv_scale,
                counters=self.split_counters(query.device), rope=rope, window=window, softcap=softcap,
            )  # fmt: skip
        else:
            assert rope is None, "RoPE in the attention kernel: pure decode steps only"
            tk.paged_prefill(
                query, kv_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, out, scale,
                num_seqs, kv_scale=kv_scale, window=window, softcap=softcap,
            )  # fmt: skip
        return out
