"""Physical KV blocks, their refcounts, and the LRU free queue that doubles as the prefix cache.

A block is in exactly one of two states: referenced (``ref_cnt > 0``, owned by one or more block
tables) or free (``ref_cnt == 0``, in the free queue). A free block may still carry a hash: its KV is
valid and a later request with the same prefix can take it back out of the queue in O(1) (a prefix
hit). Fresh blocks are taken from the queue's head and only then lose their hash (eviction). A freed
block with a hash joins the tail (least recently used first out); one without a hash holds nothing
worth keeping and joins the head, so it is reused before any cached block is evicted.

Verification of a hit. The hash is only a lookup key. Each published block also records what its KV
was computed from: its own token ids, the salt (first block only), and ``parent_key``, the
``cache_key`` of the block before it in the table that computed it. A ``cache_key`` names one content
(a prefix ending in this block): equal keys are handed out only to blocks whose tokens, salt and
parent key are all equal, so by induction from the first block, equal keys mean equal full prefixes
at equal positions. A lookup accepts a block only if its tokens and salt match and its parent key is
the key of the block it matched one position earlier, so even when every hash collides no request
ever gets KV computed from a different prefix.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from sluice.kv.events import KVEventLog
from sluice.kv.prefix_cache import BlockHash

ROOT_KEY = 0  # the parent key of a first block; real keys start at 1


@dataclass(slots=True, eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    # What the KV was computed from, kept only while the block is published (see the module docstring).
    token_ids: tuple[int, ...] | None = None
    cache_key: int = ROOT_KEY
    parent_key: int = ROOT_KEY
    extra_key: str | None = None
    prev: KVBlock | None = field(default=None, repr=False)
    next: KVBlock | None = field(default=None, repr=False)
    in_free_queue: bool = False


class FreeBlockQueue:
    """Doubly linked list of free blocks: O(1) append at either end, pop from the head, removal anywhere."""

    def __init__(self, blocks: Iterable[KVBlock]) -> None:
        self.head: KVBlock | None = None
        self.tail: KVBlock | None = None
        self.num_free = 0
        for b in blocks:
            self.append(b)

    def append(self, block: KVBlock) -> None:
        assert not block.in_free_queue
        block.prev, block.next = self.tail, None
        if self.tail is None:
            self.head = block
        else:
            self.tail.next = block
        self.tail = block
        block.in_free_queue = True
        self.num_free += 1

    def appendleft(self, block: KVBlock) -> None:
        assert not block.in_free_queue
        block.prev, block.next = None, self.head
        if self.head is None:
            self.tail = block
        else:
            self.head.prev = block
        self.head = block
        block.in_free_queue = True
        self.num_free += 1

    def remove(self, block: KVBlock) -> None:
        assert block.in_free_queue
        if block.prev is None:
            self.head = block.next
        else:
            block.prev.next = block.next
        if block.next is None:
            self.tail = block.prev
        else:
            block.next.prev = block.prev
        block.prev = block.next = None
        block.in_free_queue = False
        self.num_free -= 1

    def popleft(self) -> KVBlock:
        if self.head is None:
            raise RuntimeError("no free KV blocks")
        block = self.head
        self.remove(block)
        return block

    def __iter__(self) -> Iterator[KVBlock]:
        b = self.head
        while b is not None:
            yield b
            b = b.next


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[BlockHash, KVBlock] = {}
        self._next_key = ROOT_KEY + 1
        # KV events (`kv/events.py`): every hash entering or leaving `cached`; None = not published
        self.events: KVEventLog | None = None

    @property
    def num_free_blocks(self) -> int:
        """Blocks with no reference, cached or not: all can be handed out."""
        return self.free_queue.num_free

    def get_new_blocks(self, n: int) -> list[KVBlock]:
        if n > self.free_queue.num_free:
            raise RuntimeError(f"asked for {n} KV blocks, {self.free_queue.num_free} free")
        out = []
        for _ in range(n):
            block = self.free_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
                if self.events is not None:
                    self.events.removed(block.block_hash)
            block.block_hash = None
            block.token_ids = None
            block.cache_key = block.parent_key = ROOT_KEY
            block.extra_key = None

    def get_cached_block(
        self, block_hash: BlockHash, token_ids: tuple[int, ...], parent_key: int, extra_key: str | None = None
    ) -> KVBlock | None:
        """The cached block for this content, or None; ``parent_key`` is the key of the block matched one
        position earlier (`ROOT_KEY` for the first block), ``extra_key`` the first block's salt."""
        block = self.cached.get(block_hash)
        if (
            block is None
            or block.parent_key != parent_key
            or block.token_ids != token_ids
            or block.extra_key != extra_key
        ):
            return None
        return block

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on blocks found in the cache (reviving them from the free queue)."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def cache_full_block(
        self,
        block: KVBlock,
        block_hash: BlockHash,
        token_ids: tuple[int, ...],
        parent_key: int,
        extra_key: str | None = None,
        parent_hash: BlockHash | None = None,
    ) -> None:
        """Publish a full block whose KV is computed; ``parent_key`` is the key of the table's previous block
        (``parent_hash`` its hash, for KV events)."""
        if not self.enable_caching or block.block_hash is not None:
            return
        token_ids = tuple(token_ids)
        same = self.get_cached_block(block_hash, token_ids, parent_key, extra_key)
        # Two tables computed the same content (concurrently): the copies share a key, so a chain that
        # continues in either one still verifies; the first stays the one the lookup finds.
        if same is not None:
            key = same.cache_key
        else:
            key = self._next_key
            self._next_key += 1
        block.block_hash = block_hash
        block.token_ids = token_ids
        block.cache_key, block.parent_key, block.extra_key = key, parent_key, extra_key
        if self.cached.setdefault(block_hash, block) is block and self.events is not None:
            self.events.stored(block_hash, parent_hash, token_ids)

    def free_blocks(self, ordered_blocks: Iterable[KVBlock]) -> None:
        """Drop one reference from each block, in eviction order (first freed = first evicted)."""
        for block in ordered_blocks:
            assert block.ref_cnt > 0, f"block {block.block_id} freed twice"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None or not self.enable_caching:
                    self._evict(block)
                    self.free_queue.appendleft(block)
                else:
                    self.free_queue.append(block)

    def reset_prefix_cache(self) -> None:
        for block in self.blocks:
            if block.ref_cnt == 0:
                self._evict(block)
