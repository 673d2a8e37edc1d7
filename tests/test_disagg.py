"""Prefill/decode disaggregation on the CPU (gloo): a `DisaggEngine` pair against one engine.

Greedy ``dummy:tiny`` outputs barely depend on the context (its random weights repeat a token), so the
comparisons also use seeded sampling, whose draws follow every logit: wrong KV on the decode side changes
them (`test_wrong_kv_would_be_caught` shows the comparison catches it). The slow test compares greedy outputs
of the real default model."""

from __future__ import annotations

import random
import time

import anyio
import httpx
import pytest
from sluice.app.server.app import build_app
from sluice.core import AsyncEngine, EngineArgs, EngineDeadError, InvalidRequestError, SamplingParams
from sluice.core.disagg.engine import DisaggEngine
from sluice.kv import transfer as kv_transfer

from tests.helpers import InTask

TINY = dict(model="dummy:tiny", device="cpu", num_kv_blocks=256, max_model_len=1024, max_num_seqs=32)
BS = 16


@pytest.fixture(scope="module")
async def single():
    holder = InTask(lambda: AsyncEngine(EngineArgs(**TINY)))
    yield await holder.start()
    await holder.stop()


@pytest.fixture(scope="module")
async def pair():
    holder = InTask(lambda: DisaggEngine(EngineArgs(**TINY)))
    yield await holder.start()
    await holder.stop()


