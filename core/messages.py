"""What crosses the engine's inbox and comes back: `AddRequest` / `AbortRequest` / `EndAllRequests` in; out to
each request's own stream, first the answer to its admission (`Admitted`, or a refusal: a finished `TokenEvent`
with the error), then its `TokenEvent`s."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import anyio
from sluice.core.outputs import TokenLogprob
from sluice.core.request import Request


@dataclass(slots=True)
class TokenEvent:
    """Scheduler -> request actor: new tokens of one request, and whether it ended."""

    request_id: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | None = None
    num_cached_tokens: int = 0
    error: Exception | None = None  # the step failed; the request is over
    first_token_time: float | None = None  # time.time() of the first token, for an event held until the end


@dataclass(slots=True)
class Admitted:
    """Scheduler -> request actor: the request (every sequence of it) was added; its `TokenEvent`s follow."""

    request_id: str  # the first sequence's


@dataclass(slots=True)
class AddRequest:
    """Admit ``requests`` (the n sequences of one caller request); their events go to ``events``.
    The first message answers admission: `Admitted`, else a refusal (`refusal`: the error, nothing added)."""

    requests: list[Request]
    events: Any  # ObjectSendStream[Admitted | TokenEvent]
    # Hold each sequence's tokens until it ends, then send them as one event: an offline batch wakes its
    # request actors once per sequence instead of once per token (the event loop's main cost at large batches).
    final_only: bool = False


@dataclass(slots=True)
class AbortRequest:
    request_id: str


@dataclass(slots=True)
class EndAllRequests:
    """End every request in flight with ``error``, and refuse every later one with it (a server shutting down)."""

    error: Exception


_GONE = (anyio.BrokenResourceError, anyio.ClosedResourceError, anyio.WouldBlock)


def refusal(request_id: str, error: Exception) -> TokenEvent:
    """The answer to a request that is not (or no longer) served: it ends, with ``error``."""
    return TokenEvent(request_id, [], finish_reason="abort", error=error)


def reply(events: Any, ev: TokenEvent | Admitted) -> bool:
    """Send ``ev`` to a caller's event stream without waiting; False if the caller is gone (its abort is on the
    way)."""
    try:
        events.send_nowait(ev)
    except _GONE:
        return False
    return True


async def submit_to(inbox: Any, msg: object) -> bool:
    """Put ``msg`` on an engine's inbox (waiting for room in it); False once the inbox is closed (stopped)."""
    try:
        await inbox.send(msg)
    except (anyio.BrokenResourceError, anyio.ClosedResourceError):
        return False
    return True


def refuse_queued(inbox: Any, error: Exception | None = None) -> None:
    """An inbox closes: the requests still queued in it are answered, not dropped unanswered: refused with
    ``error`` (the engine's failure, when it failed) or `EngineStoppedError` (a stop). Later senders find it
    closed."""
    from sluice.core.errors import EngineStoppedError

    error = error or EngineStoppedError("the engine stopped before the request was admitted")
    while True:
        try:
            msg = inbox.receive_nowait()
        except (anyio.WouldBlock, anyio.EndOfStream, anyio.ClosedResourceError):
            return
        if isinstance(msg, AddRequest):
            reply(msg.events, refusal(msg.requests[0].request_id, error))
