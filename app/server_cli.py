"""`sluice serve`: the OpenAI-compatible server under uvicorn.

Shutdown on SIGINT/SIGTERM is graceful: uvicorn stops accepting connections, in-flight streams get
``--shutdown-timeout`` seconds to finish before they are cancelled (which aborts their requests), the
engine stops in the lifespan's exit, and the process exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
from collections.abc import Iterator


def register(subparsers) -> None:
    from sluice.app.cli import add_engine_args
    from sluice.app.disagg_cli import add_disagg_args

    p = subparsers.add_parser("serve", help="serve the OpenAI-compatible HTTP API (chat completions over SSE)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default: %(default)s)")
    p.add_argument(
        "--api-key",
        default=os.environ.get("SLUICE_API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1/* (default: $SLUICE_API_KEY; unset = no key)",
    )
    p.add_argument(
        "--metrics-require-key",
        action="store_true",
        help="require the API key on /metrics too (it shows every tenant's counts and cache hits)",
    )
    p.add_argument(
        "--body-timeout",
        type=float,
        default=30.0,
        help="seconds to receive a request's headers (else the connection is closed) and its whole body (else 408) "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--max-response-bytes",
        type=int,
        default=32 << 20,
        help="refuse (400) a request whose whole response could be larger (n x max_tokens x logprobs) "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--max-body-bytes", type=int, default=1 << 20, help="larger request bodies get 413 (default: %(default)s)"
    )
    p.add_argument(
        "--send-timeout",
        type=float,
        default=30.0,
        help="seconds a stalled client may block a stream (default: %(default)s)",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=10.0,
        help="seconds in-flight requests get to finish on shutdown (default: %(default)s)",
    )
    p.add_argument(
        "--retry-after",
        type=int,
        default=1,
        help="Retry-After seconds sent with 503 when overloaded (default: %(default)s)",
    )
    p.add_argument(
        "--log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug"],
        help="uvicorn's log level (default: %(default)s)",
    )
    p.add_argument(
        "--record-trace",
        default=None,
        metavar="FILE",
        help="write every engine step to FILE (JSON lines) for `sluice inspect --trace FILE`; turns the inspector on",
    )
    p.add_argument(
        "--access-log",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="log a line per HTTP request (default: off: at thousands of requests a second it costs the front end "
        "time it needs for streaming)",
    )
    add_engine_args(p)
    add_disagg_args(p)  # --prefill-device / --decode-device: a prefill/decode pair (app/disagg_cli.py)
    # A server runs its engine core in a process of its own: HTTP, detokenization and SSE encoding then never
    # take time from scheduling (--no-engine-core-process keeps one process).
    p.set_defaults(func=cmd_serve, engine_core_process=True)


def cmd_serve(ns: argparse.Namespace) -> int:
    import uvicorn
    from sluice.app.cli import engine_args_from
    from sluice.app.disagg_cli import pair_engine
    from sluice.app.server import SHUTDOWN_MARGIN_S, build_app
    from sluice.core.engine import AsyncEngine
    from sluice.core.models.loader import resolve_model

    args = engine_args_from(ns)
    # A wrong device or model path ends the command with one line here, not with a traceback from inside the
    # server's startup (a GGUF is converted now, once; the engine then finds it in the cache).
    args.resolve_device()
    resolve_model(args.model)
    if ns.record_trace:
        args.enable_inspector = True
    engine = pair_engine(ns, args) or AsyncEngine(args)
    app = build_app(
        engine,
        api_key=ns.api_key,
        max_body_bytes=ns.max_body_bytes,
        send_timeout=ns.send_timeout,
        shutdown_grace_seconds=ns.shutdown_timeout,
        retry_after_seconds=ns.retry_after,
        record_trace=ns.record_trace,
        body_timeout=ns.body_timeout,
        max_response_bytes=ns.max_response_bytes,
        metrics_require_key=ns.metrics_require_key,
    )
    config = uvicorn.Config(
        app,
        host=ns.host,
        port=ns.port,
        log_level=ns.log_level,
        access_log=ns.access_log,
        lifespan="on",
        # At shutdown_timeout the server ends what is still in flight with an error (OpenAIServer.drain); the
        # margin lets those answers go out before uvicorn cancels what is left.
        timeout_graceful_shutdown=math.ceil(ns.shutdown_timeout + 2 * SHUTDOWN_MARGIN_S),
        http=_h11_with_header_timeout(ns.body_timeout),
    )
    server = _server(config, app.state.openai_server, ns.shutdown_timeout)
    server.run()  # a failed startup (model load, port in use) exits non-zero inside, after logging why
    return 0


def _h11_with_header_timeout(timeout_s: float):
    """uvicorn's h11 protocol, closing a connection whose request line and headers have not all arrived
    ``timeout_s`` after it opened (or after its last response): uvicorn only times out idle connections, so a
    client sending its headers a byte at a time could hold a connection forever. The body has its own timeout
    (`OpenAIServer._read_body`)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class Protocol(H11Protocol):
        _headers_timer = None

        def _arm(self) -> None:
            self._disarm()
            self._headers_timer = self.loop.call_later(timeout_s, self._headers_overdue)

        def _disarm(self) -> None:
            if self._headers_timer is not None:
                self._headers_timer.cancel()
                self._headers_timer = None

        def _headers_overdue(self) -> None:
            if (self.cycle is None or self.cycle.response_complete) and not self.transport.is_closing():
                self.transport.close()

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def handle_events(self) -> None:
            super().handle_events()
            if self.cycle is not None and not self.cycle.response_complete:
                self._disarm()  # a request's headers are in

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

    return Protocol


def _server(config, api, grace_seconds: float):
    """A uvicorn server whose shutdown drains ``api`` (`OpenAIServer.drain`: requests still in flight after
    the grace end with an error, not a cut body) and, once complete, exits 0. uvicorn re-raises a caught
    SIGINT/SIGTERM after its graceful shutdown, so the process would die of the signal (exit 130/143); a
    shutdown we completed on request is a clean exit. uvicorn is imported here so other subcommands run
    without it."""
    import anyio
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            with super().capture_signals():
                yield
                self._captured_signals.clear()

        async def shutdown(self, sockets=None) -> None:
            async with anyio.create_task_group() as tg:
                tg.start_soon(api.drain, grace_seconds)
                await super().shutdown(sockets)
                tg.cancel_scope.cancel()

    return Server(config)
