"""What the front end sends a replica, and the HTTP request's session id (``x-session-id``).

The prompt travels as token ids (the front end tokenized it: the `kv` router hashes them into the prefix
cache's block hashes) and as ``text`` (what Ray's prefix-affinity router matches: it reads an argument's
``prompt`` attribute).
"""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass

from sluice.core.sampling_params import SamplingParams

SESSION_HEADER = b"x-session-id"
session_id: ContextVar[str | None] = ContextVar("sluice_session_id", default=None)


@dataclass(slots=True)
class ReplicaRequest:
    token_ids: list[int]
    params: SamplingParams
    request_id: str
    prompt: str  # the prompt's text, for `prefix` routing
    session_id: str | None = None


class SessionMiddleware:
    """Puts the request's ``x-session-id`` header in `session_id`, for the router to keep a session on one
    replica (a pure ASGI middleware: the route's tasks inherit the context)."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            value = dict(scope.get("headers") or ()).get(SESSION_HEADER)
            session_id.set(value.decode("latin-1") if value else None)
        await self.app(scope, receive, send)