def cases(seed: int, n: int, min_len: int = 1, max_len: int = 90) -> list[tuple[list[int], SamplingParams]]:
    """Random prompts (no shared prefixes), greedy and seeded sampling; lengths on and off block edges."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        length = rng.choice([rng.randint(min_len, max_len), BS * rng.randint(1, 4), BS * rng.randint(1, 4) - 1])
        prompt = [rng.randrange(100, 40000) for _ in range(max(length, min_len))]
        if i % 2:
            params = SamplingParams(max_tokens=rng.randint(2, 12), temperature=0, ignore_eos=True)
        else:
            seed_i = seed * 1000 + i
            params = SamplingParams(max_tokens=rng.randint(2, 12), temperature=1.0, seed=seed_i, ignore_eos=True)
        out.append((prompt, params))
    return out


async def tokens(engine, prompt, params, request_id=None) -> list[int]:
    last = None
    async for out in engine.generate(prompt, params, request_id=request_id):
        last = out
    assert last is not None and last.finished
    return last.token_ids


async def run_all(engine, work, concurrent: bool) -> list[list[int]]:
    results: list[list[int] | None] = [None] * len(work)

    async def one(i: int) -> None:
        results[i] = await tokens(engine, *work[i])

    if concurrent:
        async with anyio.create_task_group() as tg:
            for i in range(len(work)):
                tg.start_soon(one, i)
    else:
        for i in range(len(work)):
            await one(i)
    return results


async def quiesce(pair: DisaggEngine) -> None:
    """Until both engines hold no request (aborts are processed a step later)."""
    with anyio.fail_after(30):
        while pair.prefill.stats().num_running or pair.decode.stats().num_running or pair._routes:
            await anyio.sleep(0.01)
        await anyio.sleep(0.05)


def assert_no_block_held(pair: DisaggEngine) -> None:
    for engine in (pair.prefill, pair.decode):
        sched = engine.local_core.scheduler_actor.scheduler
        assert sched.num_pinned_blocks == 0
        assert not sched.kv.req_blocks
        held = [b.block_id for b in sched.kv.pool.blocks if b.ref_cnt]
        assert not held, f"{engine.args.kv_role}: blocks still referenced: {held}"
        assert sched.kv.num_free_blocks == sched.kv.num_blocks


def payload_bytes(pair: DisaggEngine, num_blocks: int) -> int:
    return num_blocks * kv_transfer.block_bytes(pair.prefill.kv_caches)


async def test_pair_equals_one_engine_solo_and_32_concurrent(single, pair):
    work = cases(1, 32)
    ref = await run_all(single, work, concurrent=False)
    t0, s0 = pair.transfer_stats.num_bytes, pair.decode.stats().prefix_cache_hits
    local0 = pair.pair_stats.num_local_blocks
    assert await run_all(pair, work[:6], concurrent=False) == ref[:6]
    assert await run_all(pair, work, concurrent=True) == ref
    # The bytes shipped are exactly the prompts' full blocks (random prompts share no block; a prompt shorter
    # than a block goes to the decode engine whole), less those of the 6 prompts sent twice: the second time
    # the decode engine had them cached already. It hit every full block.
    full = sum(len(p) // BS for p, _ in work[:6] + work)
    again = sum(len(p) // BS for p, _ in work[:6])
    assert pair.pair_stats.num_local_blocks - local0 == again
    assert pair.transfer_stats.num_bytes - t0 == payload_bytes(pair, full - again)
    assert pair.decode.stats().prefix_cache_hits - s0 == BS * full
    await quiesce(pair)
    assert_no_block_held(pair)


async def test_shipped_blocks_serve_a_later_prefix_hit(single, pair):
    rng = random.Random(7)
    system = [rng.randrange(100, 40000) for _ in range(3 * BS)]
    first, second = system + [11, 12, 13], system + [rng.randrange(100, 40000) for _ in range(BS + 5)]
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=3, ignore_eos=True)
    ref = [await tokens(single, p, params) for p in (first, second)]
    local0, bytes0 = pair.pair_stats.num_local_blocks, pair.transfer_stats.num_bytes
    assert [await tokens(pair, p, params) for p in (first, second)] == ref
    # the second request found the shared 3 blocks on the decode side already: only its own block crossed
    assert pair.pair_stats.num_local_blocks - local0 == 3
    assert pair.transfer_stats.num_bytes - bytes0 == payload_bytes(pair, 3 + 1)


@pytest.mark.parametrize("fault", ["kill", "raise", "timeout"])
async def test_a_failed_transfer_recomputes_with_identical_output(single, pair, fault):
    work = cases(20 + len(fault), 4, min_len=2 * BS)
    ref = await run_all(single, work, concurrent=False)
    transport = pair.transport
    failed0, recomputed0 = transport.stats.num_failed, pair.pair_stats.num_recomputed

    def inject() -> None:
        if fault == "kill":
            transport.kill()  # the link dies with the payload on its way
        elif fault == "raise":
            raise RuntimeError("injected send failure")
        else:
            time.sleep(0.5)  # the payload leaves after the transfer's deadline

    if fault == "timeout":
        transport.timeout_s = 0.2
    transport.fault = inject
    try:
        assert await run_all(pair, work, concurrent=True) == ref
    finally:
        transport.fault = None
        transport.timeout_s = pair.args.kv_transfer_timeout
    assert transport.stats.num_failed - failed0 == len(work)
    assert pair.pair_stats.num_recomputed - recomputed0 == len(work)
    # and the transport works again afterwards (a fresh group)
    assert await run_all(pair, work[:1], concurrent=False) == ref[:1]
    await quiesce(pair)
    assert_no_block_held(pair)


async def test_wrong_kv_would_be_caught(single, pair, monkeypatch):
    """The comparison above has teeth: shipped KV that is wrong (zeros) changes the outputs."""
    work = [(p, s) for p, s in cases(3, 8, min_len=3 * BS) if s.temperature > 0]
    ref = await run_all(single, work, concurrent=False)
    real = kv_transfer.scatter_blocks

    def zeros(kv_caches, block_ids, payload):
        real(kv_caches, block_ids, payload.zero_())

    monkeypatch.setattr("sluice.core.disagg.engine.scatter_blocks", zeros)
    try:
        got = await run_all(pair, work, concurrent=False)
    finally:
        monkeypatch.undo()
        # the zeroed blocks are published in the decode engine's prefix cache: drop them
        pair.decode.local_core.scheduler_actor.scheduler.kv.pool.reset_prefix_cache()
    assert got != ref


async def test_200_random_cancellations_leak_no_block(pair):
    rng = random.Random(5)
    work = cases(9, 200, max_len=70)

    async def one(i: int) -> None:
        prompt, params = work[i]
        params.max_tokens = 16
        stop_after = rng.randint(0, 6)  # 0: cancelled before its first token (in prefill, or in transfer)
        with anyio.move_on_after(rng.choice([None, None, 0.0, 0.01, 0.05])):
            seen = 0
            async for _ in pair.generate(prompt, params):
                seen += 1
                if seen >= stop_after:
                    break

    # transfers that take a moment, so that cancellations land in every stage: prefill, transfer, decode
    pair.transport.fault = lambda: time.sleep(0.01)
    before = pair.pair_stats.num_cancelled_in_transfer
    try:
        async with anyio.create_task_group() as tg:
            for i in range(len(work)):
                tg.start_soon(one, i)
                if i % 8 == 0:
                    await anyio.sleep(0)
    finally:
        pair.transport.fault = None
    await quiesce(pair)
    assert pair.pair_stats.num_cancelled_in_transfer > before
    assert_no_block_held(pair)


async def test_pair_of_n_and_short_prompts_goes_to_decode_whole(single, pair):
    params = SamplingParams(max_tokens=5, temperature=1.0, seed=4, n=2, ignore_eos=True)
    prompt = list(range(200, 260))

    async def all_seqs(engine):
        outs = {}
        async for out in engine.generate(prompt, params):
            outs[out.index] = out.token_ids
        return outs

    direct0 = pair.pair_stats.num_direct
    assert await all_seqs(pair) == await all_seqs(single)
    assert pair.pair_stats.num_direct == direct0 + 1


async def test_first_token_that_ends_it_ends_at_prefill(single, pair):
    prompt = list(range(300, 340))
    params = SamplingParams(max_tokens=1, temperature=0)
    ended0 = pair.pair_stats.num_ended_at_prefill
    assert await tokens(pair, prompt, params) == await tokens(single, prompt, params)
    assert pair.pair_stats.num_ended_at_prefill == ended0 + 1
    await quiesce(pair)
    assert_no_block_held(pair)


async def test_a_dead_engine_fails_its_requests_and_health():
    async with DisaggEngine(EngineArgs(**{**TINY, "num_kv_blocks": 64})) as pair:
        app = build_app(pair)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            assert (await c.get("/health")).status_code == 200
            resp = await c.post("/v1/completions", json={"prompt": "Tell me about rivers and", "max_tokens": 4})
            assert resp.status_code == 200, resp.text

            def broken(so):
                raise RuntimeError("CUDA error: the decode device is gone")

            pair.decode.local_core.executor.runner.launch = broken
            with pytest.raises(Exception) as info:
                await tokens(pair, list(range(500, 540)), SamplingParams(max_tokens=4, temperature=0))
            assert "CUDA error" in str(info.value)
            assert not pair.is_healthy
            assert (await c.get("/health")).status_code == 503
            with pytest.raises(EngineDeadError, match="decode engine is dead"):
                await tokens(pair, list(range(500, 540)), SamplingParams(max_tokens=4, temperature=0))


def test_kv_role_is_validated():
    with pytest.raises(InvalidRequestError, match="kv_role"):
        EngineArgs(kv_role="middle")
    with pytest.raises(InvalidRequestError, match="speculative_model"):
        EngineArgs(kv_role="decode", speculative_model="default")
    assert EngineArgs().kv_role == "both"


@pytest.mark.slow
async def test_real_model_pair_equals_one_engine(default_tokenizer):
    """Greedy outputs of the real default model through the pair equal one engine's (whose concurrent outputs
    equal its solo ones: tests/test_engine.py), solo and 12 concurrent."""
    from tests.helpers import chat_prompt_of_length

    args = EngineArgs(model="smollm2-135m-instruct", device="cpu", num_kv_blocks=1024, max_model_len=2048)
    rng = random.Random(11)
    work = [
        (
            chat_prompt_of_length(default_tokenizer, rng.randint(20, 120), topic=f"topic {i}"),
            SamplingParams(max_tokens=rng.randint(3, 8), temperature=0),
        )
        for i in range(12)
    ]
    async with AsyncEngine(args) as engine:
        ref = await run_all(engine, work, concurrent=True)
    async with DisaggEngine(args) as pair:
        assert await run_all(pair, work[:2], concurrent=False) == ref[:2]
        assert await run_all(pair, work, concurrent=True) == ref
        assert pair.pair_stats.num_shipped == 14 and pair.pair_stats.num_recomputed == 0


def test_bench_disagg_runs_both_configurations(tmp_path, capsys):
    import json

    from sluice.app.commands.cli import main as sluice

    out = tmp_path / "disagg.json"
    argv = [
        "bench", "disagg", "--model", "dummy:tiny", "--prefill-device", "cpu", "--decode-device", "cpu",
        "--dataset", "random", "--num-prompts", "8", "--input-len", "20", "--output-len", "4",
        "--long-fraction", "0.25", "--long-len", "70", "--long-output-len", "3", "--request-rate", "inf",
        "--num-kv-blocks", "64", "--max-model-len", "256", "--out", str(out),
    ]  # fmt: skip
    assert sluice(argv) == 0
    r = json.loads(out.read_text())
    for name in ("pair", "split"):
        assert r[name]["completed"] == 8 and r[name]["failed"] == 0
    assert r["pair"]["kv_transfer"]["transfers"] == 8 and r["pair"]["kv_transfer"]["recomputed"] == 0
    assert r["pair"]["kv_transfer"]["blocks"] == 6 * 1 + 2 * 4  # full blocks of 6 x 20 and 2 x 70 tokens
    assert r["itl_p99_gain"] is not None and "pair vs split" in capsys.readouterr().out


async def test_stopping_the_pair_ends_requests_in_flight():
    from sluice.core import EngineStoppedError

    errors = []
    async with anyio.create_task_group() as tg:
        async with DisaggEngine(EngineArgs(**{**TINY, "num_kv_blocks": 64})) as pair:

            async def one(i: int) -> None:
                params = SamplingParams(max_tokens=500, temperature=0, ignore_eos=True)
                try:
                    await tokens(pair, [700 + i] * (20 + i), params)
                except EngineStoppedError as e:
                    errors.append(e)

            for i in range(4):
                tg.start_soon(one, i)
            with anyio.fail_after(30):
                while pair.decode.stats().generation_tokens < 8:
                    await anyio.sleep(0.01)
        # the pair has stopped: every caller's loop ends with an error, none waits forever
    assert len(errors) == 4


@pytest.mark.slow
def test_readme_example(tmp_path):
    """The README's DisaggEngine example, as written: its prompt crosses from prefill to decode."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    text = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    (block,) = [b for b in re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M) if "DisaggEngine(" in b]
    (tmp_path / "pair.py").write_text(block)
    run = subprocess.run([sys.executable, "pair.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "Paris" in run.stdout and "num_shipped=1" in run.stdout


def test_transport_ships_blocks_between_pools_and_recovers_from_a_kill():
    import torch
    from sluice.kv.transfer import KVTransport, TransferFailed, gather_blocks, scatter_blocks

    src = [torch.randn(2, 10, 4, 2, 3) for _ in range(3)]
    dst = [torch.zeros(2, 12, 4, 2, 3) for _ in range(3)]
    transport = KVTransport(torch.device("cpu"), torch.device("cpu"), timeout_s=10)
    scatter_blocks(dst, [0, 5, 6], transport.transfer(gather_blocks(src, [3, 1, 7])))
    for a, b in zip(src, dst):
        assert torch.equal(b[:, [0, 5, 6]], a[:, [3, 1, 7]])
        assert not b[:, [1, 2, 3, 4, 7]].any()  # nothing else written
    assert transport.stats.num_bytes == 3 * kv_transfer.block_bytes(src)
    transport.fault = transport.kill
    with pytest.raises(TransferFailed, match="killed"):
        transport.transfer(gather_blocks(src, [0]))
    transport.fault = None
    payload = gather_blocks(src, [2, 4])
    assert torch.equal(transport.transfer(payload), payload)
    assert (transport.stats.num_transfers, transport.stats.num_failed, transport.stats.generation) == (2, 1, 2)


def test_serve_refuses_half_a_pair(capsys):
    from sluice.app.commands.cli import main as sluice

    assert sluice(["serve", "--model", "dummy:tiny", "--device", "cpu", "--kv-role", "prefill"]) == 2
    assert "runs in a pair" in capsys.readouterr().err
    assert sluice(["serve", "--model", "dummy:tiny", "--device", "cpu", "--prefill-device", "cpu"]) == 2
    assert "both --prefill-device and --decode-device" in capsys.readouterr().err


async def test_a_lone_role_engine_is_refused():
    with pytest.raises(InvalidRequestError, match="half of a prefill/decode pair"):
        async with AsyncEngine(EngineArgs(**TINY, kv_role="decode")):
            pass
