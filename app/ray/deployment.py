"""The Serve application: N `EngineReplica`s, the chosen router, and the stats board they post to."""

from __future__ import annotations

from typing import Any

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig
from sluice.app.ray.replica import EngineReplica
from sluice.app.ray.routers import ROUTERS
from sluice.app.ray.stats_board import StatsBoard
from sluice.core.args import EngineArgs

HEALTH_CHECK_PERIOD_S = 2.0
# A replica's time to finish its requests when the deployment goes down (Serve's default is 20 s, polled every
# 2 s): the server's own SIGTERM has drained its HTTP streams by then, and a loaded machine's shutdown stays
# well inside a supervisor's kill timeout.
GRACEFUL_SHUTDOWN_S = 5.0


def replica_gpus(args: EngineArgs, configured: float | None) -> float:
    if configured is not None:
        return configured
    if args.device.startswith("cuda"):
        return float(args.tensor_parallel_size)
    if args.device == "auto":  # a GPU where the cluster has one
        return float(args.tensor_parallel_size) if ray.cluster_resources().get("GPU", 0) >= 1 else 0.0
    return 0.0


def replica_app(args: EngineArgs, config: Any) -> tuple[Any, Any]:
    """The stats board (a Ray actor) and the bound application to `serve.run`."""
    if config.routing not in ROUTERS:
        raise ValueError(f"routing: must be one of {', '.join(ROUTERS)}, got {config.routing!r}")
    board = ray.remote(num_cpus=0)(StatsBoard).remote()
    router_kwargs: dict[str, Any] = {}
    if config.routing == "kv":
        router_kwargs = {"block_size": args.block_size, "max_imbalance": config.max_imbalance}
    elif config.routing == "prefix":
        router_kwargs = {"imbalanced_threshold": config.max_imbalance}
    deployment = serve.deployment(
        EngineReplica,
        name="engine",
        num_replicas=config.num_replicas,
        max_ongoing_requests=config.max_ongoing_requests,
        health_check_period_s=HEALTH_CHECK_PERIOD_S,
        graceful_shutdown_timeout_s=GRACEFUL_SHUTDOWN_S,
        graceful_shutdown_wait_loop_s=1.0,
        ray_actor_options={"num_cpus": config.replica_cpus, "num_gpus": replica_gpus(args, config.replica_gpus)},
        request_router_config=RequestRouterConfig(
            request_router_class=ROUTERS[config.routing],
            request_router_kwargs=router_kwargs,
            request_routing_stats_period_s=1.0,
        ),
    )
    return board, deployment.bind(args, board)
