"""One bad request never hurts another: per-row parameters are checked before any step, and a step that
still fails is re-run to find its culprits (`core.culprit`), so only they fail."""

from __future__ import annotations

import anyio
import pytest
from sluice.core import EngineArgs, InvalidRequestError, RequestFailedError, SamplingParams
from sluice.core.culprit import isolate_culprits
from sluice.core.step import ModelOutput, ScheduledRequest, SchedulerOutput

from tests.helpers import EngineInTask

INNOCENTS = 4


@pytest.fixture(scope="module")
async def engine():
    args = EngineArgs(model="dummy:tiny", device="cpu", num_kv_blocks=256, max_model_len=512, max_num_seqs=16)
    holder = EngineInTask(args)
    yield await holder.start()
    await holder.stop()


def innocent_params(i: int) -> SamplingParams:
    return SamplingParams(max_tokens=12, temperature=1.0, seed=100 + i, ignore_eos=True)


async def run_batch(engine, offender=None) -> tuple[list[list[int]], BaseException | None]:
    """Four seeded streams side by side, plus ``offender`` (a coroutine function) started with them. Returns
    each innocent's tokens and what the offender raised."""
    tokens: list[list[int]] = [[] for _ in range(INNOCENTS)]
    raised: list[BaseException] = []

    async def innocent(i: int) -> None:
        async for out in engine.generate(list(range(10 + i, 30 + i)), innocent_params(i), request_id=f"good{i}"):
            tokens[i] += out.delta_token_ids

    async def guilty() -> None:
        try:
            await offender()
        except Exception as e:
            raised.append(e)

    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            for i in range(INNOCENTS):
                tg.start_soon(innocent, i)
            if offender is not None:
                tg.start_soon(guilty)
    return tokens, (raised[0] if raised else None)


def assert_idle(engine) -> None:
    s = engine.stats()
    assert s.num_running == 0 and s.num_waiting == 0 and s.kv_blocks_free == s.kv_blocks_total


@pytest.mark.parametrize("seed, n", [(2**64, 1), (-(2**63) - 1, 1), (2**70, 3)], ids=["2**64", "-2**63-1", "2**70-n3"])
async def test_a_seed_the_sampler_cannot_take_fails_only_its_own_request(engine, seed, n):
    expected, _ = await run_batch(engine)

    async def offender() -> None:
        params = SamplingParams(max_tokens=12, temperature=1.0, n=n)
        params.seed = seed  # set after construction: the engine checks again before admitting it
        async for _ in engine.generate(list(range(40, 60)), params, request_id="offender"):
            pass

    got, raised = await run_batch(engine, offender)
    assert got == expected, "the innocent streams changed beside the offender"
    assert isinstance(raised, InvalidRequestError) and raised.param == "seed", raised
    assert_idle(engine)


async def test_largest_seed_with_siblings_runs(engine):
    """Sibling seeds are seed + i, wrapped into 64 bits: seed 2**64 - 1 with n = 2 used to overflow."""
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=2**64 - 1, n=2, ignore_eos=True)
    outs = [o async for o in engine.generate(list(range(5, 25)), params) if o.finished]
    assert sorted(o.index for o in outs) == [0, 1] and all(len(o.token_ids) == 6 for o in outs)
    solo = SamplingParams(max_tokens=6, temperature=1.0, seed=0, ignore_eos=True)  # sibling 1's wrapped seed
    alone = [o async for o in engine.generate(list(range(5, 25)), solo) if o.finished]
    assert alone[0].token_ids == next(o.token_ids for o in outs if o.index == 1)


@pytest.mark.parametrize(
    "kwargs, param",
    [
        (dict(seed=2**64), "seed"),
        (dict(seed=True), "seed"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(temperature=float("inf")), "temperature"),
        (dict(repetition_penalty=float("inf")), "repetition_penalty"),
        (dict(repetition_penalty=1e300), "repetition_penalty"),
        (dict(temperature=1e300), "temperature"),
        (dict(top_k=2**63), "top_k"),
    ],
)
def test_values_that_would_break_a_step_are_refused_up_front(kwargs, param):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**kwargs)
    assert e.value.param == param


async def test_a_stop_token_outside_the_vocabulary_is_refused(engine):
    """With min_tokens the sampler bans the stop ids by index: one past the vocabulary failed the step."""
    params = SamplingParams(max_tokens=4, min_tokens=2, stop_token_ids=[10**9])
    with pytest.raises(InvalidRequestError) as e:
        async for _ in engine.generate([1, 2, 3], params):
            pass
    assert e.value.param == "stop_token_ids"


