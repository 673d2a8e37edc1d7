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

Asynchronous scheduling: the next step may be scheduled while the last one still runs, before its sampled
tokens are known. A request that samples in a step counts that token as pending (``num_pending``) until
its output is processed: it still decodes the next position in the next step (the executor feeds the
token from the device), is not scheduled past ``max_tokens`` or ``max_model_len`` counting its pending
tokens, and is not resumed after a preemption while a token is pending. A request that stops on a token
(EOS, a stop token) costs the step after it one wasted row: its output is dropped, never appended.

Speculative steps overlap too, in their steady state: a uniform step (`SchedulerOutput.uniform`: every row
greedy, verifying k drafts and drafting again) leaves its emitted tokens, its accepted counts and the next
drafts on the device, so the step after it can be scheduled before they are known, its rows fed from the
device (`SchedulerOutput.device_fed`). Such a row is scheduled as if none of the drafts in flight will be
accepted (``num_computed_tokens`` back by k: its last token's earliest position), with KV slots reserved
for the most that can be (k more); the executor moves its positions by the accepted count on the device.
When the step in flight's output arrives, ``num_computed_tokens`` moves forward by what it accepted
instead of back over what it rejected. Any other step that may speculate (drafts to catch up after a
prefill, sampled or penalized requests, requests waiting to be admitted) is scheduled on known tokens
only (`needs_sync`).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from sluice.core.messages import TokenEvent
from sluice.core.request import Request, RequestStatus
from sluice.core.step import ModelOutput, NewRequest, SchedulerOutput
from sluice.kv.manager import KVCacheManager


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    max_waiting_requests: int
    num_speculative_tokens: int = 0  # 0 = no speculative decoding
    speculative_disable_batch_size: int = 1 << 30
    async_scheduling: bool = False  # may schedule a step before the last one's tokens are known
    max_uniform_batch: int = 0  # the most rows the executor runs as a uniform speculative step (0: none)


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
        self.num_generation_tokens = 0
        self._finished_ids: list[str] = []
        self._preempted_ids: list[str] = []
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
        sampling params and seed (the executor repeats the row: `SchedulerOutput.forks`), so sequence i
        draws exactly what a solo request would. From then on the siblings are ordinary running
        requests; the first decode of each writes into the shared partial last block, which
        `allocate_slots` replaces with a private copy (copy-on-write) before the step's attention.
        A parent that ends before its prompt is computed (aborted) hands its place to the first sibling.
        """
        req.draft_synced = self._may_draft(req)
        for sib in forks:
            sib.draft_synced = False  # forks decode without the draft head
        max_len = self.config.max_model_len
        for r in (req, *forks):
            r.token_limit = min(r.token_limit, max_len)
        self.requests[req.request_id] = req
        for sib in forks:
            self.requests[sib.request_id] = sib
        if forks:
            self._pending_forks[req.request_id] = list(forks)
        self.waiting.append(req)

    def _may_draft(self, req: Request) -> bool:
        """Whether ``req`` may speculate: a draft head, and no logprobs (reported per sampled token; verification
        does not compute them)."""
        return self.config.num_speculative_tokens > 0 and req.sampling_params.logprobs is None

    def abort(self, request_id: str) -> Request | None:
        req = self.requests.get(request_id)
        if req is None:
            return None
        self._finish(req)
        return req

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def needs_sync(self) -> bool:
        """Whether the next step must be scheduled on known tokens only: asynchronous scheduling is off, or
        the step may speculate (how many drafts to verify depends on the last step's acceptance)."""
        if not self.config.async_scheduling:
            return True
        k = self.config.num_speculative_tokens
        if k == 0 or len(self.running) + len(self.waiting) > self.config.speculative_disable_batch_size:
            return False
        # only a request whose draft head has kept up can speculate: the others (decoded without it once, at a
        # larger batch) let the steps overlap as without a head
        if not (any(r.draft_synced for r in self.running) or any(r.draft_synced for r in self.waiting)):
            return False
        # the next step can be fed from the device only if every running request's row in flight is uniform
        return bool(self.waiting) or not self.running or not all(map(self._feedable, self.running))

    def _uniform_eligible(self, req: Request) -> bool:
        """Whether ``req``'s verification needs nothing but greedy argmax matching (no penalties, no min_tokens
        ban, no logprobs, no grammar mask, no siblings to fork)."""
        sp = req.sampling_params
        return (
            sp.is_greedy
            and sp.logprobs is None
            and sp.structured_outputs is None
            and not sp.has_penalties
            and len(req.output_token_ids) >= sp.min_tokens
            and req.request_id not in self._pending_forks
        )

    def _feedable(self, req: Request) -> bool:
        """A request whose next row may be fed from the device: its row in flight is uniform, and the furthest
        position that row could reach (all k drafts in flight accepted, k more verified, k - 1 drafted) is
        inside max_model_len."""
        k = self.config.num_speculative_tokens
        return (
            req.num_uniform_inflight > 0
            and req.num_computed_tokens + 2 * k <= self.config.max_model_len
            and self._uniform_eligible(req)
        )

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
        """The next step. One without rows (nothing can run now) changes nothing the executor must know: the
        requests dropped meanwhile wait for the next step that has rows."""
        so = SchedulerOutput(self.step_id + 1)
        k = self.config.num_speculative_tokens
        spec_on = k > 0 and len(self.running) + len(self.waiting) <= self.config.speculative_disable_batch_size
        forked: list[Request] = []  # siblings forked this step; they run from the next step on
        budget = self._schedule_running(so, self.config.max_num_batched_tokens, spec_on, forked)
        self._schedule_waiting(so, budget, spec_on, forked)
        self.running.extend(forked)
        if so.req_ids:
            if k and self._is_uniform(so):
                so.uniform = True
                for rid in so.req_ids:
                    self.requests[rid].num_uniform_inflight += 1
            self.step_id += 1
            so.finished_request_ids, self._finished_ids = self._finished_ids, []
            so.preempted_request_ids, self._preempted_ids = self._preempted_ids, []
        return so

    def _schedule_running(self, so: SchedulerOutput, budget: int, spec_on: bool, forked: list[Request]) -> int:
        """Running requests, oldest first, within ``budget`` tokens; returns what is left of it.

        The common row, a decode into its request's own last block that the executor already has, is taken
        inline: its row is recorded here and its request advanced by `_advance` with the other inline rows
        before the next row that is not (`_close_inline`), by the rule every row follows (`_scheduled`)."""
        running = self.running
        max_len = self.config.max_model_len
        req_blocks = self.kv.req_blocks
        bs = self.kv.block_size
        pending_forks = self._pending_forks
        row_ids, row_starts = so.req_ids, so.num_computed_tokens
        inline: list[Request] = []
        i = 0
        end = len(running)
        while i < end and budget > 0:
            req = running[i]
            i += 1
            if req.num_uniform_inflight and spec_on:  # `needs_sync` let this step go before that row's output
                self._close_inline(so, inline)
                budget -= self._schedule_device_fed(so, req, budget, forked)
                continue
            known = len(req.all_token_ids) + req.num_pending
            start = req.num_computed_tokens
            n = known - start
            if n > budget:
                n = budget
            # nothing to compute yet, or every further token would be past the request's end
            if n <= 0 or known >= req.token_limit or known >= max_len:
                continue
            if n == 1 and not spec_on and req.in_batch:
                rid = req.request_id
                blocks = req_blocks[rid]
                # no new block, no copy-on-write, nothing of its table unsent, no siblings to fork
                if (
                    start < len(blocks) * bs
                    and blocks[start // bs].ref_cnt == 1
                    and len(blocks) == req.num_blocks_sent
                    and rid not in pending_forks
                ):
                    row_ids.append(rid)  # its length (1) and sample (True) are filled in by `_close_inline`
                    row_starts.append(start)
                    inline.append(req)
                    budget -= 1
                    continue
            self._close_inline(so, inline)
            taken = self._schedule_running_row(so, req, n, budget, spec_on, forked)
            if taken is None:
                break  # req itself was preempted: nothing after it is left either
            budget -= taken
            end = len(running)  # preemption took requests off the end
        self._close_inline(so, inline)
        return budget

    def _close_inline(self, so: SchedulerOutput, inline: list[Request]) -> None:
        """The inline decode rows so far: one token each, sampled; their requests advanced as `_scheduled` would."""
        if inline:
            pad = len(inline)
            so.num_scheduled_tokens.extend([1] * pad)
            so.samples.extend([True] * pad)
            self._advance(inline, 1, False, True)
            inline.clear()

    def _schedule_running_row(
        self, so: SchedulerOutput, req: Request, n: int, budget: int, spec_on: bool, forked: list[Request]
    ) -> int | None:
        """A running request's row that needs the KV manager: with its drafts to verify where it speculates and
        the blocks allow, else without; short of blocks, the newest running requests are preempted. Returns the
        tokens it takes of the budget, or None where ``req`` itself was preempted."""
        if spec_on and req.draft_synced:
            k = self.config.num_speculative_tokens
            drafts = self._drafts_to_verify(req, n, budget)
            reaches_end = req.num_computed_tokens + n == req.num_tokens
            got = self.kv.allocate_slots(req, n + len(drafts), num_lookahead_tokens=k - 1 if reaches_end else 0)
            if got is not None:
                so.block_copies.extend(got)
                self._scheduled(so, req, n, forked, drafts, spec=True, cow=bool(got))
                return n + len(drafts)
            # short of blocks: this step goes without speculation (and may preempt, below)
        while True:
            got = self.kv.allocate_slots(req, n)
            if got is not None:
                break
            victim = self.running[-1]
            self._preempt(victim)
            if victim is req:
                return None
        so.block_copies.extend(got)
        self._scheduled(so, req, n, forked, cow=bool(got))
        return n

    def _schedule_waiting(self, so: SchedulerOutput, budget: int, spec_on: bool, forked: list[Request]) -> None:
        """Waiting requests, in arrival order (preempted ones were put back at the front), while the budget and
        the sequence cap allow; a request that cannot start yet keeps its place for the next step."""
        k = self.config.num_speculative_tokens
        deferred: list[Request] = []
        max_seqs = self.config.max_num_seqs
        while self.waiting and budget > 0 and (seats := self._num_seats() + len(forked)) < max_seqs:
            req = self.waiting[0]
            group = 1 + len(self._pending_forks.get(req.request_id, ()))
            if seats > 0 and seats + group > max_seqs:
                break
            # preempted with a token still in flight: resumed once it is known; or its next block is being
            # computed by another request: it hits a step later
            if req.num_pending or self.kv.still_awaiting_prefix(req):
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
            so.block_copies.extend(got)
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = num_hit
            if req.num_cached_tokens < 0:  # first admission: what the hit rate counts
                req.num_cached_tokens = num_hit
                self.kv.record_prefix_query(req.num_prompt_tokens, num_hit)
            self.running.append(req)
            self._scheduled(so, req, n, forked, spec=spec)
            budget -= n
        self.waiting.extendleft(reversed(deferred))

    def _schedule_device_fed(self, so: SchedulerOutput, req: Request, budget: int, forked: list[Request]) -> int:
        """A row fed from the device, after ``req``'s uniform row in flight: its last token and k drafts are
        that row's outputs, from the earliest position they can start at; slots reserved for the latest.
        Returns the tokens it takes of the budget (0: not scheduled this step)."""
        k = self.config.num_speculative_tokens
        if budget < 1 + k or len(req.all_token_ids) + req.num_pending >= req.token_limit:
            return 0  # no room, or its row in flight already reaches its end
        start = req.num_computed_tokens
        req.num_computed_tokens = start - k  # as if the step in flight accepts none of its drafts
        got = self.kv.allocate_slots(req, 1 + k, num_lookahead_tokens=2 * k - 1)
        if got is None:  # never preempt under a step in flight: this request waits for its output
            req.num_computed_tokens = start
            return 0
        so.block_copies.extend(got)
        so.device_fed.add(req.request_id)
        self._scheduled(so, req, 1, forked, [0] * k, spec=True, cow=bool(got))  # the drafts wait on the device
        return 1 + k

    def _is_uniform(self, so: SchedulerOutput) -> bool:
        """Every row greedy, verifying k drafts after its last token and drafting again (see `_uniform_eligible`),
        within the executor's uniform batch sizes."""
        k = self.config.num_speculative_tokens
        if so.forks or not 0 < len(so.req_ids) <= self.config.max_uniform_batch or len(so.drafting) != len(so.req_ids):
            return False
        nd = so.num_draft_tokens
        requests = self.requests
        return all(
            nd.get(rid) == k and n == k + 1 and sample and self._uniform_eligible(requests[rid])
            for rid, n, sample in zip(so.req_ids, so.num_scheduled_tokens, so.samples)
        )

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
        self,
        so: SchedulerOutput,
        req: Request,
        n: int,
        forked: list[Request],
        drafts: Sequence[int] = (),
        spec: bool = False,
        cow: bool = False,
    ) -> None:
        """Add ``req``'s row to the step: ``n`` of its tokens from ``num_computed_tokens`` on, then ``drafts``."""
        rid = req.request_id
        start = req.num_computed_tokens
        sample = start + n == len(req.all_token_ids) + req.num_pending
        if cow or not req.in_batch or len(self.kv.req_block_ids[rid]) > req.num_blocks_sent:
            self._sync_blocks(so, req, cow)
        so.req_ids.append(rid)
        so.num_scheduled_tokens.append(n + len(drafts))
        so.num_computed_tokens.append(start)
        so.samples.append(sample)
        if drafts:
            so.num_draft_tokens[rid] = len(drafts)
        if spec:
            so.drafting.add(rid)
        self._advance((req,), n + len(drafts), spec, sample)
        if sample and rid in self._pending_forks:
            siblings = self._pending_forks.pop(rid)
            so.forks[rid] = [sib.request_id for sib in siblings]
            for sib in siblings:
                self.kv.fork(rid, sib.request_id)
                sib.status = RequestStatus.RUNNING
                sib.num_computed_tokens = req.num_computed_tokens
                sib.num_cached_tokens = max(req.num_cached_tokens, 0)
                sib.num_pending = 1  # its first token is sampled from the parent's row this step
                self._sync_blocks(so, sib)
                forked.append(sib)

    @staticmethod
    def _advance(reqs: Sequence[Request], n: int, spec: bool, sample: bool) -> None:
        """What scheduling a row does to its request, the one rule for every row (`_scheduled` applies it to one,
        `_schedule_running` to its inline decode rows at once): ``n`` more tokens computed (optimistic: the
        executor computes them this step), its drafts taken (verified now, or never), a gap in the draft head's
        KV where the row does not speculate, and a token pending where it samples."""
        for req in reqs:
            req.num_computed_tokens += n
            if req.spec_token_ids:
                req.spec_token_ids = []
            if not spec:
                req.draft_synced = False  # positions computed without the draft head: its KV has a gap now
            if sample:
                req.num_pending += 1

    def _sync_blocks(self, so: SchedulerOutput, req: Request, replaced: bool = False) -> None:
        """Tell the executor what it lacks of ``req``: all of it the first time, else the blocks its table
        gained (or its whole table, when copy-on-write replaced a shared block)."""
        table = self.kv.req_block_ids.get(req.request_id, ())
        if not req.in_batch:
            so.new_requests.append(
                NewRequest(
                    req.request_id,
                    list(req.all_token_ids),
                    req.num_prompt_tokens,
                    list(table),
                    req.sampling_params,
                    req.eos_token_ids,
                )
            )
            req.in_batch = True
        elif replaced:
            so.block_updates[req.request_id] = (0, list(table))
        elif len(table) > req.num_blocks_sent:
            so.block_updates[req.request_id] = (req.num_blocks_sent, table[req.num_blocks_sent :])
        req.num_blocks_sent = len(table)

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req.request_id)
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        req.num_uniform_inflight = 0
        # recomputed from scratch, so the draft head can follow again
        req.draft_synced = self._may_draft(req)
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        if req.in_batch:  # the executor drops it (and takes it again in full when it resumes)
            req.in_batch = False
            self._preempted_ids.append(req.request_id)
        req.num_blocks_sent = 0
        self.waiting.appendleft(req)

    # -- results -----------------------------------------------------------------------------------
    def update_from_output(self, so: SchedulerOutput, out: ModelOutput) -> list[TokenEvent]:
        """Append the step's tokens; return the events for the callers (per token, or at the end for final-only
        requests). With asynchronous scheduling the next step has been scheduled already: a request that
        finishes here has a row in it, whose token is dropped."""
        events: list[TokenEvent] = []
        if out.error is not None:
            for rid in (*so.req_ids, *(sib for sibs in so.forks.values() for sib in sibs)):
                self._fail(rid, out.error, events)
            return events
        if out.failed:  # rows that failed the step alone; the others' tokens follow
            for rid, error in out.failed.items():
                self._fail(rid, error, events)
        bs = self.kv.block_size
        requests = self.requests
        # prefill chunks that sample nothing: publish the blocks they filled
        if not all(so.samples):
            for rid, sample in zip(so.req_ids, so.samples):
                req = requests.get(rid)
                if not sample and req is not None and req.status is RequestStatus.RUNNING:
                    self.kv.cache_blocks(req, req.num_computed_tokens)
        spec = out.spec_token_ids
        drafts = out.draft_token_ids
        logprobs = out.logprobs
        num_cached = self.kv.num_cached_blocks
        RUNNING = RequestStatus.RUNNING
        caching = self.kv.enable_prefix_caching
        finished = 0
        for row, (rid, token) in enumerate(zip(out.req_ids, out.token_ids)):
            req = requests.get(rid)
            if req is None:
                continue  # finished or aborted while the step ran
            req.num_pending -= 1
            if spec is not None and rid in spec:
                tokens = spec[rid]
                self._roll_back(req, so.num_draft_tokens[rid], len(tokens) - 1, so.uniform)
                for n, t in enumerate(tokens, 1):
                    req.append_output(t)
                    reason, stop_reason = self._check_stop(req, t)
                    if reason is not None:
                        tokens = tokens[:n]
                        break
                self.num_generation_tokens += len(tokens)
            else:  # one token: the common case, inline (`_check_stop`), without a list per row
                tokens = None
                outputs = req.output_token_ids
                outputs.append(token)
                req.all_token_ids.append(token)
                reason = stop_reason = None
                if token in req.stop_ids and len(outputs) >= req.sampling_params.min_tokens:
                    reason, stop_reason = "stop", token
                elif len(req.all_token_ids) >= req.token_limit:  # max_tokens or max_model_len
                    reason = "length"
                self.num_generation_tokens += 1
            if drafts is not None:
                req.spec_token_ids = drafts.get(rid, [])
            # publish the blocks this token completed (its KV is computed by this step or the one in flight)
            if caching and req.status is RUNNING and req.num_computed_tokens // bs > num_cached.get(rid, 0):
                self.kv.cache_blocks(req, req.num_computed_tokens)
            lp = logprobs[row] if logprobs is not None else None
            if req.final_only:
                if req.first_token_time is None:
                    req.first_token_time = time.time()
                if lp is not None:
                    req.output_logprobs = req.output_logprobs or []
                    req.output_logprobs.append(lp)
                if reason is not None:
                    events.append(self.final_event(req, reason, stop_reason))
            else:
                events.append(
                    TokenEvent(
                        rid,
                        [token] if tokens is None else tokens,
                        logprobs=[lp] if lp is not None else None,
                        finish_reason=reason,
                        stop_reason=stop_reason,
                        num_cached_tokens=max(req.num_cached_tokens, 0),
                    )
                )
            if reason is not None:
                self._finish(req, keep_running_list=True)
                finished += 1
        if finished:  # out of the running list in one pass (many requests often end in the same step)
            self.running = [r for r in self.running if r.status is RUNNING]
        return events

    def _fail(self, rid: str, error: Exception, events: list[TokenEvent]) -> None:
        req = self.requests.get(rid)
        if req is None:
            return
        for sib in self._pending_forks.pop(rid, ()):  # never forked: fails with it
            self._finish(sib)
            events.append(TokenEvent(sib.request_id, [], finish_reason="abort", error=error))
        self._finish(req)
        events.append(TokenEvent(rid, [], finish_reason="abort", error=error))

    def final_event(
        self, req: Request, reason: str, stop_reason: int | None = None, error: Exception | None = None
    ) -> TokenEvent:
        """A request's last event: for a final-only request, with every output token (and logprob) it held."""
        if not req.final_only:
            return TokenEvent(req.request_id, [], finish_reason=reason, stop_reason=stop_reason, error=error)
        return TokenEvent(
            req.request_id,
            list(req.output_token_ids),
            logprobs=req.output_logprobs,
            finish_reason=reason,
            stop_reason=stop_reason,
            num_cached_tokens=max(req.num_cached_tokens, 0),
            error=error,
            first_token_time=req.first_token_time,
        )

    def _roll_back(self, req: Request, num_drafts: int, num_accepted: int, uniform: bool = False) -> None:
        """Rejected drafts were computed optimistically: their KV slots are now past the end, to be
        overwritten (the cache never hashes them: they are not in all_token_ids). When the next step was fed
        from the device, it was scheduled as if none were accepted: the accepted ones move it forward.
        A preempted request recomputes from scratch: nothing to move."""
        fed_next = req.num_uniform_inflight > 1  # the row after this one went before this output: fed from the device
        if uniform and req.num_uniform_inflight:
            req.num_uniform_inflight -= 1
        if req.status is RequestStatus.RUNNING:
            if fed_next:
                req.num_computed_tokens += num_accepted
            else:
                req.num_computed_tokens -= num_drafts - num_accepted
        st = self.spec_stats
        st.num_drafts += 1
        st.num_draft_tokens += num_drafts
        st.num_accepted_tokens += num_accepted
        for j in range(num_accepted):
            st.accepted_per_position[j] += 1

    @staticmethod
    def _check_stop(req: Request, token: int) -> tuple[str | None, int | None]:
        """The stop rule (`update_from_output` inlines it for its one-token rows)."""
        if token in req.stop_ids and len(req.output_token_ids) >= req.sampling_params.min_tokens:
            return "stop", token
        if len(req.all_token_ids) >= req.token_limit:  # max_tokens or max_model_len
            return "length", None
        return None, None

    def _finish(self, req: Request, keep_running_list: bool = False) -> None:
        """``keep_running_list``: the caller takes finished requests out of ``running`` itself, all at once."""
        if req.status is RequestStatus.RUNNING:
            if not keep_running_list:
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
