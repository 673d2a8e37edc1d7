"""Prefix cache: verified hits (forced collisions, salts), the scheduler's use of it (deferral behind an
in-flight prefix, n > 1 forks with copy-on-write), hit-rate accounting against the analytic optimum,
the cache simulator against the engine, and greedy equality with the cache on and off on the real
model."""

from __future__ import annotations

from dataclasses import dataclass

import anyio
import pytest
from sluice.app.bench.prefix import run_engine
from sluice.app.bench.workloads import shared_prefix, shared_prefix_optimum
from sluice.app.commands.cache_sim import SimConfig, simulate
from sluice.core import AsyncEngine, EngineArgs, SamplingParams
from sluice.core.frontend.request_actor import RequestLimits, make_requests
from sluice.core.request import Request, RequestStatus
from sluice.core.sched.scheduler import Scheduler, SchedulerConfig
from sluice.kv import prefix_cache
from sluice.kv.manager import KVCacheManager

from tests.helpers import fake_output

BS = 16


@dataclass
class FakeReq:
    request_id: str
    all_token_ids: list[int]
    cache_salt: str | None = None
    num_computed_tokens: int = 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.all_token_ids)


def run_alone(kv: KVCacheManager, req: FakeReq, free: bool = True) -> int:
    """Admit ``req`` as the scheduler does, compute its whole prompt, publish; returns the hit in tokens."""
    hits, num_hit = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, len(req.all_token_ids) - num_hit, hits) is not None
    req.num_computed_tokens = len(req.all_token_ids)
    kv.cache_blocks(req, req.num_computed_tokens)
    if free:
        kv.free(req.request_id)
    return num_hit


def block(first: int) -> list[int]:
    return list(range(first, first + BS))


# ------------------------------------------------------------------------------------------ kv level


def test_forced_collision_never_reuses_a_block_computed_under_another_prefix(monkeypatch):
    """Every hash equal. c's block 1 holds tokens X computed at positions 16..31 behind Q, and it ends up as
    the one cached entry; d starts with X, so it matches that entry on hash and tokens alone, and must
    still not get it (its KV belongs to another prefix, at other positions)."""
    monkeypatch.setattr(prefix_cache, "hash_block_tokens", lambda parent, tokens, extra=None: b"h")
    mgr = KVCacheManager(num_blocks=16, block_size=BS)
    P, Q, X = block(100), block(200), block(300)
    run_alone(mgr, FakeReq("a", P + [1]), free=False)  # a's block 0 takes the only entry
    c = FakeReq("c", Q + X + [1])
    assert mgr.allocate_slots(c, BS) is not None  # c's first chunk: block 0, published behind a's entry
    c.num_computed_tokens = BS
    mgr.cache_blocks(c, BS)
    mgr.free("a")
    filler = FakeReq("filler", [5] * (mgr.num_free_blocks * BS))
    mgr.allocate_slots(filler, len(filler.all_token_ids))  # evicts a's block: the entry is vacant
    assert not mgr.pool.cached
    mgr.free("filler")
    assert mgr.allocate_slots(c, BS + 1) is not None  # c's second chunk: block 1 takes the entry
    c.num_computed_tokens = 2 * BS + 1
    mgr.cache_blocks(c, c.num_computed_tokens)
    assert mgr.pool.cached[b"h"].token_ids == tuple(X)  # the trap is armed
    d = FakeReq("d", X + [1])
    assert mgr.get_computed_blocks(d) == ([], 0), "a block computed behind another prefix was handed out"
    d_salted = FakeReq("d2", X + [1], cache_salt="s")
    assert mgr.get_computed_blocks(d_salted) == ([], 0)


def test_salts_never_share_and_equal_salts_do():
    mgr = KVCacheManager(num_blocks=32, block_size=BS)
    prompt = block(10) + block(40) + [3, 4]
    assert run_alone(mgr, FakeReq("a", prompt, "tenant-a")) == 0
    assert run_alone(mgr, FakeReq("b", prompt, "tenant-b")) == 0
    assert run_alone(mgr, FakeReq("n", prompt, None)) == 0
    assert run_alone(mgr, FakeReq("a2", prompt, "tenant-a")) == 2 * BS
    assert run_alone(mgr, FakeReq("n2", prompt, None)) == 2 * BS


