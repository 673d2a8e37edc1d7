"""Speculative decoding in the engine, on dummy:tiny: greedy equality with plain decoding (batched,
chunked, with prefix-cache hits, penalties), seeds, the load switch, head loading errors, and no leaks
after cancellations (no cached block holds the KV of an unverified token)."""

from __future__ import annotations

import random

import anyio
import pytest
import torch
from sluice.core import LLM, AsyncEngine, EngineArgs, SamplingParams
from sluice.core.errors import InvalidRequestError
from sluice.core.models.loader import resolve_model
from sluice.core.sched.scheduler import Scheduler
from sluice.kv.attention import allocate_kv_cache, get_attention_backend
from sluice.kv.attention.torch_ref import TorchAttentionBackend
from sluice.kv.prefix_cache import block_hashes
from sluice.spec.eagle import DraftHeadError, load_draft_head, new_draft_head, save_draft_head
from sluice.spec.proposer import paged_metadata

from tests.graph_helpers import EagerMixedReplay, EagerReplay
from tests.spec_helpers import copy_head_dir, tiny_config

MODEL = "dummy:tiny"
COMMON = dict(device="cpu", num_kv_blocks=512, max_num_batched_tokens=48, max_model_len=512)


@pytest.fixture(scope="module")
def tiny_source():
    return resolve_model(MODEL)


@pytest.fixture(scope="module")
def copy_head(tmp_path_factory, tiny_source):
    return copy_head_dir(tmp_path_factory.mktemp("spec"), MODEL, tiny_source.config)


