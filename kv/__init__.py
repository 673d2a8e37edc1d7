"""Paged KV cache: block pool, prefix cache, KV manager, attention backends.

This package imports nothing of `core` or `spec`.
"""

from sluice.kv.block_pool import BlockPool, KVBlock
from sluice.kv.manager import KVCacheManager, KVRequest

__all__ = ["BlockPool", "KVBlock", "KVCacheManager", "KVRequest"]
