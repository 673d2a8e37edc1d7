"""The engine inspector's recorder: per-step metadata (never tensors) in a bounded ring buffer, and snapshots
of the KV block pool, for the ``/inspect`` page (`app.inspector`) and for traces.

The `SchedulerActor` owns one only when ``EngineArgs.enable_inspector`` is on; with it off the actor's
``recorder`` is None and each hook in the loop costs one ``is not None`` test. Everything here runs on the
event loop between awaits (the executor's thread never touches the scheduler's state), so a record or a
snapshot is a consistent picture of one moment. `app.cache_sim` drives the same recorder with a virtual clock.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import anyio
from sluice.core.messages import TokenEvent
from sluice.core.request import Request
from sluice.core.sched.scheduler import Scheduler
from sluice.core.step import ModelOutput, SchedulerOutput

MAX_STEPS = 4096  # records kept for late viewers; older ones are dropped


@dataclass(slots=True)
class StepRequest:
    """One request's share of a step."""

    request_id: str
    kind: str  # "decode" (the last known token), or "prefill" (prompt tokens, or a recompute after preemption)
    num_tokens: int  # tokens computed, drafts excluded
    num_draft_tokens: int  # draft tokens verified
    num_accepted_tokens: int  # of those, accepted
    start_pos: int
    num_cached_tokens: int  # admitted this step: prompt tokens found in the prefix cache (not computed)
    num_output_tokens: int  # tokens this step emitted
    forks: list[str]  # n > 1: siblings that sampled their first token from this request's logits
    constrained: bool  # sampled under a grammar (structured outputs)


@dataclass(slots=True)
class StepRecord:
    step_id: int
    t: float  # step start, seconds since the recorder started
    duration_s: float  # schedule + forward + update
    token_budget: int
    num_tokens: int
    requests: list[StepRequest]
    preempted: list[str]
    num_preempted: int
    finished: dict[str, str]  # request id -> finish reason ("abort" included)
    # after the step: `Scheduler.counters()`, as `EngineStats` publishes them (cumulative counters)
    num_running: int
    num_waiting: int
    kv_blocks_free: int
    kv_blocks_total: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    spec_num_drafts: int
    spec_num_accepted_tokens: int
    ttft_s: list[float]  # arrival to first token, for requests whose first token came this step
    itl_s: list[float]  # time since the previous output, for requests that emitted again this step
    recorder_s: float  # cumulative wall time spent in this recorder (its cost)


@dataclass(slots=True)
class RequestRecord:
    """A caller request that ended, as a trace records it for `sluice cache-sim --trace` to replay: what it asked
    (its prompt's token ids, when, under which cache salt) and how long its reply was."""

    arrival_time: float  # seconds since the recorder started
    prompt_token_ids: list[int]
    output_len: int  # tokens its (first) sequence generated, at least 1
    cache_salt: str | None
    reply_token_ids: list[int]


@dataclass(slots=True)
class StepMark:
    t0: float
    running: set[str]
    num_preemptions: int


