"""The schedulers of a prefill/decode pair: who holds which KV blocks while a prompt's KV changes engines.

The KV of a prompt moves in four hand-overs, each a `KVOp` message to one engine's scheduler actor (so the
block pool is only ever touched on its own actor's loop):

1. **prefill engine, pin.** `PrefillScheduler` runs each request to its first token (the pair sends it with
   ``max_tokens=1``). In the step that produces that token, before the request is finished and its blocks
   are freed, it takes an extra reference on the prompt's *full* blocks: a shipment. Nothing can evict
   or overwrite them now.
2. **decode engine, reserve** (`ReserveBlocks`). `DecodeScheduler` hashes the prompt's full blocks exactly
   as its prefix cache would (same chain, same ``cache_salt``), pins the leading ones it already caches
   (those are not shipped) and allocates fresh blocks for the rest. No room: the answer is None, and the
   request simply recomputes its prompt.
3. **the wire.** The pair (`core/disagg/engine.py`) takes the shipment (`TakeShipment`), gathers its blocks into a
   staging copy, hands them back to the prefill pool (`ReleaseShipment`), ships the copy
   (`kv/transfer.py`) and writes it into the reserved blocks.
4. **decode engine, publish** (`CommitBlocks`). On success the fresh blocks are published in the prefix
   cache under their hashes; on failure they are returned unpublished (nothing can ever read them). The
   pins stay until the request arrives and is admitted: its prefix lookup then finds every shipped
   block, exactly as a prefix-cache hit (a later request sharing the prefix hits them too). Only the last
   partial block of the prompt, and the first token, are computed again on the decode side: a few tokens,
   and no hashing of partial blocks.

A request that never arrives (cancelled meanwhile, refused) has its pins dropped by `ReleaseBlocks`, or by
its abort. Every path ends with the pins dropped, so no block leaks on either side.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import anyio
from sluice.core.messages import TokenEvent
from sluice.core.request import Request, RequestStatus
from sluice.core.sched.scheduler import Scheduler
from sluice.core.step import ModelOutput, SchedulerOutput
from sluice.kv.block_pool import ROOT_KEY, KVBlock
from sluice.kv.prefix_cache import block_hashes


# -- messages (front end -> an engine's scheduler actor) --------------------------------------------------
@dataclass(slots=True)
class KVOp:
    """A block hand-over asked of one engine's scheduler; its answer goes to ``reply`` (a send stream)."""

    request_id: str
    reply: Any = None  # ObjectSendStream[object]: None when nobody waits for the answer

    def answer(self, value: object) -> None:
        if self.reply is None:
            return
        try:
            self.reply.send_nowait(value)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, anyio.WouldBlock):
            pass  # the asker is gone; whatever it held is released by its own cleanup


@dataclass(slots=True)
class TakeShipment(KVOp):
    """Prefill side: the block ids of the request's pinned full prompt blocks, or None (none pinned)."""


@dataclass(slots=True)
class ReleaseShipment(KVOp):
    """Prefill side: drop the shipment's pins (its blocks stay cached in the prefill engine's prefix cache)."""


@dataclass(slots=True)
class ReserveBlocks(KVOp):
    """Decode side: room for the full blocks of ``token_ids`` (the prompt). Answer: ``(num_local, block_ids)``
    -- the leading ``num_local`` blocks are cached here already (not shipped), ``block_ids`` receive the
    rest -- or None when the pool has no room."""

    token_ids: list[int] = field(default_factory=list)
    cache_salt: str | None = None


@dataclass(slots=True)
class CommitBlocks(KVOp):
    """Decode side: the reserved blocks hold the shipped KV (``ok``): publish them; else return them."""

    ok: bool = True


@dataclass(slots=True)
class ReleaseBlocks(KVOp):
    """Decode side: the request will not arrive: drop the pins of its reserved blocks."""


@dataclass(slots=True)
class _Reservation:
    local: list[KVBlock]  # cached here already
    fresh: list[KVBlock]  # receive the shipped KV
    hashes: list[bytes]
    token_ids: list[int]
    cache_salt: str | None
    arrived: bool = False  # the request was added: the pins go once it is admitted


