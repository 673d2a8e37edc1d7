"""The engine core's own process: `run_core_process` is its whole life (the target of a spawned process).

It loads the model, answers `CoreReady` (or `CoreFailed`), then runs the `EngineCore` on its own event loop
between two bridges:

* inbound: `FrontBatch` messages from the front end's socket become the in-process `AddRequest` /
  `AbortRequest` / `EndAllRequests` on the scheduler actor's inbox;
* outbound: every request's events go to one `StepCollector` (it stands in for each request's event stream),
  and whatever a step delivered leaves as one `CoreStep`, with the engine's counters: one message per step,
  not one per request.

Its life is the front end's: Ctrl-C and SIGTERM reach a terminal's whole process group, so the core ignores
them and stops when the front end says so (`ShutdownMsg`); a thread watches its parent and ends the process
when the parent is gone (killed, crashed), so a core never outlives its front end.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import threading
import time
from dataclasses import dataclass

import anyio
import zmq
from sluice.core import wire, zmq_io
from sluice.core.args import EngineArgs
from sluice.core.engine_core import EngineCore
from sluice.core.request import AbortRequest, EndAllRequests, TokenEvent
from sluice.core.scheduler_actor import SchedulerActor

logger = logging.getLogger("sluice")

PARENT_POLL_S = 0.2  # how soon an orphaned core notices


@dataclass(slots=True)
class CoreProcessSpec:
    args: EngineArgs
    max_model_len: int
    to_core: str  # the front end's PUSH socket (bound by the front end)
    to_front: str  # the front end's PULL socket
    parent_pid: int
    log_level: int


class StepCollector:
    """Every request's event stream inside the core process: the scheduler actor's ``send_nowait`` appends
    here, and the outbound bridge takes the lot once the step (or admission) that produced them is done. It
    never refuses an event: a request whose caller is gone is aborted by the front end's `AbortRequest`."""

    __slots__ = ("events", "_ready")

    def __init__(self) -> None:
        self.events: list[TokenEvent] = []
        self._ready = anyio.Event()

    def send_nowait(self, ev: TokenEvent) -> None:
        self.events.append(ev)
        self._ready.set()

    def wake(self) -> None:
        self._ready.set()

    async def take(self) -> list[TokenEvent]:
        await self._ready.wait()
        self._ready = anyio.Event()
        events, self.events = self.events, []
        return events


def run_core_process(spec: CoreProcessSpec) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=spec.log_level, format="%(levelname)s sluice core: %(message)s")
    _watch_parent(spec.parent_pid)
    ctx = zmq.Context()
    to_front = zmq_io.socket(ctx, zmq.PUSH, spec.to_front, bind=False)
    from_front = zmq_io.socket(ctx, zmq.PULL, spec.to_core, bind=False)
    try:
        from sluice.core.models.loader import resolve_model

        core = EngineCore.build(spec.args, resolve_model(spec.args.model), spec.max_model_len)
    except BaseException as e:
        logger.debug("building the engine core failed", exc_info=True)
        to_front.send(wire.core_encoder.encode(wire.CoreFailed(wire.error_to_wire(e))))
        to_front.setsockopt(zmq.LINGER, 5000)  # let the answer out before the socket closes
        to_front.close()
        from_front.close()
        ctx.term()
        raise SystemExit(1) from None
    actor = core.scheduler_actor
    to_front.send(wire.core_encoder.encode(wire.CoreReady(core.num_kv_blocks, os.getpid(), actor.stats)))
    try:
        anyio.run(_serve, core, from_front, to_front)
    finally:
        to_front.close()
        from_front.close()
        ctx.term()


async def _serve(core: EngineCore, from_front: zmq.Socket, to_front: zmq.Socket) -> None:
    collector = StepCollector()
    actor = core.scheduler_actor
    actor.on_publish = collector.wake
    # Unbounded here: the front end's own inbox is the bounded one (its callers wait there).
    inbox_send, inbox_recv = anyio.create_memory_object_stream(math.inf)
    async with anyio.create_task_group() as tg:
        tg.start_soon(core.run, inbox_recv)
        tg.start_soon(_send_steps, collector, actor, to_front)
        await _receive(from_front, inbox_send, collector)
        tg.cancel_scope.cancel()


async def _receive(sock: zmq.Socket, inbox, collector: StepCollector) -> None:
    """Front-end messages onto the scheduler actor's inbox, until `ShutdownMsg`."""
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
        events = await collector.take()
        stats = actor.stats
        if not events and stats == last:
            continue  # published again, unchanged (the step loop going idle)
        last = stats
        try:
            zmq_io.send(sock, encode(wire.CoreStep([to_wire(e) for e in events], stats)))
        except zmq.Again:
            return  # the front end is gone; the parent watch ends this process


def _watch_parent(parent_pid: int) -> None:
    """End this process once its parent is gone (killed, crashed: it could not say so). Polling ``getppid``
    works wherever the engine was started from (PR_SET_PDEATHSIG fires when the parent's *thread* ends, and
    `LLM` starts the engine from a thread that may end first)."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(PARENT_POLL_S)
        os._exit(1)

    threading.Thread(target=watch, name="sluice-core-parent-watch", daemon=True).start()
