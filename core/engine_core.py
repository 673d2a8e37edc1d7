"""The engine core: the scheduler actor and the executor actor, built and run together.

The same core runs inside the caller's process (``engine_core_process=False``) or in a process of its own
(`core/core_process.py`); either way its one input is a stream of `AddRequest` / `AbortRequest` /
`EndAllRequests`, and each request's events leave through the stream named in its `AddRequest`.
"""

from __future__ import annotations

import gc
import sys
from dataclasses import dataclass

import anyio
from anyio.abc import ObjectReceiveStream
from sluice.core.args import EngineArgs
from sluice.core.disagg_scheduler import scheduler_class
from sluice.core.executor import ExecutorActor
from sluice.core.models.loader import ModelSource
from sluice.core.scheduler import Scheduler, SchedulerConfig
from sluice.core.scheduler_actor import SchedulerActor
from sluice.kv.manager import KVCacheManager


def freeze_heap() -> None:
    """Collect, then move every object alive to the garbage collector's permanent generation (`gc.freeze`).

    A started engine holds hundreds of thousands of long-lived objects (the model's modules and parameters, the
    tokenizer, compiled kernels and their caches, the block pool). The cyclic collector's full collections
    traverse them all, and the allocation of a burst of requests triggers such collections: pauses of tens to
    hundreds of milliseconds with the device idle. Frozen objects are skipped (reference counting still frees
    them). `unfreeze_heap` when the engine stops makes a stopped engine's cycles collectable again."""
    gc.collect()
    gc.freeze()


def unfreeze_heap() -> None:
    gc.unfreeze()


_switch = {"holders": 0, "saved": 0.005}  # engines running with a shortened interval; the interval before them


def shorten_switch_interval(ms: float) -> bool:
    """Shorten the interpreter's GIL switch interval to ``ms`` while the engine runs (0: leave it); True if
    shortened, to be undone by `restore_switch_interval` when it stops (engines running at once share it: the
    first sets it, the last restores it).

    The executor launches each step from a worker thread, beside the event loop's thread. Every torch op and
    kernel launch lets go of the GIL for a moment; when the loop's thread is busy (admitting a burst of
    requests, streaming outputs), it takes the GIL then, and the launching thread waits for the switch interval
    (5 ms by default) to get it back: a step of a few hundred ops is launched at a few ops per interval, the
    device idle. A short interval bounds each of those waits."""
    if ms <= 0:
        return False
    if _switch["holders"] == 0:
        _switch["saved"] = sys.getswitchinterval()
        sys.setswitchinterval(ms / 1000)
    _switch["holders"] += 1
    return True


def restore_switch_interval() -> None:
    _switch["holders"] -= 1
    if _switch["holders"] == 0:
        sys.setswitchinterval(_switch["saved"])


@dataclass(slots=True)
class EngineCore:
    executor: ExecutorActor
    scheduler_actor: SchedulerActor

    @classmethod
    def build(cls, args: EngineArgs, source: ModelSource, max_model_len: int) -> EngineCore:
        """Load the model (sizing the KV pool) and set up the scheduler over it; blocking, seconds to minutes."""
        executor = ExecutorActor.start(args, source, max_model_len)
        runner = executor.runner
        kv = KVCacheManager(runner.num_kv_blocks, args.block_size, args.enable_prefix_caching)
        # prefill/decode disaggregation: a pair's engines run role schedulers (core/disagg_scheduler.py)
        scheduler_cls = Scheduler if args.kv_role == "both" else scheduler_class(args.kv_role)
        scheduler = scheduler_cls(
            SchedulerConfig(
                max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens,
                max_model_len=max_model_len,
                max_waiting_requests=args.max_waiting_requests,
                num_speculative_tokens=args.num_speculative_tokens if runner.drafter is not None else 0,
                speculative_disable_batch_size=args.speculative_disable_batch_size,
                async_scheduling=args.async_scheduling and executor.overlaps_steps,
                max_uniform_batch=runner.drafter.max_uniform_batch if runner.drafter is not None else 0,
            ),
            kv,
        )
        return cls(executor, SchedulerActor(scheduler, inspector=args.enable_inspector))

    @property
    def num_kv_blocks(self) -> int:
        return self.executor.runner.num_kv_blocks

    async def run(self, inbox: ObjectReceiveStream) -> None:
        """Serve ``inbox`` until cancelled; then every open request ends with `EngineStoppedError`."""
        steps_send, steps_recv = anyio.create_memory_object_stream(1)
        results_send, results_recv = anyio.create_memory_object_stream(1)
        async with anyio.create_task_group() as tg:
            tg.start_soon(self.executor.run, steps_recv, results_send)
            tg.start_soon(self.scheduler_actor.run, inbox, steps_send, results_recv)
