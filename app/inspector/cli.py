"""`sluice inspect --trace FILE`: the inspector page over a recorded trace. Registering the command imports
nothing of the web stack, so the other subcommands start without it."""

from __future__ import annotations

import argparse


def cmd_inspect(ns: argparse.Namespace) -> int:
    import uvicorn
    from sluice.app.inspector.web import build_trace_app

    app = build_trace_app(ns.trace)  # a missing or bad file: one line, exit status 2 (`commands.cli.main`)
    print(f"inspector on {ns.trace}: http://{ns.host}:{ns.port}/inspect")
    uvicorn.run(app, host=ns.host, port=ns.port, log_level=ns.log_level)
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "inspect", help="open the inspector page on a trace recorded by `serve --record-trace` or `cache-sim`"
    )
    p.add_argument("--trace", required=True, metavar="FILE", help="the trace (JSON lines)")
    p.add_argument("--host", default="127.0.0.1", help="the server's host")
    p.add_argument("--port", type=int, default=8000, help="the server's port")
    p.add_argument(
        "--log-level",
        default="warning",
        choices=["critical", "error", "warning", "info", "debug"],
        help="the inspector's own log level",
    )
    p.set_defaults(func=cmd_inspect)
