"""Every consumer loop ends: when ``async with AsyncEngine(...)`` exits with requests in flight (streaming,
final-only, or still queued), each caller's ``async for`` ends with `EngineStoppedError`, on asyncio and
trio alike; a second ``async with`` on a running engine and ``stats()`` before start are refused clearly."""

from __future__ import annotations

import anyio
import pytest
from sluice.core import AsyncEngine, EngineArgs, EngineDeadError, EngineStoppedError, SamplingParams, SluiceError


def tiny_args(**kw) -> EngineArgs:
    return EngineArgs(model="dummy:tiny", device="cpu", num_kv_blocks=128, max_model_len=512, **kw)


async def stop_with_requests_in_flight(core_process: bool) -> dict[str, object]:
    """Three consumers in a task group outside the engine's block: two streaming (one of them seen started),
    one final-only. The block exits while all run. Returns how each ended."""
    ended: dict[str, object] = {}
    streaming = anyio.Event()
    params = SamplingParams(max_tokens=400, ignore_eos=True)

    async def consume(engine: AsyncEngine, name: str, final_only: bool) -> None:
        got = 0
        try:
            async for _ in engine.generate(list(range(5, 40)), params, request_id=name, final_only=final_only):
                got += 1
                streaming.set()
            ended[name] = f"ended without an error after {got} outputs"
        except Exception as e:
            ended[name] = e

    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            engine = AsyncEngine(tiny_args(engine_core_process=core_process))
            async with engine:
                for name, final_only in (("a", False), ("b", False), ("final", True)):
                    tg.start_soon(consume, engine, name, final_only)
                await streaming.wait()
            # the engine has stopped; the task group now waits for the consumers: they must end
        with pytest.raises(SluiceError, match="not running"):
            async for _ in engine.generate([1, 2], params):
                pass
    return ended


@pytest.mark.parametrize("core_process", [False, True], ids=["one-process", "core-process"])
@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_exiting_the_engine_ends_every_consumer(backend, core_process):
    ended = anyio.run(stop_with_requests_in_flight, core_process, backend=backend)
    assert set(ended) == {"a", "b", "final"}
    for name, how in ended.items():
        assert isinstance(how, EngineStoppedError) and isinstance(how, EngineDeadError), (name, how)


@pytest.mark.parametrize("core_process", [False, True], ids=["one-process", "core-process"])
async def test_a_request_still_queued_when_the_engine_stops_is_answered(core_process):
    """Requests admitted in the same instant as the stop: in the inbox, not yet seen by the scheduler."""
    outcomes: list[object] = []

    async def consume(engine: AsyncEngine) -> None:
        try:
            async for _ in engine.generate([1, 2, 3], SamplingParams(max_tokens=50, ignore_eos=True)):
                pass
            outcomes.append("finished")
        except EngineStoppedError as e:
            outcomes.append(e)

    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            async with AsyncEngine(tiny_args(engine_core_process=core_process)) as engine:
                for _ in range(20):
                    tg.start_soon(consume, engine)
                await anyio.sleep(0)  # they run up to their first await: the AddRequest is queued
    assert len(outcomes) == 20 and all(isinstance(o, EngineStoppedError) for o in outcomes), outcomes
    assert any("before the request was admitted" in str(o) for o in outcomes)


async def test_entering_a_running_engine_again_is_refused_and_the_first_block_goes_on():
    async with AsyncEngine(tiny_args()) as engine:
        with pytest.raises(SluiceError, match="already running"):
            async with engine:
                pass
        outs = [o async for o in engine.generate([1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True))]
        assert outs[-1].finished and len(outs[-1].token_ids) == 3
    async with engine:  # and once stopped, it may start again
        assert engine.stats().num_running == 0


def test_stats_before_start_says_so():
    with pytest.raises(SluiceError, match="has not started"):
        AsyncEngine(tiny_args()).stats()


@pytest.mark.parametrize("gc_freeze", [True, False])
async def test_the_heap_is_frozen_while_the_engine_runs_and_collectable_again_after(gc_freeze):
    """``gc_freeze`` (the default): the started engine's objects leave the cyclic collector's reach, and come back
    when it stops, so a stopped engine's reference cycles are freed; off, the collector is left alone."""
    import gc

    gc.unfreeze()
    async with AsyncEngine(tiny_args(gc_freeze=gc_freeze)) as engine:
        frozen = gc.get_freeze_count()
        out = [o async for o in engine.generate([5, 6, 7], SamplingParams(max_tokens=2, ignore_eos=True))]
        assert len(out[-1].token_ids) == 2
    assert (frozen > 10_000) == gc_freeze  # the model's modules, the tokenizer, ...
    assert gc.get_freeze_count() == 0