def test_a_hit_never_covers_the_whole_prompt():
    mgr = KVCacheManager(num_blocks=32, block_size=BS)
    prompt = block(10) + block(40)  # block-aligned: the last block is recomputed for its last token
    run_alone(mgr, FakeReq("a", prompt))
    assert mgr.get_computed_blocks(FakeReq("b", prompt))[1] == BS
    assert mgr.get_computed_blocks(FakeReq("c", prompt + [9]))[1] == 2 * BS


@pytest.mark.parametrize("salt", [None, "tenant"])
def test_a_reservation_pins_the_cached_prefix_and_publishes_the_rest_as_a_prefix_hit(salt):
    """Disaggregation's decode side (`KVCacheManager.reserve` / `publish` / `release`): the leading blocks cached
    here are pinned, not shipped; the fresh ones, once published, are found by a later lookup exactly as blocks
    computed here; releasing drops every pin."""
    mgr = KVCacheManager(num_blocks=8, block_size=BS)
    prompt = block(10) + block(40) + block(70)
    run_alone(mgr, FakeReq("a", block(10) + [1, 2], cache_salt=salt))  # caches the first block only
    free = mgr.num_free_blocks
    res = mgr.reserve(prompt, salt)
    assert res is not None and (len(res.cached), len(res.fresh), res.num_blocks) == (1, 2, 3)
    assert all(b.ref_cnt == 1 for b in res.cached + res.fresh) and mgr.num_free_blocks == free - 3
    other = "x" if salt is None else None
    assert mgr.reserve(prompt, other).cached == []  # another salt: nothing of it is cached
    assert mgr.get_computed_blocks(FakeReq("b", prompt + [5], cache_salt=salt))[1] == BS  # not published yet
    mgr.publish(res)
    hit, num_hit = mgr.get_computed_blocks(FakeReq("c", prompt + [5], cache_salt=salt))
    assert num_hit == 3 * BS and hit == res.cached + res.fresh
    mgr.release(res)
    assert all(b.ref_cnt == 0 for b in hit)


def test_a_reservation_the_pool_cannot_hold_holds_nothing():
    mgr = KVCacheManager(num_blocks=3, block_size=BS)
    run_alone(mgr, FakeReq("a", block(10) + [1]))
    free = mgr.num_free_blocks
    assert mgr.reserve(block(10) + block(40) + block(70) + block(99), None) is None
    assert mgr.num_free_blocks == free and all(b.ref_cnt == 0 for b in mgr.pool.blocks)


def test_pinned_prompt_blocks_outlive_their_table():
    """Disaggregation's prefill side (`pin_prompt` / `unpin`): the request's full prompt blocks stay held after
    it is freed, and are freed tail first when unpinned; a table short of them pins nothing."""
    mgr = KVCacheManager(num_blocks=8, block_size=BS)
    req = FakeReq("a", block(10) + block(40) + [1, 2])
    run_alone(mgr, req, free=False)
    assert mgr.pin_prompt("nobody", len(req.all_token_ids)) is None
    pinned = mgr.pin_prompt("a", len(req.all_token_ids))
    assert pinned == mgr.blocks("a")[:2] and [b.ref_cnt for b in pinned] == [2, 2]
    mgr.free("a")
    assert [b.ref_cnt for b in pinned] == [1, 1]
    mgr.unpin(pinned)
    assert [b.ref_cnt for b in pinned] == [0, 0]
    assert list(mgr.pool.free_queue)[-2:] == [pinned[1], pinned[0]]  # the prefix is evicted last
    assert mgr.get_computed_blocks(FakeReq("b", block(10) + block(40) + [3]))[1] == 2 * BS  # still cached


def test_disabled_cache_publishes_nothing_and_never_hits():
    mgr = KVCacheManager(num_blocks=32, block_size=BS, enable_prefix_caching=False)
    prompt = block(10) + block(40) + [1]
    run_alone(mgr, FakeReq("a", prompt))
    assert run_alone(mgr, FakeReq("b", prompt)) == 0
    assert not mgr.pool.cached and all(b.block_hash is None for b in mgr.pool.blocks)


# ------------------------------------------------------------------------------------------ scheduler level


def make_scheduler(num_blocks: int = 64, budget: int = 2048, caching: bool = True, max_seqs: int = 16):
    kv_mgr = KVCacheManager(num_blocks, BS, caching)
    return Scheduler(SchedulerConfig(max_seqs, budget, 4096, 1024), kv_mgr)


