"""Rejection sampler: statistical losslessness (with a power check), greedy, seeding, short rows."""

from __future__ import annotations

import math

import pytest
import sluice.spec.rejection as rej
import torch
from sluice.spec.rejection import rejection_sample, sample_from_probs

from tests.helpers import chi2_sf, chi2_test

# --------------------------------------------------------------------------- chi-square helpers


def test_chi2_sf_known_values():
    assert chi2_sf(3.841458820694124, 1) == pytest.approx(0.05, abs=1e-9)
    assert chi2_sf(18.307038053275146, 10) == pytest.approx(0.05, abs=1e-9)
    for x in (0.5, 3.0, 10.0):  # df=2: exactly exp(-x/2)
        assert chi2_sf(x, 2) == pytest.approx(math.exp(-x / 2), rel=1e-12)
    assert chi2_sf(0.0, 5) == pytest.approx(1.0)


def test_chi2_test_pools_small_cells():
    probs = torch.tensor([0.5, 0.49, 0.005, 0.005])
    stat, df, p = chi2_test(torch.tensor([50, 49, 1, 0]), probs)
    assert df == 1  # 0.5 + 0.5 expected < 5, so the 49 cell joins the pool: 2 bins left
    assert p > 0.5


# --------------------------------------------------------------------------- bigram world

VOCAB = 12
K = 3
START = 0


