"""The engine core: the scheduler actor and the executor actor, built and run together.

The same core runs inside the caller's process (``engine_core_process=False``) or in a process of its own
(`core/engine_core/process.py`); either way its one input is a stream of `AddRequest` / `AbortRequest` /
`EndAllRequests`, and each request's events leave through the stream named in its `AddRequest`.
"""

from __future__ import annotations

from dataclasses import dataclass

import anyio
from anyio.abc import ObjectReceiveStream
from sluice.core.args import EngineArgs
from sluice.core.engine_core.executor import ExecutorActor
from sluice.core.engine_core.scheduler_actor import SchedulerActor
from sluice.core.ipc.kv_event_publisher import KVEventPublisher
from sluice.core.models.loader import ModelSource
from sluice.core.sched.disagg import scheduler_class
from sluice.core.sched.scheduler import Scheduler, SchedulerConfig
from sluice.kv.manager import KVCacheManager


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
        # prefill/decode disaggregation: a pair's engines run role schedulers (core/sched/disagg.py)
        scheduler_cls = Scheduler if args.kv_role == "both" else scheduler_class(args.kv_role)
        scheduler = scheduler_cls(
            SchedulerConfig(
                max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens,
                max_model_len=max_model_len,
                max_waiting_requests=args.max_waiting_requests,
                num_speculative_tokens=runner.num_speculative_tokens,
                speculative_disable_batch_size=args.speculative_disable_batch_size,
                async_scheduling=args.async_scheduling and executor.overlaps_steps,
                max_uniform_batch=runner.max_uniform_batch,
            ),
            kv,
        )
        actor = SchedulerActor(scheduler, inspector=args.enable_inspector, kv_events=kv_event_publisher(args, kv))
        return cls(executor, actor)

    @property
    def num_kv_blocks(self) -> int:
        return self.executor.runner.num_kv_blocks

    async def run(self, inbox: ObjectReceiveStream) -> None:
        """Serve ``inbox`` until cancelled; then every open request ends with `EngineStoppedError`."""
        steps_send, steps_recv = anyio.create_memory_object_stream(1)
        results_send, results_recv = anyio.create_memory_object_stream(1)
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self.executor.run, steps_recv, results_send)
                tg.start_soon(self.scheduler_actor.run, inbox, steps_send, results_recv)
        finally:
            if self.scheduler_actor.kv_events is not None:
                self.scheduler_actor.kv_events.close()


def kv_event_publisher(args: EngineArgs, kv: KVCacheManager) -> KVEventPublisher | None:
    """The KV event publisher over ``kv``'s prefix cache, or None with ``--kv-events-endpoint`` unset."""
    if not args.kv_events_endpoint:
        return None
    return KVEventPublisher(
        kv.record_events(),
        args.kv_events_endpoint,
        args.kv_events_replay_endpoint,
        kv.block_size,
        args.data_parallel_rank,
    )
