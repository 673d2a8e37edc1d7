"""Asynchronous scheduling (step N+1 scheduled and launched before step N's tokens are read back) changes no
output: the same requests through an engine with it on and one with it off give identical tokens, solo and
batched, with preemption, prefix-cache hits, n > 1, stop strings, penalties and speculation."""

from __future__ import annotations

import random

import pytest
import torch
from sluice.core import LLM, SamplingParams

from tests.spec_helpers import copy_head_dir

MODEL = "dummy:tiny"
COMMON = dict(device="cpu", num_kv_blocks=512, max_num_batched_tokens=64, max_model_len=512)


def _roughen(llm: LLM) -> LLM:
    """dummy:tiny's own weights repeat one token forever; larger random weights (the same in every engine
    here) make its greedy text vary, so a token fed from the wrong step would show."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in llm.engine.local_core.executor.runner.model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.1, generator=g)
    return llm


def _pair(**kw):
    """The same engine with asynchronous scheduling on and off."""
    return [_roughen(LLM(MODEL, async_scheduling=on, **{**COMMON, **kw})) for on in (True, False)]


@pytest.fixture(scope="module")
def engines():
    pair = _pair()
    yield pair
    for llm in pair:
        llm.close()


def _prompts(n: int, seed: int, shared: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(5, 40000) for _ in range(shared)]
    return [prefix + [rng.randrange(5, 40000) for _ in range(rng.randrange(1, 60))] for _ in range(n)]


def _outputs(llm: LLM, prompts, params) -> list[list[tuple[list[int], str | None]]]:
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [[(list(o.token_ids), o.finish_reason) for o in sorted(p.outputs, key=lambda o: o.index)] for p in outs]


def _greedy(max_tokens: int = 24, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, **kw)


def test_solo_and_batched(engines):
    on, off = engines
    prompts = _prompts(20, seed=1)
    params = [_greedy(max_tokens=1 + (i * 7) % 30) for i in range(len(prompts))]
    batched = _outputs(on, prompts, params)
    assert batched == _outputs(off, prompts, params)
    solo = [_outputs(on, [p], [sp])[0] for p, sp in zip(prompts[:4], params[:4])]
    assert solo == batched[:4]
    assert all(len(seq[0][0]) == sp.max_tokens for seq, sp in zip(batched, params))


def test_prefix_cache_hits(engines):
    on, off = engines
    prompts = _prompts(12, seed=2, shared=70)
    first = [_outputs(llm, prompts, _greedy()) for llm in engines]
    again = [_outputs(llm, prompts, _greedy()) for llm in engines]  # now served from the cache
    assert first[0] == first[1] == again[0] == again[1]
    assert on.engine.stats().prefix_cache_hits > 0 and off.engine.stats().prefix_cache_hits > 0


def test_parallel_sampling_and_seeds(engines):
    prompts = _prompts(6, seed=3)
    greedy_n = _greedy(n=3)
    seeded = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, seed=11, n=2, ignore_eos=True)
    got = [(_outputs(llm, prompts, greedy_n), _outputs(llm, prompts, seeded)) for llm in engines]
    assert got[0] == got[1]
    g, s = got[0]
    assert all(seqs[0] == seqs[1] == seqs[2] for seqs in g)
    assert any(seqs[0] != seqs[1] for seqs in s), "seeded siblings sample differently"


def test_penalties_and_min_tokens(engines):
    """Penalties count every output token, the one still in flight included (it is read back first)."""
    prompts = _prompts(8, seed=4)
    params = SamplingParams(
        max_tokens=30, temperature=0, repetition_penalty=1.3, frequency_penalty=0.5, min_tokens=10, ignore_eos=True
    )
    assert _outputs(engines[0], prompts, params) == _outputs(engines[1], prompts, params)


def test_stop_strings_and_stop_tokens(engines):
    on, off = engines
    prompts = _prompts(8, seed=5)
    plain = on.generate(prompts, _greedy(40), use_tqdm=False)
    stops = []
    for p in plain:
        text = p.outputs[0].text
        stops.append(text[len(text) // 2 : len(text) // 2 + 3] or "x")
    params = [SamplingParams(max_tokens=40, temperature=0, stop=[s], ignore_eos=True) for s in stops]
    with_stop = [llm.generate(prompts, params, use_tqdm=False) for llm in engines]
    assert [[o.text for o in p.outputs] for p in with_stop[0]] == [[o.text for o in p.outputs] for p in with_stop[1]]
    assert sum(p.outputs[0].finish_reason == "stop" for p in with_stop[0]) >= len(prompts) // 2
    for p, stop in zip(with_stop[0], stops):  # never a token past the stop string
        assert stop not in p.outputs[0].text
    token_stop = [_greedy(40, stop_token_ids=[p.outputs[0].token_ids[5]]) for p in plain]
    got = [_outputs(llm, prompts, token_stop) for llm in engines]
    assert got[0] == got[1]
    assert all(seqs[0][1] == "stop" and len(seqs[0][0]) <= 6 for seqs in got[0])


def test_preemption():
    """A pool too small for the batch: requests are preempted and recomputed, with tokens in flight."""
    pair = _pair(num_kv_blocks=40, block_size=16)
    try:
        prompts = _prompts(16, seed=6)
        params = _greedy(max_tokens=60)
        got = [_outputs(llm, prompts, params) for llm in pair]
        assert got[0] == got[1]
        assert all(len(seqs[0][0]) == 60 for seqs in got[0])
        assert pair[0].engine.stats().num_preemptions > 0
    finally:
        for llm in pair:
            llm.close()


def test_speculation(tmp_path, engines):
    """Steps that speculate run synchronously; the steps beside them (above the batch size that turns
    speculation off) overlap. Either way, the tokens equal plain decoding's."""
    from sluice.core.models.loader import resolve_model

    head = copy_head_dir(tmp_path, MODEL, resolve_model(MODEL).config)
    spec = _pair(speculative_model=head, num_speculative_tokens=3, speculative_disable_batch_size=4)
    try:
        prompts = _prompts(10, seed=7)
        params = _greedy(max_tokens=30)
        plain = _outputs(engines[0], prompts, params)
        assert _outputs(spec[0], prompts, params) == _outputs(spec[1], prompts, params) == plain
        solo = [_outputs(spec[0], [p], params)[0] for p in prompts[:2]]  # below the switch: speculates
        assert solo == plain[:2]
        assert spec[0].engine.stats().spec_num_draft_tokens > 0
    finally:
        for llm in spec:
            llm.close()
