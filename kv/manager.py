"""Block tables: which physical blocks hold each request's KV, and when they change hands.

The scheduler asks; the manager answers in block ids and copy orders, never touching tensors:
- ``get_computed_blocks``: the longest cached prefix of a new request (block-aligned, verified block by
  block, and never the whole prompt: the last prompt token is always recomputed so its logits exist).
  ``prefix_in_flight`` tells the scheduler when the next block is being computed by another request.
- ``allocate_slots``: blocks for the next ``num_new_tokens`` (+ lookahead for draft tokens); ``None``
  when the pool is short, so the scheduler can preempt. A write into a block shared with another
  table (a fork's partial last prompt block) first gets a private copy: copy-on-write.
- ``cache_blocks``: publish the hashes of blocks whose KV is now computed. Only verified tokens live in
  ``all_token_ids``, so speculative tokens are never hashed.
- ``free``: drop references tail-first, so a request's suffix is evicted before its prefix.
- ``fork``: a second table over the same blocks (parallel sampling); the first write into a shared
  block is what ``allocate_slots`` turns into a copy.

A prompt's KV computed in another engine (disaggregated prefill, `core/sched/disagg.py`) changes hands through
pins, references held outside any table: ``pin_prompt`` keeps a finished prompt's full blocks for shipping;
``reserve`` finds the leading blocks cached here and allocates the rest, ``publish`` hashes the rest into the
prefix cache once the shipped KV is in them, and ``release`` / ``unpin`` drop the pins.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from sluice.kv.block_pool import ROOT_KEY, BlockPool, KVBlock
from sluice.kv.events import KVEventLog
from sluice.kv.prefix_cache import BlockHash, block_hashes


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


@dataclass(slots=True)
class KVReservation:
    """Blocks held for a prompt whose KV is computed elsewhere: the leading ``cached`` ones were in this pool's
    prefix cache already, the ``fresh`` ones receive the shipped KV. Each is pinned until `release`."""

    cached: list[KVBlock]
    fresh: list[KVBlock]
    hashes: list[BlockHash]
    token_ids: list[int]
    cache_salt: str | None

    @property
    def num_blocks(self) -> int:
        return len(self.cached) + len(self.fresh)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        self.req_blocks: dict[str, list[KVBlock]] = {}
        self.req_block_ids: dict[str, list[int]] = {}  # the same tables as ids, kept for block_table()
        self.req_hashes: dict[str, list[BlockHash]] = {}
        self.num_cached_blocks: dict[str, int] = {}
        self._awaited: dict[str, tuple[str, int]] = {}  # waiting request -> (request computing its block, index)
        # Prefix-cache counters, in tokens: the scheduler records each request's first admission.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    def record_events(self) -> KVEventLog:
        """Start logging every block hash the prefix cache gains or loses (`kv/events.py`); returns the log."""
        self.pool.events = KVEventLog()
        return self.pool.events

    def cached_hashes(self) -> set[BlockHash]:
        """The hashes a prefix lookup can find now (what the KV events describe)."""
        return set(self.pool.cached)

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
        ids = self.req_block_ids.get(request_id)
        return list(ids) if ids is not None else []

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
        """The longest verified cached prefix of a request not yet running, and its length in tokens.

        Block-aligned, and at most ``num_tokens - 1`` tokens: the last known token is always computed,
        since the next token is sampled from its logits (a preempted request resumes the same way, its
        own output blocks included)."""
        if not self.enable_prefix_caching or req.num_computed_tokens > 0:
            return [], 0
        hashes = self._hashes(req)
        tokens = req.all_token_ids
        hit = self._cached_prefix(
            hashes, tokens, req.cache_salt, min((len(tokens) - 1) // self.block_size, len(hashes))
        )
        return hit, len(hit) * self.block_size

    def _cached_prefix(
        self, hashes: list[BlockHash], tokens: list[int], cache_salt: str | None, max_blocks: int
    ) -> list[KVBlock]:
        """The cached blocks that continue the chain from the root over ``tokens``, verified block by block."""
        bs = self.block_size
        hit: list[KVBlock] = []
        parent_key = ROOT_KEY
        for i in range(max_blocks):
            block = self.pool.get_cached_block(
                hashes[i], tuple(tokens[i * bs : (i + 1) * bs]), parent_key, cache_salt if i == 0 else None
            )
            if block is None:
                break
            hit.append(block)
            parent_key = block.cache_key
        return hit

    def prefix_in_flight(self, req: KVRequest, num_hit_blocks: int) -> bool:
        """Whether the first block ``req`` missed is being computed right now by another request (allocated,
        not yet published). Waiting for it turns a duplicate prefill into a hit one step later."""
        if not self.enable_prefix_caching:
            return False
        i = num_hit_blocks
        if i >= (len(req.all_token_ids) - 1) // self.block_size:
            return False  # nothing more could hit anyway
        want = self._hashes(req)[i]
        # A running request computes block i if its hashes (its known tokens) reach it and it has not
        # published it yet; it may not have allocated it yet (a later prefill chunk).
        for rid in self.req_blocks:
            if rid == req.request_id or self.num_cached_blocks.get(rid, 0) > i:
                continue
            hashes = self.req_hashes.get(rid)
            if hashes is not None and i < len(hashes) and hashes[i] == want:
                self._awaited[req.request_id] = (rid, i)
                return True
        self._awaited.pop(req.request_id, None)
        return False

    def still_awaiting_prefix(self, req: KVRequest) -> bool:
        """O(1) re-check of an earlier positive `prefix_in_flight`: the block it waits for is still unpublished
        by the request computing it (so the lookup need not be repeated this step)."""
        awaited = self._awaited.get(req.request_id)
        if awaited is None:
            return False
        owner, i = awaited
        if owner in self.req_blocks and self.num_cached_blocks.get(owner, 0) <= i:
            return True
        del self._awaited[req.request_id]
        return False

    def record_prefix_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one admission's lookup (tokens asked, tokens found) in the hit-rate counters."""
        self.prefix_cache_queries += num_tokens
        self.prefix_cache_hits += num_hit_tokens

    def allocate_slots(
        self,
        req: KVRequest,
        num_new_tokens: int,
        new_computed_blocks: list[KVBlock] | None = None,
        num_lookahead_tokens: int = 0,
    ) -> list[tuple[int, int]] | None:
        """Make room for ``num_new_tokens`` (+ lookahead) after the computed ones.

        Returns the copy-on-write orders ``[(src_block, dst_block)]`` for the executor, or ``None`` if
        the pool cannot supply the blocks (nothing is changed then). Every block this step writes into
        that another table also points at (a fork's partial last prompt block) is replaced by a fresh
        private block, and the executor copies the old block's KV into it before the step's attention.
        """
        bs = self.block_size
        computed = new_computed_blocks or ()
        rid = req.request_id
        blocks = self.req_blocks.get(rid)
        if blocks is None:
            blocks = []
        start = req.num_computed_tokens + len(computed) * bs
        total = start + num_new_tokens + num_lookahead_tokens
        # the common case, a decode inside its own last block: nothing to allocate or copy
        if not computed and total <= len(blocks) * bs and (total - 1) // bs == start // bs:
            if blocks[start // bs].ref_cnt == 1:
                return []
        num_needed = -(-total // bs)
        num_new_blocks = max(0, num_needed - len(blocks) - len(computed))
        cow: list[int] = []
        # Hit blocks are full and never written; only this table's own existing blocks can be shared.
        if not computed and total > start and start // bs < len(blocks):
            cow = [i for i in range(start // bs, min(num_needed, len(blocks))) if blocks[i].ref_cnt > 1]
        revived = sum(1 for b in computed if b.ref_cnt == 0) if computed else 0
        if num_new_blocks + len(cow) + revived > self.pool.free_queue.num_free:
            return None

        ids = self.req_block_ids.get(rid)
        if ids is None:
            self._awaited.pop(rid, None)
            self.req_blocks[rid] = blocks
            ids = self.req_block_ids[rid] = []
            self.num_cached_blocks.setdefault(rid, 0)
        copies: list[tuple[int, int]] = []
        if computed:
            self.pool.touch(computed)
            blocks.extend(computed)
            ids.extend(b.block_id for b in computed)
            self.num_cached_blocks[rid] = len(blocks)
        if cow:
            fresh = self.pool.get_new_blocks(len(cow))
            for i, new in zip(cow, fresh):
                old = blocks[i]
                copies.append((old.block_id, new.block_id))
                blocks[i] = new
                ids[i] = new.block_id
                self.pool.free_blocks([old])  # still referenced by the other tables
        if num_new_blocks:
            new_blocks = self.pool.get_new_blocks(num_new_blocks)
            blocks.extend(new_blocks)
            ids.extend(b.block_id for b in new_blocks)
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
        end = self._publish(
            blocks, self._hashes(req), req.all_token_ids, req.cache_salt, first, min(num_full, len(blocks))
        )
        self.num_cached_blocks[rid] = max(first, end)

    def _publish(
        self,
        blocks: list[KVBlock],
        hashes: list[BlockHash],
        tokens: list[int],
        cache_salt: str | None,
        first: int,
        end: int,
    ) -> int:
        """Publish ``blocks[first:end]`` in the prefix cache, each chained to the one before it; returns where it
        stopped (``end``, or the first block whose parent is unpublished: nothing after it can be verified)."""
        bs = self.block_size
        for i in range(first, end):
            parent_key = blocks[i - 1].cache_key if i > 0 else ROOT_KEY
            if i > 0 and parent_key == ROOT_KEY:
                return i
            self.pool.cache_full_block(
                blocks[i],
                hashes[i],
                tuple(tokens[i * bs : (i + 1) * bs]),
                parent_key,
                cache_salt if i == 0 else None,
                hashes[i - 1] if i > 0 else None,
            )
        return end

    # -- release -----------------------------------------------------------------------------------
    def free(self, request_id: str) -> None:
        blocks = self.req_blocks.pop(request_id, None)
        self.req_block_ids.pop(request_id, None)
        self._awaited.pop(request_id, None)
        self.num_cached_blocks.pop(request_id, None)
        self.req_hashes.pop(request_id, None)
        if blocks:
            self.pool.free_blocks(reversed(blocks))

    # -- pins: blocks held outside any table while a prompt's KV changes engines --------------------------
    def pin_prompt(self, request_id: str, num_prompt_tokens: int) -> list[KVBlock] | None:
        """Pin the request's full prompt blocks (they outlive its table) and return them; None where its table
        does not hold them all."""
        n = num_prompt_tokens // self.block_size
        blocks = self.blocks(request_id)[:n]
        if not blocks or len(blocks) != n:
            return None
        self.pool.touch(blocks)
        return blocks

    def unpin(self, blocks: list[KVBlock]) -> None:
        """Drop pins, tail first: a prefix is evicted after what follows it."""
        self.pool.free_blocks(reversed(blocks))

    def reserve(self, token_ids: list[int], cache_salt: str | None) -> KVReservation | None:
        """Room for the full blocks of ``token_ids``, hashed as this pool's prefix cache hashes them: the leading
        blocks it caches already, and fresh ones for the rest, all pinned. None (nothing held) when the pool is
        short."""
        hashes = block_hashes(token_ids, self.block_size, cache_salt)
        cached = self._cached_prefix(hashes, token_ids, cache_salt, len(hashes)) if self.enable_prefix_caching else []
        self.pool.touch(cached)
        num_fresh = len(hashes) - len(cached)
        if num_fresh > self.pool.free_queue.num_free:
            self.unpin(cached)
            return None
        fresh = self.pool.get_new_blocks(num_fresh)
        return KVReservation(cached, fresh, hashes, list(token_ids), cache_salt)

    def publish(self, res: KVReservation) -> None:
        """The fresh blocks hold their KV now: publish them in the prefix cache, chained after the cached ones.
        Without a prefix cache nothing can find them: their request recomputes (correct, slower)."""
        if self.enable_prefix_caching:
            blocks = res.cached + res.fresh
            self._publish(blocks, res.hashes, res.token_ids, res.cache_salt, len(res.cached), len(blocks))

    def release(self, res: KVReservation) -> None:
        """Drop the reservation's pins."""
        self.unpin(res.cached + res.fresh)

    def fork(self, parent_id: str, child_id: str) -> None:
        """The child's table points at every parent block (each gains a reference). The child's tokens must
        equal the parent's at this point: it inherits the parent's hashes and published-block count."""
        assert child_id not in self.req_blocks, f"{child_id} already has blocks"
        blocks = list(self.req_blocks.get(parent_id, []))
        self.pool.touch(blocks)
        self.req_blocks[child_id] = blocks
        self.req_block_ids[child_id] = [b.block_id for b in blocks]
        self.num_cached_blocks[child_id] = self.num_cached_blocks.get(parent_id, 0)
        if parent_id in self.req_hashes:
            self.req_hashes[child_id] = list(self.req_hashes[parent_id])
