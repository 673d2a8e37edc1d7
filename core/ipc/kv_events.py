"""KV events in vLLM's wire format, so a KV-aware router (llm-d, NVIDIA Dynamo, Ray) reads sluice as it reads vLLM.

A batch is a msgpack array ``[ts, [event, ...], data_parallel_rank]``; each event a tagged array, its tag first:
``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]``,
``["BlockRemoved", block_hashes, medium]``, ``["AllBlocksCleared"]``. A block hash is the prefix cache's own
(16 bytes of xxh3-128, chained over the prefix: `kv/prefix_cache.py`), so a router that hashes a prompt with
`sluice.kv.prefix_cache.block_hashes` finds the same keys. Frames and replay: `kv_event_publisher.py`.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec
from sluice.kv.events import BlockRemovedEntry, BlockStoredEntry

ExternalBlockHash = bytes | int
MEDIUM = "GPU"  # vLLM's name for the device pool (sluice has no other tier); the CPU pool says it too


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """The base of the three events (the tag is the class name)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def to_batch(entries: list[BlockStoredEntry | BlockRemovedEntry], block_size: int, rank: int | None) -> KVEventBatch:
    """One step's log as a batch: a chain of stored blocks (each the parent of the next) becomes one
    `BlockStored`, as vLLM sends it; consecutive removals one `BlockRemoved`."""
    events: list[BlockStored | BlockRemoved | AllBlocksCleared] = []
    for e in entries:
        last = events[-1] if events else None
        if isinstance(e, BlockStoredEntry):
            if isinstance(last, BlockStored) and e.parent_hash == last.block_hashes[-1]:
                last.block_hashes.append(e.block_hash)
                last.token_ids.extend(e.token_ids)
            else:
                events.append(BlockStored([e.block_hash], e.parent_hash, list(e.token_ids), block_size, None, MEDIUM))
        elif isinstance(last, BlockRemoved):
            last.block_hashes.append(e.block_hash)
        else:
            events.append(BlockRemoved([e.block_hash], MEDIUM))
    return KVEventBatch(time.time(), events, rank)


def apply(batch: KVEventBatch, blocks: set[ExternalBlockHash]) -> None:
    """Replay ``batch`` over a subscriber's view of one engine's cached blocks."""
    for ev in batch.events:
        if isinstance(ev, BlockStored):
            blocks.update(ev.block_hashes)
        elif isinstance(ev, BlockRemoved):
            blocks.difference_update(ev.block_hashes)
        else:
            blocks.clear()


decode_batch = msgspec.msgpack.Decoder(KVEventBatch).decode
