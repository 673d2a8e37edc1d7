"""ExecutorActor: owns the model runner (model, KV tensors, sampler) and runs each step off the event loop."""

from __future__ import annotations

import logging

import anyio
from anyio.abc import ObjectReceiveStream, ObjectSendStream
from sluice.core.args import EngineArgs
from sluice.core.model_runner import ModelRunner
from sluice.core.models.loader import ModelSource
from sluice.core.step import ModelOutput, SchedulerOutput

logger = logging.getLogger("sluice")


def is_fatal(exc: BaseException) -> bool:
    """Errors after which the model or its device cannot be trusted (every request must fail)."""
    text = str(exc)
    return isinstance(exc, MemoryError) or "CUDA error" in text or "device-side assert" in text


class ExecutorActor:
    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner

    @classmethod
    def start(cls, args: EngineArgs, source: ModelSource, max_model_len: int) -> ExecutorActor:
        """The model in this process; with ``tensor_parallel_size > 1``, one worker process per rank
        (`core/tp_runner.py`), stopped when `run` ends."""
        if args.tensor_parallel_size > 1:
            from sluice.core.tp_runner import TPRunner

            return cls(TPRunner(args, source, max_model_len))
        return cls(ModelRunner(args, source, max_model_len))

    @property
    def failure(self) -> Exception | None:
        """Set when worker processes died, even between steps (the engine is then unhealthy)."""
        return getattr(self.runner, "failure", None)

    async def run(self, steps: ObjectReceiveStream[SchedulerOutput], results: ObjectSendStream[ModelOutput]) -> None:
        # Worker processes: a step waiting on them may be left behind at shutdown (stopping them ends it).
        out_of_process = hasattr(self.runner, "close")
        try:
            async with steps, results:
                async for so in steps:
                    try:
                        # A worker thread: torch releases the GIL in its kernels, so the loop keeps serving.
                        out = await anyio.to_thread.run_sync(self.runner.execute, so, abandon_on_cancel=out_of_process)
                    except Exception as e:
                        logger.exception("step %d failed", so.step_id)
                        out = ModelOutput(so.step_id, {}, error=e, fatal=is_fatal(e))
                    await results.send(out)
        finally:
            if out_of_process:
                with anyio.CancelScope(shield=True):
                    await anyio.to_thread.run_sync(self.runner.close)
