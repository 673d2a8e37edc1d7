"""The step contract between the scheduler and the executor: what changed since the last step
(`SchedulerOutput`) and what the step produced (`ModelOutput`).

The executor keeps a persistent batch (`core/worker/input_batch.py`): every running request's tokens, block
table and sampling parameters, from the step it was first scheduled in until it is dropped. So a step
carries only changes: the requests scheduled for the first time (or again, after a preemption) in full,
and for every request in the step how many tokens it computes from which position, the blocks its table
gained, and which requests to drop. Tokens the executor sampled itself are never sent back to it.

Its own module, so the executor side (model runner, TP workers) and the inspector know the contract,
not the policy.

Between two steps the scheduler may send `FLUSH` instead: the executor then collects the oldest step in flight
and sends its `ModelOutput` (the scheduler needs its tokens before it can schedule again).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sluice.core.outputs import TokenLogprob
from sluice.core.sampling_params import SamplingParams

FLUSH = "flush"  # scheduler -> executor: collect the oldest step in flight and send its output


@dataclass(slots=True)
class NewRequest:
    """A request the executor does not hold: scheduled for the first time, or again after a preemption."""

    request_id: str
    token_ids: list[int]  # every known token: the prompt, then the outputs of an earlier run (resumed)
    num_prompt_tokens: int
    block_ids: list[int]  # its whole table so far (a prefix-cache hit's blocks first)
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()


@dataclass(slots=True)
class SchedulerOutput:
    """One step. Rows are the requests computing tokens, in batch order: row ``i`` computes
    ``num_scheduled_tokens[i]`` tokens from position ``num_computed_tokens[i]`` and, when ``samples[i]``,
    samples the token after them. A row's tokens are its known ones from that position on; for a row
    with drafts to verify (``num_draft_tokens``), its last token and then those drafts."""

    step_id: int
    req_ids: list[str] = field(default_factory=list)
    num_scheduled_tokens: list[int] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)  # before this step
    samples: list[bool] = field(default_factory=list)
    new_requests: list[NewRequest] = field(default_factory=list)
    # blocks a held request's table gained or replaced: table[start:] = ids (appended blocks; a private copy
    # replacing a shared block, copy-on-write, with its data copy in block_copies)
    block_updates: dict[str, tuple[int, list[int]]] = field(default_factory=dict)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write, before attention
    finished_request_ids: list[str] = field(default_factory=list)  # finished or aborted: dropped
    # dropped until they are scheduled again (as new requests); their sampling generators live on
    preempted_request_ids: list[str] = field(default_factory=list)
    # n > 1: siblings (in new_requests, computing nothing) that sample their first token from their parent's
    # row in this step, the one that computes the parent's last prompt token
    forks: dict[str, list[str]] = field(default_factory=dict)
    # speculative decoding: drafts each row verifies (the last of its scheduled tokens), and the requests
    # whose draft head follows this step's positions (and, if they sample, proposes the next drafts)
    num_draft_tokens: dict[str, int] = field(default_factory=dict)
    drafting: set[str] = field(default_factory=set)
    # a uniform speculative step: every row greedy, verifying k drafts and drafting again, with nothing that
    # needs the general sampler (the executor's fixed-shape path, `Drafter.prepare_uniform`); and the rows whose
    # inputs wait on the device (asynchronous scheduling): their last token and drafts come from the uniform
    # step in flight, their positions are ``num_computed_tokens`` plus the drafts it accepts
    uniform: bool = False
    device_fed: set[str] = field(default_factory=set)
    # the scheduler waits for this step's output before scheduling another (no step in flight before it):
    # the executor sends it as soon as it is collected, not when the next step or FLUSH arrives
    sync: bool = False

    @property
    def num_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    def rows(self, rows: list[int]) -> SchedulerOutput:
        """Some of this step's rows again, without its changes (already applied): to re-run them alone."""
        ids = [self.req_ids[i] for i in rows]
        keep = set(ids)
        return SchedulerOutput(
            self.step_id,
            ids,
            [self.num_scheduled_tokens[i] for i in rows],
            [self.num_computed_tokens[i] for i in rows],
            [self.samples[i] for i in rows],
            forks={p: sibs for p, sibs in self.forks.items() if p in keep},
            num_draft_tokens={r: k for r, k in self.num_draft_tokens.items() if r in keep},
            drafting=self.drafting & keep,
        )


@dataclass(slots=True)
class ModelOutput:
    """Executor -> scheduler: one token per sampling row (forks included), in step order."""

    step_id: int
    req_ids: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob | None] | None = None  # per row, where asked for
    error: Exception | None = None  # the step failed: every request in it fails
    fatal: bool = False
    # requests whose rows failed the step alone (`core/worker/culprit.py`); the other rows' tokens are above
    failed: dict[str, Exception] | None = None
    # speculative decoding: for rows that verified drafts, the accepted drafts then the resampled / bonus
    # token (their entry in token_ids is the last of these); and the next drafts proposed per request
    spec_token_ids: dict[str, list[int]] | None = None
    draft_token_ids: dict[str, list[int]] | None = None
    grammar_mask_s: float = 0.0  # the host's time on this step's grammar masks (structured outputs)
