"""The core engine through `AsyncEngine`: continuous batching, chunked prefill, preemption,
cancellation, overload, and the event loop kept free while the model works."""

from __future__ import annotations

import random
import time

import anyio
import pytest
from sluice.core import AsyncEngine, EngineArgs, EngineOverloaded, InvalidRequestError, SamplingParams

from tests.helpers import EngineInTask, chat_prompt_of_length, prompt_of_length

MODEL = "smollm2-135m-instruct"


async def collect(engine: AsyncEngine, prompt, params: SamplingParams, request_id: str | None = None):
    """Final output of one request, plus the concatenated deltas."""
    deltas, last = [], None
    async for out in engine.generate(prompt, params, request_id=request_id):
        deltas.append(out.delta_text)
        last = out
    assert last is not None and last.finished
    return last, "".join(deltas)


async def wait_for(predicate, timeout: float = 5.0) -> None:
    with anyio.fail_after(timeout):
        while not predicate():
            await anyio.sleep(0.005)


@pytest.fixture(scope="module")
async def engine():
    holder = EngineInTask(EngineArgs(model=MODEL, device="cpu", num_kv_blocks=2048, max_model_len=2048))
    yield await holder.start()
    await holder.stop()


@pytest.fixture(scope="module")
async def tiny_engine():
    """The engine core in its own process, as a server runs it."""
    tiny = dict(model="dummy:tiny", device="cpu", num_kv_blocks=256, max_model_len=1024, max_num_seqs=32)
    args = EngineArgs(**tiny, engine_core_process=True)
    holder = EngineInTask(args)
    yield await holder.start()
    await holder.stop()


@pytest.mark.slow
async def test_concurrent_requests_equal_their_solo_runs(engine, default_tokenizer):
    rng = random.Random(0)
    cases = []
    for i in range(12):  # four of each kind of sampling
        prompt = chat_prompt_of_length(default_tokenizer, rng.randint(15, 120), topic=f"topic number {i}")
        kind = i % 3
        if kind == 0:
            params = SamplingParams(max_tokens=rng.randint(4, 20), temperature=0, ignore_eos=True)
        elif kind == 1:
            params = SamplingParams(
                max_tokens=rng.randint(4, 20), temperature=0.8, top_p=0.9, top_k=50, seed=1000 + i, ignore_eos=True
            )
        else:
            params = SamplingParams(max_tokens=rng.randint(4, 20), temperature=1.0, min_p=0.05, seed=7 * i)
        cases.append((prompt, params))

    together: dict[int, object] = {}

    async def run(i: int) -> None:
        together[i], _ = await collect(engine, cases[i][0], cases[i][1], request_id=f"c{i}")

    async with anyio.create_task_group() as tg:
        for i in range(len(cases)):
            tg.start_soon(run, i)
    assert len(together) == len(cases)
    for i, (prompt, params) in enumerate(cases):
        solo, _ = await collect(engine, prompt, params, request_id=f"solo{i}")
        assert together[i].token_ids == solo.token_ids, f"request {i} ({params.temperature=}, {params.seed=})"
        assert together[i].finish_reason == solo.finish_reason
    s = engine.stats()
    assert s.kv_blocks_free == s.kv_blocks_total and s.num_running == 0


@pytest.mark.slow
async def test_long_prompt_is_prefilled_in_chunks_with_the_same_output(engine, default_tokenizer):
    prompt = chat_prompt_of_length(default_tokenizer, 300, topic="glaciers")
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    whole, _ = await collect(engine, prompt, params)
    args = EngineArgs(
        model=MODEL,
        device="cpu",
        num_kv_blocks=256,
        max_model_len=2048,
        max_num_batched_tokens=64,
        enable_prefix_caching=False,
        async_scheduling=False,  # counted exactly: with it on, the next step is scheduled before this token arrives
    )
    async with AsyncEngine(args) as small_budget:
        before = small_budget.stats().num_steps
        first_token_steps = None
        async for out in small_budget.generate(prompt, params):
            if first_token_steps is None:
                first_token_steps = small_budget.stats().num_steps - before
            last = out
    # 300 prompt tokens at 64 per step: the first token needs ceil(300 / 64) = 5 steps
    assert first_token_steps == 5
    assert last.token_ids == whole.token_ids


@pytest.mark.slow
async def test_preemption_when_the_pool_is_too_small(engine, default_tokenizer):
    prompts = [chat_prompt_of_length(default_tokenizer, 40 + 3 * i, topic=f"pool {i}") for i in range(6)]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    expected = [(await collect(engine, p, params))[0].token_ids for p in prompts]
    # each request needs 4-5 blocks of 16 at its end; 6 of them need ~27 blocks; the pool has 14
    args = EngineArgs(model=MODEL, device="cpu", num_kv_blocks=14, max_model_len=2048, enable_prefix_caching=False)
    async with AsyncEngine(args) as small:
        outs: dict[int, list[int]] = {}

        async def run(i: int) -> None:
            outs[i] = (await collect(small, prompts[i], params))[0].token_ids

        async with anyio.create_task_group() as tg:
            for i in range(len(prompts)):
                tg.start_soon(run, i)
        s = small.stats()
        assert s.num_preemptions > 0
        assert s.kv_blocks_free == s.kv_blocks_total == 14
    assert [outs[i] for i in range(6)] == expected