def req(rid: str, prompt: list[int], max_tokens: int = 4, **sp) -> Request:
    return Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sp), max_tokens)


def step(sched: Scheduler, token: int = 7):
    so = sched.schedule()
    return so, sched.update_from_output(so, fake_output(so, token))


def test_request_arriving_while_its_prefix_is_prefilled_waits_and_hits():
    sched = make_scheduler(budget=32)
    shared = list(range(1000, 1100))  # 100 tokens: 6 full blocks, the hit ends mid-prompt
    a = req("a", shared + [1, 2, 3])
    sched.add_request(a)
    step(sched)  # a computes 32 tokens
    b = req("b", shared + [4, 5])
    sched.add_request(b)
    waited = 0
    while b.status is RequestStatus.WAITING:
        step(sched)
        waited += 1
    assert waited > 1, "b was deferred while a computed the shared blocks"
    assert b.num_cached_tokens == 96  # everything a computed, up to the last full block of the shared part
    while sched.has_work():
        step(sched)
    assert sched.kv.prefix_cache_hits == 96 and sched.kv.prefix_cache_queries == 103 + 102
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


@pytest.mark.parametrize("caching", [True, False])
def test_only_the_cache_makes_a_request_wait_for_an_in_flight_prefix(caching):
    sched = make_scheduler(budget=64, caching=caching)
    shared = list(range(1000, 1100))
    sched.add_request(req("a", shared + [1]))
    step(sched)  # a: tokens 0..63
    sched.add_request(req("b", shared + [2]))
    so, _ = step(sched)  # a: 64..100, 27 tokens of budget left
    assert so.req_ids == (["a"] if caching else ["a", "b"])


def n_group(prompt: list[int], n: int, max_tokens: int = 6, **sp) -> list[Request]:
    """The n sequences of one request, built as the request actor builds them (ids g#i, seeds seed + i)."""
    limits = RequestLimits(max_model_len=4096, vocab_size=1 << 20, max_kv_tokens=64 * BS)
    return make_requests("g", prompt, SamplingParams(n=n, max_tokens=max_tokens, ignore_eos=True, **sp), (), limits)


def run_tracking(sched: Scheduler, seqs: list[Request]):
    """Run to the end; returns (blocks held once every sequence has its first token, peak blocks held,
    prompt tokens computed, the step outputs)."""
    log, at_first, peak = [], None, 0
    while sched.has_work():
        so, _ = step(sched)
        log.append(so)
        used = sched.kv.num_blocks - sched.kv.num_free_blocks
        peak = max(peak, used)
        if at_first is None and all(r.output_token_ids for r in seqs):
            at_first = used
    prompt_len = len(seqs[0].prompt_token_ids)
    prompt_computed = sum(
        min(q, max(0, prompt_len - start))
        for so in log
        for q, start in zip(so.num_scheduled_tokens, so.num_computed_tokens)
    )
    return at_first, peak, prompt_computed, log


