"""The scheduler's one rule, as plain code: every request's ``num_computed_tokens`` catches up to its
``num_tokens``, within a per-step token budget and a cap on sequences.

Running requests are served first (a decode is one token; a request still mid-prefill continues its
chunk), then waiting ones take what is left of the budget, their prompts cut into chunks when they
do not fit (chunked prefill). Prefill and decode tokens share one flattened batch. When the KV pool
runs dry, the newest running request is preempted: its blocks are freed and it goes back to the
front of the waiting queue, to be recomputed later (its prefix may still be cached).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from core.outputs import TokenLogprob
from core.request import Request, RequestStatus, TokenEvent
from core.sampling_params import SamplingParams
from kv.manager import KVCacheManager


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of a step: compute ``token_ids`` at positions ``start_pos...``."""

    request_id: str
    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    sample: bool  # this chunk reaches the last known token: sample the next one
    sampling_params: SamplingParams | None = None
    num_output_tokens: int = 0
    eos_token_ids: tuple[int, ...] = ()
    # only when the request uses penalties (copies, so nothing mutable crosses actors)
    output_token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None


@dataclass(slots=True)
class SchedulerOutput:
    step_id: int
    requests: list[ScheduledRequest]
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write, before attention
    finished_request_ids: list[str] = field(default_factory=list)  # the executor drops their state

    @property
    def num_tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.requests)


@dataclass(slots=True)
class ModelOutput:
    """Executor -> scheduler: the token sampled for each scheduled request with ``sample=True``."""

    step_id: int
    sampled: dict[str, int]
    logprobs: dict[str, TokenLogprob] | None = None
    error: Exception | None = None
    fatal: bool = False


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    max_waiting_requests: int


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.step_id = 0
        self.num_preemptions = 0
        self._finished_ids: list[str] = []

    # -- intake ------------------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def abort(self, request_id: str) -> Request | None:
        req = self.requests.get(request_id)
        if req is None:
            return None
        self._finish(req)
        return req

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # -- one step ----------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        copies: list[tuple[int, int]] = []
        # 1. running requests, oldest first
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if n <= 0:
                i += 1
                continue
            while True:
                got = self.kv.allocate_slots(req, n)
                if got is not None:
                    break
                victim = self.running[-1]
                self._preempt(victim)
                if victim is req:
                    break
            if got is None:
                break  # req itself was preempted: nothing after it is left either
            copies.extend(got)
            scheduled.append(self._scheduled(req, n))
            budget -= n
            i += 1
        # 2. waiting requests, in arrival order (preempted ones were put back at the front)
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            hit_blocks, num_hit = self.kv.get_computed_blocks(req)
            n = min(req.num_tokens - num_hit, budget)
            got = self.kv.allocate_slots(req, n, hit_blocks)
            if got is None:
                break
            self.waiting.popleft()
            copies.extend(got)
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = num_hit
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_hit
            self.running.append(req)
            scheduled.append(self._scheduled(req, n))
            budget -= n
        self.step_id += 1
        finished, self._finished_ids = self._finished_ids, []
        return SchedulerOutput(self.step_id, scheduled, copies, finished)

    def _scheduled(self, req: Request, n: int) -> ScheduledRequest:
        start = req.num_computed_tokens
        sample = start + n == req.num_tokens
        sp = req.sampling_params
        penalties = sp.presence_penalty != 0 or sp.frequency_penalty != 0 or sp.repetition_penalty != 1
        req.num_computed_tokens += n  # optimistic: the executor computes them this step
        return ScheduledRequest(
            request_id=req.request_id,
            token_ids=req.all_token_ids[start : start + n],
            start_pos=start,
            block_table=self.kv.block_table(req.request_id),
            sample=sample,
            sampling_params=sp if sample else None,
            num_output_tokens=req.num_output_tokens,
            eos_token_ids=req.eos_token_ids,
            output_token_ids=list(req.output_token_ids) if sample and penalties else None,
            prompt_token_ids=list(req.prompt_token_ids) if sample and sp.repetition_penalty != 1 else None,
        )

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req.request_id)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    # -- results -----------------------------------------------------------------------------------
    def update_from_output(self, so: SchedulerOutput, out: ModelOutput) -> list[TokenEvent]:
        events: list[TokenEvent] = []
        if out.error is not None:
            for sr in so.requests:
                req = self.requests.get(sr.request_id)
                if req is not None:
                    self._finish(req)
                    events.append(TokenEvent(sr.request_id, [], finish_reason="abort", error=out.error))
            return events
        for sr in so.requests:
            req = self.requests.get(sr.request_id)
            if req is None or req.status is not RequestStatus.RUNNING:
                continue  # aborted while the step ran
            self.kv.cache_blocks(req, req.num_computed_tokens)
            token = out.sampled.get(sr.request_id)
            if token is None:
                continue  # a prefill chunk that does not reach the end yet
            req.append_output(token)
            reason, stop_reason = self._check_stop(req, token)
            lp = out.logprobs.get(sr.request_id) if out.logprobs else None
            events.append(
                TokenEvent(
                    req.request_id,
                    [token],
                    logprobs=[lp] if lp is not None else None,
                    finish_reason=reason,
                    stop_reason=stop_reason,
                    num_cached_tokens=max(req.num_cached_tokens, 0),
                )
            )
            if reason is not None:
                self._finish(req)
        return events

    def _check_stop(self, req: Request, token: int) -> tuple[str | None, int | None]:
        sp = req.sampling_params
        if req.num_output_tokens >= sp.min_tokens:
            if not sp.ignore_eos and token in req.eos_token_ids:
                return "stop", token
            if token in sp.stop_token_ids:
                return "stop", token
        if req.num_output_tokens >= req.max_tokens or req.num_tokens >= self.config.max_model_len:
            return "length", None
        return None, None

    def _finish(self, req: Request) -> None:
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status is RequestStatus.WAITING:
            self.waiting.remove(req)
        req.status = RequestStatus.FINISHED
        self.kv.free(req.request_id)
        self.requests.pop(req.request_id, None)
        self._finished_ids.append(req.request_id)
