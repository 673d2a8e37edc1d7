"""SchedulerActor: the loop around `Scheduler` that moves messages in and out.

Two tasks share the actor's state (cooperatively, on one thread): the inbox task admits and aborts
requests at once, even while a step runs; the step loop sends one `SchedulerOutput` at a time to the
executor and routes the resulting `TokenEvent`s to each request's own stream.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import anyio
from anyio.abc import ObjectReceiveStream, ObjectSendStream
from sluice.core.culprit import isolate_culprits
from sluice.core.errors import EngineDeadError, EngineOverloaded, EngineStoppedError
from sluice.core.inspector import StepRecorder
from sluice.core.request import AbortRequest, AddRequest, EndAllRequests, Request, TokenEvent
from sluice.core.scheduler import Scheduler
from sluice.core.step import ModelOutput, SchedulerOutput

logger = logging.getLogger("sluice")


@dataclass(slots=True, frozen=True)
class EngineStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_total: int = 0
    kv_blocks_free: int = 0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0  # tokens
    prefix_cache_hits: int = 0  # tokens
    num_steps: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    healthy: bool = True
    # speculative decoding (mean acceptance length = 1 + accepted / drafts)
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_position: tuple[int, ...] = ()

    @property
    def kv_cache_usage(self) -> float:
        return 1.0 - self.kv_blocks_free / self.kv_blocks_total if self.kv_blocks_total else 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    @property
    def spec_mean_acceptance_length(self) -> float:
        """Tokens per verification step: the accepted drafts plus the one the target always adds."""
        return 1.0 + self.spec_num_accepted_tokens / self.spec_num_drafts if self.spec_num_drafts else 0.0


class SchedulerActor:
    def __init__(self, scheduler: Scheduler, inspector: bool = False) -> None:
        self.scheduler = scheduler
        # Step records for the inspector page; None (off) costs the step loop one test per hook.
        self.recorder: StepRecorder | None = StepRecorder(scheduler) if inspector else None
        self.streams: dict[str, ObjectSendStream[TokenEvent]] = {}
        self.held: dict[str, TokenEvent] = {}  # final-only sequences: their tokens so far
        self._wakeup = anyio.Event()
        self.dead: Exception | None = None
        self.closed: Exception | None = None  # set by EndAllRequests: every new request is refused with it
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.stats = EngineStats()
        self._publish()

    def _publish(self) -> None:
        s = self.scheduler
        self.stats = EngineStats(
            **s.counters(),
            num_steps=s.step_id,
            prompt_tokens=self.prompt_tokens,
            generation_tokens=self.generation_tokens,
            healthy=self.dead is None,
            spec_num_draft_tokens=s.spec_stats.num_draft_tokens,
            spec_accepted_per_position=tuple(s.spec_stats.accepted_per_position),
        )

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
        finally:
            self._end_all(EngineStoppedError("the engine stopped before the request finished"))

    def _end_all(self, error: Exception) -> None:
        """The engine stops: every open request ends with ``error``, so no caller waits for tokens forever."""
        for rid in list(self.streams):
            self.scheduler.abort(rid)
            self._deliver(TokenEvent(rid, [], finish_reason="abort", error=error))
        self.held.clear()
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
                self._refuse_queued(inbox)

    def _refuse_queued(self, inbox: ObjectReceiveStream[AddRequest | AbortRequest]) -> None:
        """The inbox closes: requests still queued in it are answered (refused), not dropped unanswered.
        Later senders find it closed."""
        while True:
            try:
                msg = inbox.receive_nowait()
            except (anyio.WouldBlock, anyio.EndOfStream, anyio.ClosedResourceError):
                return
            if isinstance(msg, AddRequest):
                error = EngineStoppedError("the engine stopped before the request was admitted")
                self._reply(msg.events, TokenEvent(msg.requests[0].request_id, [], finish_reason="abort", error=error))

    def _handle(self, msg: AddRequest | AbortRequest | EndAllRequests) -> None:
        if isinstance(msg, AddRequest):
            self._add(msg)
        elif isinstance(msg, AbortRequest):
            self._abort(msg.request_id)
        else:
            self.closed = msg.error
            self._end_all(msg.error)

    def _add(self, msg: AddRequest) -> None:
        s = self.scheduler
        if self.closed is not None:
            rid = msg.requests[0].request_id
            self._reply(msg.events, TokenEvent(rid, [], finish_reason="abort", error=self.closed))
            return
        if self.dead is not None:
            self._reply(
                msg.events,
                TokenEvent(
                    msg.requests[0].request_id,
                    [],
                    finish_reason="abort",
                    error=EngineDeadError(f"engine is dead: {self.dead}"),
                ),
            )
            return
        if len(s.waiting) + len(msg.requests) > s.config.max_waiting_requests:
            self._reply(
                msg.events,
                TokenEvent(
                    msg.requests[0].request_id,
                    [],
                    finish_reason="abort",
                    error=EngineOverloaded(
                        f"engine overloaded: {len(s.waiting)} requests waiting (max_waiting_requests="
                        f"{s.config.max_waiting_requests})"
                    ),
                ),
            )
            return
        if not self._reply(msg.events, TokenEvent(msg.requests[0].request_id, [])):  # admitted
            return  # the caller was cancelled before admission: nobody would ever abort its requests
        for req in msg.requests:
            self.streams[req.request_id] = msg.events
            if msg.final_only:
                self.held[req.request_id] = TokenEvent(req.request_id, [])
            self.prompt_tokens += req.num_prompt_tokens
        if self.recorder is not None:
            self.recorder.admitted(msg.requests)
        s.add_request(msg.requests[0], msg.requests[1:])  # n > 1: one prefill, then forks
        self._wakeup.set()

    @staticmethod
    def _reply(events: ObjectSendStream[TokenEvent], ev: TokenEvent) -> bool:
        try:
            events.send_nowait(ev)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            return False
        return True

    def _abort(self, request_id: str) -> None:
        """Abort a request; a caller's id also reaches its n > 1 sequences (``id#i``)."""
        family = [rid for rid in self.streams if rid.startswith(request_id + "#")]
        for rid in (request_id, *family):
            if self.scheduler.abort(rid) is not None:
                self._deliver(TokenEvent(rid, [], finish_reason="abort"))

    def _deliver(self, ev: TokenEvent) -> None:
        stream = self.streams.get(ev.request_id)
        if stream is None:
            return
        held = self.held.get(ev.request_id)
        if held is not None:
            held.token_ids += ev.token_ids
            if ev.logprobs is not None:
                held.logprobs = held.logprobs or []  # the held event's own list: extended, not copied per token
                held.logprobs.extend(ev.logprobs)
            held.num_cached_tokens = max(held.num_cached_tokens, ev.num_cached_tokens)
            if ev.finish_reason is None and ev.error is None:
                return
            del self.held[ev.request_id]
            held.finish_reason, held.stop_reason, held.error = ev.finish_reason, ev.stop_reason, ev.error
            ev = held
        try:
            stream.send_nowait(ev)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, anyio.WouldBlock):
            pass  # the caller is gone; its Abort is on the way
        if ev.finish_reason is not None:
            del self.streams[ev.request_id]

    # -- steps -------------------------------------------------------------------------------------
    async def _step_loop(self, steps: ObjectSendStream[SchedulerOutput], results: ObjectReceiveStream[ModelOutput]):
        s = self.scheduler
        # A step's events are delivered only after the next step has been sent: delivering wakes every
        # request actor (detokenizing, building outputs), and the executor should start first, so that
        # work overlaps the GPU instead of delaying it.
        pending: list[TokenEvent] = []
        rec = self.recorder
        async with steps, results:
            while True:
                if not s.has_work() or self.dead is not None:
                    pending = self._deliver_all(pending)
                    self._publish()
                    await self._wakeup.wait()
                    self._wakeup = anyio.Event()
                    continue
                if rec is not None:
                    mark = rec.begin()
                so = s.schedule()
                if not so.requests:
                    pending = self._deliver_all(pending)
                    self._fail_unschedulable()
                    continue
                await steps.send(so)
                pending = self._deliver_all(pending)
                out = await results.receive()
                if out.error is not None and not out.fatal and len(so.requests) > 1:
                    so, out, pending = await self._fail_culprits_only(so, out, steps, results)
                else:
                    pending = s.update_from_output(so, out)
                if rec is not None:
                    rec.record(mark, so, out, pending)
                if out.fatal:
                    pending = self._deliver_all(pending)
                    self._die(out.error)
                self._publish()

    async def _fail_culprits_only(
        self, so: SchedulerOutput, out: ModelOutput, steps: ObjectSendStream, results: ObjectReceiveStream
    ) -> tuple[SchedulerOutput, ModelOutput, list[TokenEvent]]:
        """A failed step: re-run its requests to find the ones that fail it (`core.culprit`) and fail only those.
        Returns what ran (for the recorder), its output, and the events."""

        async def run(sub: SchedulerOutput) -> ModelOutput:
            await steps.send(sub)
            return await results.receive()

        ran, merged, culprits = await isolate_culprits(so, out, run)
        events = self.scheduler.update_from_output(ran, merged)
        for sr, error in culprits:
            logger.warning("step %d: request %s failed it alone; the others go on", so.step_id, sr.request_id)
            events += self.scheduler.update_from_output(
                SchedulerOutput(so.step_id, [sr]), ModelOutput(so.step_id, {}, error=error)
            )
        return ran, merged, events

    def _deliver_all(self, events: list[TokenEvent]) -> list[TokenEvent]:
        for ev in events:
            self.generation_tokens += len(ev.token_ids)
            self._deliver(ev)
        return []

    def _fail_unschedulable(self) -> None:
        """Nothing fits although the pool is as free as it gets: the head request can never run."""
        s = self.scheduler
        if s.running or not s.waiting:
            return
        req: Request = s.waiting[0]
        s.abort(req.request_id)
        self._deliver(
            TokenEvent(
                req.request_id,
                [],
                finish_reason="abort",
                error=RuntimeError(
                    f"request {req.request_id} needs more KV blocks than the pool has ({s.kv.num_blocks})"
                ),
            )
        )

    def _die(self, error: Exception | None) -> None:
        self.dead = error or RuntimeError("engine failed")
        logger.error("engine is dead: %s", self.dead)
        for rid in list(self.scheduler.requests):
            self.scheduler.abort(rid)
            self._deliver(
                TokenEvent(rid, [], finish_reason="abort", error=EngineDeadError(f"engine failed: {self.dead}"))
            )
