"""The front end's side of an engine core in its own process: `CoreClient` starts the process, bridges the
engine's inbox to it, fans each step's events out to the request actors, and notices when it dies.

To the request actors nothing changes: they put `AddRequest` / `AbortRequest` on the same inbox stream and
read `Admitted` and `TokenEvent`s from their own stream, as in one process. The bridge registers each request's
stream by id when it forwards the `AddRequest`, and drops it when the request's last event has been routed (or
its admission was refused: every sequence of it then goes).

A dead core (killed, out of memory, crashed) shows as its process sentinel becoming readable: every open
request then ends with `EngineDeadError`, later ones are refused with it, and the engine reports unhealthy.

With ``shared`` (`SharedCore`: `sluice serve --api-server-count N`), the core was started by someone else (the
server's supervisor) and serves N front ends, each with a `CoreClient` of its own: this one connects to its own
socket pair, watches the core's process through a pidfd (it is not this process's child), and leaves starting
and stopping the process to its owner. Three things differ from the one front end that owns its core:

* request ids cross the wire prefixed with the front end's number (``"1:chatcmpl-..."``, `core/request_ids.py`),
  so two front ends can never put the same id into the one scheduler (it keys requests by id); events come back
  prefixed and are cut back on arrival;
* `EndAllRequests` (a server's shutdown grace is over) ends this front end's requests only: it is answered
  here and its requests are aborted in the core, where the core's own `EndAllRequests` would end every front
  end's;
* stopping sends `ShutdownMsg` after aborting what is still open; the core stops once every front end has.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import shutil
import signal
import weakref
from dataclasses import replace

import anyio
import zmq
from anyio.abc import ObjectReceiveStream, ObjectSendStream
from sluice.core.args import EngineArgs
from sluice.core.engine_core.process import BridgeAddress, CoreProcessSpec, run_core_process
from sluice.core.errors import EngineDeadError, EngineStoppedError, RequestFailedError
from sluice.core.frontend.engine_core_client import EngineCoreClient, SharedCore
from sluice.core.frontend.run_dir import make_run_dir, pid_alive
from sluice.core.ipc import wire, zmq_io
from sluice.core.messages import AddRequest, Admitted, EndAllRequests, TokenEvent, refusal, refuse_queued, reply
from sluice.core.stats import EngineStats

logger = logging.getLogger("sluice")

STOP_TIMEOUT_S = 30.0  # a step in flight finishes before the core exits; past this it is killed

_STREAM_GONE = (anyio.BrokenResourceError, anyio.ClosedResourceError, anyio.WouldBlock)


class CoreClient(EngineCoreClient):
    """The `EngineCoreClient` of a core in a process of its own (see the module's docstring)."""

    def __init__(self, args: EngineArgs, max_model_len: int, shared: SharedCore | None = None) -> None:
        self.args = args
        self.max_model_len = max_model_len
        self.shared = shared
        self.stats = EngineStats()
        self.dead: EngineDeadError | None = None
        self.num_kv_blocks = 0
        self.pid: int | None = None
        self.proc = None
        self._pidfd: int | None = None  # shared: the core's process, readable once it has ended
        self._prefix = shared.id_prefix if shared is not None else ""  # `core/request_ids.py`
        self._streams: dict[str, ObjectSendStream[TokenEvent]] = {}
        self._admitting: dict[str, list[str]] = {}  # first sequence's id -> every sequence id, until answered
        self._closed: Exception | None = None  # EndAllRequests: later requests are refused with it
        self._dir: str | None = None
        self._ctx: zmq.Context | None = None
        self._out: zmq.Socket | None = None
        self._in: zmq.Socket | None = None

    # -- process -------------------------------------------------------------------------------------------
    async def start(self) -> None:
        """Spawn the core (or, shared, attach to it) and wait until its model is loaded; raises what its start
        raised."""
        if self.shared is not None:
            self._bind(self.shared.bridge)
            self.pid = self.shared.pid
            self._pidfd = _open_pidfd(self.pid)
            await self._answer_of_start()
            return
        from sluice.core.main_guard import check_main_guard

        check_main_guard("engine_core_process starts the engine core")
        self._dir = make_run_dir("sluice-core-")  # removes those a killed front end left behind
        bridge = BridgeAddress(f"ipc://{self._dir}/to-core", f"ipc://{self._dir}/to-front")
        self._bind(bridge)
        level = logging.getLogger("sluice").getEffectiveLevel()
        spec = CoreProcessSpec(self.args, self.max_model_len, [bridge], os.getpid(), level)
        # spawn, not fork: a forked CUDA context is unusable, and the front end's threads would be copied.
        # Not a daemon: a daemon may not start processes of its own (tensor-parallel workers).
        self.proc = mp.get_context("spawn").Process(
            target=run_core_process, args=(spec,), name="sluice-core", daemon=False
        )
        self.proc.start()
        self.pid = self.proc.pid
        self._finalizer = weakref.finalize(self, _kill, self.proc)  # dropped without close(): no orphan
        await self._answer_of_start()

    def _bind(self, bridge: BridgeAddress) -> None:
        """This front end's sockets; shared, the core binds ``to_core`` (see `CoreProcessSpec.core_binds`)."""
        self._ctx = zmq.Context()
        self._out = zmq_io.socket(self._ctx, zmq.PUSH, bridge.to_core, bind=self.shared is None)
        self._in = zmq_io.socket(self._ctx, zmq.PULL, bridge.to_front, bind=True)

    async def _answer_of_start(self) -> None:
        msg = await self._first_message()
        if isinstance(msg, wire.CoreFailed):
            raise wire.error_from_wire(msg.error)
        self.num_kv_blocks = msg.num_kv_blocks
        self.stats = msg.stats

    async def _core_ended(self) -> None:
        """Return once the core's process has ended."""
        if self.proc is not None:
            await anyio.wait_readable(self.proc.sentinel)
        elif self._pidfd is not None:
            await anyio.wait_readable(self._pidfd)
        else:  # no pidfd (not Linux): ask now and then
            while pid_alive(self.pid):
                await anyio.sleep(0.2)

    async def _first_message(self) -> wire.CoreReady | wire.CoreFailed:
        msg = None
        async with anyio.create_task_group() as tg:

            async def died() -> None:
                await self._core_ended()
                tg.cancel_scope.cancel()

            tg.start_soon(died)
            msg = wire.core_decoder.decode(await zmq_io.recv(self._in))
            tg.cancel_scope.cancel()
        if msg is None:  # its answer may still be in the socket
            try:
                msg = wire.core_decoder.decode(self._in.recv(zmq.NOBLOCK))
            except zmq.Again:
                raise EngineDeadError(f"the engine core process {self._exit_status()} while starting") from None
        return msg

    def _exit_status(self) -> str:
        if self.proc is None:
            return "exited"  # not this process's child: its owner knows (and logs) how
        self.proc.join(5.0)
        return exit_status(self.proc.exitcode)

    def close(self) -> None:
        """Stop the process (blocking: run it in a thread). It was told to stop by `run`; one that does not
        within `STOP_TIMEOUT_S`, or never started serving, is killed. A shared core is its owner's to stop."""
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None
        if self.proc is not None:
            self.proc.join(STOP_TIMEOUT_S if self.dead is None and self.num_kv_blocks else 0.0)
            _kill(self.proc)
            self._finalizer.detach()
        if self._ctx is not None:
            if self.shared is not None and self.dead is None:  # let ShutdownMsg out (nothing waited for the core)
                self._out.setsockopt(zmq.LINGER, 2000)
            for sock in (self._out, self._in):  # None: the start failed before it was made
                if sock is not None:
                    sock.close()
            self._ctx.term()
            self._ctx = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def dead_error(self) -> Exception | None:
        return self.dead or (None if self.stats.healthy else EngineDeadError("engine failed"))

    def health_error(self) -> Exception | None:
        return self.dead_error()

    # -- bridge --------------------------------------------------------------------------------------------
    async def run(self, inbox: ObjectReceiveStream) -> None:
        """Bridge until cancelled (the engine stops); then every request still open or queued is answered
        with `EngineStoppedError`, and the core is told to stop."""
        try:
            async with inbox:
                try:
                    async with anyio.create_task_group() as tg:
                        tg.start_soon(self._watch_death)
                        tg.start_soon(self._receive_steps)
                        await self._forward(inbox)
                except Exception as e:
                    # The bridge itself failed: its requests end as the engine's failure (engine_dead), not as
                    # a stop (server_shutting_down), which a client would retry elsewhere as a planned restart.
                    self._die(EngineDeadError(f"the engine's bridge to its core failed: {e!r}"))
                    raise
                finally:
                    refuse_queued(inbox, self.dead)  # a failed bridge's queue: engine_dead
        finally:
            # Shared, the core goes on serving the other front ends: what is still open here is aborted there.
            aborts = [wire.AbortMsg(self._prefix + rid) for rid in self._streams] if self.shared is not None else []
            self._end_all(EngineStoppedError("the engine stopped before the request finished"))
            try:
                zmq_io.send(self._out, wire.front_encoder.encode(wire.FrontBatch([*aborts, wire.ShutdownMsg()])))
            except zmq.ZMQError:
                pass  # already gone

    async def _forward(self, inbox: ObjectReceiveStream) -> None:
        """The engine's inbox to the core: everything queued at a wake-up goes as one message."""
        encode = wire.front_encoder.encode
        async for msg in inbox:
            batch = [msg]
            while True:
                try:
                    batch.append(inbox.receive_nowait())
                except (anyio.WouldBlock, anyio.EndOfStream):
                    break
            out, sent = [], []  # the wire messages, and what each was made of
            for m in batch:
                if isinstance(m, AddRequest):
                    refused = self.dead or self._closed
                    if refused is not None:
                        reply(m.events, refusal(m.requests[0].request_id, refused))
                        continue
                    ids = [r.request_id for r in m.requests]
                    for rid in ids:
                        self._streams[rid] = m.events
                    self._admitting[ids[0]] = ids
                elif isinstance(m, EndAllRequests):
                    self._closed = m.error
                    if self.shared is not None:  # this front end's requests only, not the other front ends'
                        aborts = [wire.AbortMsg(self._prefix + rid) for rid in self._streams]
                        out += aborts
                        sent += [None] * len(aborts)  # `_encodable` pairs each wire message with its source
                        self._end_all(m.error)
                        continue
                out.append(wire.front_to_wire(m, self._prefix))
                sent.append(m)
            if not out or self.dead is not None:
                continue
            try:
                data = encode(wire.FrontBatch(out))
            except Exception:  # noqa: BLE001 - whatever the codec raises fails the message that caused it only
                data = encode(wire.FrontBatch(self._encodable(out, sent)))
            try:
                zmq_io.send(self._out, data)
            except zmq.Again:
                # No peer: the core has gone, its death watch is about to say so.
                self._die(EngineDeadError("the engine core process is gone"))

    def _encodable(self, out: list, sent: list) -> list:
        """The messages of a batch that failed to encode, less those that cannot be: each of those ends its own
        request with `RequestFailedError` (the range rule at the edge should leave none; this keeps one request
        the codec cannot carry from stopping every other)."""
        keep = []
        for w, m in zip(out, sent, strict=True):
            try:
                wire.front_encoder.encode(w)
            except Exception as e:  # noqa: BLE001
                logger.exception("a message to the engine core could not be encoded: %s", type(m).__name__)
                if isinstance(m, AddRequest):
                    self._fail_unsent(m, e)
                continue
            keep.append(w)
        return keep

    def _fail_unsent(self, m: AddRequest, error: Exception) -> None:
        ids = [r.request_id for r in m.requests]
        for rid in ids:
            self._streams.pop(rid, None)
        self._admitting.pop(ids[0], None)
        failed = RequestFailedError(f"request {ids[0]} could not be sent to the engine core: {error!r}")
        reply(m.events, TokenEvent(ids[0], [], finish_reason="abort", error=failed))

    async def _receive_steps(self) -> None:
        decode = wire.core_decoder.decode
        from_wire = wire.event_from_wire
        cut = len(self._prefix)
        while True:
            msg = decode(await zmq_io.recv(self._in))
            if not isinstance(msg, wire.CoreStep):
                continue
            if self.dead is None:
                self.stats = msg.stats
            for rid in msg.admitted:  # before the events: a request's admission precedes its events
                self._admitted(rid[cut:])
            for w in msg.events:
                if cut:
                    w.request_id = w.request_id[cut:]
                self._route(from_wire(w))

    def _admitted(self, rid: str) -> None:
        self._admitting.pop(rid, None)
        stream = self._streams.get(rid)
        if stream is not None:
            reply(stream, Admitted(rid))

    def _route(self, ev: TokenEvent) -> None:
        rid = ev.request_id
        stream = self._streams.get(rid)
        if stream is None:
            return
        if ev.error is not None:
            family = self._admitting.pop(rid, None)
            if family is not None:  # refused: none of its sequences was added
                for x in family:
                    self._streams.pop(x, None)
        try:
            stream.send_nowait(ev)
        except _STREAM_GONE:
            pass  # the caller is gone; its Abort is on the way
        if ev.finish_reason is not None:
            self._streams.pop(rid, None)

    async def _watch_death(self) -> None:
        await self._core_ended()
        status = await anyio.to_thread.run_sync(self._exit_status)
        logger.error("the engine core process (pid %s) %s", self.pid, status)
        self._die(EngineDeadError(f"the engine core process {status}"))

    def _die(self, error: EngineDeadError) -> None:
        if self.dead is not None:
            return
        self.dead = error
        self.stats = replace(self.stats, healthy=False)
        self._end_all(error)

    def _end_all(self, error: Exception) -> None:
        streams, self._streams = self._streams, {}
        self._admitting.clear()
        for rid, stream in streams.items():
            reply(stream, refusal(rid, error))


def exit_status(code: int | None) -> str:
    """How a process ended, from its ``exitcode``: "exited with code 1", "was killed by SIGKILL"."""
    if code is not None and code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


def _kill(proc) -> None:
    if proc.is_alive():
        proc.kill()  # it ignores SIGTERM (see core/engine_core/process.py)
    proc.join(5.0)


def _open_pidfd(pid: int) -> int | None:
    """A file descriptor that turns readable when process ``pid`` ends (Linux 5.3+), or None where there is
    none. A process that has already ended (and been reaped) raises `EngineDeadError`."""
    if not hasattr(os, "pidfd_open"):
        return None
    try:
        return os.pidfd_open(pid)
    except ProcessLookupError:
        raise EngineDeadError("the engine core process exited before this front end started") from None
    except OSError:  # a kernel without pidfds
        return None
