"""`RayEngine`: N sluice engines as one, for the OpenAI app (`app/server/app.py`) on Ray Serve.

It has what the app uses of an `AsyncEngine` (``generate``, ``stats``, ``model_name``, ``tokenizer``,
``max_model_len``, ``is_running``, ``is_healthy``, ``end_all_requests``, ``async with``): the app, its routes,
errors, metrics and auth are the same as with one engine. ``generate`` tokenizes here (the `kv` router hashes the
token ids) and streams the request's outputs from the replica its router picks, through a streaming Serve
handle. A replica that dies fails its own requests with `EngineDeadError` (``engine_dead``); Serve replaces it
and routes new requests to the others meanwhile.

Without ``ray_address`` it starts a Ray of its own on this machine (and stops it on exit); with one it joins
that cluster (``ray start --head`` / ``ray start --address``) and removes only its own application on exit.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any

import anyio
from sluice.app.ray.policy import MAX_IMBALANCE
from sluice.app.ray.request import ReplicaRequest, session_id
from sluice.app.ray.stats_board import POST_INTERVAL_S, live, summed
from sluice.core import envs
from sluice.core.args import EngineArgs
from sluice.core.errors import EngineDeadError, SluiceError
from sluice.core.frontend.engine import max_model_len_for
from sluice.core.frontend.tokenizer import apply_chat_template, load_tokenizer
from sluice.core.models.loader import resolve_model
from sluice.core.outputs import RequestOutput
from sluice.core.sampling_params import SamplingParams
from sluice.core.stats import EngineStats

logger = logging.getLogger("sluice")

STARTUP_TIMEOUT_S = 600.0  # serve.run returned: the replicas are up, their first post is a moment away


@dataclass(slots=True)
class RayConfig:
    num_replicas: int = 2
    routing: str = "kv"
    ray_address: str | None = None
    num_cpus: int | None = None  # a local Ray's CPUs (None: the machine's)
    replica_cpus: float = 0.0  # each replica's CPU reservation (its engine core uses its own threads anyway)
    replica_gpus: float | None = None  # None: 1 where the engine runs on a GPU, 0 on the CPU
    max_ongoing_requests: int = 1024
    max_imbalance: int = MAX_IMBALANCE  # `kv`: see `policy.kv_choice`
    app_name: str = "sluice"  # the Serve application; one per routing in a process (a handle keeps its router)


class RayEngine:
    def __init__(self, args: EngineArgs, config: RayConfig) -> None:
        self.args = replace(args, enable_inspector=False)
        self.config = config
        source = resolve_model(args.model, envs.SLUICE_CACHE_DIR)
        self.model_name = args.served_model_name or source.name
        self.tokenizer = load_tokenizer(source.tokenizer_dir)
        self.max_model_len = max_model_len_for(args, source.config)
        self.handle: Any = None
        self.board: Any = None
        self._posts: dict[str, tuple[EngineStats, float]] = {}
        self._tg: anyio.abc.TaskGroup | None = None
        self._own_ray = False
        self._closed: Exception | None = None

    # -- lifecycle ---------------------------------------------------------------------------------
    async def __aenter__(self) -> RayEngine:
        await anyio.to_thread.run_sync(self._deploy)
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        self._tg.start_soon(self._read_board)
        return self

    async def __aexit__(self, *exc) -> None:
        assert self._tg is not None
        self._tg.cancel_scope.cancel()
        try:
            await self._tg.__aexit__(*exc)
        finally:
            self._tg = None
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(self._undeploy)

    def _deploy(self) -> None:
        # Ray's C++ failure handler would catch the server's SIGTERM, dump a stack and kill the process
        # mid-shutdown (the replicas and Ray's own processes left behind): uvicorn handles that signal.
        os.environ.setdefault("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", "1")
        import ray
        from ray import serve
        from sluice.app.ray.deployment import replica_app

        if not ray.is_initialized():
            self._own_ray = self.config.ray_address is None
            ray.init(
                # "local": a Ray of its own even where another runs on this machine (ray.init() alone would join
                # the newest one started here, a stale one included)
                address=self.config.ray_address or "local",
                num_cpus=self.config.num_cpus if self._own_ray else None,
                include_dashboard=False,
                log_to_driver=False,
            )
        serve.start(proxy_location="Disabled")
        self.board, app = replica_app(self.args, self.config)
        self.handle = serve.run(app, name=self.config.app_name, route_prefix=None)
        # every replica has posted its counters once: /health and the dead-engine watch then see them all
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while len(live(ray.get(self.board.read.remote()))) < self.config.num_replicas:
            if time.monotonic() > deadline:
                raise SluiceError(f"ray: {self.config.num_replicas} replicas did not all start in {STARTUP_TIMEOUT_S}s")
            time.sleep(0.2)
        self._posts = ray.get(self.board.read.remote())

    def _undeploy(self) -> None:
        import ray
        from ray import serve

        if not self._own_ray:
            serve.delete(self.config.app_name)  # a shared cluster: only this application goes
            return
        try:
            serve.shutdown()
        finally:
            ray.shutdown()

    async def _read_board(self) -> None:
        while True:
            try:
                self._posts = await self.board.read.remote()
            except Exception as e:  # the board is gone: the cluster is going down
                logger.warning("ray: the replicas' stats are unavailable: %s", e)
            await anyio.sleep(POST_INTERVAL_S)

    # -- what the app uses -------------------------------------------------------------------------
    @property
    def is_running(self) -> bool:
        return self._tg is not None

    @property
    def is_healthy(self) -> bool:
        return self.is_running and any(s.healthy for s in self.replica_stats().values())

    def replica_stats(self) -> dict[str, EngineStats]:
        """Each live replica's counters, as it last posted them."""
        return live(self._posts)

    def stats(self) -> EngineStats:
        return summed(list(self.replica_stats().values()))

    async def end_all_requests(self, error: Exception) -> None:
        """Refuse new requests with ``error``; those in flight end as their streams are closed."""
        self._closed = error

    def tokenize_prompt(self, prompt: Any) -> tuple[list[int], str]:
        """The prompt's token ids and text (the text is what the `prefix` router matches)."""
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt, add_special_tokens=True)), prompt
        if isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
            ids = apply_chat_template(self.tokenizer, prompt, self.args.split_special_tokens)
            return ids, "".join(str(m.get("content", "")) for m in prompt)
        ids = list(prompt)
        return ids, " ".join(map(str, ids))

    async def generate(
        self,
        prompt: Any,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        final_only: bool = False,
        wait_for_room: bool = True,
    ) -> AsyncIterator[RequestOutput]:
        if self._tg is None:
            raise SluiceError("engine is not running: use `async with RayEngine(...)`")
        if self._closed is not None:
            raise self._closed
        token_ids, text = await anyio.to_thread.run_sync(self.tokenize_prompt, prompt)
        req = ReplicaRequest(
            token_ids, params or SamplingParams(), request_id or f"ray-{time.monotonic_ns()}", text, session_id.get()
        )
        stream = self.handle.options(stream=True).generate.remote(req)
        try:
            async for out in stream:
                yield out
        except Exception as e:
            raise _engine_error(e) from None
        finally:
            stream.cancel()


def _engine_error(e: Exception) -> Exception:
    """A replica's failure as the app knows it: sluice's own errors as themselves, a lost replica as dead."""
    cause = getattr(e, "cause", None)  # a replica's own exception, wrapped by Ray (RayTaskError)
    if isinstance(cause, SluiceError):
        return cause
    if isinstance(e, SluiceError):
        return e
    return EngineDeadError(f"the replica serving this request failed: {e!r}")
