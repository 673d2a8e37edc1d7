"""What the engine hands back to callers."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token_id, logprob), best first


@dataclass(slots=True)
class RequestOutput:
    """One sequence's state after an engine step. ``delta_*`` are what is new since the last output;
    concatenating every ``delta_text`` gives ``text``."""

    request_id: str
    index: int  # which of the n sequences
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    delta_text: str
    delta_token_ids: list[int]
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | None
    usage: Usage
    logprobs: list[TokenLogprob] | None = None
    delta_logprobs: list[TokenLogprob] | None = None
    stop_reason: str | int | None = None  # the stop string or token id that ended it
