"""The uvicorn server of `sluice serve`, built from its flags: one per process (`app/commands/serve.py` runs one, each
front end of `--api-server-count` runs its own, `app/server/api_servers.py`)."""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import socket
from collections.abc import Callable, Iterator

logger = logging.getLogger("sluice.server")


def no_delay(sock: socket.socket) -> None:
    """TCP_NODELAY on a listening socket, which the connections it accepts inherit. asyncio sets it only on the
    connections of a socket whose protocol number says TCP (a socket made with the default, 0, gets none): uvicorn
    on asyncio's loop (where uvloop is not installed) then answered each request after the first on a kept-alive
    connection ~40 ms late (Nagle's algorithm waiting on the client's delayed ACK)."""
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def build_server(
    ns: argparse.Namespace, engine, log_config: dict | None = None, on_started: Callable[[], None] | None = None
):
    """The uvicorn server of `sluice serve`'s flags over ``engine``. An `--api-server-count` front end passes
    its own ``log_config`` (its lines say which front end they come from) and ``on_started``, called once it
    serves."""
    import uvicorn
    from sluice.app.server.app import SHUTDOWN_MARGIN_S, build_app

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
        default_max_tokens=ns.default_max_tokens or None,
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
        **({} if log_config is None else {"log_config": log_config}),
    )
    return _server(config, app.state.openai_server, ns.shutdown_timeout, on_started)


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


def _server(config, api, grace_seconds: float, on_started: Callable[[], None] | None = None):
    """A uvicorn server whose shutdown drains ``api`` (`OpenAIServer.drain`: requests still in flight after
    the grace end with an error, not a cut body) and, once complete, exits 0. uvicorn re-raises a caught
    SIGINT/SIGTERM after its graceful shutdown, so the process would die of the signal (exit 130/143); a
    shutdown we completed on request is a clean exit. uvicorn is imported here so other subcommands run
    without it.

    A dead engine (its core process killed, a failed step) shuts the server down too, and ``engine_died`` then
    tells the command to exit non-zero: a front end that can only answer 503 is better restarted by its
    supervisor (vLLM's front end exits likewise). The engine has already ended every request in flight with
    `EngineDeadError`, so each stream sends its error event and ``[DONE]`` before the server stops. uvicorn's
    main loop ticks every 0.1 s; the check rides on that tick (two attribute reads), never on a request."""
    import anyio
    import uvicorn

    class Server(uvicorn.Server):
        engine_died = False

        async def on_tick(self, counter: int) -> bool:
            if not self.engine_died and api.engine_is_dead():
                self.engine_died = True
                self.should_exit = True
                logger.error("the engine is dead: stopping the server (exit status 1) for its supervisor to restart")
            return await super().on_tick(counter)

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            with super().capture_signals():
                yield
                self._captured_signals.clear()

        async def startup(self, sockets=None) -> None:
            await super().startup(sockets)
            if self.started and on_started is not None:
                on_started()
            elif self.started and sockets:  # `sluice serve` bound its socket before the load: uvicorn says nothing
                self._log_started_message(sockets)

        async def shutdown(self, sockets=None) -> None:
            async with anyio.create_task_group() as tg:
                tg.start_soon(api.drain, grace_seconds)
                await super().shutdown(sockets)
                tg.cancel_scope.cancel()

    return Server(config)
