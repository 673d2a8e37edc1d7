"""ExecutorActor: owns the model runner (model, KV tensors, persistent batch, sampler) and runs each step off
the event loop.

Its inbox carries steps (`SchedulerOutput`) and `FLUSH`. A step is launched at once; the oldest launched
step is collected, and its `ModelOutput` sent back, when a second step is launched behind it (asynchronous
scheduling: the device goes straight on to the next step while the host processes this one's tokens) or
when `FLUSH` asks for it (the scheduler needs the tokens before it can go on). A step marked ``sync`` (alone,
and the scheduler waits for it: speculative steps other than uniform ones, asynchronous scheduling off) is
collected in the same hop to the worker thread and answered at once. So at most two steps are in flight, and
outputs come back in step order.
"""

from __future__ import annotations

import json
import logging
import time
from collections import deque

import anyio
import torch
from anyio.abc import ObjectReceiveStream, ObjectSendStream
from sluice.core import cpu_threads, envs
from sluice.core.args import EngineArgs
from sluice.core.host_profile import HostProfile
from sluice.core.models.loader import ModelSource
from sluice.core.step import FLUSH, ModelOutput, SchedulerOutput
from sluice.core.worker.culprit import is_fatal
from sluice.core.worker.model_runner import ModelRunner
from sluice.core.worker.runner import LaunchedStep, Runner
from sluice.core.worker.tp.runner import TPRunner

logger = logging.getLogger("sluice")


def _failed(step_id: int, e: Exception) -> ModelOutput:
    """A step that raised: its output fails every request in it (all of them, if the device is lost)."""
    logger.exception("step %d failed", step_id)
    return ModelOutput(step_id, error=e, fatal=is_fatal(e))