def _roughen(llm: LLM | AsyncEngine) -> LLM | AsyncEngine:
    """dummy:tiny's own weights make it copy its last token forever, and the copy head would never miss.
    Larger weights (the same in every engine of this module) make its greedy text vary."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        engine = llm.engine if isinstance(llm, LLM) else llm
        for p in engine.local_core.executor.runner.model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.1, generator=g)
    return llm


@pytest.fixture(scope="module")
def plain_llm():
    llm = _roughen(LLM(MODEL, **COMMON))
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def spec_llm(copy_head):
    llm = _roughen(LLM(MODEL, speculative_model=copy_head, num_speculative_tokens=3, **COMMON))
    yield llm
    llm.close()


def _prompts(n: int, seed: int, shared: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(5, 40000) for _ in range(shared)]
    return [prefix + [rng.randrange(5, 40000) for _ in range(rng.randrange(1, 70))] for _ in range(n)]


def _count_calls(obj, name: str):
    """Wrap ``obj.name`` (an instance attribute from now on) to count its calls in ``.calls``."""
    inner = getattr(obj, name)

    def counted(*args, **kwargs):
        counted.calls += 1
        return inner(*args, **kwargs)

    counted.calls = 0
    setattr(obj, name, counted)
    return counted


def _ids(llm: LLM, prompts, params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_greedy_equals_plain_batched_chunked_and_cached(plain_llm, spec_llm):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = _prompts(6, seed=0, shared=40)  # a 40-token shared prefix: prefix-cache hits
    expected = _ids(plain_llm, prompts, params)
    before = spec_llm.engine.stats()
    assert _ids(spec_llm, prompts[:1], params) == expected[:1]  # alone
    assert _ids(spec_llm, prompts, params) == expected  # batched; prompts over 48 tokens are chunked
    assert _ids(spec_llm, prompts[::-1], params) == expected[::-1]  # again: whole prefixes cached
    st = spec_llm.engine.stats()
    assert st.prefix_cache_hits > before.prefix_cache_hits
    drafted = st.spec_num_draft_tokens - before.spec_num_draft_tokens
    accepted = st.spec_num_accepted_tokens - before.spec_num_accepted_tokens
    assert 0 < accepted < drafted  # both accepts and rejections happened
    per_pos = st.spec_accepted_per_position
    assert len(per_pos) == 3 and list(per_pos) == sorted(per_pos, reverse=True)
    assert st.spec_mean_acceptance_length == pytest.approx(1 + st.spec_num_accepted_tokens / st.spec_num_drafts)


def test_greedy_with_penalties_and_min_tokens_equals_plain(plain_llm, spec_llm):
    # Row j of a verification sees the drafts before it as output: repetition penalties and min_tokens
    # bans must count them, or the copy head's repeated drafts would be judged against the wrong p.
    prompts = _prompts(3, seed=1)
    for params in (
        SamplingParams(temperature=0, max_tokens=24, repetition_penalty=1.5, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=24, frequency_penalty=0.5, presence_penalty=0.3, ignore_eos=True),
    ):
        assert _ids(spec_llm, prompts, params) == _ids(plain_llm, prompts, params)


def test_eos_and_max_tokens_inside_accepted_drafts(plain_llm, spec_llm):
    prompts = _prompts(4, seed=2)
    ref = _ids(plain_llm, prompts, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    # Stop at a token the target emits mid-run (it will sit among accepted drafts of some step).
    stops = [r[7] for r in ref]
    for p, r, stop in zip(prompts, ref, stops):
        params = SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop])
        ((out,),) = (o.outputs for o in spec_llm.generate([p], params, use_tqdm=False))
        assert out.token_ids == r[: r.index(stop) + 1]
        assert out.finish_reason == "stop"
    for n in (1, 2, 5, 7):
        outs = _ids(spec_llm, prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        assert outs == [r[:n] for r in ref]


def test_seeded_sampling_reproducible_alone_and_batched(spec_llm):
    prompts = _prompts(4, seed=3)
    params = [SamplingParams(temperature=0.8, max_tokens=20, seed=100 + i, ignore_eos=True) for i in range(4)]
    batched = _ids(spec_llm, prompts, params)
    alone = [_ids(spec_llm, [p], q)[0] for p, q in zip(prompts, params)]
    assert batched == alone
    assert len({tuple(b) for b in batched}) == 4


def test_logprobs_requests_decode_without_drafts(plain_llm, spec_llm):
    prompts = _prompts(2, seed=4)
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=2, ignore_eos=True)
    before = spec_llm.engine.stats().spec_num_drafts
    outs = [o.outputs[0] for o in spec_llm.generate(prompts, params, use_tqdm=False)]
    ref = [o.outputs[0] for o in plain_llm.generate(prompts, params, use_tqdm=False)]
    assert spec_llm.engine.stats().spec_num_drafts == before
    for o, r in zip(outs, ref):
        assert o.token_ids == r.token_ids
        assert [list(pos) for pos in o.logprobs] == [list(pos) for pos in r.logprobs]
        values = [lp.logprob for pos in o.logprobs for lp in pos.values()]
        assert values == pytest.approx([lp.logprob for pos in r.logprobs for lp in pos.values()], abs=1e-5)


UNIFORM_KW = dict(COMMON, attention_backend="triton")
# 8 tokens: two or three speculative steps a request, through the Triton interpreter (the suite's slowest tests)
UNIFORM_PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
UNIFORM_MIXED = [UNIFORM_PARAMS, SamplingParams(temperature=0, max_tokens=8, repetition_penalty=1.3, ignore_eos=True)]


@pytest.fixture(scope="module")
def uniform_plain_outputs():
    """Plain decoding's greedy tokens for the uniform-step test: the three prompts alone, then the first two
    with a penalized one beside (each run on a fresh engine). The same for every head's parametrization, so
    computed once: a plain engine never speculates, and the Triton interpreter is slow."""
    prompts = _prompts(3, seed=6)
    with _roughen(LLM(MODEL, **UNIFORM_KW)) as plain:
        expected = _ids(plain, prompts, UNIFORM_PARAMS)
    with _roughen(LLM(MODEL, **UNIFORM_KW)) as plain:
        mixed = [o.outputs[0].token_ids for o in plain.generate(prompts[:2], UNIFORM_MIXED, use_tqdm=False)]
    return prompts, expected, mixed


@pytest.mark.parametrize("feature", ["final", "eagle3"])
def test_uniform_greedy_steps_through_the_graph_path_match_plain_and_eager(
    feature, tmp_path, tiny_source, uniform_plain_outputs
):
    # The fixed-shape step the GPU captures (verification, catch-up and draft chain without a host sync),
    # run eagerly over the graphs' padded buffers: the Triton backend, as on the GPU, through the interpreter.
    # Asynchronous scheduling is on: its steady state feeds each step's rows from the one in flight, on the
    # device. An EAGLE-3 head reads the target's layer features in both paths.
    copy_head = copy_head_dir(tmp_path, MODEL, tiny_source.config, feature)
    kw, params, mixed = UNIFORM_KW, UNIFORM_PARAMS, UNIFORM_MIXED
    prompts, expected, ref = uniform_plain_outputs
    with _roughen(LLM(MODEL, speculative_model=copy_head, num_speculative_tokens=3, **kw)) as llm:
        spec = llm.engine.local_core.executor.runner.drafter
        sched = llm.engine.local_core.scheduler_actor.scheduler
        assert sched.config.max_uniform_batch == spec.max_uniform_batch > 0
        sched.config.max_uniform_batch = 0  # first every step through the general path
        s0 = llm.engine.stats()
        assert _ids(llm, prompts, params) == expected
        s1 = llm.engine.stats()
        sched.config.max_uniform_batch = spec.max_uniform_batch
        spec.graphs = graphs = EagerReplay.like(spec.graphs)
        graphs.capture()
        general = _count_calls(spec, "verify")
        fed = _count_calls(sched, "_schedule_device_fed")
        assert _ids(llm, prompts, params) == expected
        s2 = llm.engine.stats()
        # every verification took the graph path, the requests' last steps (drafts past max_tokens) too, and
        # most rows were fed from the device
        assert general.calls == 0
        assert fed.calls >= (s2.spec_num_drafts - s1.spec_num_drafts) // 2
        if feature == "final":
            # rows fed from the device never add a token past a request's end: a stop token met among accepted
            # drafts, max_tokens reached inside a step, while the others run on
            stop = expected[0][4]
            ends = [
                SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, stop_token_ids=[stop]),
                SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
            ]
            got = [o.outputs[0].token_ids for o in llm.generate(prompts, ends, use_tqdm=False)]
            assert got == [expected[0][: expected[0].index(stop) + 1], expected[1][:3], expected[2][:7]]
            assert llm.engine.stats().kv_blocks_free == llm.engine.stats().kv_blocks_total
        else:
            # steps that draft after a prompt replay the mixed-step graphs, which keep the head's features beside
            # the target's hidden states
            runner = llm.engine.local_core.executor.runner
            runner.mixed_graphs = steps = EagerMixedReplay(runner.mixed_forward, runner.buffers, [16, 48], 512)
            steps.capture()
            assert _ids(llm, prompts, params) == expected
            assert steps.replayed
            runner.mixed_graphs = None
        # a penalized request in the batch sends its steps back to the general path
        n = len(graphs.replayed)
        assert [o.outputs[0].token_ids for o in llm.generate(prompts[:2], mixed, use_tqdm=False)] == ref
    assert 4 in graphs.replayed and set(graphs.replayed) <= {1, 2, 4}  # 3 requests padded to 4
    assert set(graphs.replayed[n:]) <= {1}  # only the lone request after the penalized one finished
    drafts = (s1.spec_num_drafts - s0.spec_num_drafts, s2.spec_num_drafts - s1.spec_num_drafts)
    accepted = (
        s1.spec_num_accepted_tokens - s0.spec_num_accepted_tokens,
        s2.spec_num_accepted_tokens - s1.spec_num_accepted_tokens,
    )
    assert drafts[0] == drafts[1] and accepted[0] == accepted[1] > 0  # the same drafts, the same verdicts


def test_aborts_and_cancellations_under_steps_fed_from_the_device(tmp_path, tiny_source, uniform_plain_outputs):
    # Requests that end while their next step is already in flight (fed from the device): aborted, cancelled by
    # the caller, or at max_tokens. Every block comes back, and the ones that finish decode the plain tokens.
    copy_head = copy_head_dir(tmp_path, MODEL, tiny_source.config)
    prompts, expected, _ = uniform_plain_outputs
    rng = random.Random(11)
    done: dict[int, list[int]] = {}
    args = EngineArgs(MODEL, speculative_model=copy_head, num_speculative_tokens=3, **UNIFORM_KW)

    async def main():
        async with AsyncEngine(args) as engine:
            _roughen(engine)
            sched = engine.local_core.scheduler_actor.scheduler
            fed = _count_calls(sched, "_schedule_device_fed")
            limiter = anyio.CapacityLimiter(3)

            async def one(i: int) -> None:
                n = rng.randrange(2, 9)
                params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
                end = rng.choice(["finish", "finish", "abort", "cancel"])
                rid = f"d{i}"
                async with limiter:
                    tokens: list[int] = []
                    async for out in engine.generate(prompts[i % 3], params, request_id=rid):
                        tokens += out.token_ids if not out.finished else []
                        if out.finished:
                            done[i] = (out.token_ids, n)
                        elif end == "abort" and len(tokens) >= 2:
                            await engine.abort(rid)
                        elif end == "cancel" and len(tokens) >= 2:
                            break

            await _run_all(engine, one, 8, timeout=30)
            return engine.stats(), fed.calls

    stats, fed_calls = anyio.run(main)
    assert stats.kv_blocks_free == stats.kv_blocks_total
    assert fed_calls > 0
    finished = [(i, t, n) for i, (t, n) in done.items() if len(t) == n]
    assert finished
    for i, tokens, n in finished:
        assert tokens == expected[i % 3][:n]


def test_speculation_turns_off_above_the_batch_size(copy_head, plain_llm):
    llm = _roughen(LLM(MODEL, speculative_model=copy_head, speculative_disable_batch_size=2, **COMMON))
    try:
        params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        prompts = _prompts(4, seed=5)
        assert _ids(llm, prompts, params) == _ids(plain_llm, prompts, params)
        assert llm.engine.stats().spec_num_drafts == 0  # 4 requests > 2: none was drafted for
        assert _ids(llm, prompts[:2], params) == _ids(plain_llm, prompts[:2], params)
        assert llm.engine.stats().spec_num_drafts > 0
    finally:
        llm.close()


def test_head_loading_checks_the_target(tmp_path, tiny_source):
    other = tiny_config(vocab=64)
    wrong = save_draft_head(new_draft_head("tiny64", other, 64), tmp_path / "wrong")
    with pytest.raises(DraftHeadError, match="hidden_size"):
        load_draft_head(wrong, tiny_source.config, MODEL, 64)
    with pytest.raises(DraftHeadError, match="no default draft head"):
        LLM(MODEL, speculative_model="default", **COMMON)
    with pytest.raises(DraftHeadError, match="not a draft head directory"):
        LLM(MODEL, speculative_model=str(tmp_path), **COMMON)
    with pytest.raises(InvalidRequestError, match="num_speculative_tokens"):
        EngineArgs(num_speculative_tokens=0)
    # a head round-trips through its files, reduced vocabulary included
    vocab = torch.tensor([5, 2, 9, 400])
    head = new_draft_head(MODEL, tiny_source.config, 64, draft_vocab=vocab, seed=3)
    back = load_draft_head(save_draft_head(head, tmp_path / "ok", torch.float32), tiny_source.config, MODEL, 64)
    assert torch.equal(back.draft_vocab, vocab)
    for (n, a), b in zip(head.state_dict().items(), back.state_dict().values()):
        assert torch.equal(a, b), n
    # EAGLE-3 features: layers the target has, at least two, ascending
    layers = tiny_source.config.num_hidden_layers
    deep = save_draft_head(
        new_draft_head(MODEL, tiny_source.config, 64, feature="eagle3", feature_layers=[0, layers]), tmp_path / "deep"
    )
    with pytest.raises(DraftHeadError, match="outside the target's"):
        load_draft_head(deep, tiny_source.config, MODEL, 64)
    for bad in ([1], [1, 0], []):
        with pytest.raises(DraftHeadError, match="feature_layers"):
            new_draft_head(MODEL, tiny_source.config, 64, feature="eagle3", feature_layers=bad)


def test_batched_attention_matches_one_sequence_at_a_time():
    torch.manual_seed(0)
    bs, heads, kv_heads, dim = 4, 4, 2, 8
    (cache,) = allocate_kv_cache(1, 32, bs, kv_heads, dim, torch.float32, "cpu")
    cache.normal_()
    lens = [5, 9, 3, 14]
    tables = [[4 * i + j for j in range(4)] for i in range(4)]
    q_len = 3
    _, meta = paged_metadata([n - q_len for n in lens], [q_len] * 4, tables, bs, torch.device("cpu"))
    query = torch.randn(4 * q_len, heads, dim)
    ref = TorchAttentionBackend()
    got = ref.forward(query, cache, meta, 0.3)
    for i in range(4):
        s = slice(i * q_len, (i + 1) * q_len)
        want = ref._one_seq(query[s], cache, meta.block_tables[i], lens[i], 0.3)
        torch.testing.assert_close(got[s], want)


# ------------------------------------------------------------------------------------------ no leaks


def _dense_kv(model, tokens: list[int], block_size: int) -> list[torch.Tensor]:
    nb = -(-len(tokens) // block_size)
    caches = allocate_kv_cache(
        len(model.model.layers), nb, block_size, model.num_kv_heads, model.head_dim, torch.float32, "cpu"
    )
    positions, meta = paged_metadata([0], [len(tokens)], [list(range(nb))], block_size, torch.device("cpu"))
    from sluice.core.models.layers import ForwardContext

    with torch.inference_mode():
        model(torch.tensor(tokens), positions, ForwardContext(meta, caches, get_attention_backend("torch")))
    return caches


def test_no_leaks_after_cancellations_and_cached_blocks_hold_verified_kv(copy_head, monkeypatch):
    finished: list[tuple[list[int], str | None]] = []
    original = Scheduler._finish

    def record(self, req, **kw):
        finished.append((list(req.all_token_ids), req.cache_salt))
        original(self, req, **kw)

    monkeypatch.setattr(Scheduler, "_finish", record)
    args = EngineArgs(
        MODEL,
        speculative_model=copy_head,
        num_speculative_tokens=3,
        speculative_disable_batch_size=24,
        **{**COMMON, "max_num_batched_tokens": 256},
    )
    rng = random.Random(7)
    prompts = [p[:50] for p in _prompts(200, seed=8, shared=20)]

    async def main():
        async with AsyncEngine(args) as engine:
            _roughen(engine)
            limiter = anyio.CapacityLimiter(16)  # speculation stays on: at most 16 requests at a time

            async def one(i: int) -> None:
                params = SamplingParams(
                    temperature=rng.choice([0, 0, 0.7]),
                    max_tokens=rng.randrange(1, 25),
                    ignore_eos=True,
                    seed=i if i % 3 == 0 else None,
                )
                stop_after = rng.choice([None, 0, 1, 2, 3, 8])
                rid = f"q{i}"
                async with limiter:
                    if stop_after == 0:  # cancelled by the caller's scope, maybe before admission
                        with anyio.move_on_after(0.001 * rng.randrange(5)):
                            async for _ in engine.generate(prompts[i], params, request_id=rid):
                                pass
                        return
                    async for n, _ in aenumerate(engine.generate(prompts[i], params, request_id=rid)):
                        if stop_after is not None and n + 1 >= stop_after:
                            if rng.random() < 0.5:
                                await engine.abort(rid)
                            break

            await _run_all(engine, one, 200, timeout=20)
            await anyio.sleep(0.05)
            return engine.stats(), engine.local_core.executor.runner, engine.local_core.scheduler_actor.scheduler.kv

    stats, runner, kv = anyio.run(main)
    assert stats.kv_blocks_free == stats.kv_blocks_total
    assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens and stats.spec_num_drafts > 100
    # Every cached block's KV is that of the verified tokens its hash names.
    bs = kv.block_size
    where: dict[bytes, tuple[int, int]] = {}
    for s, (tokens, salt) in enumerate(finished):
        for j, h in enumerate(block_hashes(tokens, bs, salt)):
            where.setdefault(h, (s, j))
    cached = [b for b in kv.pool.blocks if b.block_hash is not None]
    assert len(cached) > 20
    by_seq: dict[int, list[tuple[int, int]]] = {}
    for b in cached:
        s, j = where[b.block_hash]
        assert tuple(finished[s][0][j * bs : (j + 1) * bs]) == b.token_ids
        by_seq.setdefault(s, []).append((j, b.block_id))
    for s, blocks in by_seq.items():
        last = max(j for j, _ in blocks)
        dense = _dense_kv(runner.model, finished[s][0][: (last + 1) * bs], bs)
        for j, block_id in blocks:
            for layer, pool in zip(dense, runner.kv_caches):
                torch.testing.assert_close(pool[:, block_id], layer[:, j], atol=1e-4, rtol=1e-4)


async def _run_all(engine, one, n: int, timeout: float) -> None:
    """``one(i)`` for every ``i < n`` at once, then wait until the engine holds no request."""
    async with anyio.create_task_group() as tg:
        for i in range(n):
            tg.start_soon(one, i)
    with anyio.fail_after(timeout):
        while engine.stats().num_running or engine.stats().num_waiting:
            await anyio.sleep(0.01)


async def aenumerate(it):
    n = 0
    async for x in it:
        yield n, x
        n += 1


def test_metrics_export_the_spec_counters():
    from sluice.app.server.metrics import ServerMetrics
    from sluice.core.stats import EngineStats

    class Engine:
        def __init__(self, stats):
            self._stats = stats

        def stats(self):
            return self._stats

    on = EngineStats(
        kv_blocks_total=4,
        spec_num_drafts=3,
        spec_num_draft_tokens=12,
        spec_num_accepted_tokens=7,
        spec_accepted_per_position=(3, 2, 1, 1),
    )
    text = ServerMetrics(Engine(on)).render()[0].decode()
    assert "sluice:spec_decode_num_drafts_total 3.0" in text
    assert "sluice:spec_decode_num_accepted_tokens_total 7.0" in text
    assert 'sluice:spec_decode_num_accepted_tokens_per_pos_total{position="1"} 2.0' in text
    assert on.spec_mean_acceptance_length == pytest.approx(1 + 7 / 3)
    off = ServerMetrics(Engine(EngineStats(kv_blocks_total=4))).render()[0].decode()
    assert "spec_decode" not in off
