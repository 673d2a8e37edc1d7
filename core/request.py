"""A request as the scheduler sees it, and the events that flow back to its caller."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from sluice.core.outputs import TokenLogprob
from sluice.core.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int  # resolved against max_model_len
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit at first admission; -1 until admitted
    status: RequestStatus = RequestStatus.WAITING
    num_preemptions: int = 0
    # Speculative decoding: drafts proposed for the next step (never part of all_token_ids), and whether
    # the draft head's KV has kept up with every computed position (it stops once a step skips it).
    spec_token_ids: list[int] = field(default_factory=list)
    draft_synced: bool = True
    # Asynchronous scheduling: tokens sampled by steps still in flight (the next step is scheduled before the
    # last one's token is known, and computes it from the device); whether the executor holds this request
    # (it is sent in full once, then only changes), and how many of its blocks the executor knows.
    num_pending: int = 0
    in_batch: bool = False
    num_blocks_sent: int = 0
    # Asynchronous speculative steps: this request's uniform rows in flight (`SchedulerOutput.uniform`); with two,
    # the younger was scheduled before the older's output, fed from the device
    num_uniform_inflight: int = 0
    # The caller wants only the final output: no event per token, one with every token at the end.
    final_only: bool = False
    output_logprobs: list[TokenLogprob] | None = None  # final-only requests that asked for logprobs
    first_token_time: float | None = None  # final-only: time.time() of its first token, for its metrics
    stop_ids: frozenset[int] = frozenset()  # tokens that end it (EOS unless ignored, stop_token_ids)
    token_limit: int = 0  # prompt + max_tokens: no token is computed at or past it

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids) + list(self.output_token_ids)
        sp = self.sampling_params
        self.stop_ids = frozenset(sp.stop_token_ids) | frozenset(() if sp.ignore_eos else self.eos_token_ids)
        self.token_limit = len(self.prompt_token_ids) + self.max_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def cache_salt(self) -> str | None:
        return self.sampling_params.cache_salt

    def append_output(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
