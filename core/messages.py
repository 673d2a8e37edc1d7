"""What crosses the engine's inbox and comes back: `AddRequest` / `AbortRequest` / `EndAllRequests` in,
`TokenEvent`s out to each request's own stream."""

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
class AddRequest:
    """Admit ``requests`` (the n sequences of one caller request); their events go to ``events``.
    The first event answers admission: empty and unfinished if admitted, else an error."""

    requests: list[Request]
    events: Any  # ObjectSendStream[TokenEvent]
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


def reply(events: Any, ev: TokenEvent) -> bool:
    """Send ``ev`` to a caller's event stream without waiting; False if the caller is gone (its abort is on the
    way)."""
    try:
        events.send_nowait(ev)
    except _GONE:
        return False
    return True


def refuse_queued(inbox: Any) -> None:
    """An inbox closes: the requests still queued in it are answered (refused with `EngineStoppedError`), not
    dropped unanswered. Later senders find it closed."""
    from sluice.core.errors import EngineStoppedError

    while True:
        try:
            msg = inbox.receive_nowait()
        except (anyio.WouldBlock, anyio.EndOfStream, anyio.ClosedResourceError):
            return
        if isinstance(msg, AddRequest):
            error = EngineStoppedError("the engine stopped before the request was admitted")
            reply(msg.events, TokenEvent(msg.requests[0].request_id, [], finish_reason="abort", error=error))
