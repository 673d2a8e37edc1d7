"""The sampler (core/worker/sampler.py): masks on hand-built logits, penalties as defined, seeded draws that do
not depend on the batch, temperature sampling that follows softmax(logits / T) (chi-square), raw
logprobs; then the same through the model runner and `LLM` on ``dummy:tiny``."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from sluice.core import LLM, SamplingParams
from sluice.core.models.layers import argmax_rows
from sluice.core.worker.sampler import (
    SamplingBatch,
    apply_min_p,
    apply_penalties,
    apply_top_k_top_p,
    process_logits,
    sample,
)

from tests.helpers import chi2_test

NEG = float("-inf")


def _batch(n: int, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, generators=None, **kw) -> SamplingBatch:
    """A batch of ``n`` rows; a scalar applies to every row, a list gives one value per row. The fast-path
    flags are derived the way the model runner derives them."""

    def col(x, dtype):
        return torch.tensor(x if isinstance(x, list) else [x] * n, dtype=dtype)

    t, k = col(temperature, torch.float32), col(top_k, torch.long)
    p, m = col(top_p, torch.float32), col(min_p, torch.float32)
    return SamplingBatch(
        temperature=t,
        top_k=k,
        top_p=p,
        min_p=m,
        generators=generators if generators is not None else [None] * n,
        all_greedy=bool((t == 0).all()),
        any_top_k_top_p=bool(((k > 0) | (p < 1)).any()),
        any_min_p=bool((m > 0).any()),
        **kw,
    )


def _kept(logits: torch.Tensor) -> list[list[int]]:
    return [torch.nonzero(torch.isfinite(row)).flatten().tolist() for row in logits]


def _logits_of(probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs).log()[None, :]


# --------------------------------------------------------------------------- masks


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_greedy_rows_are_argmax_with_ties_and_nans(dtype):
    """`argmax_rows` (greedy tokens by ``max``'s indices) is ``argmax``: the first of tied largest values, a NaN's
    index where a row has one, an inf's where it has no NaN."""
    g = torch.Generator().manual_seed(3)
    x = torch.randint(-3, 3, (6, 4099), generator=g).to(dtype)  # a few values: many ties at the top
    x[1, 2000] = float("nan")
    x[1, 3000] = float("nan")
    x[2, 17] = float("inf")
    x[3, 4098] = 9
    got = argmax_rows(x)
    assert torch.equal(got, x.argmax(-1))
    assert got[1] == 2000 and got[2] == 17 and got[3] == 4098
    assert got[0] == int((x[0] == x[0].max()).nonzero()[0])


def test_top_k_keeps_the_k_largest_and_ties_at_the_cut():
    logits = torch.tensor(
        [
            [1.0, 3.0, 2.0, 0.0, -1.0],
            [3.0, 3.0, 1.0, 3.0, 0.0],  # k=2 cuts through a three-way tie: all three stay
            [1.0, 3.0, 2.0, 0.0, -1.0],  # k=1
            [1.0, 3.0, 2.0, 0.0, -1.0],  # k larger than the vocabulary
            [1.0, 3.0, 2.0, 0.0, -1.0],  # 0 = off (SamplingParams' top_k=-1)
        ]
    )
    out = apply_top_k_top_p(logits, torch.tensor([2, 2, 1, 99, 0]), torch.ones(5))
    assert _kept(out) == [[1, 2], [0, 1, 3], [1], [0, 1, 2, 3, 4], [0, 1, 2, 3, 4]]
    kept = torch.isfinite(out)
    assert torch.equal(out[kept], logits[kept])  # kept logits are untouched


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    logits = _logits_of([0.15, 0.5, 0.05, 0.3]).expand(5, 4)
    top_p = torch.tensor([0.4, 0.75, 0.81, 0.96, 1.0])
    out = apply_top_k_top_p(logits, torch.zeros(5, dtype=torch.long), top_p)
    # sorted: 0.5 (token 1), 0.3 (3), 0.15 (0), 0.05 (2); the token that crosses p is kept
    assert _kept(out) == [[1], [1, 3], [0, 1, 3], [0, 1, 2, 3], [0, 1, 2, 3]]


def test_top_p_ties_at_the_cut_are_kept():
    out = apply_top_k_top_p(_logits_of([0.4, 0.2, 0.2, 0.2]), torch.tensor([0]), torch.tensor([0.5]))
    assert _kept(out) == [[0, 1, 2, 3]]
    out = apply_top_k_top_p(_logits_of([0.4, 0.2, 0.2, 0.2]), torch.tensor([0]), torch.tensor([0.3]))
    assert _kept(out) == [[0]]


def test_top_p_applies_to_the_top_k_renormalized():
    logits = _logits_of([0.4, 0.3, 0.2, 0.1]).expand(3, 4)
    # top-2 renormalized: 4/7 = 0.571, 3/7
    out = apply_top_k_top_p(logits, torch.tensor([2, 2, 3]), torch.tensor([0.5, 0.6, 1.0]))
    assert _kept(out) == [[0], [0, 1], [0, 1, 2]]


def test_top_p_one_and_top_k_off_mask_nothing():
    """Off means off, also for a tail whose mass float32 rounds away (cumsum reaches 1.0 before it) and
    in a batch where another row does truncate."""
    tail = torch.tensor([[0.0, 0.0, 0.0, -16.0, -16.0, -16.0, -16.0]])
    assert _kept(apply_top_k_top_p(tail, torch.tensor([0]), torch.tensor([1.0]))) == [list(range(7))]
    g = torch.Generator().manual_seed(0)
    logits = 3 * torch.randn(4, 5000, generator=g)
    out = apply_top_k_top_p(logits, torch.tensor([0, 10, 0, 0]), torch.tensor([1.0, 1.0, 0.5, 1.0]))
    assert torch.equal(out[0], logits[0]) and torch.equal(out[3], logits[3])
    assert len(_kept(out[1:2])[0]) == 10
    assert len(_kept(out[2:3])[0]) < 5000


def test_min_p_is_relative_to_the_top_probability():
    logits = _logits_of([0.5, 0.3, 0.15, 0.05]).expand(4, 4)
    out = apply_min_p(logits, torch.tensor([0.0, 0.2, 0.5, 1.0]))
    # thresholds: 0, 0.1, 0.25, 0.5 (x the top prob 0.5)
    assert _kept(out) == [[0, 1, 2, 3], [0, 1, 2], [0, 1], [0]]


def test_process_logits_order_temperature_then_min_p():
    """min_p sees the tempered distribution: at T=0.5, probs ~ p^2 = [.685, .247, .062, .007]."""
    logits = _logits_of([0.5, 0.3, 0.15, 0.05]).expand(2, 4)
    out = process_logits(logits, _batch(2, temperature=[1.0, 0.5], min_p=0.2))
    assert _kept(out) == [[0, 1, 2], [0, 1]]
    torch.testing.assert_close(out[1, :2], logits[1, :2] / 0.5)


def test_masked_tokens_are_never_sampled():
    torch.manual_seed(0)
    logits = torch.randn(1, 50).expand(2000, 50)
    batch = _batch(2000, temperature=2.0, top_k=[5] * 1000 + [0] * 1000, top_p=[1.0] * 1000 + [0.3] * 1000)
    tokens = sample(logits, batch).token_ids
    allowed_k = set(logits[0].topk(5).indices.tolist())
    assert set(tokens[:1000].tolist()) == allowed_k  # every allowed token shows up, nothing else
    nucleus = set(_kept(apply_top_k_top_p(logits[:1] / 2.0, torch.tensor([0]), torch.tensor([0.3])))[0])
    assert set(tokens[1000:].tolist()) <= nucleus and len(nucleus) < 50


# --------------------------------------------------------------------------- temperature: chi-square


@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.7])
def test_temperature_sampling_follows_softmax_over_t(temperature):
    torch.manual_seed(1)
    logits = torch.tensor([1.2, 0.3, -0.5, 2.0, 0.0, -1.5, 0.8, -0.2])
    n = 20000
    tokens = sample(logits.expand(n, -1), _batch(n, temperature=temperature)).token_ids
    counts = torch.bincount(tokens, minlength=8)
    stat, df, p = chi2_test(counts, (logits / temperature).softmax(-1))
    print(f"\nT={temperature}: chi2={stat:.1f} df={df} p={p:.3f}")
    assert p > 1e-3
    # power: the same counts reject the untempered (or differently tempered) distribution
    wrong_t = 1.0 if temperature != 1.0 else 0.8
    assert chi2_test(counts, (logits / wrong_t).softmax(-1))[2] < 1e-6


