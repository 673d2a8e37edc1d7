"""`EngineCoreClient`: the front end's one handle on its engine core, wherever the core runs.

`AsyncEngine` holds one client and asks it everything about the core (vLLM v1's ``EngineCoreClient`` shape);
`make_client` (`core/frontend/engine.py`) picks the implementation from the engine's arguments:

* `InprocClient` (`core/frontend/inproc_client.py`): the core in this process, run in the engine's task group
  (``engine_core_process=False``, the inspector, a prefill/decode pair);
* `CoreClient` (`core/frontend/core_client.py`): the core in a process of its own, started by this front end,
  or, given a `SharedCore`, started by ``sluice serve --api-server-count N``'s supervisor and shared.

Either way the request actors see the same thing: they put `AddRequest` / `AbortRequest` on the engine's inbox,
which the client's `run` serves, and read `Admitted` / `TokenEvent`s from their own stream.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

from anyio.abc import ObjectReceiveStream
from sluice.core.errors import SluiceError
from sluice.core.host_profile import HostProfile
from sluice.core.request_ids import front_end_prefix
from sluice.core.stats import EngineStats

if TYPE_CHECKING:
    import torch
    from sluice.core.engine_core.core import EngineCore
    from sluice.core.engine_core.inspector import StepRecorder
    from sluice.core.engine_core.process import BridgeAddress


@dataclass(slots=True)
class SharedCore:
    """An engine core process that serves several front ends, started by their supervisor (``sluice serve
    --api-server-count N``): this front end's number among them, its socket pair and the core's process id.
    Given to `AsyncEngine`, it attaches to this core instead of starting one."""

    index: int
    bridge: BridgeAddress
    pid: int

    @property
    def id_prefix(self) -> str:
        return front_end_prefix(self.index)


class EngineCoreClient(ABC):
    """The engine core as the front end sees it. Its life: `start` (load or attach; raises what the start
    raised), `run` the inbox until cancelled (every request still open then ends with `EngineStoppedError`),
    `close` (blocking: run it in a thread; also after a failed start)."""

    stats: EngineStats  # the engine's counters as of its last step
    num_kv_blocks: int  # the KV pool's size, once started
    pid: int | None  # the core's process id when it runs in a process of its own

    @abstractmethod
    async def start(self) -> None: ...

    @abstractmethod
    async def run(self, inbox: ObjectReceiveStream) -> None: ...

    @abstractmethod
    def close(self) -> None: ...

    @abstractmethod
    def dead_error(self) -> Exception | None:
        """Why the core takes no more requests (it died); None while it does."""

    @abstractmethod
    def health_error(self) -> Exception | None:
        """Why the engine is unhealthy (``/health`` answers 503); None while it is healthy."""

    def host_profile(self) -> HostProfile:
        """Where the steps' host time went; empty where the profile lives in another process."""
        return HostProfile()

    @property
    def inspector(self) -> StepRecorder | None:
        """The step recorder (``enable_inspector``, in this process only)."""
        return None

    @property
    def local_core(self) -> EngineCore | None:
        """The `EngineCore` itself when it runs in this process (None otherwise): for tools that need the model
        (draft training, benchmarks' counters); requests never go this way."""
        return None

    @property
    def kv_caches(self) -> list[torch.Tensor]:
        """The KV pool's tensors (a prefill/decode pair ships blocks between two engines' pools)."""
        raise SluiceError("the KV caches live in the engine core's own process")
