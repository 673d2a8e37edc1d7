"""One bad request never hurts another: per-row parameters are checked before any step, and a step that
still fails is re-run to find its culprits (`core.culprit`), so only they fail."""

from __future__ import annotations

import anyio
import pytest
from sluice.core import EngineArgs, InvalidRequestError, RequestFailedError, SamplingParams
from sluice.core.step import ModelOutput, SchedulerOutput
from sluice.core.worker.culprit import isolate_culprits

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
    runner re-runs the step's rows without it; the innocent streams end exactly as they do alone."""
    expected, _ = await run_batch(engine)
    runner = engine.local_core.executor.runner
    real = runner._launch_rows
    calls = []

    def launch_rows(so: SchedulerOutput):
        calls.append(len(so.req_ids))
        if "offender" in so.req_ids:
            raise ValueError("this row breaks the sampler")
        return real(so)

    monkeypatch.setattr(runner, "_launch_rows", launch_rows)

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
    runner = engine.local_core.executor.runner
    real = runner._launch_rows
    failed = []

    def launch_rows(so: SchedulerOutput):
        if not failed and len(so.req_ids) == INNOCENTS:
            failed.append(so.step_id)
            raise RuntimeError("transient")
        return real(so)

    monkeypatch.setattr(runner, "_launch_rows", launch_rows)
    got, _ = await run_batch(engine)
    assert failed and got == expected
    assert_idle(engine)


# --------------------------------------------------------------------------- the bisection on its own


def _step(ids: list[str]) -> SchedulerOutput:
    n = len(ids)
    return SchedulerOutput(7, ids, [1] * n, [5] * n, [True] * n, forks={"r2": ["r2#1"]}, block_copies=[(1, 2)])


def test_bisection_pins_each_culprit_and_keeps_the_others_outputs():
    ids = [f"r{i}" for i in range(11)]
    bad = {"r2", "r9"}
    runs: list[SchedulerOutput] = []

    def run(sub: SchedulerOutput) -> ModelOutput:
        runs.append(sub)
        hit = bad & set(sub.req_ids)
        if hit:
            raise ValueError(sorted(hit)[0])
        return ModelOutput(sub.step_id, list(sub.req_ids), [int(r[1:]) for r in sub.req_ids])

    out = isolate_culprits(_step(ids), ValueError("x"), run)
    assert out.failed is not None and sorted(out.failed) == sorted(bad | {"r2#1"}), "a culprit's forks fail with it"
    assert all(str(e) == rid.split("#")[0] for rid, e in out.failed.items())
    assert sorted(out.req_ids) == sorted(set(ids) - bad)
    assert out.error is None and dict(zip(out.req_ids, out.token_ids)) == {i: int(i[1:]) for i in ids if i not in bad}
    assert len(runs) < 2 * len(ids)
    assert not any(sub.block_copies or sub.new_requests for sub in runs), "a re-run carries rows, not changes"
    assert all(sub.forks == ({"r2": ["r2#1"]} if "r2" in sub.req_ids else {}) for sub in runs)


def test_a_fatal_failure_while_isolating_ends_the_search():
    def run(sub: SchedulerOutput) -> ModelOutput:
        raise MemoryError("device lost")

    with pytest.raises(MemoryError):
        isolate_culprits(_step(["a", "b", "c", "d"]), ValueError("x"), run)