@pytest.mark.parametrize("caching", [True, False])
def test_n4_computes_the_prompt_once_shares_its_blocks_and_copies_on_write(caching):
    prompt = list(range(2000, 2000 + 5 * BS + 3))  # 5 full blocks and a partial one of 3 tokens
    sched = make_scheduler(caching=caching)
    group = n_group(prompt, 4, max_tokens=6, temperature=0.8, seed=11)
    assert [r.request_id for r in group] == ["g#0", "g#1", "g#2", "g#3"]
    assert [r.sampling_params.seed for r in group] == [11, 12, 13, 14]
    sched.add_request(group[0], group[1:])
    at_first, peak, prompt_computed, log = run_tracking(sched, group)
    assert prompt_computed == len(prompt), "the prompt is computed once"
    prefill = log[0]
    assert prefill.req_ids == ["g#0"] and prefill.forks == {"g#0": ["g#1", "g#2", "g#3"]}
    assert [nr.sampling_params.seed for nr in prefill.new_requests] == [11, 12, 13, 14]
    assert at_first == 6, "after one prefill the four sequences share all six prompt blocks, the partial one too"
    # the first decode: three sequences copy the shared partial block, the last one writes in place
    first_decode = log[1]
    assert first_decode.num_scheduled_tokens == [1, 1, 1, 1]
    assert len(first_decode.block_copies) == 3
    parent_table = prefill.new_requests[0].block_ids
    assert {src for src, _ in first_decode.block_copies} == {parent_table[5]}
    tables = {nr.request_id: list(nr.block_ids) for nr in prefill.new_requests}
    for rid, (start, ids) in first_decode.block_updates.items():
        tables[rid][start:] = ids
    assert len({t[5] for t in tables.values()}) == 4, "each sequence owns its last block after the copies"
    assert all(t[:5] == parent_table[:5] for t in tables.values()), "the full prompt blocks stay shared"
    assert peak == 6 + 3
    assert all(len(r.output_token_ids) == 6 for r in group)
    assert sched.kv.num_free_blocks == sched.kv.num_blocks, "every block is freed afterwards"

    separate = make_scheduler(caching=caching)
    solo = [req(f"s{i}", prompt, max_tokens=6) for i in range(4)]
    for r in solo:
        separate.add_request(r)
    sep_first, sep_peak, sep_computed, _ = run_tracking(separate, solo)
    assert at_first < sep_first and peak <= sep_peak and prompt_computed < sep_computed
    if not caching:
        assert peak < sep_peak == 4 * 6


def test_a_group_waits_for_room_for_all_its_sequences():
    sched = make_scheduler(max_seqs=4)
    sched.add_request(req("x", list(range(3000, 3020)), max_tokens=20))
    sched.add_request(req("y", list(range(3100, 3120)), max_tokens=20))
    group = n_group(list(range(4000, 4020)), 3)
    sched.add_request(group[0], group[1:])
    so, _ = step(sched)
    assert so.req_ids == ["x", "y"], "2 running + a group of 3 > max_num_seqs 4"


def test_parent_aborted_before_its_prompt_is_computed_hands_over_to_a_sibling():
    sched = make_scheduler(budget=32)
    prompt = list(range(5000, 5100))
    group = n_group(prompt, 3, max_tokens=3)
    sched.add_request(group[0], group[1:])
    step(sched)  # mid-prefill
    sched.abort("g#0")
    assert "g#0" not in sched.requests
    while sched.has_work():
        step(sched)
    assert group[0].output_token_ids == []
    assert [len(r.output_token_ids) for r in group[1:]] == [3, 3]
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


def test_aborting_a_pending_sibling_leaves_the_rest():
    sched = make_scheduler(budget=32)
    group = n_group(list(range(5000, 5100)), 3, max_tokens=3)
    sched.add_request(group[0], group[1:])
    step(sched)
    sched.abort("g#1")
    while sched.has_work():
        step(sched)
    assert [len(r.output_token_ids) for r in group] == [3, 0, 3]
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


# ------------------------------------------------------------------------------------------ hit rates


