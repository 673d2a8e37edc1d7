"""What the prefix cache gained and lost since it was last asked: the raw material of KV events.

The pool appends one entry when a hash enters its lookup table (`BlockPool.cached`) and one when it leaves it,
so replaying the entries in order over an empty set gives exactly the set of hashes a lookup can find. The
engine core drains the log once per step and publishes the entries as one batch (`core/ipc/kv_events.py`);
with KV events off the pool has no log and pays one ``is None`` test per published or evicted block.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sluice.kv.prefix_cache import BlockHash


@dataclass(slots=True)
class BlockStoredEntry:
    block_hash: BlockHash
    parent_hash: BlockHash | None
    token_ids: tuple[int, ...]


@dataclass(slots=True)
class BlockRemovedEntry:
    block_hash: BlockHash


@dataclass(slots=True)
class KVEventLog:
    entries: list[BlockStoredEntry | BlockRemovedEntry] = field(default_factory=list)

    def stored(self, block_hash: BlockHash, parent_hash: BlockHash | None, token_ids: tuple[int, ...]) -> None:
        self.entries.append(BlockStoredEntry(block_hash, parent_hash, token_ids))

    def removed(self, block_hash: BlockHash) -> None:
        self.entries.append(BlockRemovedEntry(block_hash))

    def drain(self) -> list[BlockStoredEntry | BlockRemovedEntry]:
        out, self.entries = self.entries, []
        return out
