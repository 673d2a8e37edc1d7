"""The replay behind `sluice cache-sim`: a workload through the engine's own `Scheduler` and `KVCacheManager` on a
virtual clock (see `cache_sim.py` for what is real and what is made up); `cache_sim_replicas.py` runs several."""

from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass, field

from sluice.app.bench.workloads import Workload
from sluice.core.errors import InvalidRequestError
from sluice.core.frontend.request_actor import RequestLimits, make_requests
from sluice.core.request import Request
from sluice.core.sampling_params import SamplingParams
from sluice.core.sched.scheduler import Scheduler, SchedulerConfig
from sluice.core.step import ModelOutput
from sluice.kv.manager import KVCacheManager

FILLER_TOKEN = 0  # what the fake model "generates": only identical prompts then share output blocks


@dataclass(slots=True)
class SimConfig:
    """The engine settings that shape scheduling (the same names as `EngineArgs`)."""

    num_kv_blocks: int
    block_size: int = 16
    enable_prefix_caching: bool = True
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_model_len: int = 8192
    max_concurrency: int | None = None  # requests in flight at once (None: no limit)
    recorded_replies: bool = False
    step_s: float = 0.02  # virtual cost of one step ...
    token_s: float = 0.0005  # ... plus this per token in it


@dataclass(slots=True)
class TenantResult:
    """One tenant's (``cache_salt``'s; "" for none) share of a replay."""

    num_requests: int = 0
    num_rejected: int = 0
    prompt_tokens: int = 0  # every request's, the rejected ones' included
    hit_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass(slots=True)
class SimResult:
    block_size: int
    num_kv_blocks: int
    pool_tokens: int
    prefix_cache_queries: int  # the engine's counters: prompt tokens of admitted requests ...
    prefix_cache_hits: int  # ... and of them, found in the cache
    # hits over every request's prompt tokens: a request the pool cannot hold (refused, as the engine would)
    # counts as all misses, so a pool too small never reads better than a larger one
    hit_rate: float
    num_requests: int
    num_finished: int
    num_rejected: int
    rejected_prompt_tokens: int
    num_preemptions: int
    num_steps: int
    computed_tokens: int  # prompt and output tokens the (fake) model computed
    virtual_s: float
    wall_s: float
    tenants: dict[str, TenantResult] = field(default_factory=dict)
    best_hit_rate: float | None = None  # the same block size with a pool that never evicts (`sweep` fills it)


def simulate(workload: Workload, cfg: SimConfig, trace: str | None = None, model: str = "") -> SimResult:
    """Replay ``workload`` through a fresh `Scheduler` + `KVCacheManager` configured by ``cfg``; with ``trace``,
    write the inspector's step records (on the virtual clock) and final KV snapshot there."""
    t0 = time.perf_counter()
    replay = Replay(workload, cfg)
    if trace is not None:
        replay.trace_to(trace, model)
    while True:
        replay.admit_ready()
        if not replay.sched.has_work():
            if not replay.ready:
                break
            replay.clock = max(replay.clock, replay.ready[0][0])
            continue
        replay.step()
    return replay.result(t0)