def test_seeded_row_follows_softmax_over_t():
    """One seeded row drawn step after step (its own generator, as in decoding)."""
    logits = torch.tensor([[0.5, -0.3, 1.1, 0.0, -1.0]])
    gen = torch.Generator().manual_seed(5)
    batch = _batch(1, temperature=0.7, generators=[gen])
    tokens = torch.stack([sample(logits, batch).token_ids[0] for _ in range(4000)])
    stat, df, p = chi2_test(torch.bincount(tokens, minlength=5), (logits[0] / 0.7).softmax(-1))
    assert p > 1e-3, (stat, df, p)


def test_truncated_sampling_follows_the_renormalized_distribution():
    torch.manual_seed(2)
    logits = torch.tensor([1.0, 0.2, -0.4, 1.5, 0.6, -2.0])
    n = 20000
    tokens = sample(logits.expand(n, -1), _batch(n, temperature=0.9, top_k=4, top_p=0.9)).token_ids
    kept = apply_top_k_top_p((logits / 0.9)[None], torch.tensor([4]), torch.tensor([0.9]))[0]
    assert chi2_test(torch.bincount(tokens, minlength=6), kept.softmax(-1))[2] > 1e-3


def test_greedy_rows_take_the_argmax():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 100, generator=g)
    out = sample(logits, _batch(6, temperature=[0.0, 1.0, 0.0, 1.0, 0.0, 0.0], top_k=[0, 0, 3, 0, 0, 0]))
    assert out.token_ids[[0, 2, 4, 5]].tolist() == logits[[0, 2, 4, 5]].argmax(-1).tolist()
    assert torch.equal(sample(logits, _batch(6, temperature=0.0)).token_ids, logits.argmax(-1))