async def test_cancelled_consumer_frees_its_blocks_within_the_steps_in_flight(tiny_engine):
    """A consumer that stops reading ends its request at once: the core applies the abort as it arrives, before
    its next schedule, so the request leaves within the step in flight and the one scheduled behind it
    (asynchronous scheduling), never at its max_tokens. Counted from the first stats message that shows it gone
    (the core sends one after every step and after the abort; a later poll would also count the steps run
    since)."""
    long_params = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
    stop_after = 3

    async def background() -> None:  # keeps the engine stepping while we cancel
        await collect(tiny_engine, list(range(100, 140)), SamplingParams(max_tokens=60, ignore_eos=True))

    async with anyio.create_task_group() as tg:
        tg.start_soon(background)
        agen = tiny_engine.generate(list(range(200, 300)), long_params, request_id="victim")
        n = 0
        async for _ in agen:
            n += 1
            if n == stop_after:
                break
        await agen.aclose()
        step_at_cancel = tiny_engine.stats().num_steps
        gone = []

        def victim_gone() -> bool:
            s = tiny_engine.stats()  # one message's counters: its step count and running count go together
            if s.num_running <= 1:
                gone.append(s.num_steps)
            return bool(gone)

        await wait_for(victim_gone)
        assert gone[0] - step_at_cancel <= 2
    s = tiny_engine.stats()
    assert s.kv_blocks_free == s.kv_blocks_total


async def test_a_request_id_in_use_is_refused_and_free_again_after(tiny_engine):
    """Two live requests under one id would share the scheduler's entry (tokens and aborts crossed): the
    second is refused with a typed error naming the field, the first is untouched, and the id is free once
    the first stream ends."""
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    first = tiny_engine.generate(list(range(10, 30)), params, request_id="dup")
    got = [await first.__anext__()]
    with pytest.raises(InvalidRequestError, match="request_id"):
        await collect(tiny_engine, list(range(50, 60)), params, request_id="dup")
    async for out in first:
        got.append(out)
    assert got[-1].finished and len(got[-1].token_ids) == 40
    again, _ = await collect(tiny_engine, list(range(10, 30)), params, request_id="dup")
    assert again.token_ids == got[-1].token_ids
    s = tiny_engine.stats()
    assert s.num_running == 0 and s.kv_blocks_free == s.kv_blocks_total


async def test_200_random_cancellations_leak_nothing(tiny_engine):
    rng = random.Random(1)

    async def one(i: int) -> None:
        prompt = [rng.randrange(49152) for _ in range(rng.randint(1, 60))]
        params = SamplingParams(max_tokens=rng.randint(1, 40), temperature=1.0, seed=i, ignore_eos=True)
        cut = rng.randint(0, 12)
        mode = rng.random()
        if mode < 0.3:  # cancelled by its task's deadline, wherever it is
            with anyio.move_on_after(rng.uniform(0, 0.05)):
                await collect(tiny_engine, prompt, params)
            return
        n = 0
        async for _ in tiny_engine.generate(prompt, params, request_id=f"rc{i}"):
            n += 1
            if n >= cut:
                break
        if mode > 0.9:
            await tiny_engine.abort(f"rc{i}")  # idempotent after the break

    async with anyio.create_task_group() as tg:
        for i in range(200):
            tg.start_soon(one, i)
    await wait_for(lambda: tiny_engine.stats().num_running == 0 and tiny_engine.stats().num_waiting == 0)
    s = tiny_engine.stats()
    assert s.kv_blocks_free == s.kv_blocks_total


@pytest.mark.slow
async def test_event_loop_keeps_running_during_a_long_prefill(engine, default_tokenizer):
    prompt = prompt_of_length(default_tokenizer, 1500)
    ticks: list[float] = []
    done = anyio.Event()

    async def ticker() -> None:
        while not done.is_set():
            ticks.append(time.perf_counter())
            await anyio.sleep(0.01)

    async with anyio.create_task_group() as tg:
        tg.start_soon(ticker)
        start = time.perf_counter()
        await collect(engine, prompt, SamplingParams(max_tokens=1, temperature=0))
        elapsed = time.perf_counter() - start
        done.set()
    during = [t for t in ticks if start <= t <= start + elapsed]
    # the 1500-token prefill takes hundreds of ms; a blocked loop would tick about once
    assert elapsed > 0.2
    assert len(during) >= max(5, int(elapsed / 0.01 * 0.3)), (len(during), elapsed)


