"""Block tables: which physical blocks hold each request's KV, and when they change hands.

The scheduler asks; the manager answers in block ids and copy orders, never touching tensors:
- ``get_computed_blocks``: the longest cached prefix of a new request (block-aligned, and never the
  whole prompt: the last prompt token is always recomputed so its logits exist).
- ``allocate_slots``: blocks for the next ``num_new_tokens`` (+ lookahead for draft tokens); ``None``
  when the pool is short, so the scheduler can preempt. A write into a block shared with another
  table (a fork's partial last prompt block) first gets a private copy: copy-on-write.
- ``cache_blocks``: publish the hashes of blocks whose KV is now computed. Only verified tokens live in
  ``all_token_ids``, so speculative tokens are never hashed.
- ``free``: drop references tail-first, so a request's suffix is evicted before its prefix.
"""

from __future__ import annotations

from typing import Protocol

from kv.block_pool import BlockPool, KVBlock
from kv.prefix_cache import BlockHash, block_hashes


class KVRequest(Protocol):
    request_id: str
    num_computed_tokens: int

    @property
    def all_token_ids(self) -> list[int]: ...

    @property
    def num_prompt_tokens(self) -> int: ...

    @property
    def cache_salt(self) -> str | None: ...


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        self.req_blocks: dict[str, list[KVBlock]] = {}
        self.req_hashes: dict[str, list[BlockHash]] = {}
        self.num_cached_blocks: dict[str, int] = {}
        # Prefix-cache counters, in tokens, counted once per admitted request.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # -- queries -----------------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return 1.0 - self.pool.num_free_blocks / self.pool.num_blocks

    def block_table(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, ())]

    def blocks(self, request_id: str) -> list[KVBlock]:
        return self.req_blocks.get(request_id, [])

    def _hashes(self, req: KVRequest) -> list[BlockHash]:
        hashes = self.req_hashes.setdefault(req.request_id, [])
        tokens = req.all_token_ids
        if len(hashes) < len(tokens) // self.block_size:
            parent = hashes[-1] if hashes else None
            hashes.extend(block_hashes(tokens, self.block_size, req.cache_salt, len(hashes), parent))
        return hashes

    # -- admission ---------------------------------------------------------------------------------
    def get_computed_blocks(self, req: KVRequest) -> tuple[list[KVBlock], int]:
        if not self.enable_prefix_caching or req.num_computed_tokens > 0:
            return [], 0
        hashes = self._hashes(req)
        bs = self.block_size
        max_blocks = (req.num_prompt_tokens - 1) // bs
        tokens = req.all_token_ids
        hit: list[KVBlock] = []
        for i in range(min(max_blocks, len(hashes))):
            block = self.pool.get_cached_block(hashes[i], tuple(tokens[i * bs : (i + 1) * bs]))
            if block is None:
                break
            hit.append(block)
        return hit, len(hit) * bs

    def allocate_slots(
        self,
        req: KVRequest,
        num_new_tokens: int,
        new_computed_blocks: list[KVBlock] | None = None,
        num_lookahead_tokens: int = 0,
    ) -> list[tuple[int, int]] | None:
        """Make room for ``num_new_tokens`` (+ lookahead) after the computed ones.

        Returns the copy-on-write orders ``[(src_block, dst_block)]`` for the executor, or ``None`` if
        the pool cannot supply the blocks (nothing is changed then).
        """
        bs = self.block_size
        computed = new_computed_blocks or []
        rid = req.request_id
        blocks = self.req_blocks.get(rid, [])
        start = req.num_computed_tokens + len(computed) * bs
        total = start + num_new_tokens + num_lookahead_tokens
        num_new_blocks = max(0, cdiv(total, bs) - len(blocks) - len(computed))
        # Copy-on-write: the block the first new token lands in is shared and only partly written.
        cow_index = start // bs
        needs_cow = not computed and num_new_tokens > 0 and cow_index < len(blocks) and blocks[cow_index].ref_cnt > 1
        revived = sum(1 for b in computed if b.ref_cnt == 0)
        if num_new_blocks + int(needs_cow) + revived > self.pool.num_free_blocks:
            return None

        if rid not in self.req_blocks:
            self.req_blocks[rid] = blocks
            self.num_cached_blocks.setdefault(rid, 0)
            if req.num_computed_tokens == 0:
                self.prefix_cache_queries += req.num_prompt_tokens
                self.prefix_cache_hits += len(computed) * bs
        copies: list[tuple[int, int]] = []
        if computed:
            self.pool.touch(computed)
            blocks.extend(computed)
            self.num_cached_blocks[rid] = len(blocks)
        if needs_cow:
            old = blocks[cow_index]
            (new,) = self.pool.get_new_blocks(1)
            copies.append((old.block_id, new.block_id))
            blocks[cow_index] = new
            self.pool.free_blocks([old])
        if num_new_blocks:
            blocks.extend(self.pool.get_new_blocks(num_new_blocks))
        return copies

    def cache_blocks(self, req: KVRequest, num_computed_tokens: int) -> None:
        """Publish every full block whose KV is computed (only verified tokens are ever hashed)."""
        if not self.enable_prefix_caching:
            return
        rid = req.request_id
        blocks = self.req_blocks.get(rid)
        if not blocks:
            return
        bs = self.block_size
        num_full = min(num_computed_tokens, len(req.all_token_ids)) // bs
        first = self.num_cached_blocks.get(rid, 0)
        if num_full <= first:
            return
        hashes = self._hashes(req)
        tokens = req.all_token_ids
        for i in range(first, min(num_full, len(blocks))):
            self.pool.cache_full_block(blocks[i], hashes[i], tuple(tokens[i * bs : (i + 1) * bs]))
        self.num_cached_blocks[rid] = num_full

    # -- release -----------------------------------------------------------------------------------
    def free(self, request_id: str) -> None:
        blocks = self.req_blocks.pop(request_id, None)
        self.num_cached_blocks.pop(request_id, None)
        self.req_hashes.pop(request_id, None)
        if blocks:
            self.pool.free_blocks(reversed(blocks))

    def fork(self, parent_id: str, child_id: str) -> None:
        """The child's table points at every parent block (each gains a reference)."""
        blocks = list(self.req_blocks.get(parent_id, []))
        self.pool.touch(blocks)
        self.req_blocks[child_id] = blocks
        self.num_cached_blocks[child_id] = self.num_cached_blocks.get(parent_id, 0)
        if parent_id in self.req_hashes:
            self.req_hashes[child_id] = list(self.req_hashes[parent_id])