# -- the role schedulers -----------------------------------------------------------------------------------
class PrefillScheduler(Scheduler):
    """Pins each request's full prompt blocks in the step that samples its first token (see the module)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.shipments: dict[str, list[KVBlock]] = {}

    def update_from_output(self, so: SchedulerOutput, out: ModelOutput) -> list[TokenEvent]:
        pinned: dict[str, list[KVBlock]] = {}
        if out.error is None:
            bs = self.kv.block_size
            failed = out.failed or {}
            for rid in out.req_ids:
                req = self.requests.get(rid)
                if req is None or rid in failed or req.output_token_ids or rid in self.shipments:
                    continue  # gone, failed, or not its first token
                blocks = self.kv.blocks(rid)[: req.num_prompt_tokens // bs]
                if blocks and len(blocks) == req.num_prompt_tokens // bs:
                    self.kv.pool.touch(blocks)  # the request's own reference goes when it finishes below
                    pinned[rid] = blocks
        events = super().update_from_output(so, out)
        for rid, blocks in pinned.items():
            if rid in self.requests:  # not finished by its first token: no shipment (a prefill engine used alone)
                self.kv.pool.free_blocks(reversed(blocks))
            else:
                self.shipments[rid] = blocks
        return events

    def kv_op(self, op: KVOp) -> object:
        if isinstance(op, TakeShipment):
            blocks = self.shipments.get(op.request_id)
            return None if blocks is None else [b.block_id for b in blocks]
        if isinstance(op, ReleaseShipment):
            blocks = self.shipments.pop(op.request_id, None)
            if blocks is not None:
                self.kv.pool.free_blocks(reversed(blocks))  # tail first: the prefix is evicted last
            return None
        raise TypeError(f"a prefill engine does not take {type(op).__name__}")

    @property
    def num_pinned_blocks(self) -> int:
        return sum(map(len, self.shipments.values()))


class DecodeScheduler(Scheduler):
    """Reserves and publishes shipped blocks, and pins them until their request is admitted (see the module)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.reservations: dict[str, _Reservation] = {}

    def kv_op(self, op: KVOp) -> object:
        if isinstance(op, ReserveBlocks):
            return self._reserve(op)
        if isinstance(op, CommitBlocks):
            res = self.reservations.get(op.request_id)
            if res is not None:
                if op.ok:
                    self._publish(res)
                else:
                    self._release(op.request_id)
            return None
        if isinstance(op, ReleaseBlocks):
            self._release(op.request_id)
            return None
        raise TypeError(f"a decode engine does not take {type(op).__name__}")

    def _reserve(self, op: ReserveBlocks) -> tuple[int, list[int]] | None:
        self._release(op.request_id)  # an earlier reservation under this id (never the case in the pair)
        bs = self.kv.block_size
        pool = self.kv.pool
        tokens = op.token_ids
        hashes = block_hashes(tokens, bs, op.cache_salt)
        local: list[KVBlock] = []
        parent_key = ROOT_KEY
        if self.kv.enable_prefix_caching:
            for i, h in enumerate(hashes):  # the lookup `KVCacheManager.get_computed_blocks` does
                block = pool.get_cached_block(
                    h, tuple(tokens[i * bs : (i + 1) * bs]), parent_key, op.cache_salt if i == 0 else None
                )
                if block is None:
                    break
                local.append(block)
                parent_key = block.cache_key
        pool.touch(local)
        num_fresh = len(hashes) - len(local)
        if num_fresh > pool.free_queue.num_free:
            pool.free_blocks(reversed(local))
            return None
        fresh = pool.get_new_blocks(num_fresh)
        self.reservations[op.request_id] = _Reservation(local, fresh, hashes, list(tokens), op.cache_salt)
        return len(local), [b.block_id for b in fresh]

    def _publish(self, res: _Reservation) -> None:
        """The shipped blocks hold their KV now: hash them into the prefix cache, chained after the local ones."""
        if not self.kv.enable_prefix_caching:
            return  # without a prefix cache the request cannot find them: it recomputes (correct, slower)
        bs = self.kv.block_size
        blocks = res.local + res.fresh
        for i in range(len(res.local), len(blocks)):
            parent_key = blocks[i - 1].cache_key if i > 0 else ROOT_KEY
            self.kv.pool.cache_full_block(
                blocks[i],
                res.hashes[i],
                tuple(res.token_ids[i * bs : (i + 1) * bs]),
                parent_key,
                res.cache_salt if i == 0 else None,
            )

    def _release(self, request_id: str) -> None:
        res = self.reservations.pop(request_id, None)
        if res is not None:
            self.kv.pool.free_blocks(reversed(res.local + res.fresh))

    # -- the request's side: pins go once it is admitted (it holds its own references then) or ends --------
    def add_request(self, req: Request, forks: Any = ()) -> None:
        res = self.reservations.get(req.request_id)
        if res is not None:
            res.arrived = True
        super().add_request(req, forks)

    def schedule(self) -> SchedulerOutput:
        so = super().schedule()
        if self.reservations:
            for rid, res in list(self.reservations.items()):
                req = self.requests.get(rid)
                if res.arrived and (req is None or req.status is not RequestStatus.WAITING):
                    self._release(rid)
        return so

    def abort(self, request_id: str) -> Request | None:
        self._release(request_id)
        return super().abort(request_id)

    @property
    def num_pinned_blocks(self) -> int:
        return sum(len(r.local) + len(r.fresh) for r in self.reservations.values())


def scheduler_class(kv_role: str) -> type[Scheduler]:
    """The scheduler an engine of this role runs (`EngineArgs.kv_role`)."""
    return {"both": Scheduler, "prefill": PrefillScheduler, "decode": DecodeScheduler}[kv_role]
