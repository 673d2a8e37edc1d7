"""The executor's host profile: per-step device time and the device's idle time between steps, from the events
each launched step carries (stand-in events here: the CPU has none)."""

from __future__ import annotations

from dataclasses import dataclass

from sluice.core.engine_core.executor import ExecutorActor
from sluice.core.step import ModelOutput, SchedulerOutput
from sluice.core.worker.runner import LaunchedStep


@dataclass
class _Event:
    """A device timestamp in seconds; ``elapsed_time`` in milliseconds, as CUDA events give it."""

    t: float

    def elapsed_time(self, later: _Event) -> float:
        return (later.t - self.t) * 1e3


class _Runner:
    """Launches steps at given device times: ``(start, end, eager)``, or None for a step complete at launch."""

    overlaps_steps, out_of_process, failure = True, False, None

    def __init__(self, times) -> None:
        self.times = list(times)

    def launch(self, so: SchedulerOutput) -> LaunchedStep:
        t = self.times.pop(0)
        if t is None:
            return LaunchedStep(so, ModelOutput(so.step_id))
        start, end, eager = t
        step = LaunchedStep(so, started=_Event(start), eager=eager)
        step.ready = _Event(end)
        return step

    def collect(self, step: LaunchedStep) -> ModelOutput:
        return ModelOutput(step.so.step_id)


def test_device_idle_between_steps_is_counted_once_and_only_after_a_step_with_device_work():
    runner = _Runner([(0.0, 1.0, False), (1.25, 2.0, True), (2.0, 3.0, False), None, (5.0, 6.0, False)])
    ex = ExecutorActor(runner)
    # two in flight, as with asynchronous scheduling: launch N+1, then collect N
    launched = [ex._timed_launch(SchedulerOutput(i)) for i in range(2)]
    ex._timed_collect(launched[0])
    launched.append(ex._timed_launch(SchedulerOutput(2)))
    ex._timed_collect(launched[1])
    ex._timed_collect(launched[2])
    ex._timed_launch(SchedulerOutput(3))  # no device work of its own: the next step's gap is not measured
    ex._timed_collect(ex._timed_launch(SchedulerOutput(4)))
    p = ex.profile
    assert p.steps == 5 and p.gpu_steps == 4
    assert abs(p.gpu - 3.75) < 1e-9
    assert abs(p.gpu_idle - 0.25) < 1e-9  # before the eager step; none before step 2 (it started at 2.0)
    assert abs(p.gpu_idle_eager - 0.25) < 1e-9
    ms = p.per_step_ms()
    assert abs(ms["gpu"] - 937.5) < 1e-6 and abs(ms["gpu_idle"] - 62.5) < 1e-6


async def test_step_trace_records_each_steps_shape_and_device_time_and_is_written_when_run_ends(tmp_path, monkeypatch):
    import json

    import anyio
    from sluice.core.step import FLUSH

    path = tmp_path / "trace.json"
    monkeypatch.setenv("SLUICE_STEP_TRACE", str(path))
    ex = ExecutorActor(_Runner([(0.0, 1.0, True), (1.25, 1.75, False)]))
    send, inbox = anyio.create_memory_object_stream(8)
    results, recv = anyio.create_memory_object_stream(8)
    # a step with a 3-token prompt chunk beside a decode row, then two decode rows
    await send.send(SchedulerOutput(0, ["a", "b"], [3, 1], [0, 7], [True, True]))
    await send.send(SchedulerOutput(1, ["a", "b"], [1, 1], [3, 8], [True, True]))
    await send.send(FLUSH)
    await send.aclose()
    await ex.run(inbox, results)
    assert [o.step_id async for o in recv] == [0, 1]
    steps = json.loads(path.read_text())["steps"]
    assert [s[:5] for s in steps] == [[1, 3, True, 1.0, 0.0], [2, 0, False, 0.5, 0.25]]
    # the host's side: when each launch began (from the first) and how long it took; the allocator's bytes (none)
    assert steps[0][5] == 0.0 and steps[1][5] >= steps[0][6] >= 0.0 and steps[1][6] >= 0.0
    assert [s[7] for s in steps] == [0, 0]
