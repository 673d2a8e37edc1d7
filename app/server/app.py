"""The OpenAI-compatible HTTP API over an `AsyncEngine`: ``build_app(engine) -> Starlette``.

Standalone, the app's lifespan starts the engine. Mounted inside a user's app (``Mount("/llm", app)``),
Starlette does not run a mounted app's lifespan, so the user starts the engine in theirs
(``async with engine: yield``); the app then only serves it.

Streams follow OpenAI's wire format: one ``id``/``created``/``model`` per stream; a choice's first chunk
carries ``delta.role`` together with its first content and is sent only once that content exists (so
time-to-first-token is what a client measures); its last chunk carries ``finish_reason``; with
``stream_options.include_usage`` a final chunk with ``choices: []`` carries the usage; then ``[DONE]``.

Admission errors (bad sampling values, a prompt too long, an overloaded engine) surface on the engine
stream's first step, before any output. So a stream's first output is awaited before the HTTP response
starts: those errors get their proper status (400, 503) instead of a 200 stream that fails. While that
first output is awaited (and while a non-streamed request runs) a watcher cancels the work if the
client disconnects; once streaming, sse-starlette's own disconnect listener does. Either way the engine
generator is closed, which aborts the request and frees its KV blocks.
"""

from __future__ import annotations

import contextlib
import functools
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import anyio
from pydantic import BaseModel, ValidationError
from sluice.app.server import schemas as S
from sluice.app.server.errors import APIError, engine_error, internal_error, validation_error
from sluice.app.server.metrics import RequestTracker, ServerMetrics
from sluice.app.server.openapi import openapi_schema
from sluice.app.server.stream_chunks import ChatChunks, CompletionChunks
from sluice.app.server.tools import ToolCallParser, ToolPlan, plan_tools
from sluice.app.server.tools.plan import constrain_to_tools
from sluice.app.server.tools.stream import ToolCallStream, assistant_message
from sluice.app.server.tools.stream import finish_reason as tool_finish_reason
from sluice.core import __version__
from sluice.core.errors import EngineStoppedError, InvalidRequestError, SluiceError
from sluice.core.outputs import RequestOutput, TokenLogprob, Usage
from sse_starlette import EventSourceResponse
from sse_starlette.sse import SendTimeoutError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

logger = logging.getLogger("sluice.server")


# Bytes of JSON a response carries per generated token: its text (escaped), and per logprob entry (chat:
# token, logprob and its bytes; completions: a token -> logprob pair), upper estimates of what the wire format
# takes, used for the response-size budget.
TEXT_BYTES_PER_TOKEN = 16
CHAT_LOGPROB_BYTES = 100
COMPLETION_LOGPROB_BYTES = 48

# After the shutdown grace: time for the streams `OpenAIServer.drain` ended to send their error and [DONE]
# before sse-starlette (and, later, uvicorn) cut what is left.
SHUTDOWN_MARGIN_S = 2.0

# The most tokens a chat request that sends no max_tokens gets (`sluice serve --default-max-tokens`): an openai
# client's request without one would otherwise run to the end of the context (8k tokens), minutes on a CPU.
DEFAULT_MAX_TOKENS = 1024


@dataclass(slots=True)
class ServerConfig:
    api_key: str | None = None
    max_body_bytes: int = 1 << 20
    send_timeout: float = 30.0  # seconds a stalled client may block one SSE send before its stream is dropped
    ping_interval: float = 15.0  # SSE keep-alive comments, for proxies that close idle connections
    shutdown_grace_seconds: float = 10.0  # on shutdown, streams get this long to finish before they are aborted
    retry_after_seconds: int = 1
    body_timeout: float = 30.0  # seconds to receive a whole request body (a slow sender holds a connection)
    max_response_bytes: int = 32 << 20  # the estimated size of one whole response (see `response_size_error`)
    metrics_require_key: bool = False  # /metrics shows every tenant's counts: behind the API key too
    default_max_tokens: int | None = DEFAULT_MAX_TOKENS  # a chat request that sends none; None: the context's rest


