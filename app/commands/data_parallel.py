"""`sluice serve --data-parallel-size N --data-parallel-backend ray`: N engine replicas behind one endpoint.

The flags live here; the Ray code (`app/ray/`) is imported only when the Ray backend is chosen.
"""

from __future__ import annotations

import argparse

ROUTINGS = ("kv", "prefix", "least-loaded", "round-robin")


def add_data_parallel_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("data parallel (Ray Serve replicas)")
    g.add_argument(
        "--data-parallel-size",
        type=int,
        default=1,
        metavar="N",
        help="engine replicas, each a full engine with its own core process (and its own GPU where there are GPUs), "
        "behind this one endpoint (default: %(default)s)",
    )
    g.add_argument(
        "--data-parallel-backend",
        default=None,
        choices=("ray",),
        help="what runs the replicas: ray = a Ray Serve deployment (pip install 'sluice-llm[ray]') (default: ray "
        "when --data-parallel-size > 1)",
    )
    g.add_argument(
        "--ray-address",
        default=None,
        help="join this Ray cluster (ray start --head; 'auto' = the one on this machine) (default: start a local "
        "Ray, stopped on exit)",
    )
    g.add_argument(
        "--routing",
        default="kv",
        choices=ROUTINGS,
        help="which replica takes a request: kv = the one whose cache holds the longest prefix of its blocks (from "
        "the KV events), unless its queue is much longer; prefix = Ray's prefix-affinity router on the prompt "
        "text; least-loaded; round-robin. A request's x-session-id header keeps a session on one replica "
        "(default: %(default)s)",
    )


def serve_data_parallel(ns: argparse.Namespace, args, sock=None) -> int:
    """``sock``: the listening socket `sluice serve` bound before anything loaded (uvicorn listens on it)."""
    from sluice.app.ray.engine import RayConfig, RayEngine
    from sluice.app.ray.request import SessionMiddleware
    from sluice.app.server.uvicorn_server import build_server

    if ns.data_parallel_size < 1:
        raise SystemExit("--data-parallel-size: must be >= 1")
    if ns.api_server_count != 1 or ns.record_trace or args.kv_role != "both":
        raise SystemExit("--data-parallel-size: not with --api-server-count, --record-trace or a prefill/decode pair")
    engine = RayEngine(args, RayConfig(ns.data_parallel_size, ns.routing, ns.ray_address))
    server = build_server(ns, engine)
    server.config.app.add_middleware(SessionMiddleware)
    server.run(sockets=[sock] if sock is not None else None)
    return 1 if server.engine_died else 0
