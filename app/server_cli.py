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

    p = subparsers.add_parser("serve", help="serve the OpenAI-compatible HTTP API (chat completions over SSE)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default: %(default)s)")
    p.add_argument(
        "--api-key",
        default=os.environ.get("SLUICE_API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1/* (default: $SLUICE_API_KEY; unset = no key)",
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
    add_engine_args(p)
    p.set_defaults(func=cmd_serve)


def cmd_serve(ns: argparse.Namespace) -> int:
    import uvicorn
    from sluice.app.cli import engine_args_from
    from sluice.app.server import build_app
    from sluice.core.engine import AsyncEngine
    from sluice.core.models.loader import resolve_model

    args = engine_args_from(ns)
    # A wrong device or model path ends the command with one line here, not with a traceback from inside the
    # server's startup (a GGUF is converted now, once; the engine then finds it in the cache).
    args.resolve_device()
    resolve_model(args.model)
    if ns.record_trace:
        args.enable_inspector = True
    engine = AsyncEngine(args)
    app = build_app(
        engine,
        api_key=ns.api_key,
        max_body_bytes=ns.max_body_bytes,
        send_timeout=ns.send_timeout,
        shutdown_grace_seconds=ns.shutdown_timeout,
        retry_after_seconds=ns.retry_after,
        record_trace=ns.record_trace,
    )
    config = uvicorn.Config(
        app,
        host=ns.host,
        port=ns.port,
        log_level=ns.log_level,
        lifespan="on",
        # Streams are cut at shutdown_timeout by sse-starlette; the margin lets their aborts and the
        # non-streamed requests settle before uvicorn cancels what is left.
        timeout_graceful_shutdown=math.ceil(ns.shutdown_timeout) + 2,
    )
    server = _server(config)
    server.run()  # a failed startup (model load, port in use) exits non-zero inside, after logging why
    return 0


def _server(config):
    """A uvicorn server whose completed graceful shutdown exits 0. uvicorn re-raises a caught SIGINT/SIGTERM
    after its graceful shutdown, so the process would die of the signal (exit 130/143); a shutdown we
    completed on request is a clean exit. uvicorn is imported here so other subcommands run without it."""
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            with super().capture_signals():
                yield
                self._captured_signals.clear()

    return Server(config)
