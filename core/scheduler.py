"""The scheduler's one rule, as plain code: every request's ``num_computed_tokens`` catches up to its
``num_tokens``, within a per-step token budget and a cap on sequences.

Running requests are served first (a decode is one token; a request still mid-prefill continues its
chunk), then waiting ones take what is left of the budget, their prompts cut into chunks when they
do not fit (chunked prefill). Prefill and decode tokens share one flattened batch. When the KV pool
runs dry, the newest running request is preempted: its blocks are freed and it goes back to the
front of the waiting queue, to be recomputed later (its prefix may still be cached).

Speculative decoding (``num_speculative_tokens > 0``): a decoding request whose draft head proposed
tokens last step computes ``1 + k`` tokens (its last token and the drafts, to verify) with KV slots
reserved ``k - 1`` further for the next drafts. After the step ``num_computed_tokens`` rolls back over
the rejected drafts (their KV slots are simply overwritten later), and only verified tokens ever enter
``all_token_ids``, so only they are hashed into the prefix cache. Above
``speculative_disable_batch_size`` requests a step does not speculate; a request whose tokens were
computed without the draft head keeps decoding without it.

With the prefix cache on, a waiting request whose next uncached block is being computed right now by
another request waits for it instead of computing it a second time (it hits a step later); the
requests behind it are still admitted. Parallel sampling (``n > 1``) computes the prompt once and
forks: see `Scheduler.add_request`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from sluice.core.request import Request, RequestStatus, TokenEvent
from sluice.core.step import ModelOutput, ScheduledRequest, SchedulerOutput
from sluice.kv.manager import KVCacheManager


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    max_waiting_requests: int
    num_speculative_tokens: int = 0  # 0 = no speculative decoding
    speculative_disable_batch_size: int = 1 << 30


@dataclass(slots=True)
class SpecStats:
    num_drafts: int = 0  # verification steps with at least one draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)


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
        self.spec_stats = SpecStats(accepted_per_position=[0] * config.num_speculative_tokens)

        self._pending_forks: dict[str, list[Request]] = {}  # parent id -> siblings not yet forked

    # -- intake ------------------------------------------------------------------------------------
    def add_request(self, req: Request, forks: Sequence[Request] = ()) -> None:
        """Queue a request; ``forks`` are its sibling sequences (``SamplingParams.n > 1``: same prompt).

        Parallel sampling computes the prompt once. Only ``req``, the parent, is queued; the siblings
        wait outside the queues and are admitted with it as one group (room for all in ``max_num_seqs``,
        unless nothing else runs). In the step that computes the parent's last prompt token each sibling
        forks the parent's block table (`KVCacheManager.fork`: every prompt block shared, the partial
        last one included) and samples its first token from the parent's logits row with its own
        sampling params and seed (the executor repeats the row: `ScheduledRequest.forks`), so sequence i
        draws exactly what a solo request would. From then on the siblings are ordinary running
        requests; the first decode of each writes into the shared partial last block, which
        `allocate_slots` replaces with a private copy (copy-on-write) before the step's attention.
        A parent that ends before its prompt is computed (aborted) hands its place to the first sibling.
        """
        # logprobs are reported per sampled token; verification does not compute them
        req.draft_synced = self.config.num_speculative_tokens > 0 and req.sampling_params.logprobs is None
        for sib in forks:
            sib.draft_synced = False  # forks decode without the draft head
        self.requests[req.request_id] = req
        for sib in forks:
            self.requests[sib.request_id] = sib
        if forks:
            self._pending_forks[req.request_id] = list(forks)
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

    def counters(self) -> dict[str, int]:
        """Queue lengths, KV pool and cumulative counters as they stand: the one source of what
        `EngineStats` publishes and the inspector's step records carry."""
        kv, st = self.kv, self.spec_stats
        return {
            "num_running": len(self.running),
            "num_waiting": len(self.waiting),
            "kv_blocks_total": kv.num_blocks,
            "kv_blocks_free": kv.num_free_blocks,
            "num_preemptions": self.num_preemptions,
            "prefix_cache_queries": kv.prefix_cache_queries,
            "prefix_cache_hits": kv.prefix_cache_hits,
            "spec_num_drafts": st.num_drafts,
            "spec_num_accepted_tokens": st.num_accepted_tokens,
        }

    # -- one step ----------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        copies: list[tuple[int, int]] = []
        k = self.config.num_speculative_tokens
        spec_on = k > 0 and len(self.running) + len(self.waiting) <= self.config.speculative_disable_batch_size
        forked: list[Request] = []  # siblings forked this step; they run from the next step on
        # 1. running requests, oldest first
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if n <= 0:
                i += 1
                continue
            if spec_on and req.draft_synced:
                drafts = self._drafts_to_verify(req, n, budget)
                reaches_end = req.num_computed_tokens + n == req.num_tokens
                got = self.kv.allocate_slots(req, n + len(drafts), num_lookahead_tokens=k - 1 if reaches_end else 0)
                if got is not None:
                    copies.extend(got)
                    scheduled.append(self._scheduled(req, n, forked, drafts, spec=True))
                    budget -= n + len(drafts)
                    i += 1
                    continue
                # short of blocks: this step goes without speculation (and may preempt, below)
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
            scheduled.append(self._scheduled(req, n, forked))
            budget -= n
            i += 1
        # 2. waiting requests, in arrival order (preempted ones were put back at the front)
        deferred: list[Request] = []
        max_seqs = self.config.max_num_seqs
        while self.waiting and budget > 0 and (seats := self._num_seats() + len(forked)) < max_seqs:
            req = self.waiting[0]
            group = 1 + len(self._pending_forks.get(req.request_id, ()))
            if seats > 0 and seats + group > max_seqs:
                break
            if self.kv.still_awaiting_prefix(req):
                deferred.append(self.waiting.popleft())
                continue
            hit_blocks, num_hit = self.kv.get_computed_blocks(req)
            if self.kv.prefix_in_flight(req, len(hit_blocks)):
                deferred.append(self.waiting.popleft())
                continue
            n = min(req.num_tokens - num_hit, budget)
            spec = spec_on and req.draft_synced
            look = k - 1 if spec and num_hit + n == req.num_tokens else 0
            got = self.kv.allocate_slots(req, n, hit_blocks, num_lookahead_tokens=look)
            if got is None and look:
                spec, got = False, self.kv.allocate_slots(req, n, hit_blocks)
            if got is None:
                break
            self.waiting.popleft()
            copies.extend(got)
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = num_hit
            if req.num_cached_tokens < 0:  # first admission: what the hit rate counts
                req.num_cached_tokens = num_hit
                self.kv.record_prefix_query(req.num_prompt_tokens, num_hit)
            self.running.append(req)
            scheduled.append(self._scheduled(req, n, forked, spec=spec))
            budget -= n
        self.waiting.extendleft(reversed(deferred))
        self.running.extend(forked)
        self.step_id += 1
        finished, self._finished_ids = self._finished_ids, []
        return SchedulerOutput(self.step_id, scheduled, copies, finished)

    def _drafts_to_verify(self, req: Request, n: int, budget: int) -> list[int]:
        """The pending drafts this step can verify: only after the last token, within the token budget and
        max_model_len. Not capped by max_tokens: the tokens past it are cut off when the step's tokens are
        appended, and a request's last steps keep all k drafts, the shape of the graphed greedy step."""
        if req.num_computed_tokens + n != req.num_tokens:
            return []
        room = min(budget - n, self.config.max_model_len - req.num_tokens)
        return req.spec_token_ids[: max(room, 0)]

    def _num_seats(self) -> int:
        """Sequences running, plus the siblings that running parents will fork (their seats are taken)."""
        pending = sum(
            len(sibs) for rid, sibs in self._pending_forks.items() if self.requests[rid].status is RequestStatus.RUNNING
        )
        return len(self.running) + pending

    def _scheduled(
        self, req: Request, n: int, forked: list[Request], drafts: Sequence[int] = (), spec: bool = False
    ) -> ScheduledRequest:
        start = req.num_computed_tokens
        sample = start + n == req.num_tokens
        req.num_computed_tokens += n + len(drafts)  # optimistic: the executor computes them this step
        req.spec_token_ids = []
        if not spec:
            req.draft_synced = False  # positions computed without the draft head: its KV has a gap now
        sr = self._sampling_request(req, req.all_token_ids[start : start + n] + list(drafts), start, sample)
        sr.num_draft_tokens = len(drafts)
        sr.spec = spec
        sr.next_token_id = req.all_token_ids[start + n] if spec and not sample else -1
        if sample and req.request_id in self._pending_forks:
            for sib in self._pending_forks.pop(req.request_id):
                self.kv.fork(req.request_id, sib.request_id)
                sib.status = RequestStatus.RUNNING
                sib.num_computed_tokens = req.num_computed_tokens
                sib.num_cached_tokens = max(req.num_cached_tokens, 0)
                forked.append(sib)
                sr.forks.append(self._sampling_request(sib, [], sib.num_computed_tokens, True))
        return sr

    def _sampling_request(self, req: Request, token_ids: list[int], start: int, sample: bool) -> ScheduledRequest:
        sp = req.sampling_params
        penalties = sp.presence_penalty != 0 or sp.frequency_penalty != 0 or sp.repetition_penalty != 1
        return ScheduledRequest(
            request_id=req.request_id,
            token_ids=token_ids,
            start_pos=start,
            block_table=self.kv.block_table(req.request_id) if token_ids else [],
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
        req.spec_token_ids = []
        # recomputed from scratch, so the draft head can follow again
        req.draft_synced = self.config.num_speculative_tokens > 0 and req.sampling_params.logprobs is None
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    # -- results -----------------------------------------------------------------------------------
    def update_from_output(self, so: SchedulerOutput, out: ModelOutput) -> list[TokenEvent]:
        events: list[TokenEvent] = []
        if out.error is not None:
            for sr in so.requests:
                for x in (sr, *sr.forks):
                    req = self.requests.get(x.request_id)
                    if req is None:
                        continue
                    for sib in self._pending_forks.pop(x.request_id, ()):  # never forked: fails with it
                        self._finish(sib)
                        events.append(TokenEvent(sib.request_id, [], finish_reason="abort", error=out.error))
                    self._finish(req)
                    events.append(TokenEvent(x.request_id, [], finish_reason="abort", error=out.error))
            return events
        for x in (x for sr in so.requests for x in (sr, *sr.forks)):
            req = self.requests.get(x.request_id)
            if req is None or req.status is not RequestStatus.RUNNING:
                continue  # aborted while the step ran
            if x.num_draft_tokens:
                tokens = out.spec_token_ids[x.request_id]
                self._roll_back(req, x.num_draft_tokens, len(tokens) - 1)
            else:
                token = out.sampled.get(x.request_id)
                tokens = None if token is None else [token]
            if out.draft_token_ids:
                req.spec_token_ids = out.draft_token_ids.get(x.request_id, [])
            if tokens is None:
                self.kv.cache_blocks(req, req.num_computed_tokens)
                continue  # a prefill chunk that does not reach the end yet
            reason = stop_reason = None
            for n, token in enumerate(tokens, 1):
                req.append_output(token)
                reason, stop_reason = self._check_stop(req, token)
                if reason is not None:
                    tokens = tokens[:n]
                    break
            self.kv.cache_blocks(req, req.num_computed_tokens)
            lp = out.logprobs.get(x.request_id) if out.logprobs else None
            events.append(
                TokenEvent(
                    req.request_id,
                    tokens,
                    logprobs=[lp] if lp is not None else None,
                    finish_reason=reason,
                    stop_reason=stop_reason,
                    num_cached_tokens=max(req.num_cached_tokens, 0),
                )
            )
            if reason is not None:
                self._finish(req)
        return events

    def _roll_back(self, req: Request, num_drafts: int, num_accepted: int) -> None:
        """Rejected drafts were computed optimistically: their KV slots are now past the end, to be
        overwritten (the cache never hashes them: they are not in all_token_ids)."""
        req.num_computed_tokens -= num_drafts - num_accepted
        st = self.spec_stats
        st.num_drafts += 1
        st.num_draft_tokens += num_drafts
        st.num_accepted_tokens += num_accepted
        for j in range(num_accepted):
            st.accepted_per_position[j] += 1

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
        elif req.status is RequestStatus.WAITING and not self._drop_pending_fork(req):
            self.waiting.remove(req)
        siblings = self._pending_forks.pop(req.request_id, None)
        if siblings:  # the parent ends before its prompt is computed: the first sibling takes its place
            heir, rest = siblings[0], siblings[1:]
            if rest:
                self._pending_forks[heir.request_id] = rest
            self.waiting.appendleft(heir)
        req.status = RequestStatus.FINISHED
        self.kv.free(req.request_id)
        self.requests.pop(req.request_id, None)
        self._finished_ids.append(req.request_id)

    def _drop_pending_fork(self, req: Request) -> bool:
        for parent_id, sibs in self._pending_forks.items():
            if req in sibs:
                sibs.remove(req)
                if not sibs:
                    del self._pending_forks[parent_id]
                return True
        return False
