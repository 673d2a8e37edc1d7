"""The library as a user meets it: `LLM.generate` in vLLM's shape (one output per prompt, its sequences in
``outputs``), request ids unique across calls and threads, the progress bar's token rates, and back-pressure
(library callers wait for room; only callers that opt out get `EngineOverloaded`)."""

from __future__ import annotations

import threading
import time

import anyio
import pytest
from sluice.core import LLM, AsyncEngine, EngineArgs, EngineOverloaded, SamplingParams
from sluice.core.frontend.admission import AdmissionGate

TINY = dict(model="dummy:tiny", device="cpu", num_kv_blocks=64, max_model_len=256)
LONG_PROMPT = "The quick brown fox jumps over the lazy dog near the river bank. " * 4  # > 2 blocks of 16


@pytest.fixture(scope="module")
def llm():
    with LLM(**TINY) as llm:
        yield llm


def test_generate_returns_one_output_per_prompt_with_its_sequences(llm):
    prompts = ["Hello there", "The capital of France is", "One, two, three,"]
    t0 = time.time()
    outs = llm.generate(prompts, SamplingParams(n=2, max_tokens=4, temperature=0.8, seed=1, ignore_eos=True))
    assert len(outs) == 3
    for prompt, out in zip(prompts, outs):
        assert out.prompt == prompt
        assert out.prompt_token_ids == list(llm.tokenizer.encode(prompt))
        assert [c.index for c in out.outputs] == [0, 1]
        for c in out.outputs:
            assert len(c.token_ids) == 4 and c.finish_reason == "length"
            assert c.text == llm.tokenizer.decode(c.token_ids, skip_special_tokens=True)
            assert c.cumulative_logprob is None and c.logprobs is None  # not asked for
        m = out.metrics
        assert t0 <= m.arrival_time <= m.first_token_time <= m.finished_time <= time.time()
    assert len({o.request_id for o in outs}) == 3


def test_cumulative_logprob_sums_the_sampled_tokens(llm):
    (out,) = llm.generate("Once upon a time", SamplingParams(max_tokens=5, temperature=0, logprobs=0, ignore_eos=True))
    (c,) = out.outputs
    # vLLM's shape: per position {token_id: Logprob}, here the sampled token's alone (logprobs=0)
    assert [list(pos) for pos in c.logprobs] == [[t] for t in c.token_ids]
    sampled = [pos[t] for pos, t in zip(c.logprobs, c.token_ids)]
    assert c.cumulative_logprob == pytest.approx(sum(lp.logprob for lp in sampled))
    assert c.cumulative_logprob < 0


def test_num_cached_tokens_counts_the_prefix_cache_hit(llm):
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    first = llm.generate(LONG_PROMPT + "first", params)[0]
    again = llm.generate(LONG_PROMPT + "again", params)[0]
    assert first.num_cached_tokens == 0
    assert again.num_cached_tokens >= 32 and again.num_cached_tokens % 16 == 0


def test_chat_output_carries_the_templated_prompt(llm):
    (out,) = llm.chat([[{"role": "user", "content": "Name three primes."}]], SamplingParams(max_tokens=2))
    assert "Name three primes." in out.prompt and "<|im_start|>" in out.prompt
    assert llm.tokenizer.encode(out.prompt, add_special_tokens=False) == out.prompt_token_ids


def test_two_threads_share_one_llm(llm):
    """Both threads' requests run at once in the one engine: their ids must differ (they all were llm-0...)."""
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    prompts = [[5, 6, 7 + i] for i in range(8)]
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    barrier = threading.Barrier(2)
    results: dict[int, list] = {}
    errors: list[BaseException] = []

    def worker(k: int) -> None:
        try:
            barrier.wait()
            results[k] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert results == {0: expected, 1: expected}


def test_progress_bar_shows_input_and_output_token_rates(llm, capsys):
    llm.generate(["a b c", "d e f"], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=True)
    err = capsys.readouterr().err
    assert "Processed prompts" in err and "2/2" in err
    assert "input:" in err and "output:" in err and "toks/s" in err


# ------------------------------------------------------------------------------------------ back-pressure


async def test_library_callers_wait_for_room_instead_of_failing():
    """Many more concurrent calls than the engine holds (2 running + 4 waiting): every one completes, while
    the same load without waiting is refused."""
    args = EngineArgs(**TINY, max_num_seqs=2, max_waiting_requests=4)
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    async with AsyncEngine(args) as eng:
        done: list[int] = []
        most_waiting = 0

        async def call(i: int, wait: bool) -> None:
            nonlocal most_waiting
            async for out in eng.generate([5, 6, i % 50 + 10], params, wait_for_room=wait):
                most_waiting = max(most_waiting, eng.stats().num_waiting)
                if out.finished:
                    done.append(i)

        async with anyio.create_task_group() as tg:
            for i in range(60):
                tg.start_soon(call, i, True)
        assert sorted(done) == list(range(60))
        assert most_waiting <= 4

        refused = 0

        async def impatient(i: int) -> None:
            nonlocal refused
            try:
                await call(i, False)
            except EngineOverloaded:
                refused += 1

        async with anyio.create_task_group() as tg:
            for i in range(60):
                tg.start_soon(impatient, i)
        assert refused > 0
        s = eng.stats()
        assert s.num_running == s.num_waiting == 0 and s.kv_blocks_free == s.kv_blocks_total


async def test_a_waiting_caller_gets_in_after_impatient_callers_filled_the_queue():
    """An HTTP server sharing the engine (its callers do not wait) filled the queue: a library call is refused by
    the scheduler at first, and retries once the queue drains, rather than raising."""
    args = EngineArgs(**TINY, max_num_seqs=1, max_waiting_requests=2)
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    async with AsyncEngine(args) as eng:
        outs: dict[str, list[int]] = {}

        async def run(name: str, wait: bool) -> None:
            async for out in eng.generate([5, 6, 7], params, request_id=name, wait_for_room=wait):
                outs[name] = out.token_ids

        async def until(condition) -> None:
            with anyio.fail_after(30):
                while not condition(eng.stats()):
                    await anyio.sleep(0.005)

        async with anyio.create_task_group() as tg:
            tg.start_soon(run, "a", False)
            await until(lambda s: s.num_running == 1)
            tg.start_soon(run, "b", False)
            tg.start_soon(run, "c", False)
            await until(lambda s: s.num_waiting == 2)
            tg.start_soon(run, "library", True)
        assert set(outs) == {"a", "b", "c", "library"}
        assert outs["library"] == outs["a"] and len(outs["a"]) == 20


async def test_admission_gate_serves_in_arrival_order_and_never_splits_a_request():
    gate = AdmissionGate(3)
    order: list[str] = []
    release = anyio.Event()

    async def take(name: str, units: int) -> None:
        async with gate.hold(units):
            order.append(name)
            await release.wait()

    async with anyio.create_task_group() as tg:
        tg.start_soon(take, "a", 2)
        await anyio.sleep(0.01)
        tg.start_soon(take, "wide", 3)  # must wait for a: only 1 unit free
        await anyio.sleep(0.01)
        tg.start_soon(take, "small", 1)  # 1 unit is free, but "wide" came first
        await anyio.sleep(0.01)
        assert order == ["a"] and gate.num_waiting == 2
        release.set()
    assert order == ["a", "wide", "small"] and gate.free == 3


async def test_admission_gate_gives_back_a_cancelled_waiters_place():
    gate = AdmissionGate(1)
    async with gate.hold(1):
        with anyio.move_on_after(0.05):
            async with gate.hold(1):
                pytest.fail("the gate was full")
        assert gate.num_waiting == 0
    assert gate.free == 1
