"""One data-parallel replica: a full sluice engine (its engine core in a process of its own) behind Serve.

Serve builds the class in a Ray actor; the engine runs in a task of the actor's event loop for the replica's
whole life, so `generate` streams straight from it. Each replica publishes its KV events on ports of its own
and tells the routers where (`record_routing_stats`), so the `kv` router follows every replica's cache. A
failed engine fails `check_health`: Serve replaces the replica, and the router stops sending it requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from sluice.app.ray.request import ReplicaRequest
from sluice.app.ray.stats_board import POST_INTERVAL_S
from sluice.core import AsyncEngine, EngineArgs
from sluice.core.errors import EngineDeadError
from sluice.core.outputs import RequestOutput
from sluice.core.stats import EngineStats


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def kv_event_endpoints(host: str, rank: int, pub: int, replay: int) -> tuple[dict[str, str], dict[str, str]]:
    """The engine's KV event endpoints (`EngineArgs` fields) and where routers reach them (routing stats), for a
    replica of data-parallel ``rank`` publishing on the free ports ``pub`` and ``replay``. The publisher binds
    its base port + rank (`endpoint_for_rank`: vLLM's convention for ranks sharing one endpoint), while each
    replica picked ports of its own: so the engine is given the ports less the rank. (Advertising the base
    ports sent every router of a replica of rank > 0 to a port nobody published on: it saw only its own
    routing, never an eviction.)"""
    engine = {"kv_events_endpoint": f"tcp://*:{pub - rank}", "kv_events_replay_endpoint": f"tcp://*:{replay - rank}"}
    return engine, {"kv_events": f"tcp://{host}:{pub}", "kv_replay": f"tcp://{host}:{replay}"}


class EngineReplica:
    async def __init__(self, args: EngineArgs, board: Any = None, publish_kv_events: bool = True) -> None:
        import ray
        from ray import serve

        ctx = serve.get_replica_context()
        self.tag = ctx.replica_tag if ctx is not None else "replica"
        self.board = board
        self.rank = ctx.rank.rank if ctx is not None and ctx.rank is not None else 0
        self.routing_stats: dict[str, Any] = {"rank": self.rank, "block_size": args.block_size}
        if publish_kv_events:
            engine, routers = kv_event_endpoints(ray.util.get_node_ip_address(), self.rank, _free_port(), _free_port())
            args = replace(args, **engine)
            self.routing_stats |= routers
        self.engine = AsyncEngine(replace(args, data_parallel_rank=self.rank, engine_core_process=True))
        self._stop = asyncio.Event()
        started: asyncio.Future = asyncio.get_running_loop().create_future()
        self._task = asyncio.create_task(self._serve(started))
        await started

    async def _serve(self, started: asyncio.Future) -> None:
        try:
            async with self.engine:
                started.set_result(None)
                while not self._stop.is_set():
                    if self.board is not None:
                        self.board.post.remote(self.tag, replace(self.engine.stats(), healthy=self.engine.is_healthy))
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(self._stop.wait(), POST_INTERVAL_S)
        except BaseException as e:
            if not started.done():
                started.set_exception(e)
            raise

    async def generate(self, req: ReplicaRequest) -> AsyncIterator[RequestOutput]:
        gen = self.engine.generate(req.token_ids, req.params, request_id=req.request_id, wait_for_room=False)
        try:
            async for out in gen:
                yield out
        finally:
            await gen.aclose()

    async def stats(self) -> EngineStats:
        return self.engine.stats()

    async def end_all_requests(self, error: Exception) -> None:
        await self.engine.end_all_requests(error)

    def record_routing_stats(self) -> dict[str, Any]:
        return self.routing_stats

    def check_health(self) -> None:
        error = self.engine.health_error()
        if error is not None or not self.engine.is_running:
            raise EngineDeadError(f"replica {self.rank}: the engine is dead: {error}")

    async def __del__(self) -> None:
        self._stop.set()
        await asyncio.wait([self._task], timeout=10)
