"""Content hashes for full KV blocks.

A block's hash chains its parent's: ``h_i = xxh3_128(h_{i-1} || tokens_i || extra_i)``, so equal hashes
mean equal *prefixes*, not only equal blocks. The first block's extra keys carry the request's
``cache_salt``: requests with different salts never share a block, even for identical prompts.
Hashes are only a lookup key; `BlockPool.get_cached_block` compares the stored token ids too, so a
collision can never hand out wrong KV.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import xxhash

BlockHash = bytes

_ROOT = b"sluice-root"


def hash_block_tokens(
    parent_hash: BlockHash | None, token_ids: Sequence[int], extra_key: str | None = None
) -> BlockHash:
    h = xxhash.xxh3_128()
    h.update(parent_hash if parent_hash is not None else _ROOT)
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    if extra_key is not None:
        h.update(b"\x00salt\x00" + extra_key.encode())
    return h.digest()


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    cache_salt: str | None = None,
    start: int = 0,
    parent: BlockHash | None = None,
) -> list[BlockHash]:
    """Hashes of the full blocks of ``token_ids`` from block index ``start`` on (``parent`` is block
    ``start - 1``'s hash)."""
    end = len(token_ids) // block_size
    if end <= start:
        return []
    # One conversion for all blocks: each block hashes a view of this array.
    arr = np.asarray(token_ids[start * block_size : end * block_size], dtype=np.int64)
    out: list[BlockHash] = []
    for j in range(end - start):
        chunk = arr[j * block_size : (j + 1) * block_size]
        parent = hash_block_tokens(parent, chunk, cache_salt if start + j == 0 else None)
        out.append(parent)
    return out