class StepRecorder:
    def __init__(
        self, scheduler: Scheduler, max_steps: int = MAX_STEPS, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.scheduler = scheduler
        self.steps: deque[StepRecord] = deque(maxlen=max_steps)
        self.clock = clock  # the clock of `Request.arrival_time`
        self.origin = clock()
        self.cost_s = 0.0
        self._arrival: dict[str, float] = {}
        self._prompt_len: dict[str, int] = {}
        self._last_output: dict[str, float] = {}
        self._reported: set[str] = set()  # finishes already recorded, until the scheduler reports them done
        self._new: anyio.Event | None = None
        # Requests that ended, for a trace (`keep_requests`); None: not kept (the /inspect page needs none).
        self.ended_requests: list[RequestRecord] | None = None
        self._open: dict[str, Request] = {}  # caller request id -> its first sequence, while it runs

    def keep_requests(self) -> None:
        """From now on, collect a `RequestRecord` of every caller request that ends, for `take_ended_requests`."""
        if self.ended_requests is None:
            self.ended_requests = []

    def take_ended_requests(self) -> list[RequestRecord]:
        """The requests that ended since the last call, oldest first."""
        out = self.ended_requests or []
        if self.ended_requests is not None:
            self.ended_requests = []
        return out

    # -- hooks (the scheduler actor's loop) --------------------------------------------------------------
    def admitted(self, requests: Sequence[Request]) -> None:
        """``requests``: the n sequences of one caller request (``id``, or ``id#0`` .. ``id#{n-1}``)."""
        for r in requests:
            self._arrival[r.request_id] = r.arrival_time
            self._prompt_len[r.request_id] = r.num_prompt_tokens
        if self.ended_requests is not None:
            self._open[requests[0].request_id] = requests[0]

    def _ended(self, rid: str) -> None:
        """A sequence ended: a caller request's first sequence stands for it in the trace (n > 1 replays as 1)."""
        req = self._open.pop(rid, None)
        if req is not None and req.num_cached_tokens >= 0:  # never admitted (aborted while waiting): nothing ran
            out = list(req.output_token_ids)
            self.ended_requests.append(
                RequestRecord(
                    req.arrival_time - self.origin, list(req.prompt_token_ids), max(len(out), 1), req.cache_salt, out
                )
            )

    def begin(self) -> StepMark:
        """Before ``schedule()``: what the step's record compares against."""
        c = time.perf_counter()
        s = self.scheduler
        mark = StepMark(self.clock(), {r.request_id for r in s.running}, s.num_preemptions)
        self.cost_s += time.perf_counter() - c
        return mark

    def record(self, mark: StepMark, so: SchedulerOutput, out: ModelOutput, events: list[TokenEvent]) -> StepRecord:
        """After ``update_from_output``: one record of the step, appended to the ring buffer."""
        c = time.perf_counter()
        s = self.scheduler
        now = self.clock()
        emitted = {ev.request_id: ev for ev in events}
        spec = out.spec_token_ids or {}
        running = mark.running
        requests = s.requests
        reqs = []
        # Positional arguments, in field order: this loop runs for every request of every step.
        for rid, q, start, sample in zip(so.req_ids, so.num_scheduled_tokens, so.num_computed_tokens, so.samples):
            nd = so.num_draft_tokens.get(rid, 0)
            n = q - nd
            ev = emitted.get(rid)
            decode = n == 1 and sample and start >= self._prompt_len.get(rid, 0)
            reqs.append(
                StepRequest(
                    rid,
                    "decode" if decode else "prefill",
                    n,
                    nd,
                    len(spec[rid]) - 1 if nd and rid in spec else 0,
                    start,
                    0 if rid in running else start,
                    len(ev.token_ids) if ev is not None else 0,
                    so.forks.get(rid, []),
                    _constrained(requests.get(rid)),
                )
            )
        ttft, itl = [], []
        finished: dict[str, str] = {}
        for ev in events:
            rid = ev.request_id
            if ev.token_ids:
                last = self._last_output.get(rid)
                if last is not None:
                    itl.append(now - last)
                elif rid in self._arrival:
                    ttft.append(now - self._arrival[rid])
                self._last_output[rid] = now
            if ev.finish_reason is not None:
                finished[rid] = ev.finish_reason
                self._reported.add(rid)
                self._forget(rid)
        for rid in so.finished_request_ids:  # everything that ended before this step; aborts are news
            if rid in self._reported:
                self._reported.discard(rid)
            else:
                finished[rid] = "abort"
                self._forget(rid)
        num_preempted = s.num_preemptions - mark.num_preemptions
        # A request preempted this step went back to waiting (one re-admitted within the step is only counted).
        preempted = [r.request_id for r in s.waiting if r.request_id in mark.running] if num_preempted else []
        rec = StepRecord(
            step_id=so.step_id,
            t=mark.t0 - self.origin,
            duration_s=now - mark.t0,
            token_budget=s.config.max_num_batched_tokens,
            num_tokens=so.num_tokens,
            requests=reqs,
            preempted=preempted,
            num_preempted=num_preempted,
            finished=finished,
            **s.counters(),
            ttft_s=ttft,
            itl_s=itl,
            recorder_s=0.0,
        )
        self.steps.append(rec)
        if self._new is not None:
            self._new.set()
            self._new = None
        self.cost_s += time.perf_counter() - c
        rec.recorder_s = self.cost_s
        return rec

    def _forget(self, rid: str) -> None:
        self._arrival.pop(rid, None)
        self._prompt_len.pop(rid, None)
        self._last_output.pop(rid, None)
        if self._open:
            self._ended(rid)

    # -- readers (the server) ----------------------------------------------------------------------------
    def since(self, step_id: int) -> list[StepRecord]:
        """The buffered records after ``step_id``, oldest first (ids increase; a step that scheduled nothing
        has no record, so they may skip)."""
        out = []
        for rec in reversed(self.steps):
            if rec.step_id <= step_id:
                break
            out.append(rec)
        out.reverse()
        return out

    async def wait(self, step_id: int) -> None:
        """Return once a record after ``step_id`` exists."""
        while not self.steps or self.steps[-1].step_id <= step_id:
            if self._new is None:
                self._new = anyio.Event()
            await self._new.wait()

    def kv_snapshot(self) -> dict:
        """The block pool now, JSON-ready. Per physical block (indexed by block id): ``ref_cnt``, ``cached``
        (holds a prefix-cache hash), ``owners`` (the running requests whose block table points at it; only
        referenced blocks are listed); a block is free when its ``ref_cnt`` is 0. ``requests``: each running
        request's block table (logical block i -> physical block) and token counts."""
        s, kv = self.scheduler, self.scheduler.kv
        owners: dict[int, list[str]] = {}
        requests = {}
        for req in s.running:
            table = kv.block_table(req.request_id)
            for b in table:
                owners.setdefault(b, []).append(req.request_id)
            requests[req.request_id] = {
                "block_table": table,
                "num_prompt_tokens": req.num_prompt_tokens,
                "num_tokens": req.num_tokens,
                "num_computed_tokens": req.num_computed_tokens,
                "num_cached_tokens": max(req.num_cached_tokens, 0),
            }
        blocks = kv.pool.blocks
        return {
            "step_id": s.step_id,
            "block_size": kv.block_size,
            "num_blocks": kv.num_blocks,
            "num_free_blocks": kv.num_free_blocks,
            "ref_cnt": [b.ref_cnt for b in blocks],
            "cached": [b.block_hash is not None for b in blocks],
            "owners": {str(b): rids for b, rids in sorted(owners.items())},
            "requests": requests,
        }


def _constrained(req) -> bool:
    """Whether a request (None: ended within the step) samples under a grammar."""
    return req is not None and req.sampling_params.structured_outputs is not None
