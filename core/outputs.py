"""What the engine hands back to callers: `RequestOutput` (one sequence, streamed by `AsyncEngine.generate`) and
`PromptOutput` (one prompt with its `CompletionOutput`s, what `LLM.generate` and `LLM.chat` return, vLLM's shape)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
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
class Logprob:
    """A token's log probability at one position of `CompletionOutput.logprobs` (vLLM's ``Logprob``). ``rank``
    is its place among the vocabulary at that position (1: the most likely), None where it is not known: the
    sampled token when it is not among the top ones asked for (``logprobs=0`` asks for none)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


def sample_logprobs(
    lps: Sequence[TokenLogprob], decode: Callable[[int], str] | None = None
) -> list[dict[int, Logprob]]:
    """The streamed `TokenLogprob`s as vLLM's ``SampleLogprobs``: per position, ``{token_id: Logprob}`` of the
    sampled token and the top ones, ``decode`` giving each one's text."""
    out = []
    for lp in lps:
        pos = {tid: Logprob(v, rank, decode and decode(tid)) for rank, (tid, v) in enumerate(lp.top, 1)}
        if lp.token_id not in pos:
            pos[lp.token_id] = Logprob(lp.logprob, None, decode and decode(lp.token_id))
        out.append(pos)
    return out


@dataclass(slots=True)
class RequestOutput:
    """What one engine step added to one sequence. ``delta_*`` are what is new since the last output;
    concatenating every ``delta_text`` gives the final ``text``. Streams carry deltas (vLLM's ``DELTA``
    kind): before the sequence finishes, ``text``, ``token_ids`` and ``logprobs`` are its deltas too; the
    final output (``finished``) carries the whole sequence in them."""

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
    metrics: RequestMetrics | None = None  # the caller request's times (shared by its n sequences)


@dataclass(slots=True)
class RequestMetrics:
    """Wall-clock times of one request (``time.time()`` seconds), as vLLM's ``RequestOutput.metrics``:
    ``generate()`` called (time spent waiting for room in the engine counts), its first token out, its last
    sequence finished."""

    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@dataclass(slots=True)
class CompletionOutput:
    """One generated sequence of a prompt (vLLM's ``CompletionOutput``)."""

    index: int  # which of the prompt's n sequences
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None  # sum of the sampled tokens' logprobs; None unless logprobs were asked
    # per position, {token_id: Logprob} of the sampled token and the top ones (vLLM's SampleLogprobs)
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None  # "stop" | "length" | "abort"
    stop_reason: str | int | None = None


@dataclass(slots=True)
class PromptOutput:
    """One prompt's result (vLLM's ``RequestOutput`` of ``LLM.generate``): ``outputs[i]`` is its sequence i."""

    request_id: str
    prompt: str | None  # the text given, a chat's templated text; None for token ids
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int  # prompt tokens found in the prefix cache
    metrics: RequestMetrics | None
    finished: bool = True

    @classmethod
    def from_final(
        cls, prompt: str | None, finals: Sequence[RequestOutput], decode: Callable[[int], str] | None = None
    ) -> PromptOutput:
        """From the final `RequestOutput` of each of a request's sequences (any order); ``decode`` gives a token
        id's text (`Logprob.decoded_token`)."""
        finals = sorted(finals, key=lambda o: o.index)
        first = finals[0]
        outputs = [
            CompletionOutput(
                o.index,
                o.text,
                o.token_ids,
                None if o.logprobs is None else sum(lp.logprob for lp in o.logprobs),
                None if o.logprobs is None else sample_logprobs(o.logprobs, decode),
                o.finish_reason,
                o.stop_reason,
            )
            for o in finals
        ]
        return cls(
            first.request_id,
            prompt,
            first.prompt_token_ids,
            outputs,
            max(o.usage.cached_tokens for o in finals),
            first.metrics,
            all(o.finished for o in finals),
        )
