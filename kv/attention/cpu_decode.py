"""Decode attention of the compiled CPU step through one kernel call per layer (`sluice_cpu::decode_attention`,
`core/models/cpu_attention.cpp`, registered by `core/models/cpu_vnni.py`'s loader on AVX-512 CPUs).

The torch-ops backend it replaces (`torch_decode.py`) compiles to a loop over every row's padded width on one
thread; the kernel reads each row's own keys once for the query heads that share them, over torch's intra-op
threads. The KV write is the torch backend's (`index_put_` on the cache, fused by the compiler with the step's
other elementwise work). The step that builds this backend checks that the kernel is there and fits the cache
(`cpu_vnni.attention_fits`): one query token per sequence, a cache ``[2, blocks, block_size, Hk, D]`` of the
query's dtype (bf16 or fp32, D a multiple of 16), int32 block tables and sequence lengths.
"""

from __future__ import annotations

import torch
from sluice.kv.attention.base import AttentionMetadata, DecodeRope
from sluice.kv.attention.torch_decode import TorchDecodeAttentionBackend


class CpuKernelDecodeAttentionBackend(TorchDecodeAttentionBackend):
    name = "cpu-kernel-decode"

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
        return torch.ops.sluice_cpu.decode_attention(
            query, kv_cache, meta.block_tables, meta.seq_lens, scale, window, softcap
        )
