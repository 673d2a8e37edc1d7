"""The step contract between the scheduler and the executor: what one step computes (`SchedulerOutput`, one
`ScheduledRequest` per request) and what comes back (`ModelOutput`). Its own module, so the executor side
(model runner, TP workers, speculative steps) and the inspector know the contract, not the policy."""

from __future__ import annotations

from dataclasses import dataclass, field

from sluice.core.outputs import TokenLogprob
from sluice.core.sampling_params import SamplingParams


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
    # speculative decoding: the last num_draft_tokens of token_ids are drafts to verify
    num_draft_tokens: int = 0
    spec: bool = False  # run the draft head over this step's verified positions (and propose if sample)
    next_token_id: int = -1  # spec, chunk that does not sample: the token after the chunk
    # n > 1: sibling sequences that sample their first token from this request's logits row (no tokens
    # of their own this step); only on the chunk that computes the last prompt token.
    forks: list[ScheduledRequest] = field(default_factory=list)


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
    # speculative decoding: for requests that verified drafts, the accepted drafts then the
    # resampled / bonus token (instead of `sampled`); and the next drafts proposed per request
    spec_token_ids: dict[str, list[int]] | None = None
    draft_token_ids: dict[str, list[int]] | None = None
