"""SchedulerActor: the loop around `Scheduler` that moves messages in and out.

Two tasks share the actor's state (cooperatively, on one thread): the inbox task admits and aborts
requests at once, even while a step runs; the step loop sends steps to the executor and routes the
resulting `TokenEvent`s to each request's own stream.

With asynchronous scheduling the loop keeps two steps in flight: it schedules and sends step N+1 before it
waits for step N's output, so the executor launches N+1 while the device still runs N, and the host's work
on N's tokens (updating, delivering) overlaps N+1 on the device. Steps that speculate, and every step when
the switch is off, go one at a time (`Scheduler.needs_sync`).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable

import anyio
from anyio.abc import ObjectReceiveStream, ObjectSendStream
from sluice.core.engine_core.inspector import StepRecorder
from sluice.core.errors import EngineDeadError, EngineOverloaded, EngineStoppedError
from sluice.core.host_profile import HostProfile
from sluice.core.ipc.kv_event_publisher import KVEventPublisher
from sluice.core.messages import (
    AbortRequest,
    AddRequest,
    Admitted,
    EndAllRequests,
    TokenEvent,
    refusal,
    refuse_queued,
    reply,
)
from sluice.core.request import Request
from sluice.core.request_ids import sequence_prefix
from sluice.core.sched.disagg import KVOp
from sluice.core.sched.scheduler import Scheduler
from sluice.core.stats import EngineStats
from sluice.core.step import FLUSH, ModelOutput, SchedulerOutput

logger = logging.getLogger("sluice")


class SchedulerActor:
    def __init__(
        self, scheduler: Scheduler, inspector: bool = False, kv_events: KVEventPublisher | None = None
    ) -> None:
        self.scheduler = scheduler
        # KV events: the prefix cache's changes, sent at every publish (after each step, each inbox batch)
        self.kv_events = kv_events
        # Step records for the inspector page; None (off) costs the step loop one test per hook.
        self.recorder: StepRecorder | None = StepRecorder(scheduler) if inspector else None
        self.streams: dict[str, ObjectSendStream[TokenEvent]] = {}
        self.profile = HostProfile()  # schedule, update, deliver
        self._wakeup = anyio.Event()
        self.dead: Exception | None = None
        self.closed: Exception | None = None  # set by EndAllRequests: every new request is refused with it
        self.prompt_tokens = 0
        self.structured_requests = 0  # sequences admitted under a grammar
        self.grammar_mask_seconds = 0.0  # the executor's host time on grammar masks, and the steps that had any
        self.grammar_mask_steps = 0
        self.stats = EngineStats()
        # Called after every publish: a core in its own process sends the new counters to the front end.
        self.on_publish: Callable[[], None] | None = None
        self._publish()

    def _publish(self) -> None:
        s = self.scheduler
        self.stats = EngineStats(
            **s.counters(),
            num_steps=s.step_id,
            prompt_tokens=self.prompt_tokens,
            generation_tokens=s.num_generation_tokens,
            healthy=self.dead is None,
            spec_num_draft_tokens=s.spec_stats.num_draft_tokens,
            spec_accepted_per_position=tuple(s.spec_stats.accepted_per_position),
            structured_requests=self.structured_requests,
            grammar_mask_seconds=self.grammar_mask_seconds,
            grammar_mask_steps=self.grammar_mask_steps,
        )
        if self.on_publish is not None:
            self.on_publish()
        if self.kv_events is not None:
            self.kv_events.flush()

    async def run(
        self,
        inbox: ObjectReceiveStream[AddRequest | AbortRequest],
        steps: ObjectSendStream[SchedulerOutput],
        results: ObjectReceiveStream[ModelOutput],
    ) -> None:
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._inbox_loop, inbox)
                await self._step_loop(steps, results)
                tg.cancel_scope.cancel()
        except Exception as e:  # a failure, not a stop: its requests end with EngineDeadError (engine_dead)
            self.dead = e
            self._end_all(EngineDeadError(f"the engine failed: {e!r}"))
            raise
        finally:
            self._end_all(EngineStoppedError("the engine stopped before the request finished"))

    def _end_all(self, error: Exception) -> None:
        """The engine stops: every open request ends with ``error``, so no caller waits for tokens forever."""
        for rid in list(self.streams):
            self.scheduler.abort(rid)
            self._deliver(refusal(rid, error))
        self._publish()

    # -- inbox -------------------------------------------------------------------------------------
    async def _inbox_loop(self, inbox: ObjectReceiveStream[AddRequest | AbortRequest]) -> None:
        async with inbox:
            try:
                async for msg in inbox:
                    self._handle(msg)
                    # Take everything already queued before yielding: requests submitted together then reach
                    # the scheduler (woken by the first) together, and share their first step.
                    while True:
                        try:
                            msg = inbox.receive_nowait()
                        except (anyio.WouldBlock, anyio.EndOfStream):
                            break
                        self._handle(msg)
                    self._publish()
            finally:
                refuse_queued(inbox)

    def _handle(self, msg: AddRequest | AbortRequest | EndAllRequests) -> None:
        if isinstance(msg, AddRequest):
            self._add(msg)
        elif isinstance(msg, AbortRequest):
            self._abort(msg.request_id)
        elif isinstance(msg, KVOp):  # prefill/decode disaggregation: a block hand-over (core/sched/disagg.py)
            msg.answer(self.scheduler.kv_op(msg))
        else:
            self.closed = msg.error
            self._end_all(msg.error)

    def _add(self, msg: AddRequest) -> None:
        rid = msg.requests[0].request_id
        refused = self._refusal(len(msg.requests))
        if refused is not None:
            reply(msg.events, refusal(rid, refused))
            return
        if not reply(msg.events, Admitted(rid)):
            return  # the caller was cancelled before admission: nobody would ever abort its requests
        for req in msg.requests:
            self.streams[req.request_id] = msg.events
            req.final_only = msg.final_only
            self.prompt_tokens += req.num_prompt_tokens
            self.structured_requests += req.sampling_params.structured_outputs is not None
        if self.recorder is not None:
            self.recorder.admitted(msg.requests)
        self.scheduler.add_request(msg.requests[0], msg.requests[1:])  # n > 1: one prefill, then forks
        self._wakeup.set()

    def _refusal(self, num_seqs: int) -> Exception | None:
        """Why a request of ``num_seqs`` sequences cannot be added now (None: it can)."""
        if self.closed is not None:
            return self.closed
        if self.dead is not None:
            return EngineDeadError(f"engine is dead: {self.dead}")
        s = self.scheduler
        if len(s.waiting) + num_seqs > s.config.max_waiting_requests:
            return EngineOverloaded(
                f"engine overloaded: {len(s.waiting)} requests waiting (max_waiting_requests="
                f"{s.config.max_waiting_requests})"
            )
        return None

    def _abort(self, request_id: str) -> None:
        """Abort a request; a caller's id also reaches its n > 1 sequences (`sequence_prefix`)."""
        prefix = sequence_prefix(request_id)
        family = [rid for rid in self.streams if rid.startswith(prefix)]
        for rid in (request_id, *family):
            req = self.scheduler.abort(rid)
            if req is not None:
                self._deliver(self.scheduler.final_event(req, "abort"))

    def _deliver(self, ev: TokenEvent) -> None:
        stream = self.streams.get(ev.request_id)
        if stream is None:
            return
        try:
            stream.send_nowait(ev)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, anyio.WouldBlock):
            pass  # the caller is gone; its Abort is on the way
        if ev.finish_reason is not None:
            del self.streams[ev.request_id]

    # -- steps ---------------------------------------------------------------------------------------
    async def _step_loop(
        self, steps: ObjectSendStream[SchedulerOutput | str], results: ObjectReceiveStream[ModelOutput]
    ):
        s = self.scheduler
        rec = self.recorder
        prof = self.profile
        overlap = s.config.async_scheduling
        inflight: deque[tuple[SchedulerOutput, object]] = deque()  # steps sent, with their inspector marks
        async with steps, results:
            while True:
                if self.dead is not None:
                    inflight.clear()
                    self._publish()
                    await self._wakeup.wait()
                    self._wakeup = anyio.Event()
                    continue
                # Launch what may run now: one step at a time, or a second behind the one in flight.
                if s.has_work() and (not inflight or (overlap and len(inflight) < 2 and not s.needs_sync())):
                    mark = rec.begin() if rec is not None else None
                    t0 = time.perf_counter()
                    so = s.schedule()
                    prof.schedule += time.perf_counter() - t0
                    if so.req_ids:
                        # alone, and the next step needs its tokens: the executor answers it at once
                        so.sync = not inflight and (not overlap or s.needs_sync())
                        await steps.send(so)
                        inflight.append((so, mark))
                        if not so.sync and len(inflight) < 2:
                            continue  # the executor sends this step's output when the next one arrives
                    elif not inflight:
                        self._fail_unschedulable()
                        continue
                    else:
                        await steps.send(FLUSH)  # nothing can run before the step in flight's tokens
                elif inflight:
                    await steps.send(FLUSH)
                else:
                    self._publish()
                    await self._wakeup.wait()
                    self._wakeup = anyio.Event()
                    continue
                out = await results.receive()
                so, mark = inflight.popleft()
                t0 = time.perf_counter()
                events = s.update_from_output(so, out)
                t1 = time.perf_counter()
                self._deliver_all(events)
                prof.deliver += time.perf_counter() - t1
                prof.update += t1 - t0
                prof.steps += 1
                if out.grammar_mask_s:
                    self.grammar_mask_seconds += out.grammar_mask_s
                    self.grammar_mask_steps += 1
                if rec is not None:
                    rec.record(mark, so, out, events)
                if out.fatal:
                    self._die(out.error)
                self._publish()

    def _deliver_all(self, events: list[TokenEvent]) -> None:
        for ev in events:
            self._deliver(ev)

    def _fail_unschedulable(self) -> None:
        """Nothing fits although the pool is as free as it gets: the head request can never run."""
        s = self.scheduler
        if s.running or not s.waiting:
            return
        req: Request = s.waiting[0]
        s.abort(req.request_id)
        error = RuntimeError(f"request {req.request_id} needs more KV blocks than the pool has ({s.kv.num_blocks})")
        self._deliver(s.final_event(req, "abort", error=error))

    def _die(self, error: Exception | None) -> None:
        self.dead = error or RuntimeError("engine failed")
        logger.error("engine is dead: %s", self.dead)
        for rid in list(self.scheduler.requests):
            req = self.scheduler.abort(rid)
            self._deliver(
                self.scheduler.final_event(req, "abort", error=EngineDeadError(f"engine failed: {self.dead}"))
            )