# --------------------------------------------------------------------------- seeds


def _seeded_run(seed: int, steps: list[torch.Tensor], row: int, others: list[dict] | None):
    """The target row's tokens over ``steps`` (logits of the whole batch per step), alone or among others."""
    gen = torch.Generator().manual_seed(seed)
    if others is None:
        batch = _batch(1, temperature=0.9, top_k=0, generators=[gen])
        return [int(sample(s[row : row + 1], batch).token_ids[0]) for s in steps]
    rows = list(others)
    rows.insert(row, dict(temperature=0.9, top_k=0, top_p=1.0, min_p=0.0, generator=gen))
    batch = _batch(
        len(rows),
        temperature=[r["temperature"] for r in rows],
        top_k=[r["top_k"] for r in rows],
        top_p=[r["top_p"] for r in rows],
        min_p=[r["min_p"] for r in rows],
        generators=[r["generator"] for r in rows],
    )
    return [int(sample(s, batch).token_ids[row]) for s in steps]


def test_seeded_row_is_the_same_alone_and_in_any_batch():
    g = torch.Generator().manual_seed(11)
    steps = [torch.randn(5, 300, generator=g) for _ in range(12)]
    alone = _seeded_run(42, steps, 2, None)
    others = [
        dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, generator=torch.Generator().manual_seed(7)),
        dict(temperature=1.3, top_k=20, top_p=1.0, min_p=0.0, generator=None),  # unseeded, truncating
        dict(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, generator=None),  # greedy
        dict(temperature=0.8, top_k=0, top_p=0.7, min_p=0.1, generator=None),
    ]
    torch.manual_seed(0)
    in_batch = _seeded_run(42, steps, 2, others)
    torch.manual_seed(123)  # the unseeded rows' noise changes; the seeded row's must not
    in_batch_again = _seeded_run(42, steps, 2, others)
    assert alone == in_batch == in_batch_again
    assert _seeded_run(43, steps, 2, None) != alone  # guard: the seed matters
    assert len(set(alone)) > 6  # and the draws are not degenerate