@pytest.mark.parametrize("core_process", [False, True], ids=["one-process", "core-process"])
async def test_overload_without_waiting_raises_at_once_and_spares_admitted_requests(core_process):
    args = EngineArgs(
        model="dummy:tiny",
        device="cpu",
        num_kv_blocks=128,
        max_num_seqs=1,
        max_waiting_requests=2,
        engine_core_process=core_process,
    )
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    async with AsyncEngine(args) as eng:
        solo, _ = await collect(eng, [5, 6, 7], params)
        results: dict[str, list[int]] = {}
        admitted = 0

        async def run(name: str) -> None:
            nonlocal admitted
            agen = eng.generate([5, 6, 7], params, request_id=name)
            async for out in agen:
                if not results.get(name):
                    admitted += 1
                results[name] = out.token_ids

        async with anyio.create_task_group() as tg:
            tg.start_soon(run, "a")
            await wait_for(lambda: eng.stats().num_running == 1)
            tg.start_soon(run, "b")
            tg.start_soon(run, "c")
            await wait_for(lambda: eng.stats().num_waiting == 2)
            t0 = time.perf_counter()
            with pytest.raises(EngineOverloaded):
                async for _ in eng.generate([1, 2], params, request_id="d", wait_for_room=False):
                    pass
            assert time.perf_counter() - t0 < 0.5
        assert results == {"a": solo.token_ids, "b": solo.token_ids, "c": solo.token_ids}
        s = eng.stats()
        assert s.kv_blocks_free == s.kv_blocks_total


def test_offline_batch_larger_than_the_overload_guard_runs_whole():
    from sluice.core import LLM

    params = [SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, n=n) for n in (1, 2) * 6]
    with LLM(model="dummy:tiny", device="cpu", num_kv_blocks=64, max_num_seqs=2, max_waiting_requests=3) as llm:
        outs = llm.generate([[5, 6, i] for i in range(12)], params, use_tqdm=False)
        assert [len(o.outputs) for o in outs] == [p.n for p in params]
        assert all(len(c.token_ids) == 3 for o in outs for c in o.outputs)
        s = llm.engine.stats()
        assert s.num_running == s.num_waiting == 0 and s.kv_blocks_free == s.kv_blocks_total


@pytest.mark.parametrize("stop", [[], [","]], ids=["no-stop", "stop-string"])
async def test_final_only_yields_each_sequences_streamed_final_output(engine, stop):
    params = SamplingParams(n=2, temperature=0.8, seed=7, max_tokens=12, logprobs=2, stop=stop)
    streamed = {}
    async for out in engine.generate("Count: 1, 2, 3,", params):
        if out.finished:
            streamed[out.index] = out
    finals = [o async for o in engine.generate("Count: 1, 2, 3,", params, final_only=True)]
    assert sorted(o.index for o in finals) == [0, 1] and all(o.finished for o in finals)
    for o in finals:
        s = streamed[o.index]
        assert (o.token_ids, o.text, o.finish_reason, o.logprobs) == (s.token_ids, s.text, s.finish_reason, s.logprobs)
        assert o.delta_text == o.text and o.delta_token_ids == o.token_ids
    if stop:
        assert {o.finish_reason for o in finals} == {"stop"}
    actor = engine.local_core.scheduler_actor
    for _ in range(100):  # a stop string's Abort reaches the engine's inbox a moment after the caller returns
        if not actor.streams and not actor.scheduler.requests:
            break
        await anyio.sleep(0.01)
    assert not actor.streams and not actor.scheduler.requests


def test_a_final_only_sequence_gets_one_event_with_everything():
    """The scheduler holds a final-only request's tokens (and logprobs) and sends them in one event at its end."""
    from sluice.core.outputs import TokenLogprob
    from sluice.core.request import Request
    from sluice.core.sched.scheduler import Scheduler, SchedulerConfig
    from sluice.core.step import ModelOutput
    from sluice.kv.manager import KVCacheManager

    sched = Scheduler(SchedulerConfig(4, 64, 128, 4), KVCacheManager(16, 16))
    req = Request("x", list(range(20)), SamplingParams(max_tokens=3, logprobs=0), 3, final_only=True)
    sched.add_request(req)
    events, lps = [], []
    for t in (7, 8, 9):
        so = sched.schedule()
        lps.append(TokenLogprob(t, -0.5))
        events.append(sched.update_from_output(so, ModelOutput(so.step_id, ["x"], [t], [lps[-1]])))
    assert events[:2] == [[], []]
    (ev,) = events[2]
    assert (ev.token_ids, ev.logprobs, ev.finish_reason) == ([7, 8, 9], lps, "length")
    assert not sched.requests
