"""The engine core's own process: `run_core_process` is its whole life (the target of a spawned process).

It loads the model, answers `CoreReady` (or `CoreFailed`), then runs the `EngineCore` on its own event loop
between two bridges per front end (one, or `sluice serve --api-server-count N`'s N):

* inbound: `FrontBatch` messages from a front end's socket become the in-process `AddRequest` /
  `AbortRequest` / `EndAllRequests` on the scheduler actor's one inbox;
* outbound: every request's events go to its front end's `StepCollector` (it stands in for each request's
  event stream), and whatever a step delivered leaves as one `CoreStep` per front end, with the engine's
  counters: one message per step and front end, not one per request.

Routing costs nothing per event: an `AddRequest` carries the stream its events go to, and the inbound bridge
of front end i hands it collector i, so the scheduler actor's ``stream.send_nowait(ev)`` already lands in the
right front end's next message. That is why each front end has a socket pair of its own (a PUSH/PULL pair, as
with one front end) rather than one ROUTER socket: the owner of a request is known by the socket it came in
on, and no message needs an identity frame or a lookup. Request ids are unique across front ends because each
front end prefixes its own on the wire (`core/request_ids.py`).

Its life is its parent's: Ctrl-C and SIGTERM reach a terminal's whole process group, so the core ignores
them and stops once every front end has said so (`ShutdownMsg`); a thread watches its parent (the front end,
or the `--api-server-count` supervisor) and ends the process when the parent is gone (killed, crashed), so a
core never outlives it.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import anyio
import zmq
from sluice.core.args import EngineArgs
from sluice.core.engine_core.core import EngineCore
from sluice.core.engine_core.runtime import freeze_heap, shorten_switch_interval
from sluice.core.engine_core.scheduler_actor import SchedulerActor
from sluice.core.ipc import wire, zmq_io
from sluice.core.messages import AbortRequest, Admitted, EndAllRequests, TokenEvent

logger = logging.getLogger("sluice")

PARENT_POLL_S = 0.2  # how soon an orphaned core notices


@dataclass(slots=True)
class BridgeAddress:
    """One front end's two sockets."""

    to_core: str  # the front end's PUSH socket, the core's PULL
    to_front: str  # the core's PUSH socket, the front end's PULL (bound by the front end)


@dataclass(slots=True)
class CoreProcessSpec:
    args: EngineArgs
    max_model_len: int
    bridges: list[BridgeAddress]  # one per front end
    parent_pid: int
    log_level: int
    # Who binds each ``to_core`` socket. The one front end that starts its core binds both of its sockets before
    # the core exists, so the core finds them and its sends can fail fast once it is gone. Front ends of a
    # shared core start on their own schedule: the core binds, and a front end connects its PUSH, which then
    # queues until the core is there (a bound PUSH with no peer yet would refuse the front end's first request).
    core_binds: bool = False


class StepCollector:
    """Every request's event stream inside the core process: the scheduler actor's ``send_nowait`` appends
    here, and the outbound bridge takes the lot once the step (or admission) that produced them is done. It
    never refuses an event: a request whose caller is gone is aborted by the front end's `AbortRequest`."""

    __slots__ = ("events", "admitted", "_ready")

    def __init__(self) -> None:
        self.events: list[TokenEvent] = []
        self.admitted: list[str] = []  # `Admitted`'s ids: they travel apart from the events (`wire.CoreStep`)
        self._ready = anyio.Event()

    def send_nowait(self, ev: TokenEvent | Admitted) -> None:
        if ev.__class__ is Admitted:
            self.admitted.append(ev.request_id)
        else:
            self.events.append(ev)
        self._ready.set()

    def wake(self) -> None:
        self._ready.set()

    async def take(self) -> tuple[list[str], list[TokenEvent]]:
        """The ids admitted and the events since the last take (once there is something, or new counters)."""
        await self._ready.wait()
        self._ready = anyio.Event()
        admitted, events = self.admitted, self.events
        if admitted:
            self.admitted = []
        self.events = []
        return admitted, events


@dataclass(slots=True)
class _Bridge:
    """The core's end of one front end's bridge."""

    from_front: zmq.Socket
    to_front: zmq.Socket
    collector: StepCollector