def test_unseeded_rows_vary():
    logits = torch.zeros(2, 1000)
    a = [int(sample(logits, _batch(2)).token_ids[0]) for _ in range(5)]
    b = [int(sample(logits, _batch(2)).token_ids[0]) for _ in range(5)]
    assert a != b


# --------------------------------------------------------------------------- penalties, bans, logprobs


def test_penalties_as_defined():
    raw = torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0])
    output_ids, prompt_ids = [0, 0, 2], [4]  # token 0 generated twice, 2 once; 4 only in the prompt
    # rows: presence only, frequency only, repetition only, all three, none
    presence = torch.tensor([0.5, 0.0, 0.0, 0.5, 0.0])
    frequency = torch.tensor([0.0, 0.25, 0.0, 0.25, 0.0])
    repetition = torch.tensor([1.0, 1.0, 2.0, 2.0, 1.0])
    batch = _batch(
        5,
        presence_penalty=presence,
        frequency_penalty=frequency,
        repetition_penalty=repetition,
        output_token_ids=[output_ids] * 5,
        prompt_token_ids=[prompt_ids] * 5,
    )
    out = apply_penalties(raw.expand(5, -1).clone(), batch)
    expected = torch.tensor(
        [
            [1.5, -1.0, 0.0, 3.0, -2.0],  # presence: once per generated token
            [1.5, -1.0, 0.25, 3.0, -2.0],  # frequency: per occurrence
            [1.0, -1.0, 0.25, 3.0, -4.0],  # repetition: prompt and output, positive / rep, negative * rep
            [0.0, -1.0, -0.5, 3.0, -4.0],  # repetition first, then frequency and presence
            [2.0, -1.0, 0.5, 3.0, -2.0],
        ]
    )
    torch.testing.assert_close(out, expected)


def test_min_tokens_ban_masks_eos_even_when_it_is_the_argmax():
    logits = torch.tensor([[0.0, 1.0, 9.0, 2.0], [0.0, 1.0, 9.0, 2.0]])
    batch = _batch(2, temperature=[0.0, 1.0], banned_token_ids=[[2], [2, 3]])
    assert torch.isinf(process_logits(logits, batch)[:, 2]).all()
    assert sample(logits, batch).token_ids[0] == 3
    torch.manual_seed(0)
    many = sample(logits[1:].expand(500, -1), _batch(500, banned_token_ids=[[2, 3]] * 500)).token_ids
    assert set(many.tolist()) == {0, 1}


def test_logprobs_are_the_raw_log_softmax():
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(3, 40, generator=g)
    batch = _batch(
        3,
        temperature=[0.5, 0.0, 1.5],
        top_k=[3, 0, 0],
        presence_penalty=torch.tensor([2.0, 0.0, 0.0]),
        frequency_penalty=torch.zeros(3),
        repetition_penalty=torch.ones(3),
        output_token_ids=[[int(logits[0].argmax())], [], []],
        prompt_token_ids=[[], [], []],
        num_logprobs=5,
    )
    out = sample(logits, batch)
    raw = logits.log_softmax(-1)
    values, ids = raw.topk(5, dim=-1)
    torch.testing.assert_close(out.top_logprobs, values)
    assert torch.equal(out.top_token_ids, ids)
    torch.testing.assert_close(out.logprobs, raw.gather(-1, out.token_ids[:, None]).squeeze(-1))
    assert math.isclose(float(out.top_logprobs[0].exp().sum()), float(raw[0].topk(5).values.exp().sum()))
    no_lp = sample(logits, _batch(3, temperature=0.0))
    assert no_lp.logprobs is None and no_lp.top_logprobs is None


# --------------------------------------------------------------------------- through the runner and LLM