class ExecutorActor:
    def __init__(self, runner: Runner) -> None:
        self.runner = runner
        self.profile = HostProfile()  # prepare, launch, wait (and the device's time per step)
        self._last_ready = None  # the last launched step's end event on the device (for `HostProfile.gpu_idle`)
        # SLUICE_STEP_TRACE=F: every collected step's shape and device time, written to F as JSON when `run` ends
        # (`scripts/step_mix.py --trace F` reads it: where a run's device time goes, by batch size)
        self._trace_path = envs.SLUICE_STEP_TRACE
        # (rows computing one token, the other rows' tokens (prompt chunks, verified drafts), eager, device s,
        # device idle s before it, host s from the first traced launch to its launch, host s its launch took,
        # bytes the device's caching allocator holds after it, host s of the launch until its inputs were
        # uploaded and until its forward and sampling were enqueued): an idle device before a step whose launch
        # began in time points at the launch (a synchronizing call, memory allocated from the driver)
        self.step_trace: list[tuple[int, int, bool, float, float, float, float, int, float, float]] = []
        self._trace_t0: float | None = None

    @classmethod
    def start(cls, args: EngineArgs, source: ModelSource, max_model_len: int) -> ExecutorActor:
        """The model in this process; with ``tensor_parallel_size > 1``, one worker process per rank
        (`core/worker/tp/runner.py`), stopped when `run` ends."""
        if args.tensor_parallel_size > 1:
            return cls(TPRunner(args, source, max_model_len))
        if args.resolve_device().type == "cpu":  # before the model is built: the step threads start after
            cpu_threads.apply(cpu_threads.decide(args.cpu_threads))
        return cls(ModelRunner(args, source, max_model_len))

    @property
    def failure(self) -> Exception | None:
        """Set when worker processes died, even between steps (the engine is then unhealthy)."""
        return self.runner.failure

    @property
    def overlaps_steps(self) -> bool:
        """Whether a step may be launched before the last one is collected (its runner feeds tokens on the
        device); tensor-parallel ranks take every step whole."""
        return self.runner.overlaps_steps

    async def run(
        self, inbox: ObjectReceiveStream[SchedulerOutput | str], results: ObjectSendStream[ModelOutput]
    ) -> None:
        # Worker processes: a step waiting on them may be left behind at shutdown (stopping them ends it).
        out_of_process = self.runner.out_of_process
        inflight: deque[LaunchedStep | ModelOutput] = deque()
        try:
            async with inbox, results:
                async for msg in inbox:
                    if msg is FLUSH:
                        await results.send(await self._collect(inflight.popleft()))
                    elif not self.overlaps_steps:  # whole steps; the output waits for FLUSH like a launched one
                        inflight.append(await self._launch(msg, out_of_process))
                        if msg.sync or len(inflight) > 1:
                            await results.send(inflight.popleft())
                    else:
                        # one hop to the worker thread: launch this step, then collect the one before it (and
                        # this one too, when the scheduler waits for it)
                        oldest = inflight.popleft() if inflight else None
                        step, outs = await anyio.to_thread.run_sync(self._launch_then_collect, msg, oldest)
                        if step is not None:
                            inflight.append(step)
                        for out in outs:
                            await results.send(out)
        finally:
            with anyio.CancelScope(shield=True):  # file and process work off the event loop, also when cancelled
                if self._trace_path:
                    await anyio.to_thread.run_sync(self._write_trace)
                if out_of_process:
                    await anyio.to_thread.run_sync(self.runner.close)

    def _write_trace(self) -> None:
        with open(self._trace_path, "w") as f:
            json.dump({"steps": self.step_trace}, f)

    async def _launch(self, so: SchedulerOutput, out_of_process: bool) -> ModelOutput:
        """A whole step, for runners that do not overlap steps. A worker thread: torch releases the GIL in its
        kernels, so the loop keeps serving."""
        try:
            return await anyio.to_thread.run_sync(self.runner.execute, so, abandon_on_cancel=out_of_process)
        except Exception as e:
            return _failed(so.step_id, e)

    def _launch_then_collect(
        self, so: SchedulerOutput, oldest: LaunchedStep | ModelOutput | None
    ) -> tuple[LaunchedStep | ModelOutput | None, list[ModelOutput]]:
        """In the worker thread: enqueue ``so``'s device work, then turn the step before it into its output, and
        ``so`` too when it is a synchronous step (then nothing stays in flight)."""
        try:
            step = self._timed_launch(so)
        except Exception as e:
            step = _failed(so.step_id, e)
        outs = [] if oldest is None else [self._safe_collect(oldest)]
        if so.sync:
            return None, [*outs, self._safe_collect(step)]
        return step, outs

    def _safe_collect(self, step: LaunchedStep | ModelOutput) -> ModelOutput:
        if isinstance(step, ModelOutput):
            return step
        try:
            return self._timed_collect(step)
        except Exception as e:
            return _failed(step.so.step_id, e)

    async def _collect(self, step: LaunchedStep | ModelOutput) -> ModelOutput:
        if isinstance(step, ModelOutput):
            return step
        if step.output is not None:  # complete at launch: nothing to wait for
            return step.output
        return await anyio.to_thread.run_sync(self._safe_collect, step)

    def _timed_launch(self, so: SchedulerOutput) -> LaunchedStep:
        t0 = time.perf_counter()
        step = self.runner.launch(so)
        step.launched_at, step.launch_s = t0, time.perf_counter() - t0
        # the device's end of the step launched before this one, if it had device work of its own (`gpu_idle`)
        step.after, self._last_ready = self._last_ready, step.ready
        p = self.profile
        p.steps += 1
        p.prepare += step.prepared_at - t0 if step.prepared_at else 0.0
        p.launch += time.perf_counter() - (step.prepared_at or t0)
        return step

    def _timed_collect(self, step: LaunchedStep) -> ModelOutput:
        t0 = time.perf_counter()
        out = self.runner.collect(step)
        p = self.profile
        p.wait += step.waited_s
        p.collect += time.perf_counter() - t0 - step.waited_s
        gpu_s = step.gpu_seconds()
        if gpu_s is not None:
            p.gpu += gpu_s
            p.gpu_steps += 1
            idle = 0.0
            if step.after is not None:  # the event ring still holds it: two steps' events were recorded since
                idle = max(0.0, step.after.elapsed_time(step.started) / 1e3)
                p.gpu_idle += idle
                if step.eager:
                    p.gpu_idle_eager += idle
            if self._trace_path:
                decodes = sum(1 for n in step.so.num_scheduled_tokens if n == 1)
                if self._trace_t0 is None:
                    self._trace_t0 = step.launched_at
                held = torch.cuda.memory_reserved() if torch.cuda.is_available() else 0
                self.step_trace.append(
                    (
                        decodes,
                        step.so.num_tokens - decodes,
                        step.eager,
                        gpu_s,
                        idle,
                        step.launched_at - self._trace_t0,
                        step.launch_s,
                        held,
                        max(0.0, step.prepared_at - step.launched_at),
                        max(0.0, step.enqueued_at - step.launched_at),
                    )
                )
        return out