def run_core_process(spec: CoreProcessSpec) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=spec.log_level, format="%(levelname)s sluice core: %(message)s")
    watch_parent(spec.parent_pid)
    ctx = zmq.Context()
    socks = [
        (
            zmq_io.socket(ctx, zmq.PULL, b.to_core, bind=spec.core_binds),
            zmq_io.socket(ctx, zmq.PUSH, b.to_front, bind=False),
        )
        for b in spec.bridges
    ]

    def close() -> None:
        for pair in socks:
            for sock in pair:
                sock.close()
        ctx.term()

    try:
        from sluice.core import envs
        from sluice.core.models.loader import resolve_model

        core = EngineCore.build(spec.args, resolve_model(spec.args.model, envs.SLUICE_CACHE_DIR), spec.max_model_len)
    except BaseException as e:
        logger.debug("building the engine core failed", exc_info=True)
        failed = wire.core_encoder.encode(wire.CoreFailed(wire.error_to_wire(e)))
        for _, to_front in socks:
            to_front.send(failed)
            to_front.setsockopt(zmq.LINGER, 5000)  # let the answer out before the socket closes
        close()
        raise SystemExit(1) from None
    if spec.args.gc_freeze:  # this process ends with the engine: no unfreeze
        freeze_heap()
    shorten_switch_interval(spec.args.gil_switch_interval_ms)  # likewise, never restored
    actor = core.scheduler_actor
    ready = wire.core_encoder.encode(wire.CoreReady(core.num_kv_blocks, os.getpid(), actor.stats))
    for _, to_front in socks:
        to_front.send(ready)
    try:
        anyio.run(_serve, core, [_Bridge(f, t, StepCollector()) for f, t in socks])
    finally:
        close()


async def _serve(core: EngineCore, bridges: list[_Bridge]) -> None:
    actor = core.scheduler_actor

    def wake_all() -> None:  # new counters: every front end gets them, with or without events of its own
        for b in bridges:
            b.collector.wake()

    actor.on_publish = wake_all
    # Unbounded here: the front ends' own inboxes are the bounded ones (their callers wait there).
    inbox_send, inbox_recv = anyio.create_memory_object_stream(math.inf)

    async def bridge(b: _Bridge) -> None:  # until its front end says ShutdownMsg
        async with anyio.create_task_group() as tg:
            tg.start_soon(_send_steps, b.collector, actor, b.to_front)
            await _receive(b.from_front, inbox_send, b.collector)
            tg.cancel_scope.cancel()

    async with anyio.create_task_group() as tg:
        tg.start_soon(core.run, inbox_recv)
        async with anyio.create_task_group() as fronts:  # the core stops once every front end is done
            for b in bridges:
                fronts.start_soon(bridge, b)
        tg.cancel_scope.cancel()


async def _receive(sock: zmq.Socket, inbox, collector: StepCollector) -> None:
    """One front end's messages onto the scheduler actor's inbox, until its `ShutdownMsg`; its requests' events
    go to its ``collector``."""
    decode = wire.front_decoder.decode
    while True:
        batch = decode(await zmq_io.recv(sock))
        for msg in batch.messages:
            if isinstance(msg, wire.AddMsg):
                inbox.send_nowait(wire.add_from_wire(msg, collector))
            elif isinstance(msg, wire.AbortMsg):
                inbox.send_nowait(AbortRequest(msg.request_id))
            elif isinstance(msg, wire.EndAllMsg):
                inbox.send_nowait(EndAllRequests(wire.error_from_wire(msg.error)))
            else:
                return


async def _send_steps(collector: StepCollector, actor: SchedulerActor, sock: zmq.Socket) -> None:
    """One `CoreStep` per wake-up: the events of the step (or admissions) just done, and the counters."""
    encode = wire.core_encoder.encode
    to_wire = wire.event_to_wire
    last = actor.stats
    while True:
        admitted, events = await collector.take()
        stats = actor.stats
        if not events and not admitted and stats == last:
            continue  # published again, unchanged (the step loop going idle)
        last = stats
        try:
            zmq_io.send(sock, encode(wire.CoreStep([to_wire(e) for e in events], stats, admitted)))
        except zmq.Again:
            return  # the front end is gone; the parent watch ends this process


def watch_parent(parent_pid: int, on_gone: Callable[[], None] | None = None) -> None:
    """End this process once its parent is gone (killed, crashed: it could not say so): ``on_gone()`` in a
    thread of its own, by default an immediate exit. Polling ``getppid`` works wherever the engine was started
    from (PR_SET_PDEATHSIG fires when the parent's *thread* ends, and `LLM` starts the engine from a thread that
    may end first)."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(PARENT_POLL_S)
        if on_gone is None:
            os._exit(1)
        on_gone()

    threading.Thread(target=watch, name="sluice-parent-watch", daemon=True).start()
