"""The inspector's routes, over a live engine (``sluice serve --enable-inspector``) or a recorded trace
(``sluice inspect --trace FILE``):

- ``GET /inspect``: the page (static files of this package; its scripts read the two endpoints below).
- ``GET /inspect/steps[?since=STEP_ID]``: server-sent events, one ``step`` event per step record after
  ``since`` (default: every record still buffered), its ``id`` the step id, then live ones as they happen.
  Without ``since``, a ``Last-Event-ID`` header resumes a dropped stream.
- ``GET /inspect/kv``: a JSON snapshot of the KV block pool and the running requests' block tables.

The two data endpoints take the server's API key like ``/v1/*`` (the page asks for it); the page itself
holds no data and is open. Unknown or malformed query parameters get 400 in OpenAI's error shape.
"""

from __future__ import annotations

import functools
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from importlib import resources
from typing import Any

import anyio
import anyio.lowlevel
from sluice.app.inspector.trace import Trace, load_trace, step_dict
from sluice.app.server.errors import APIError
from sse_starlette import EventSourceResponse
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

_STATIC = {
    "/inspect": ("index.html", "text/html; charset=utf-8"),
    "/inspect/inspector.js": ("inspector.js", "text/javascript; charset=utf-8"),
    "/inspect/inspector.css": ("inspector.css", "text/css; charset=utf-8"),
}


class LiveSource:
    """The running engine's recorder (`core.inspector.StepRecorder`)."""

    mode = "live"

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def _recorder(self):
        rec = self.engine.inspector if getattr(self.engine, "is_running", True) else None
        if rec is None:
            raise APIError(503, "the engine is not running", type="server_error", code="engine_unavailable")
        return rec

    def check(self) -> None:
        self._recorder()

    def steps_after(self, since: int) -> list[dict]:
        return [step_dict(r) for r in self._recorder().since(since)]

    async def wait(self, since: int) -> None:
        await self._recorder().wait(since)

    def kv(self) -> dict:
        return {"mode": self.mode, "model": self.engine.model_name, **self._recorder().kv_snapshot()}


class TraceSource:
    """A recorded trace: every step at once, then nothing new; the KV snapshot is the trace's last one."""

    mode = "trace"

    def __init__(self, trace: Trace) -> None:
        self.trace = trace

    def check(self) -> None:
        pass

    def steps_after(self, since: int) -> list[dict]:
        return [r for r in self.trace.steps if r["step_id"] > since]

    async def wait(self, since: int) -> None:
        await anyio.sleep_forever()

    def kv(self) -> dict:
        if self.trace.kv is None:
            raise APIError(404, "the trace has no KV snapshot (its recording did not finish)", code="not_found")
        return {"mode": self.mode, "model": self.trace.meta.get("model"), **self.trace.kv}


def _query(request: Request, allowed: tuple[str, ...]) -> dict[str, str]:
    params = request.query_params
    for key in params:
        if key not in allowed:
            raise APIError(400, f"{key}: unknown query parameter (allowed: {', '.join(allowed) or 'none'})", param=key)
        if len(params.getlist(key)) > 1:
            raise APIError(400, f"{key}: given more than once", param=key)
    return dict(params)


def _step_id(raw: str, param: str) -> int:
    if not raw.isdigit():  # digits only: no sign, no spaces, no "1e3"
        raise APIError(400, f"{param}: must be a step id (an integer >= 0), got {raw!r}", param=param)
    return int(raw)


def _errors(fn: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
    @functools.wraps(fn)
    async def wrapper(request: Request) -> Response:
        try:
            return await fn(request)
        except APIError as e:
            return e.response()

    return wrapper


def inspector_routes(
    source: LiveSource | TraceSource,
    authorize: Callable[[Request], None] = lambda _request: None,
    sse: Callable[[AsyncIterator[dict]], Response] | None = None,
) -> list[Route]:
    """The page and its two endpoints over ``source``; ``authorize`` raises `APIError` (401) to refuse,
    ``sse`` makes the event-stream response (the server's own, with its timeouts and pings)."""
    files = {
        path: (resources.files(__package__).joinpath(name).read_bytes(), media)
        for path, (name, media) in _STATIC.items()
    }
    make_sse = sse or (lambda events: EventSourceResponse(events, sep="\n", ping=15))

    def static(path: str) -> Callable[[Request], Awaitable[Response]]:
        body, media = files[path]

        async def serve(_request: Request) -> Response:
            return Response(body, media_type=media, headers={"Cache-Control": "no-cache"})

        return serve

    @_errors
    async def steps(request: Request) -> Response:
        authorize(request)
        q = _query(request, ("since",))
        if "since" in q:
            since = _step_id(q["since"], "since")
        elif "last-event-id" in request.headers:
            since = _step_id(request.headers["last-event-id"], "Last-Event-ID")
        else:
            since = 0
        source.check()  # fail now (503), before the stream starts

        async def events() -> AsyncIterator[dict]:
            after = since
            while True:
                for rec in source.steps_after(after):
                    after = rec["step_id"]
                    yield {"event": "step", "id": str(after), "data": json.dumps(rec, separators=(",", ":"))}
                    # A send into an unpaused transport never suspends: without a turn of the event loop per
                    # event, a client that left is noticed only after the whole batch (a trace's every step),
                    # each send into the dead socket logging asyncio's "socket.send() raised exception."
                    await anyio.lowlevel.checkpoint()
                await source.wait(after)

        return make_sse(events())

    @_errors
    async def kv(request: Request) -> Response:
        authorize(request)
        _query(request, ())
        return JSONResponse(source.kv())

    return [
        *(Route(path, static(path), methods=["GET"]) for path in _STATIC),
        Route("/inspect/steps", steps, methods=["GET"]),
        Route("/inspect/kv", kv, methods=["GET"]),
    ]


# -- sluice inspect --trace FILE ---------------------------------------------------------------------------


def build_trace_app(path: str) -> Starlette:
    """The inspector page over a recorded trace (no engine, no API key: the file is already yours)."""

    async def http_error(_request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        return APIError(
            exc.status_code, str(exc.detail), code="not_found" if exc.status_code == 404 else None
        ).response()

    return Starlette(
        routes=inspector_routes(TraceSource(load_trace(path))), exception_handlers={HTTPException: http_error}
    )
