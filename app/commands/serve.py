"""`sluice serve`: the OpenAI-compatible server under uvicorn (built by `app/server/uvicorn_server.py`; with
``--api-server-count N``, N of them in front of one engine core: `app/server/api_servers.py`).

Shutdown on SIGINT/SIGTERM is graceful: uvicorn stops accepting connections, in-flight streams get
``--shutdown-timeout`` seconds to finish before they are cancelled (which aborts their requests), the
engine stops in the lifespan's exit, and the process exits 0. An engine that dies (its core process killed, a
failed step) ends every request with an error, then the server stops and exits 1.
"""

from __future__ import annotations

import argparse
import socket

from sluice.app.server.uvicorn_server import no_delay
from sluice.core import cpu_threads, envs
from sluice.core.errors import SluiceError

DEFAULT_MAX_TOKENS = 1024  # app.server.app.DEFAULT_MAX_TOKENS, without importing the server to build --help


def port_number(text: str) -> int:
    """``--port``'s type: a TCP port, 0..65535 (0: any free port), refused at parse time with argparse's one line."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"must be 0..65535, got {port}")
    return port


def token_count(text: str) -> int:
    """``--default-max-tokens``' type: a count >= 0, refused at parse time."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {n}")
    return n


def bind_listening_socket(host: str, port: int) -> socket.socket:
    """Bind ``host:port`` before the model loads (which takes a minute on a CPU) and keep it: a port in use, or an
    address not on this machine, is one line now rather than uvicorn's after the load, and no other program can
    take the port during the load (binding once and letting go left that window open). uvicorn then listens on
    this socket. SO_REUSEADDR as uvicorn's own, so a port left in TIME_WAIT by the last run counts as free."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise SluiceError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    family, kind, proto, _, address = infos[0]
    s = socket.socket(family, kind, proto)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    no_delay(s)  # uvicorn listens on this socket: its connections as uvicorn's own would be
    try:
        s.bind(address)
    except OSError as e:
        s.close()
        hint = " (another server there? pick another --port)" if port else ""
        raise SluiceError(f"cannot listen on {host}:{port}: {e.strerror}{hint}") from None
    return s


def register(subparsers) -> None:
    from sluice.app.commands.cli import add_engine_args
    from sluice.app.commands.data_parallel import add_data_parallel_args
    from sluice.app.commands.disagg import add_disagg_args

    p = subparsers.add_parser("serve", help="serve the OpenAI-compatible HTTP API (chat completions over SSE)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    p.add_argument("--port", type=port_number, default=8000, help="port to listen on, 0..65535 (default: %(default)s)")
    p.add_argument(
        "--api-key",
        default=envs.SLUICE_API_KEY,
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
        "--default-max-tokens",
        type=token_count,
        default=DEFAULT_MAX_TOKENS,
        metavar="N",
        help="the most tokens a chat completion that sends no max_tokens (nor max_completion_tokens) generates, "
        "within what is left of the context; 0 = up to the end of the context, vLLM's default. A completion's "
        "default stays OpenAI's 16 (default: %(default)s)",
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
    p.add_argument(
        "--api-server-count",
        type=int,
        default=1,
        metavar="N",
        help="front-end processes (HTTP, request actors, detokenizing, SSE), all on the one port, in front of one "
        "engine core; /metrics and /health cover them all. Needs the engine core process (default: %(default)s)",
    )
    add_data_parallel_args(p)  # --data-parallel-size N --data-parallel-backend ray (app/ray/)
    add_engine_args(p)
    add_disagg_args(p)  # --prefill-device / --decode-device: a prefill/decode pair (app/commands/disagg.py)
    # A server runs its engine core in a process of its own: HTTP, detokenization and SSE encoding then never
    # take time from scheduling (--no-engine-core-process keeps one process).
    p.set_defaults(func=cmd_serve, engine_core_process=True, quantization="auto")  # args.resolve_quantization


def cmd_serve(ns: argparse.Namespace) -> int:
    from sluice.app.commands.cli import engine_args_from
    from sluice.app.commands.disagg import pair_engine
    from sluice.app.server.uvicorn_server import build_server
    from sluice.core.frontend.engine import AsyncEngine
    from sluice.core.models.loader import resolve_model

    sock = bind_listening_socket(ns.host, ns.port)  # before anything loads; uvicorn listens on it
    args = engine_args_from(ns)
    if ns.api_server_count != 1:
        from sluice.app.server.api_servers import check_api_server_count

        check_api_server_count(ns, args)
    # A wrong device or model path ends the command with one line here, not with a traceback from inside the
    # server's startup (a GGUF is converted now, once; the engine then finds it in the cache).
    args.resolve_device()
    resolve_model(args.model, envs.SLUICE_CACHE_DIR)
    if ns.api_server_count > 1:
        from sluice.app.server.api_servers import serve_api_servers

        sock.close()  # the supervisor binds the socket its front ends share
        return serve_api_servers(ns, args)
    if ns.data_parallel_size > 1 or ns.data_parallel_backend == "ray":
        from sluice.app.commands.data_parallel import serve_data_parallel

        return serve_data_parallel(ns, args, sock)
    if ns.record_trace:
        args.enable_inspector = True
    if args.engine_core_process and not args.enable_inspector:  # the model runs in the core's process
        cpu_threads.apply(cpu_threads.front_end())
    engine = pair_engine(ns, args) or AsyncEngine(args)
    server = build_server(ns, engine)
    server.run(sockets=[sock])  # a failed startup (model load) exits non-zero inside, after logging why
    return 1 if server.engine_died else 0  # a dead engine: for a supervisor to restart the server
