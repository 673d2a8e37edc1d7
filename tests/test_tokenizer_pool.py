"""Large prompts are tokenized on a pool sized to the spare cores (issue 36: one thread queued a 17 KB prompt
behind a flood of big ones for seconds): the size rule, big prompts tokenized side by side, and a small prompt
(tokenized on the event loop) answered while big ones hold every thread of the pool."""

from __future__ import annotations

import os
import threading

import anyio
import pytest
from sluice.core import AsyncEngine, EngineArgs, SamplingParams
from sluice.core.frontend import tokenizer_pool
from sluice.core.frontend.engine import OFF_LOOP_CHARS
from sluice.core.frontend.tokenizer_pool import engine_busy_threads, tokenizer_threads, usable_cpus

BIG = "word " * (OFF_LOOP_CHARS // 5 + 100)  # over the threshold: tokenized in the pool


def args(**kw) -> EngineArgs:
    return EngineArgs(model="dummy:tiny", device="cpu", num_kv_blocks=64, max_model_len=256, **kw)


def test_the_pool_gets_the_cores_the_engine_leaves_free():
    assert engine_busy_threads(args()) == 2  # the event loop (front end and core), the launch thread
    assert engine_busy_threads(args(engine_core_process=True)) == 3  # + the core's own event loop
    assert engine_busy_threads(args(engine_core_process=True, enable_inspector=True)) == 2  # one process
    assert tokenizer_threads(args(engine_core_process=True), cpus=16) == 13
    assert tokenizer_threads(args(), cpus=16) == 14
    for cpus in (1, 2, 3):
        assert tokenizer_threads(args(engine_core_process=True), cpus=cpus) == 1  # at least one


def test_usable_cpus_follow_the_affinity_mask(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 2, 5}, raising=False)
    assert usable_cpus() == 3
    assert tokenizer_threads(args()) == 1
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(10)), raising=False)
    assert tokenizer_threads(args()) == 8


async def drain(engine: AsyncEngine, prompt) -> int:
    n = 0
    async for out in engine.generate(prompt, SamplingParams(max_tokens=2, ignore_eos=True)):
        n += len(out.delta_token_ids)
    return n


@pytest.fixture
def gated_tokenizer(monkeypatch):
    """Big prompts' tokenization waits for ``release`` (in its pool thread); the threads in it are counted."""
    release = threading.Event()
    state = {"inside": 0, "most": 0}
    lock = threading.Lock()

    def install(engine: AsyncEngine) -> None:
        real = engine.tokenize_prompt

        def tokenize(prompt):
            if isinstance(prompt, str) and len(prompt) > OFF_LOOP_CHARS:
                with lock:
                    state["inside"] += 1
                    state["most"] = max(state["most"], state["inside"])
                assert release.wait(30)
                with lock:
                    state["inside"] -= 1
                return [1, 2, 3]
            return real(prompt)

        monkeypatch.setattr(engine, "tokenize_prompt", tokenize)

    return install, release, state


async def test_big_prompts_are_tokenized_side_by_side_and_a_small_one_is_not_stuck_behind_them(
    monkeypatch, gated_tokenizer
):
    monkeypatch.setattr(tokenizer_pool, "usable_cpus", lambda: 5)  # 3 threads beside the engine's 2
    install, release, state = gated_tokenizer
    async with AsyncEngine(args()) as engine:
        install(engine)
        async with anyio.create_task_group() as tg:
            for _ in range(5):  # more than the pool: two wait for a thread
                tg.start_soon(drain, engine, BIG)
            with anyio.fail_after(10):
                while state["inside"] < 3:
                    await anyio.sleep(0.01)
            with anyio.fail_after(10):  # every thread of the pool is taken; a small prompt still goes through
                assert await drain(engine, "Hi") > 0
            assert state["inside"] == 3
            release.set()
        assert state["most"] == 3  # side by side, never more than the pool