class Replay:
    """One replay of a workload on a virtual clock: requests start when they arrive (a conversation's next turn
    once the one before it is over, up to ``max_concurrency`` at once), each step takes ``step_s`` plus
    ``token_s`` per token, and sampled tokens are the recorded replies where there are some."""

    def __init__(self, workload: Workload, cfg: SimConfig) -> None:
        self.cfg = cfg
        self.kv = KVCacheManager(cfg.num_kv_blocks, cfg.block_size, cfg.enable_prefix_caching)
        self.sched = Scheduler(
            SchedulerConfig(
                cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.max_model_len, max_waiting_requests=1 << 62
            ),
            self.kv,
        )
        self.limits = RequestLimits(cfg.max_model_len, 1 << 62, cfg.num_kv_blocks * cfg.block_size)
        self.reqs = reqs = workload.requests
        self.dependents: dict[int, list[int]] = {}
        self.ready: list[tuple[float, int]] = []  # (time it may start, index), the earliest first
        for i, r in enumerate(reqs):
            if r.after is None:
                self.ready.append((r.arrival_time, i))
            else:
                self.dependents.setdefault(r.after, []).append(i)
        heapq.heapify(self.ready)
        self.limit = cfg.max_concurrency or math.inf
        self.index_of: dict[str, int] = {}
        self.replies: dict[str, list[int]] = {}
        self.in_flight = self.finished = self.rejected = self.computed = 0
        self.admitted: dict[int, Request] = {}
        self.refused: set[int] = set()
        self.clock = 0.0
        self.recorder = self.writer = None

    def trace_to(self, trace: str, model: str) -> None:
        from sluice.app.inspector.trace import TraceWriter
        from sluice.core.engine_core.inspector import StepRecorder

        self.writer = TraceWriter(trace, "cache-sim", model, self.cfg.block_size, self.cfg.num_kv_blocks)
        self.recorder = StepRecorder(self.sched, max_steps=1, clock=lambda: self.clock)
        self.recorder.keep_requests()  # the trace replays in `cache-sim --trace` too

    def settle(self, i: int, ok: bool) -> None:
        self.finished += ok
        self.rejected += not ok
        if not ok:
            self.refused.add(i)
        for j in self.dependents.pop(i, ()):  # the next turn starts once this one is over
            heapq.heappush(self.ready, (max(self.reqs[j].arrival_time, self.clock), j))

    def admit_ready(self) -> None:
        """Queue every request that may start by now (the engine's refusals refused here too)."""
        ready = self.ready
        while ready and ready[0][0] <= self.clock and self.in_flight < self.limit:
            _, i = heapq.heappop(ready)
            r = self.reqs[i]
            rid = f"sim-{i}"
            params = SamplingParams(max_tokens=r.output_len, temperature=0.0, ignore_eos=True, cache_salt=r.cache_salt)
            try:
                (req,) = make_requests(rid, r.prompt_token_ids, params, (), self.limits)
            except InvalidRequestError:  # the engine refuses it too (longer than the pool or max_model_len)
                self.settle(i, ok=False)
                continue
            self.index_of[rid] = i
            self.admitted[i] = req
            if self.recorder is not None:
                req.arrival_time = self.clock
                self.recorder.admitted([req])
            if self.cfg.recorded_replies and r.reply_token_ids:
                self.replies[rid] = r.reply_token_ids
            self.sched.add_request(req)
            self.in_flight += 1

    def step(self) -> None:
        """One scheduler step on the virtual clock, its sampled tokens made up (or replayed)."""
        sched, recorder = self.sched, self.recorder
        if recorder is not None:
            mark = recorder.begin()
        so = sched.schedule()
        if not so.req_ids:
            # As the engine does: the head request can never fit, even in an empty pool.
            head: Request = sched.waiting[0]
            sched.abort(head.request_id)
            self.in_flight -= 1
            self.settle(self.index_of.pop(head.request_id), ok=False)
            return
        out = ModelOutput(so.step_id)
        self.computed += so.num_tokens
        for rid, sample in zip(so.req_ids, so.samples):
            if sample:
                for x in (rid, *so.forks.get(rid, ())):
                    reply = self.replies.get(x)
                    n = sched.requests[x].num_output_tokens
                    out.req_ids.append(x)
                    out.token_ids.append(reply[n] if reply is not None and n < len(reply) else FILLER_TOKEN)
        self.clock += self.cfg.step_s + self.cfg.token_s * so.num_tokens
        events = sched.update_from_output(so, out)
        if recorder is not None:
            steps = self.writer.step_lines([recorder.record(mark, so, out, events)])
            self.writer.write(steps + self.writer.request_lines(recorder.take_ended_requests()))
        for ev in events:
            if ev.finish_reason is not None:
                self.replies.pop(ev.request_id, None)
                self.in_flight -= 1
                self.settle(self.index_of.pop(ev.request_id), ok=True)

    def result(self, t0: float) -> SimResult:
        """The replay's figures (``t0``: when it began, on the wall clock)."""
        if self.writer is not None:
            self.writer.close(self.recorder.kv_snapshot())
        cfg, kv, reqs = self.cfg, self.kv, self.reqs
        q, h = kv.prefix_cache_queries, kv.prefix_cache_hits
        tenants: dict[str, TenantResult] = {}
        for i, r in enumerate(reqs):
            t = tenants.setdefault(r.cache_salt or "", TenantResult())
            t.num_requests += 1
            t.prompt_tokens += len(r.prompt_token_ids)
            if i in self.refused or i not in self.admitted:
                t.num_rejected += 1
            else:
                t.hit_tokens += max(self.admitted[i].num_cached_tokens, 0)
        rejected_tokens = sum(len(reqs[i].prompt_token_ids) for i in self.refused)
        return SimResult(
            block_size=cfg.block_size,
            num_kv_blocks=cfg.num_kv_blocks,
            pool_tokens=cfg.num_kv_blocks * cfg.block_size,
            prefix_cache_queries=q,
            prefix_cache_hits=h,
            hit_rate=h / (q + rejected_tokens) if q + rejected_tokens else 0.0,
            num_requests=len(reqs),
            num_finished=self.finished,
            num_rejected=self.rejected,
            rejected_prompt_tokens=rejected_tokens,
            num_preemptions=self.sched.num_preemptions,
            num_steps=self.sched.step_id,
            computed_tokens=self.computed,
            virtual_s=self.clock,
            wall_s=time.perf_counter() - t0,
            tenants=dict(sorted(tenants.items())),
        )
