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
from sluice.kv.block_pool import KVBlock
from sluice.kv.manager import KVReservation


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


# -- the role schedulers -----------------------------------------------------------------------------------
class PrefillScheduler(Scheduler):
    """Pins each request's full prompt blocks in the step that samples its first token (see the module)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.shipments: dict[str, list[KVBlock]] = {}

    def update_from_output(self, so: SchedulerOutput, out: ModelOutput) -> list[TokenEvent]:
        pinned: dict[str, list[KVBlock]] = {}
        if out.error is None:
            failed = out.failed or {}
            for rid in out.req_ids:
                req = self.requests.get(rid)
                if req is None or rid in failed or req.output_token_ids or rid in self.shipments:
                    continue  # gone, failed, or not its first token
                # pinned: the request's own reference goes when it finishes below
                blocks = self.kv.pin_prompt(rid, req.num_prompt_tokens)
                if blocks is not None:
                    pinned[rid] = blocks
        events = super().update_from_output(so, out)
        for rid, blocks in pinned.items():
            if rid in self.requests:  # not finished by its first token: no shipment (a prefill engine used alone)
                self.kv.unpin(blocks)
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
                self.kv.unpin(blocks)  # they stay cached here until evicted
            return None
        raise TypeError(f"a prefill engine does not take {type(op).__name__}")

    @property
    def num_pinned_blocks(self) -> int:
        return sum(map(len, self.shipments.values()))


class DecodeScheduler(Scheduler):
    """Reserves and publishes shipped blocks, and pins them until their request is admitted (see the module)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.reservations: dict[str, KVReservation] = {}
        self._arrived: set[str] = set()  # requests added with a reservation: its pins go once they are admitted

    def kv_op(self, op: KVOp) -> object:
        if isinstance(op, ReserveBlocks):
            self._release(op.request_id)  # an earlier reservation under this id (never the case in the pair)
            res = self.kv.reserve(op.token_ids, op.cache_salt)
            if res is None:
                return None
            self.reservations[op.request_id] = res
            return len(res.cached), [b.block_id for b in res.fresh]
        if isinstance(op, CommitBlocks):
            res = self.reservations.get(op.request_id)
            if res is not None:
                if op.ok:
                    self.kv.publish(res)
                else:
                    self._release(op.request_id)
            return None
        if isinstance(op, ReleaseBlocks):
            self._release(op.request_id)
            return None
        raise TypeError(f"a decode engine does not take {type(op).__name__}")

    def _release(self, request_id: str) -> None:
        res = self.reservations.pop(request_id, None)
        self._arrived.discard(request_id)
        if res is not None:
            self.kv.release(res)

    # -- the request's side: pins go once it is admitted (it holds its own references then) or ends --------
    def add_request(self, req: Request, forks: Any = ()) -> None:
        if req.request_id in self.reservations:
            self._arrived.add(req.request_id)
        super().add_request(req, forks)

    def schedule(self) -> SchedulerOutput:
        so = super().schedule()
        if self._arrived:
            for rid in [rid for rid in self.reservations if rid in self._arrived]:  # in reservation order
                req = self.requests.get(rid)
                if req is None or req.status is not RequestStatus.WAITING:
                    self._release(rid)
        return so

    def abort(self, request_id: str) -> Request | None:
        self._release(request_id)
        return super().abort(request_id)

    @property
    def num_pinned_blocks(self) -> int:
        return sum(r.num_blocks for r in self.reservations.values())


def scheduler_class(kv_role: str) -> type[Scheduler]:
    """The scheduler an engine of this role runs (`EngineArgs.kv_role`)."""
    return {"both": Scheduler, "prefill": PrefillScheduler, "decode": DecodeScheduler}[kv_role]