def _bigram_tables(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logits = 1.5 * torch.randn(VOCAB, VOCAB, generator=g, dtype=torch.float64)
    # The draft is a perturbed copy of the target: clearly different, yet often accepted.
    draft_logits = logits + 1.2 * torch.randn(VOCAB, VOCAB, generator=g, dtype=torch.float64)
    return torch.softmax(logits, -1).float(), torch.softmax(draft_logits, -1).float()


def _spec_round(P, Q, start: torch.Tensor, num_draft: torch.Tensor, gen: torch.Generator, **kw):
    """One speculative round per row from token `start`: draft K tokens from Q, verify against P."""
    n = start.shape[0]
    prev = start
    drafts, qs = [], []
    for _ in range(K):
        q = Q[prev]
        x = torch.multinomial(q, 1, generator=gen).squeeze(1)
        drafts.append(x)
        qs.append(q)
        prev = x
    draft_ids = torch.stack(drafts, 1)
    draft_probs = torch.stack(qs, 1)
    ctx = torch.cat([start[:, None], draft_ids], 1)  # token conditioning position i
    target_probs = P[ctx]
    return rejection_sample(
        draft_ids, draft_probs, target_probs, torch.zeros(n, dtype=torch.bool), num_draft_tokens=num_draft, **kw
    )


def _two_token_runs(n: int, seed: int, **kw):
    """(t1, t2) from n independent speculative decodes of two tokens after START."""
    P, Q = _bigram_tables()
    gen = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng():
        torch.manual_seed(seed + 1)
        # Mixed draft lengths 0..K exercise num_draft_tokens and put bonus tokens in both slots.
        num_draft = torch.randint(0, K + 1, (n,), generator=gen)
        r1 = _spec_round(P, Q, torch.full((n,), START), num_draft, gen, **kw)
        t1 = r1.output_token_ids[:, 0]
        # Runs that emitted a single token continue with a second round from t1 (run for all rows,
        # used only where needed; the rounds are independent, so this selection is unbiased).
        r2 = _spec_round(P, Q, t1, torch.randint(0, K + 1, (n,), generator=gen), gen, **kw)
        t2 = torch.where(r1.num_accepted >= 1, r1.output_token_ids[:, 1], r2.output_token_ids[:, 0])
    assert (t1 >= 0).all() and (t2 >= 0).all()
    joint = torch.zeros(VOCAB * VOCAB, dtype=torch.long).index_add_(0, t1 * VOCAB + t2, torch.ones(n, dtype=torch.long))
    expected = P[START][:, None] * P  # P(t1 | START) P(t2 | t1)
    accept_rate = float(r1.num_accepted.sum() / num_draft.sum())
    return joint, expected, accept_rate


N_RUNS = 60_000


def test_lossless_joint_distribution_of_two_tokens():
    joint, expected, accept_rate = _two_token_runs(N_RUNS, seed=1234)
    stat, df, p = chi2_test(joint, expected)
    print(f"\nlossless: chi2={stat:.1f} df={df} p={p:.4f} (draft acceptance rate {accept_rate:.2f})")
    assert 0.2 < accept_rate < 0.9  # draft really differs from target, yet is often accepted
    assert p > 1e-3


def _resample_from_p(p, q):
    return p


def _residual_slightly_off(p, q):
    r = (p - 0.8 * q).clamp(min=0)  # a subtle bug: under-subtracts the draft
    return r / r.sum(-1, keepdim=True)


def _accept_always(p_x, q_x):
    return torch.ones_like(p_x)


def _accept_by_ratio_without_min(p_x, q_x):
    return p_x / q_x / (p_x / q_x).amax()  # wrong acceptance probability, otherwise a valid scheme


@pytest.mark.parametrize(
    "name, fn",
    [
        ("_residual_probs", _resample_from_p),
        ("_residual_probs", _residual_slightly_off),
        ("_accept_probs", _accept_always),
        ("_accept_probs", _accept_by_ratio_without_min),
    ],
)
def test_broken_sampler_is_detected(monkeypatch, name, fn):
    monkeypatch.setattr(rej, name, fn)
    joint, expected, _ = _two_token_runs(N_RUNS, seed=1234)
    stat, df, p = chi2_test(joint, expected)
    print(f"\nbroken {name}={fn.__name__}: chi2={stat:.1f} df={df} p={p:.3g}")
    assert p < 1e-6


def test_deterministic_drafter_and_seeded_rows_are_lossless():
    """draft_probs=None (point-mass draft) and per-row generators: first token ~ p (marginal)."""
    P, _ = _bigram_tables()
    n = 4000
    gen = torch.Generator().manual_seed(7)
    draft_ids = torch.randint(0, VOCAB, (n, 1), generator=gen)  # proposal independent of the target
    target_probs = P[torch.stack([torch.full((n,), START), draft_ids[:, 0]], 1)]
    gens = [torch.Generator().manual_seed(100 + i) for i in range(n)]
    out = rejection_sample(draft_ids, None, target_probs, torch.zeros(n, dtype=torch.bool), generators=gens)
    counts = torch.bincount(out.output_token_ids[:, 0], minlength=VOCAB)
    stat, df, p = chi2_test(counts, P[START])
    print(f"\ndeterministic drafter, seeded rows: chi2={stat:.1f} df={df} p={p:.4f}")
    assert p > 1e-3


def test_sample_from_probs_distribution_and_generators():
    probs = torch.tensor([0.1, 0.0, 0.6, 0.3])
    with torch.random.fork_rng():
        torch.manual_seed(0)
        s = sample_from_probs(probs.expand(20000, 4))
    counts = torch.bincount(s, minlength=4)
    assert counts[1] == 0
    assert chi2_test(counts, probs)[2] > 1e-3
    a = sample_from_probs(probs.expand(3, 4) * 5, [torch.Generator().manual_seed(3), None, None])
    b = sample_from_probs(probs.expand(1, 4), [torch.Generator().manual_seed(3)])
    assert a[0] == b[0]


# --------------------------------------------------------------------------- greedy rows


def _onehot_probs(argmaxes, vocab=6, peak=0.5):
    """[batch, positions, vocab] with the given argmax per position (rest of the mass spread)."""
    t = torch.tensor(argmaxes)
    probs = torch.full((*t.shape, vocab), (1 - peak) / (vocab - 1))
    probs.scatter_(-1, t[..., None], peak)
    return probs


def test_greedy_rows():
    target = _onehot_probs([[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4], [5, 0, 0, 0]])
    drafts = torch.tensor([[1, 2, 3], [1, 5, 3], [0, 2, 3], [5, 0, 0]])
    # Greedy ignores draft_probs entirely, even ones that would reject everything.
    draft_probs = torch.full((4, 3, 6), 1 / 6)
    out = rejection_sample(drafts, draft_probs, target, torch.ones(4, dtype=torch.bool))
    assert out.num_accepted.tolist() == [3, 1, 0, 3]
    assert out.output_token_ids.tolist() == [
        [1, 2, 3, 4],  # all accepted + bonus argmax p_3
        [1, 2, -1, -1],  # mismatch at position 1: emit argmax p_1
        [1, -1, -1, -1],  # mismatch at position 0
        [5, 0, 0, 0],
    ]
    out_none = rejection_sample(drafts, None, target, torch.ones(4, dtype=torch.bool))
    assert torch.equal(out_none.output_token_ids, out.output_token_ids)


def test_greedy_and_stochastic_rows_mixed():
    target = _onehot_probs([[1, 2, 3], [1, 2, 3]], peak=0.9)
    drafts = torch.tensor([[1, 0], [1, 2]])
    # Stochastic row 1: q equals p, so every draft is accepted (p/q == 1).
    draft_probs = target[:, :2].clone()
    out = rejection_sample(drafts, draft_probs, target, torch.tensor([True, False]))
    assert out.output_token_ids[0].tolist() == [1, 2, -1]
    assert out.num_accepted[1] == 2
    assert out.output_token_ids[1, :2].tolist() == [1, 2]


def test_greedy_only_does_not_touch_rngs():
    target = _onehot_probs([[1, 2]])
    g = torch.Generator().manual_seed(5)
    before, global_before = g.get_state(), torch.get_rng_state()
    rejection_sample(torch.tensor([[1]]), None, target, torch.tensor([True]), generators=[g])
    assert torch.equal(g.get_state(), before)
    assert torch.equal(torch.get_rng_state(), global_before)


# --------------------------------------------------------------------------- seeded reproducibility


def _random_row(k, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    # Target and draft close enough that acceptance varies between 0 and k accepted.
    base = torch.randn(k + 1, vocab, generator=g)
    target = torch.softmax(base, -1)
    draft = torch.softmax(base[:k] + 0.8 * torch.randn(k, vocab, generator=g), -1)
    ids = torch.multinomial(draft, 1, generator=g).squeeze(1)
    return ids, draft, target


def test_seeded_row_reproducible_alone_and_in_batch():
    vocab, k_row, k_batch = 10, 3, 5
    ids, q, p = _random_row(k_row, vocab, seed=11)
    results = set()
    for seed in range(40):
        g_alone = torch.Generator().manual_seed(seed)
        alone = rejection_sample(ids[None], q[None], p[None], torch.tensor([False]), generators=[g_alone])

        # The same row at index 2 of a 5-row batch, padded from k=3 to k=5 with garbage, next to
        # unseeded, seeded and greedy rows.
        others = [_random_row(k_batch, vocab, seed=50 + j) for j in range(4)]
        rows = others[:2] + [None] + others[2:]
        b_ids = torch.full((5, k_batch), -1)
        b_q = torch.rand(5, k_batch, vocab)
        b_p = torch.rand(5, k_batch + 1, vocab)
        for j, r in enumerate(rows):
            if r is not None:
                b_ids[j], b_q[j], b_p[j] = r
        b_ids[2, :k_row], b_q[2, :k_row], b_p[2, : k_row + 1] = ids, q, p
        g_batch = torch.Generator().manual_seed(seed)
        gens = [None, torch.Generator().manual_seed(999), g_batch, None, torch.Generator().manual_seed(1)]
        batch = rejection_sample(
            b_ids,
            b_q,
            b_p,
            torch.tensor([False, False, False, True, False]),
            generators=gens,
            num_draft_tokens=torch.tensor([5, 4, k_row, 5, 2]),
        )
        n = int(alone.num_accepted[0])
        assert int(batch.num_accepted[2]) == n
        assert batch.output_token_ids[2, : k_row + 1].tolist() == alone.output_token_ids[0].tolist()
        assert (batch.output_token_ids[2, k_row + 1 :] == -1).all()
        # Fixed consumption: both generators end in the same state.
        assert torch.equal(g_alone.get_state(), g_batch.get_state())
        results.add((n, *alone.output_token_ids[0].tolist()))
        # Same seed again, alone: identical.
        again = rejection_sample(
            ids[None], q[None], p[None], torch.tensor([False]), generators=[torch.Generator().manual_seed(seed)]
        )
        assert torch.equal(again.output_token_ids, alone.output_token_ids)
    assert len({r[0] for r in results}) >= 3  # the test is not vacuous: outcomes vary with the seed


def test_seeded_consumption_is_fixed():
    vocab, k = 10, 3
    ids, q, p = _random_row(k, vocab, seed=3)
    states = set()
    for seed in range(20):
        g = torch.Generator().manual_seed(seed)
        rejection_sample(ids[None], q[None], p[None], torch.tensor([False]), generators=[g])
        ref = torch.Generator().manual_seed(seed)
        torch.rand(k, generator=ref)
        torch.empty(vocab).exponential_(generator=ref)
        assert torch.equal(g.get_state(), ref.get_state())
        states.add(bytes(g.get_state().numpy()))
    assert len(states) == 20


# --------------------------------------------------------------------------- short rows, k=1, padding


def test_num_draft_tokens_and_padding():
    vocab = 6
    target = _onehot_probs([[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4]], vocab=vocab, peak=1.0)
    drafts = torch.tensor([[1, 2, -1], [1, -1, -1], [-1, -1, -1]])  # -1 = padding, must be ignored
    draft_probs = _onehot_probs([[1, 2, 0], [1, 0, 0], [0, 0, 0]], vocab=vocab, peak=1.0)
    for greedy in (True, False):
        out = rejection_sample(
            drafts, draft_probs, target, torch.full((3,), greedy), num_draft_tokens=torch.tensor([2, 1, 0])
        )
        assert out.num_accepted.tolist() == [2, 1, 0]
        # The bonus comes from position num_draft, not k.
        assert out.output_token_ids.tolist() == [[1, 2, 3, -1], [1, 2, -1, -1], [1, -1, -1, -1]]
        assert out.output_token_ids.dtype == torch.int64 and out.num_accepted.dtype == torch.int64


def test_stochastic_rejection_resamples_from_residual():
    # p = [0.5, 0.5, 0, 0], q = point mass on token 0: draft 0 accepted w.p. 0.5, else emit token 1.
    target = torch.tensor([[[0.5, 0.5, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0]]]).expand(4000, 2, 4)
    draft_probs = torch.tensor([[[1.0, 0.0, 0.0, 0.0]]]).expand(4000, 1, 4)
    drafts = torch.zeros(4000, 1, dtype=torch.long)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        out = rejection_sample(drafts, draft_probs, target, torch.zeros(4000, dtype=torch.bool))
    acc = out.num_accepted == 1
    assert out.output_token_ids[acc].tolist() == [[0, 3]] * int(acc.sum())  # bonus from p_1
    assert out.output_token_ids[~acc].tolist() == [[1, -1]] * int((~acc).sum())  # residual: token 1 only
    assert 0.45 < acc.float().mean() < 0.55


def test_k1_and_zero_probability_draft():
    target = torch.tensor([[[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]], [[0.2, 0.8, 0.0], [1.0, 0.0, 0.0]]])
    q = torch.tensor([[[1.0, 0.0, 0.0]], [[0.0, 1.0, 0.0]]])
    drafts = torch.tensor([[0], [1]])
    for _ in range(20):
        out = rejection_sample(drafts, q, target, torch.tensor([False, False]))
        # Row 0: p(x)=0 -> always rejected, residual = token 1. Row 1: p(x)/q(x) = 0.8.
        assert out.output_token_ids[0].tolist() == [1, -1]
        assert out.output_token_ids[1].tolist() in ([1, 0], [0, -1])


def test_shape_validation():
    with pytest.raises(ValueError):
        rejection_sample(
            torch.zeros(2, 3, dtype=torch.long), None, torch.rand(2, 3, 5), torch.ones(2, dtype=torch.bool)
        )