@pytest.fixture(scope="module")
def runner():
    from sluice.core.args import EngineArgs
    from sluice.core.models.loader import resolve_model
    from sluice.core.worker.model_runner import ModelRunner

    args = EngineArgs(model="dummy:tiny", device="cpu", num_kv_blocks=8)
    return ModelRunner(args, resolve_model("dummy:tiny"), max_model_len=64)


_step_ids = itertools.count(1)


def _step(runner, params: SamplingParams, eos=(), num_output_tokens=0):
    """One step of a new request whose 20 tokens end with ``num_output_tokens`` outputs; then it is dropped."""
    from sluice.core.step import NewRequest, SchedulerOutput

    rid = f"r{next(_step_ids)}"
    new = NewRequest(rid, list(range(100, 120)), 20 - num_output_tokens, [3, 5], params, eos)
    out = runner.execute(SchedulerOutput(next(_step_ids), [rid], [20], [0], [True], new_requests=[new]))
    runner.execute(SchedulerOutput(next(_step_ids), finished_request_ids=[rid]))
    return out


def test_runner_bans_eos_and_stop_ids_until_min_tokens(runner):
    greedy = SamplingParams(temperature=0, max_tokens=8)
    top = _step(runner, greedy).token_ids[0]
    banned = SamplingParams(temperature=0, max_tokens=8, min_tokens=2)
    second = _step(runner, banned, eos=(top,)).token_ids[0]
    assert second != top
    assert _step(runner, banned, eos=(top,), num_output_tokens=2).token_ids[0] == top  # min_tokens reached
    stop = SamplingParams(temperature=0, max_tokens=8, min_tokens=2, stop_token_ids=[top], ignore_eos=True)
    assert _step(runner, stop).token_ids[0] == second  # stop ids are banned too
    ignore = SamplingParams(temperature=0, max_tokens=8, min_tokens=2, ignore_eos=True)
    assert _step(runner, ignore, eos=(top,)).token_ids[0] == top  # EOS does not end it: no ban needed


def test_runner_logprobs(runner):
    out = _step(runner, SamplingParams(temperature=0, max_tokens=8, logprobs=4))
    lp = out.logprobs[0]
    assert lp.token_id == out.token_ids[0] == lp.top[0][0]
    assert len(lp.top) == 4 and lp.logprob == pytest.approx(lp.top[0][1])
    assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)


@pytest.fixture(scope="module")
def tiny_llm():
    llm = LLM(model="dummy:tiny", device="cpu", num_kv_blocks=128, max_model_len=256, max_num_batched_tokens=64)
    yield llm
    llm.close()


def test_llm_same_seed_same_output_alone_and_in_a_batch(tiny_llm):
    prompt = "Once upon a time in a quiet village"
    targets = [
        SamplingParams(max_tokens=12, temperature=1.0, seed=1234),
        SamplingParams(max_tokens=12, temperature=0.8, top_k=40, top_p=0.9, seed=99),
    ]
    alone = [tiny_llm.generate([prompt], t, use_tqdm=False)[0].outputs[0].token_ids for t in targets]
    others = ["Tell me about the sea. " * 6, "Numbers: 1 2 3 4 5", "A" * 40]
    other_params = [
        SamplingParams(max_tokens=12, temperature=1.0),  # unseeded
        SamplingParams(max_tokens=9, temperature=0.7, top_k=5, seed=7),
        SamplingParams(max_tokens=15, temperature=0.0),
    ]
    prompts = [others[0], prompt, others[1], prompt, others[2]]
    params = [other_params[0], targets[0], other_params[1], targets[1], other_params[2]]
    outs = tiny_llm.generate(prompts, params, use_tqdm=False)
    assert [outs[1].outputs[0].token_ids, outs[3].outputs[0].token_ids] == alone
    assert all(len(a) == 12 for a in alone)
    other_seed = SamplingParams(max_tokens=12, temperature=1.0, seed=1235)
    assert tiny_llm.generate([prompt], other_seed, use_tqdm=False)[0].outputs[0].token_ids != alone[0]
