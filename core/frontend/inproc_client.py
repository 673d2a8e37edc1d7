"""`InprocClient`: the engine core in this process, run in the `AsyncEngine`'s own task group.

The engine's inbox is the scheduler actor's inbox; every question about the core is answered from its actors
directly. The executor's launch thread runs beside the event loop's, so the interpreter's switch interval is
shortened while the engine runs (``gil_switch_interval_ms``).
"""

from __future__ import annotations

import anyio
import torch
from anyio.abc import ObjectReceiveStream
from sluice.core.args import EngineArgs
from sluice.core.engine_core.core import EngineCore
from sluice.core.engine_core.inspector import StepRecorder
from sluice.core.engine_core.runtime import restore_switch_interval, shorten_switch_interval
from sluice.core.frontend.engine_core_client import EngineCoreClient
from sluice.core.host_profile import HostProfile
from sluice.core.models.loader import ModelSource
from sluice.core.stats import EngineStats


class InprocClient(EngineCoreClient):
    def __init__(self, args: EngineArgs, source: ModelSource, max_model_len: int) -> None:
        self.args = args
        self.source = source
        self.max_model_len = max_model_len
        self.core: EngineCore | None = None
        self.num_kv_blocks = 0
        self.pid = None
        self._switch_held = False

    async def start(self) -> None:
        """Load the model and size the KV pool (in a worker thread: seconds to minutes)."""
        self.core = await anyio.to_thread.run_sync(EngineCore.build, self.args, self.source, self.max_model_len)
        self.num_kv_blocks = self.core.num_kv_blocks
        self._switch_held = shorten_switch_interval(self.args.gil_switch_interval_ms)

    async def run(self, inbox: ObjectReceiveStream) -> None:
        await self.core.run(inbox)

    def close(self) -> None:
        if self._switch_held:
            restore_switch_interval()
            self._switch_held = False

    @property
    def stats(self) -> EngineStats:
        return self.core.scheduler_actor.stats

    def dead_error(self) -> Exception | None:
        return self.core.scheduler_actor.dead

    def health_error(self) -> Exception | None:
        return self.core.scheduler_actor.dead or self.core.executor.failure

    def host_profile(self) -> HostProfile:
        return self.core.scheduler_actor.profile.merged(self.core.executor.profile)

    @property
    def inspector(self) -> StepRecorder | None:
        return self.core.scheduler_actor.recorder

    @property
    def local_core(self) -> EngineCore:
        return self.core

    @property
    def kv_caches(self) -> list[torch.Tensor]:
        return self.core.executor.runner.kv_caches
