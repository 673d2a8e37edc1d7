"""ExecutorActor: owns the model runner (model, KV tensors, sampler) and runs each step off the event loop."""

from __future__ import annotations

import logging

import anyio
from anyio.abc import ObjectReceiveStream, ObjectSendStream

from core.model_runner import ModelRunner
from core.scheduler import ModelOutput, SchedulerOutput

logger = logging.getLogger("sluice")


def is_fatal(exc: BaseException) -> bool:
    """Errors after which the model or its device cannot be trusted (every request must fail)."""
    text = str(exc)
    return isinstance(exc, MemoryError) or "CUDA error" in text or "device-side assert" in text


class ExecutorActor:
    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner

    async def run(self, steps: ObjectReceiveStream[SchedulerOutput], results: ObjectSendStream[ModelOutput]) -> None:
        async with steps, results:
            async for so in steps:
                try:
                    # A worker thread: torch releases the GIL in its kernels, so the loop keeps serving.
                    out = await anyio.to_thread.run_sync(self.runner.execute, so)
                except Exception as e:
                    logger.exception("step %d failed", so.step_id)
                    out = ModelOutput(so.step_id, {}, error=e, fatal=is_fatal(e))
                await results.send(out)