def build_app(
    engine: Any,
    api_key: str | None = None,
    *,
    max_body_bytes: int = 1 << 20,
    send_timeout: float = 30.0,
    ping_interval: float = 15.0,
    shutdown_grace_seconds: float = 10.0,
    retry_after_seconds: int = 1,
    record_trace: str | None = None,
    body_timeout: float = 30.0,
    max_response_bytes: int = 32 << 20,
    metrics_require_key: bool = False,
    default_max_tokens: int | None = DEFAULT_MAX_TOKENS,
) -> Starlette:
    """The OpenAI-compatible API over ``engine`` (an `AsyncEngine`, started or not).

    Routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /v1/models/{model},
    GET /health, GET /version, GET /metrics, GET /openapi.json (and POST /v1/embeddings, which says it is not
    supported). With ``api_key`` set, /v1/* requires ``Authorization: Bearer KEY`` (and
    /metrics too with ``metrics_require_key``). A request body must arrive within ``body_timeout`` seconds (else
    408); a request whose whole response could exceed ``max_response_bytes`` is refused (400). A chat request
    that sends no ``max_tokens`` (nor ``max_completion_tokens``) gets at most ``default_max_tokens`` (None: up to
    the end of the context, vLLM's default); a completion's default stays OpenAI's 16.
    With the engine's ``enable_inspector``: GET /inspect (a page), /inspect/steps, /inspect/kv
    (`app.inspector.web`; the data endpoints take the key too); ``record_trace`` writes the steps to a trace
    file while the app's lifespan runs (`app.inspector.trace`).
    """
    if max_body_bytes < 1:
        raise InvalidRequestError(f"max_body_bytes: must be >= 1, got {max_body_bytes}", param="max_body_bytes")
    inspector = bool(getattr(getattr(engine, "args", None), "enable_inspector", False))
    if record_trace is not None and not inspector:
        raise InvalidRequestError("record_trace: needs the engine's enable_inspector", param="record_trace")
    if metrics_require_key and api_key is None:
        raise InvalidRequestError("metrics_require_key: needs an api_key", param="metrics_require_key")
    if default_max_tokens is not None and default_max_tokens < 1:
        raise InvalidRequestError(f"default_max_tokens: must be >= 1, got {default_max_tokens}", param="max_tokens")
    for name, value in (("body_timeout", body_timeout), ("max_response_bytes", max_response_bytes)):
        if not value > 0:
            raise InvalidRequestError(f"{name}: must be > 0, got {value}", param=name)
    config = ServerConfig(
        api_key,
        max_body_bytes,
        send_timeout,
        ping_interval,
        shutdown_grace_seconds,
        retry_after_seconds,
        body_timeout,
        max_response_bytes,
        metrics_require_key,
        default_max_tokens,
    )
    api = OpenAIServer(engine, config)

    @contextlib.asynccontextmanager
    async def lifespan(_app: Starlette) -> AsyncIterator[None]:
        async with contextlib.AsyncExitStack() as stack:
            if not getattr(engine, "is_running", True):  # else the embedding app started it
                await stack.enter_async_context(engine)
            if record_trace is not None:
                from sluice.app.inspector.trace import recording

                await stack.enter_async_context(recording(engine, record_trace))
            yield

    async def http_error(_request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        code = "not_found" if exc.status_code == 404 else None
        return APIError(exc.status_code, str(exc.detail), code=code, headers=exc.headers).response()

    async def server_error(_request: Request, _exc: Exception) -> Response:
        return internal_error().response()

    routes = api.routes()
    if inspector:
        from sluice.app.inspector.web import LiveSource, inspector_routes

        routes += inspector_routes(LiveSource(engine), api.authorize, api.event_stream)
    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers={HTTPException: http_error, 500: server_error},
    )
    app.state.openai_server = api
    return app


def _endpoint(fn: Callable[..., Awaitable[Response]]) -> Callable[..., Awaitable[Response]]:
    """Turns any failure of a route into an OpenAI-shaped error; a stack trace only reaches the log."""

    @functools.wraps(fn)
    async def wrapper(self: OpenAIServer, request: Request) -> Response:
        try:
            return await fn(self, request)
        except APIError as e:
            return e.response()
        except SluiceError as e:
            return self.engine_error(e).response()
        except Exception:
            logger.exception("%s %s failed", request.method, request.url.path)
            return internal_error().response()

    return wrapper


_GONE = object()  # the client disconnected before the work finished