def expected_optimum(groups: int, per_group: int, system_len: int, question_len: int, bs: int) -> float:
    """Computed here from the shape alone: each group's first prompt misses; every other prompt hits the
    system prompt's full blocks (the block holding the system/question boundary differs)."""
    hits = groups * (per_group - 1) * (system_len // bs) * bs
    return hits / (groups * per_group * (system_len + question_len))


@pytest.mark.parametrize(
    ("shape", "budget", "order"),
    [((64, 16, 2048, 128), 2048, "shuffled"), ((8, 5, 200, 20), 64, "interleaved"), ((3, 4, 40, 1), 2048, "grouped")],
)
def test_simulated_hit_rate_is_the_analytic_optimum_with_a_big_pool(shape, budget, order):
    w = shared_prefix(*shape, output_len=4, order=order)
    r = simulate(w, SimConfig(num_kv_blocks=w.max_blocks_touched(BS), max_num_batched_tokens=budget))
    assert r.num_finished == len(w.requests)
    assert r.prefix_cache_hits / r.prefix_cache_queries == expected_optimum(*shape, BS)
    assert (r.prefix_cache_hits, r.prefix_cache_queries) == shared_prefix_optimum(*shape, BS)


def test_cache_sim_with_a_small_pool_evicts_and_misses():
    w = shared_prefix(8, 4, 64, 8, output_len=4, order="interleaved")
    big = simulate(w, SimConfig(num_kv_blocks=w.max_blocks_touched(BS), max_concurrency=1))
    small = simulate(w, SimConfig(num_kv_blocks=12, max_concurrency=1))
    assert small.hit_rate == 0.0 < big.hit_rate  # LRU over 8 interleaved groups, room for ~2 prefixes


def tiny_args(**kw) -> EngineArgs:
    base = dict(model="dummy:tiny", device="cpu", num_kv_blocks=256, max_model_len=1024, max_num_batched_tokens=64)
    return EngineArgs(**{**base, **kw})


async def test_engine_hit_rate_is_the_analytic_optimum_with_concurrent_arrivals():
    shape = (4, 5, 72, 9)  # the system prompt ends mid-block
    w = shared_prefix(*shape, output_len=3)
    fig = await run_engine(tiny_args(num_kv_blocks=w.max_blocks_touched(BS)), w, 0)
    assert fig.num_failed == 0
    assert fig.prefix_cache_hits / fig.prefix_cache_queries == expected_optimum(*shape, BS)


async def test_cache_sim_equals_the_engine_for_the_same_workload_and_pool():
    w = shared_prefix(5, 3, 48, 8, output_len=2, order="shuffled", seed=3)
    seen = set()
    for blocks in (6, 10, w.max_blocks_touched(BS)):
        fig = await run_engine(tiny_args(num_kv_blocks=blocks), w, 0, max_concurrency=1, warmup=False)
        sim = simulate(w, SimConfig(num_kv_blocks=blocks, max_num_batched_tokens=64, max_concurrency=1))
        assert (fig.prefix_cache_hits, fig.prefix_cache_queries) == (sim.prefix_cache_hits, sim.prefix_cache_queries)
        seen.add(sim.prefix_cache_hits)
    assert len(seen) == 3, "the pool sizes span evicting and non-evicting regimes"


# ------------------------------------------------------------------------------------------ engine, dummy:tiny


async def collect(engine, prompt, params, rid=None):
    last = {}
    async for o in engine.generate(prompt, params, request_id=rid):
        last[o.index] = o
    return [last[i] for i in sorted(last)]


async def test_stats_count_unreferenced_cached_blocks_as_free_and_salts_split_the_cache():
    prompt = list(range(1000, 1000 + 3 * BS + 5))
    p = lambda salt=None: SamplingParams(max_tokens=2, temperature=0, cache_salt=salt)
    async with AsyncEngine(tiny_args()) as engine:
        (a,) = await collect(engine, prompt, p("a"))
        st = engine.stats()
        assert st.kv_blocks_free == st.kv_blocks_total, "cached blocks nobody holds are free"
        assert st.prefix_cache_hits == 0 and st.prefix_cache_queries == len(prompt)
        (b,) = await collect(engine, prompt, p("b"))
        (n,) = await collect(engine, prompt, p())
        (a2,) = await collect(engine, prompt, p("a"))
        assert (a.usage.cached_tokens, b.usage.cached_tokens, n.usage.cached_tokens) == (0, 0, 0)
        assert a2.usage.cached_tokens == 3 * BS
        st = engine.stats()
        assert st.prefix_cache_hits == 3 * BS and st.prefix_cache_hit_rate == 3 * BS / (4 * len(prompt))


async def test_enable_prefix_caching_false_end_to_end():
    prompt = list(range(1000, 1000 + 3 * BS + 5))
    params = SamplingParams(max_tokens=2, temperature=0)
    async with AsyncEngine(tiny_args(enable_prefix_caching=False)) as engine:
        outs = [(await collect(engine, prompt, params))[0] for _ in range(2)]
        assert [o.usage.cached_tokens for o in outs] == [0, 0]
        assert outs[0].token_ids == outs[1].token_ids
        st = engine.stats()
        assert st.prefix_cache_hits == 0 and st.kv_blocks_free == st.kv_blocks_total


# ------------------------------------------------------------------------------------------ real model


@pytest.fixture(scope="module")
def real_prompts(default_tokenizer):
    from tests.helpers import chat_prompt_of_length, prompt_of_length

    system = prompt_of_length(default_tokenizer, 150, "You are a careful assistant who answers about")
    topics = ("rivers", "owls")
    return {
        "system": system,
        "q": [chat_prompt_of_length(default_tokenizer, 40 + 7 * i, t) for i, t in enumerate(topics)],
    }


def real_args(budget: int = 48, **kw) -> EngineArgs:
    return EngineArgs(device="cpu", num_kv_blocks=512, max_model_len=1024, max_num_batched_tokens=budget, **kw)


async def greedy_round(engine, prompts, delayed, max_tokens=8):
    """All of ``prompts`` at once, except ``delayed``, sent once the engine is mid-way through the first
    prompt's prefill (its shared blocks computed in part)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    results: dict[int, object] = {}

    async def one(i, p):
        (results[i],) = await collect(engine, p, params)

    steps0 = engine.stats().num_steps
    async with anyio.create_task_group() as tg:
        for i, p in enumerate(prompts):
            tg.start_soon(one, i, p)
        while engine.stats().num_steps < steps0 + 2:
            await anyio.sleep(0.002)
        for j, p in enumerate(delayed):
            tg.start_soon(one, len(prompts) + j, p)
    return [results[i] for i in range(len(results))]


@pytest.mark.slow
async def test_greedy_outputs_equal_with_the_cache_on_and_off(real_prompts):
    system, (q1, q2) = real_prompts["system"], real_prompts["q"]
    prompts = [system + q1, system + q2, system[:101] + q2]  # a hit ending mid-prompt, at block 96
    delayed = [system + q1[:-5] + q2[-5:], system[:140] + q1]
    outs = {}
    for caching in (True, False):
        async with AsyncEngine(real_args(enable_prefix_caching=caching)) as engine:
            outs[caching] = await greedy_round(engine, prompts, delayed)
    cached = [o.usage.cached_tokens for o in outs[True]]
    assert cached[3] > 0 and cached[4] > 0, "the late requests hit what the first one had computed"
    assert any(c % BS == 0 and 0 < c < len(p) for c, p in zip(cached, prompts + delayed))
    for on, off in zip(outs[True], outs[False]):
        assert on.token_ids == off.token_ids
        assert off.usage.cached_tokens == 0


async def with_peak(engine, fn, *args):
    """Run ``fn(*args)`` while sampling the blocks the engine holds after every step; (result, peak)."""
    peak = 0

    async def watch():
        nonlocal peak
        while True:
            st = engine.stats()
            peak = max(peak, st.kv_blocks_total - st.kv_blocks_free)
            await anyio.sleep(0.001)

    async with anyio.create_task_group() as tg:
        tg.start_soon(watch)
        result = await fn(*args)
        tg.cancel_scope.cancel()
    return result, peak


@pytest.mark.slow
async def test_n4_forks_match_solo_runs_on_the_real_model(real_prompts):
    prompt = real_prompts["system"][:90] + real_prompts["q"][0]  # a partial last block
    assert len(prompt) % BS
    greedy = dict(max_tokens=6, temperature=0, ignore_eos=True)
    seeded = dict(max_tokens=6, temperature=0.8, ignore_eos=True)

    async def four_separate():
        async with anyio.create_task_group() as tg:
            for _ in range(4):
                tg.start_soon(collect, engine, prompt, SamplingParams(**greedy))

    async with AsyncEngine(real_args(budget=2048, enable_prefix_caching=False)) as engine:
        forks_greedy, fork_peak = await with_peak(engine, collect, engine, prompt, SamplingParams(n=4, **greedy))
        _, separate_peak = await with_peak(engine, four_separate)
        forks_seeded = await collect(engine, prompt, SamplingParams(n=4, seed=123, **seeded))
        (solo_greedy,) = await collect(engine, prompt, SamplingParams(**greedy))
        solo_seeded = [(await collect(engine, prompt, SamplingParams(seed=123 + i, **seeded)))[0] for i in range(4)]
        st = engine.stats()
        assert st.kv_blocks_free == st.kv_blocks_total, "every block is freed afterwards"
    assert [o.index for o in forks_greedy] == [0, 1, 2, 3]
    assert all(o.token_ids == solo_greedy.token_ids for o in forks_greedy)
    assert [o.token_ids for o in forks_seeded] == [o.token_ids for o in solo_seeded]
    assert len({tuple(o.token_ids) for o in forks_seeded}) > 1, "different seeds draw different samples"
    blocks_per_seq = -(-(len(prompt) + 6) // BS)
    assert fork_peak <= len(prompt) // BS + 4 * 2 < separate_peak <= 4 * blocks_per_seq
