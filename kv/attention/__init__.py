"""Attention backends over the paged KV cache.

Every backend takes the same `AttentionMetadata` and KV layout (`kv/attention/base.py`); the torch
reference runs everywhere, the Triton kernels on the GPU (and on the CPU under ``TRITON_INTERPRET=1``).
"""

from sluice.kv.attention.base import AttentionBackend, AttentionMetadata, allocate_kv_cache
from sluice.kv.attention.torch_ref import TorchAttentionBackend


def get_attention_backend(name: str, **triton_options) -> AttentionBackend:
    """The backend called ``name``; ``triton_options`` are the Triton backend's switches (its constructor's
    keywords), which the torch reference has none of."""
    if name == "torch":
        return TorchAttentionBackend()
    if name == "triton":
        from sluice.kv.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend(**triton_options)
    raise ValueError(f"unknown attention backend {name!r} (choose 'torch' or 'triton')")


__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "TorchAttentionBackend",
    "allocate_kv_cache",
    "get_attention_backend",
]