async def test_n_beyond_the_waiting_queue_is_invalid_not_overloaded():
    holder = EngineInTask(EngineArgs(model="dummy:tiny", device="cpu", num_kv_blocks=64, max_waiting_requests=4))
    engine = await holder.start()
    try:
        with pytest.raises(InvalidRequestError) as e:
            async for _ in engine.generate([1, 2, 3], SamplingParams(n=5, max_tokens=2)):
                pass
        assert e.value.param == "n"
        outs = [o async for o in engine.generate([1, 2, 3], SamplingParams(n=4, max_tokens=2)) if o.finished]
        assert len(outs) == 4
    finally:
        await holder.stop()


async def test_a_step_that_fails_because_of_one_request_fails_only_that_one(engine, monkeypatch):
    """A failure the checks did not foresee: the runner raises whenever the offender is in the step. The
    engine re-runs the step without it; the innocent streams end exactly as they do alone."""
    expected, _ = await run_batch(engine)
    runner = engine._executor.runner
    real = runner.execute
    calls = []

    def execute(so: SchedulerOutput) -> ModelOutput:
        calls.append(len(so.requests))
        if any(r.request_id == "offender" for r in so.requests):
            raise ValueError("this row breaks the sampler")
        return real(so)

    monkeypatch.setattr(runner, "execute", execute)

    async def offender() -> None:
        params = SamplingParams(max_tokens=12, temperature=1.0, seed=7)
        async for _ in engine.generate(list(range(40, 60)), params, request_id="offender"):
            pass

    got, raised = await run_batch(engine, offender)
    assert got == expected
    assert isinstance(raised, RequestFailedError) and "breaks the sampler" in str(raised)
    assert any(n == 1 for n in calls), "the offender was tried alone"
    assert_idle(engine)


async def test_a_failure_that_does_not_come_back_fails_nobody(engine, monkeypatch):
    expected, _ = await run_batch(engine)
    runner = engine._executor.runner
    real = runner.execute
    failed = []

    def execute(so: SchedulerOutput) -> ModelOutput:
        if not failed and len(so.requests) == INNOCENTS:
            failed.append(so.step_id)
            raise RuntimeError("transient")
        return real(so)

    monkeypatch.setattr(runner, "execute", execute)
    got, _ = await run_batch(engine)
    assert failed and got == expected
    assert_idle(engine)


# --------------------------------------------------------------------------- the bisection on its own


def _step(ids: list[str]) -> SchedulerOutput:
    reqs = [ScheduledRequest(i, [1], 0, [0], True) for i in ids]
    return SchedulerOutput(7, reqs, block_copies=[(1, 2)], finished_request_ids=["old"])


async def test_bisection_pins_each_culprit_and_keeps_the_others_outputs():
    ids = [f"r{i}" for i in range(11)]
    bad = {"r2", "r9"}
    runs: list[SchedulerOutput] = []

    async def run(so: SchedulerOutput) -> ModelOutput:
        runs.append(so)
        hit = bad & {r.request_id for r in so.requests}
        if hit:
            return ModelOutput(so.step_id, {}, error=ValueError(sorted(hit)[0]))
        return ModelOutput(so.step_id, {r.request_id: int(r.request_id[1:]) for r in so.requests})

    ran, out, culprits = await isolate_culprits(_step(ids), ModelOutput(7, {}, error=ValueError("x")), run)
    assert sorted(sr.request_id for sr, _ in culprits) == sorted(bad)
    assert all(str(e) == sr.request_id for sr, e in culprits)
    assert sorted(r.request_id for r in ran.requests) == sorted(set(ids) - bad)
    assert out.error is None and out.sampled == {i: int(i[1:]) for i in ids if i not in bad}
    assert len(runs) < 2 * len(ids)
    assert runs[0].block_copies == [(1, 2)] and runs[0].finished_request_ids == ["old"]
    assert not any(so.block_copies or so.finished_request_ids for so in runs[1:]), "they go with the first re-run"


async def test_a_fatal_failure_while_isolating_ends_the_search():
    so = _step(["a", "b", "c", "d"])

    async def run(sub: SchedulerOutput) -> ModelOutput:
        return ModelOutput(sub.step_id, {}, error=MemoryError("device lost"), fatal=True)

    ran, out, culprits = await isolate_culprits(so, ModelOutput(7, {}, error=ValueError("x")), run)
    assert ran is so and out.fatal and culprits == []