async def _until_disconnect(request: Request, fn: Callable[[], Awaitable[Any]]) -> Any:
    """Run ``fn()`` but cancel it if the client disconnects first (then return ``_GONE``).

    Only for use once the request body has been read: every later ASGI message is a disconnect."""
    result: Any = _GONE
    error: BaseException | None = None
    async with anyio.create_task_group() as tg:

        async def watch() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass
            tg.cancel_scope.cancel()

        tg.start_soon(watch)
        try:
            result = await fn()
        except Exception as e:  # re-raised below, outside the task group, so not as an ExceptionGroup
            error = e
        tg.cancel_scope.cancel()
    if error is not None:
        raise error
    return result


class _EventSource(EventSourceResponse):
    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except SendTimeoutError:
            # The generator was closed (request aborted) before this propagated; the client stalled.
            logger.warning("dropped a stream: the client did not read for %ss", self.send_timeout)


class OpenAIServer:
    def __init__(self, engine: Any, config: ServerConfig) -> None:
        self.engine = engine
        self.config = config
        self.metrics = ServerMetrics(engine)
        self.started = int(time.time())
        self._token_text = functools.lru_cache(maxsize=1 << 16)(self._decode_token)
        self._openapi: bytes | None = None
        self._inflight = 0  # requests between generate() and their last output
        self._draining = False

    def routes(self) -> list[Route]:
        return [
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/models/{model:path}", self.model, methods=["GET"]),
            Route("/v1/embeddings", self.embeddings, methods=["POST"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/version", self.version, methods=["GET"]),
            Route("/metrics", self.prometheus, methods=["GET"]),
            Route("/openapi.json", self.openapi, methods=["GET"]),
        ]

    def engine_error(self, e: SluiceError, prompt_param: str = "prompt") -> APIError:
        return engine_error(e, prompt_param, self.config.retry_after_seconds)

    def authorize(self, request: Request) -> None:
        """Raise 401 unless ``request`` carries this server's API key (when it has one)."""
        key = self.config.api_key
        if key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise APIError(401, "missing API key: send 'Authorization: Bearer KEY'", code="invalid_api_key")
        if not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise APIError(401, "incorrect API key", code="invalid_api_key")

    async def _read_body(self, request: Request) -> bytes:
        limit = self.config.max_body_bytes
        too_big = APIError(
            413,
            f"request body exceeds {limit} bytes",
            code="request_too_large",
            headers={"Connection": "close"},
        )
        length = request.headers.get("content-length")
        if length is not None:
            if not length.isdigit():
                raise APIError(400, "invalid Content-Length header")
            if int(length) > limit:
                raise too_big
        size, parts = 0, []
        # The whole body within body_timeout: a client that declares 100 bytes and sends 2 would otherwise
        # hold its connection (and a slot of the server's) for as long as it likes.
        with anyio.move_on_after(self.config.body_timeout) as scope:
            async for chunk in request.stream():  # also bounds bodies sent without a Content-Length
                size += len(chunk)
                if size > limit:
                    raise too_big
                parts.append(chunk)
        if scope.cancelled_caught:
            raise APIError(
                408,
                f"the request body did not arrive within {self.config.body_timeout:g} s",
                code="request_timeout",
                headers={"Connection": "close"},
            )
        return b"".join(parts)

    async def _parse(self, request: Request, model: type[BaseModel]) -> Any:
        body = await self._read_body(request)
        try:
            return model.model_validate_json(body)
        except ValidationError as e:
            raise validation_error(e) from None

    def _check_running(self) -> None:
        if self._draining:
            raise APIError(503, "the server is shutting down", type="server_error", code="server_shutting_down")
        # Mounted in a user's app whose lifespan has not started the engine (yet, or any more).
        if not getattr(self.engine, "is_running", True):
            raise APIError(503, "the engine is not running", type="server_error", code="engine_unavailable")

    def engine_is_dead(self) -> bool:
        """The engine was started and has died (its core process ended, a step failed): it will never serve
        again. Not before it starts, nor after a stop."""
        return bool(getattr(self.engine, "is_running", False)) and not getattr(self.engine, "is_healthy", True)

    async def drain(self, grace_seconds: float) -> None:
        """Shut down without cutting anyone off silently: new requests get 503 at once, those in flight get
        ``grace_seconds`` to finish, then each ends with an error in OpenAI's shape (on a stream an error event
        and ``[DONE]``, otherwise 503 JSON) instead of a truncated body. `sluice serve` runs it when shutdown
        begins; an app that serves `build_app` under its own server calls it from its shutdown."""
        self._draining = True
        with anyio.move_on_after(grace_seconds):
            while self._inflight:
                await anyio.sleep(0.05)
        # A dead engine has ended every request already (and may not read its inbox any more).
        if self._inflight and getattr(self.engine, "is_running", False) and not self.engine_is_dead():
            logger.warning("shutdown: ending %d request(s) still in flight", self._inflight)
            await self.engine.end_all_requests(EngineStoppedError("the server is shutting down"))

    def _check_response_size(self, params: Any, per_logprob_bytes: int) -> None:
        """Refuse a request whose whole response could exceed the budget: it is built (or, streamed, its
        logprobs kept) in memory, and ``n=128, top_logprobs=20`` to the end of the context is ~1 GB of JSON."""
        room = self.engine.max_model_len
        max_tokens = min(params.max_tokens or room, room)
        per_token = TEXT_BYTES_PER_TOKEN
        if params.logprobs is not None:
            per_token += (1 + params.logprobs) * per_logprob_bytes
        size = params.n * max_tokens * per_token
        budget = self.config.max_response_bytes
        if size > budget:
            raise APIError(
                400,
                f"the response could reach {size / 1e6:.1f} MB (n={params.n} x max_tokens={max_tokens} x "
                f"{per_token} bytes per token), over this server's budget of {budget / 1e6:.1f} MB: lower n, "
                "max_tokens or the number of logprobs",
                param="max_tokens",
                code="response_too_large",
            )

    def _check_model(self, name: str | None) -> str:
        self._check_running()
        served = self.engine.model_name
        if name is not None and name != served:
            raise APIError(
                404, f"the model '{name}' does not exist; served: '{served}'", param="model", code="model_not_found"
            )
        return served

    # -- generation ------------------------------------------------------------------------------------
    async def _generate(self, prompt: Any, params: Any, request_id: str) -> AsyncIterator[RequestOutput]:
        tracker: RequestTracker = self.metrics.tracker()
        gen = self.engine.generate(prompt, params, request_id=request_id, wait_for_room=False)  # full: 503
        usage = None
        self._inflight += 1
        try:
            async for out in gen:
                tracker.observe(out.index, out.finish_reason)
                usage = out.usage
                yield out
            tracker.done(usage)
        finally:
            self._inflight -= 1
            await gen.aclose()  # aborts the request if it is still running

    async def _first(self, request: Request, gen: AsyncIterator[RequestOutput], prompt_param: str) -> Any:
        try:
            first = await _until_disconnect(request, gen.__anext__)
        except StopAsyncIteration:
            raise internal_error() from None
        except SluiceError as e:
            raise self.engine_error(e, prompt_param) from None
        if first is _GONE:
            await gen.aclose()
        return first

    async def _collect(
        self, request: Request, gen: AsyncIterator[RequestOutput], prompt_param: str
    ) -> tuple[dict[int, RequestOutput], Usage] | None:
        finals: dict[int, RequestOutput] = {}
        usage = Usage()

        async def run() -> bool:
            nonlocal usage
            async for out in gen:
                usage = out.usage
                if out.finished:
                    finals[out.index] = out
            return True

        try:
            done = await _until_disconnect(request, run)
        except SluiceError as e:
            raise self.engine_error(e, prompt_param) from None
        finally:
            await gen.aclose()
        return None if done is _GONE else (finals, usage)

    def event_stream(self, events: AsyncIterator[str]) -> Response:
        """The SSE response of ``events`` (data lines) with this server's send timeout, pings and shutdown cut."""
        return _EventSource(
            events,
            sep="\n",
            send_timeout=self.config.send_timeout,
            ping=self.config.ping_interval,
            # sse-starlette's own cut at shutdown is a backstop: `drain` ends the stream properly before it.
            shutdown_grace_period=self.config.shutdown_grace_seconds + SHUTDOWN_MARGIN_S,
        )

    async def _stream_events(
        self,
        first: RequestOutput,
        gen: AsyncIterator[RequestOutput],
        make_chunk: Callable[..., str | list[str] | None],
        usage_chunk: Callable[[Usage], str] | None,
    ) -> AsyncIterator[str]:
        """The SSE data lines of one stream; an engine failure mid-stream becomes an error event."""
        try:
            usage = first.usage
            out: RequestOutput | None = first
            while out is not None:
                usage = out.usage
                data = make_chunk(out)
                if isinstance(data, str):
                    yield data
                elif data:  # several chunks for one output (a tool call's fragments)
                    for d in data:
                        yield d
                out = await anext(gen, None)
            if usage_chunk is not None:
                yield usage_chunk(usage)
            yield "[DONE]"
        except SluiceError as e:
            yield json.dumps(self.engine_error(e).body())
            yield "[DONE]"
        except Exception:
            logger.exception("stream failed")
            yield json.dumps(internal_error().body())
            yield "[DONE]"
        finally:
            await gen.aclose()

    # -- formatting ------------------------------------------------------------------------------------
    def _decode_token(self, token_id: int) -> str:
        return self.engine.tokenizer.decode([token_id])

    def _chat_logprobs(self, lps: list[TokenLogprob]) -> S.ChoiceLogprobs:
        def info(tid: int, lp: float) -> dict:
            text = self._token_text(tid)
            return {"token": text, "logprob": max(lp, -9999.0), "bytes": list(text.encode("utf-8"))}

        return S.ChoiceLogprobs(
            content=[
                S.TokenLogprobInfo(
                    **info(t.token_id, t.logprob), top_logprobs=[S.TopLogprob(**info(i, v)) for i, v in t.top]
                )
                for t in lps
            ]
        )

    def _completion_logprobs(self, lps: list[TokenLogprob], offset: int) -> S.CompletionLogprobs:
        tokens = [self._token_text(t.token_id) for t in lps]
        offsets = []
        for text in tokens:
            offsets.append(offset)
            offset += len(text)
        return S.CompletionLogprobs(
            tokens=tokens,
            token_logprobs=[max(t.logprob, -9999.0) for t in lps],
            top_logprobs=[{self._token_text(i): max(v, -9999.0) for i, v in t.top} for t in lps],
            text_offset=offsets,
        )

    @staticmethod
    def _usage(u: Usage) -> S.UsageInfo:
        return S.UsageInfo(
            prompt_tokens=u.prompt_tokens,
            completion_tokens=u.completion_tokens,
            total_tokens=u.total_tokens,
            prompt_tokens_details=S.PromptTokensDetails(cached_tokens=u.cached_tokens),
        )

    # -- routes ----------------------------------------------------------------------------------------
    async def _respond(
        self,
        request: Request,
        stream: bool,
        gen: AsyncIterator[RequestOutput],
        prompt_param: str,
        respond: Callable[[dict[int, RequestOutput], Usage], BaseModel],
        make_chunk: Callable[[RequestOutput], str | list[str] | None],
        usage_chunk: Callable[[Usage], str] | None,
    ) -> Response:
        """The JSON response of a finished request, or its event stream (chat and text completions alike)."""
        if not stream:
            got = await self._collect(request, gen, prompt_param)
            if got is None:
                return Response(status_code=499)  # nobody is listening any more
            return Response(respond(*got).model_dump_json(), media_type="application/json")
        first = await self._first(request, gen, prompt_param)
        if first is _GONE:
            return Response(status_code=499)
        return self.event_stream(self._stream_events(first, gen, make_chunk, usage_chunk))

    @staticmethod
    def _delta_logprobs(
        out: RequestOutput, want_lp: bool, pending: dict[int, list[TokenLogprob]]
    ) -> tuple[bool, list[TokenLogprob] | None]:
        """Whether ``out`` makes a chunk, and the logprobs it carries. Tokens whose text is not shown yet
        (an incomplete character, or text held back for a stop string) keep their logprobs for the next one."""
        if want_lp and out.delta_logprobs:
            pending.setdefault(out.index, []).extend(out.delta_logprobs)
        if not out.delta_text and out.finish_reason is None:
            return False, None
        return True, (pending.pop(out.index, []) if want_lp else None)

    @_endpoint
    async def chat_completions(self, request: Request) -> Response:
        self.authorize(request)
        req: S.ChatCompletionRequest = await self._parse(request, S.ChatCompletionRequest)
        model = self._check_model(req.model)
        params = req.sampling_params()
        if params.max_tokens is None and self.config.default_max_tokens is not None:
            params.max_tokens = max(self.config.default_max_tokens, params.min_tokens)
        self._check_response_size(params, CHAT_LOGPROB_BYTES)
        plan = plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls)
        if plan is not None:
            return await self._tool_chat(request, req, params, plan, model)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        want_lp = params.logprobs is not None
        role_sent: set[int] = set()
        pending: dict[int, list[TokenLogprob]] = {}
        usage_field = {"usage": None} if req.include_usage else {}

        def respond(finals: dict[int, RequestOutput], usage: Usage) -> BaseModel:
            choices = [
                S.ChatChoice(
                    index=i,
                    message=S.AssistantMessage(content=o.text),
                    logprobs=self._chat_logprobs(o.logprobs or []) if want_lp else None,
                    finish_reason=o.finish_reason,
                )
                for i, o in sorted(finals.items())
            ]
            return S.ChatCompletionResponse(
                id=rid, created=created, model=model, choices=choices, usage=self._usage(usage)
            )

        def chunk(choices: list[S.ChatChunkChoice], **usage: Any) -> str:
            c = S.ChatCompletionChunk(
                id=rid, object="chat.completion.chunk", created=created, model=model, choices=choices, **usage
            )
            return c.model_dump_json(exclude_unset=True)

        fast = ChatChunks(rid, created, model, req.include_usage)

        def make_chunk(out: RequestOutput) -> str | None:
            emit, lps = self._delta_logprobs(out, want_lp, pending)
            if not emit:
                return None
            first = out.index not in role_sent
            if lps is None:
                if first:
                    role_sent.add(out.index)
                return fast.chunk(out.index, out.delta_text, first, out.finish_reason)
            if first:
                role_sent.add(out.index)
                delta = S.DeltaMessage(role="assistant", content=out.delta_text)
            else:
                delta = S.DeltaMessage(content=out.delta_text) if out.delta_text else S.DeltaMessage()
            lp = self._chat_logprobs(lps) if lps is not None else None
            return chunk(
                [S.ChatChunkChoice(index=out.index, delta=delta, logprobs=lp, finish_reason=out.finish_reason)],
                **usage_field,
            )

        def usage_chunk(u: Usage) -> str:
            return chunk([], usage=self._usage(u))

        gen = self._generate(req.prompt(), params, rid)
        return await self._respond(
            request, bool(req.stream), gen, "messages", respond, make_chunk, usage_chunk if req.include_usage else None
        )

    async def _tool_chat(
        self, request: Request, req: S.ChatCompletionRequest, params: Any, plan: ToolPlan, model: str
    ) -> Response:
        """A chat turn with tools: the tools rendered by the chat template, the turn held to the plan's grammar,
        and its text read back into ``tool_calls`` (`app/server/tools`)."""
        from sluice.core.frontend.tokenizer import apply_chat_template

        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        want_lp = params.logprobs is not None
        usage_field = {"usage": None} if req.include_usage else {}
        constrain_to_tools(params, plan)
        split = bool(getattr(getattr(self.engine, "args", None), "split_special_tokens", False))
        prompt = await anyio.to_thread.run_sync(
            apply_chat_template, self.engine.tokenizer, req.prompt(), split, plan.tools
        )

        def respond(finals: dict[int, RequestOutput], usage: Usage) -> BaseModel:
            choices = []
            for i, o in sorted(finals.items()):
                turn = ToolCallParser.parse(o.text, plan.auto)
                choices.append(
                    S.ChatChoice(
                        index=i,
                        message=assistant_message(turn),
                        logprobs=self._chat_logprobs(o.logprobs or []) if want_lp else None,
                        finish_reason=tool_finish_reason(o.finish_reason, bool(turn.calls)),
                    )
                )
            return S.ChatCompletionResponse(
                id=rid, created=created, model=model, choices=choices, usage=self._usage(usage)
            )

        def write(choice: S.ChatChunkChoice) -> str:
            c = S.ChatCompletionChunk(
                id=rid, object="chat.completion.chunk", created=created, model=model, choices=[choice], **usage_field
            )
            return c.model_dump_json(exclude_unset=True)

        stream = ToolCallStream(plan, write)

        def make_chunk(out: RequestOutput) -> list[str]:
            lps = self._chat_logprobs(out.delta_logprobs).content if want_lp and out.delta_logprobs else None
            return stream.chunks(out.index, out.delta_text, out.finish_reason, lps)

        def usage_chunk(u: Usage) -> str:
            c = S.ChatCompletionChunk(
                id=rid, object="chat.completion.chunk", created=created, model=model, choices=[], usage=self._usage(u)
            )
            return c.model_dump_json(exclude_unset=True)

        gen = self._generate(prompt, params, rid)
        return await self._respond(
            request, bool(req.stream), gen, "messages", respond, make_chunk, usage_chunk if req.include_usage else None
        )

    @_endpoint
    async def completions(self, request: Request) -> Response:
        self.authorize(request)
        req: S.CompletionRequest = await self._parse(request, S.CompletionRequest)
        model = self._check_model(req.model)
        params = req.sampling_params()
        self._check_response_size(params, COMPLETION_LOGPROB_BYTES)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        want_lp = params.logprobs is not None
        pending: dict[int, list[TokenLogprob]] = {}
        offsets: dict[int, int] = {}
        usage_field = {"usage": None} if req.include_usage else {}

        def respond(finals: dict[int, RequestOutput], usage: Usage) -> BaseModel:
            choices = [
                S.CompletionChoice(
                    index=i,
                    text=o.text,
                    logprobs=self._completion_logprobs(o.logprobs or [], 0) if want_lp else None,
                    finish_reason=o.finish_reason,
                )
                for i, o in sorted(finals.items())
            ]
            return S.CompletionResponse(id=rid, created=created, model=model, choices=choices, usage=self._usage(usage))

        def chunk(choices: list[S.CompletionChoice], **usage: Any) -> str:
            c = S.CompletionResponse(
                id=rid, object="text_completion", created=created, model=model, choices=choices, **usage
            )
            return c.model_dump_json(exclude_unset=True)

        fast = CompletionChunks(rid, created, model, req.include_usage)

        def make_chunk(out: RequestOutput) -> str | None:
            emit, lps = self._delta_logprobs(out, want_lp, pending)
            if not emit:
                return None
            if lps is None:
                return fast.chunk(out.index, out.delta_text, out.finish_reason)
            lp = None
            if lps is not None:
                lp = self._completion_logprobs(lps, offsets.get(out.index, 0))
                offsets[out.index] = offsets.get(out.index, 0) + sum(len(t) for t in lp.tokens)
            choice = S.CompletionChoice(
                index=out.index, text=out.delta_text, logprobs=lp, finish_reason=out.finish_reason
            )
            return chunk([choice], **usage_field)

        def usage_chunk(u: Usage) -> str:
            return chunk([], usage=self._usage(u))

        gen = self._generate(req.prompt, params, rid)
        return await self._respond(
            request, bool(req.stream), gen, "prompt", respond, make_chunk, usage_chunk if req.include_usage else None
        )

    def _model_card(self) -> S.ModelCard:
        return S.ModelCard(
            id=self.engine.model_name, created=self.started, max_model_len=getattr(self.engine, "max_model_len", None)
        )

    @_endpoint
    async def models(self, request: Request) -> Response:
        self.authorize(request)
        self._check_running()
        return Response(S.ModelList(data=[self._model_card()]).model_dump_json(), media_type="application/json")

    @_endpoint
    async def model(self, request: Request) -> Response:
        """`GET /v1/models/{model}`: the served model's card, or 404 (``model_not_found``) as OpenAI answers."""
        self.authorize(request)
        self._check_model(request.path_params["model"])
        return Response(self._model_card().model_dump_json(), media_type="application/json")

    async def embeddings(self, _request: Request) -> Response:
        """Said plainly, in OpenAI's error shape, rather than a bare "Not Found": a client may try it."""
        return APIError(
            404,
            "embeddings are not supported: this server generates text (/v1/completions, /v1/chat/completions)",
            code="unsupported_endpoint",
        ).response()

    async def health(self, _request: Request) -> Response:
        if getattr(self.engine, "is_healthy", False):
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unhealthy"}, status_code=503)

    async def version(self, _request: Request) -> Response:
        return JSONResponse({"version": __version__})

    @_endpoint
    async def prometheus(self, request: Request) -> Response:
        if self.config.metrics_require_key:
            self.authorize(request)
        body, content_type = self.metrics.render()
        return Response(body, media_type=content_type)

    async def openapi(self, _request: Request) -> Response:
        if self._openapi is None:
            with_auth = self.config.api_key is not None
            self._openapi = json.dumps(openapi_schema(with_auth, self.config.metrics_require_key)).encode()
        return Response(self._openapi, media_type="application/json")
