"""Losslessness of speculative decoding end to end: the real scheduler, model runner, EAGLE proposer and
verifier, on a tiny random target (vocabulary 8) with a random draft head at temperature 1.

20,000 requests run as one batch from the same one-token prompt with max_tokens=4 and k=2. The first
two tokens emitted by speculation (t2, t3; t1 comes from the prefill's plain sampling) must follow the
target's joint distribution sum_t1 p(t1) p(t2 | t1) p(t3 | t1, t2), computed exactly from the target. They
cover every path: accepted drafts, the residual resample, the bonus token, and a second round after a
first-draft rejection (with its draft KV catch-up). A deliberately broken residual must fail the test.
"""

from __future__ import annotations

import pytest
import sluice.spec.rejection as rej
import torch
from sluice.core.models.loader import ModelSource
from sluice.core.request import Request
from sluice.core.sampling_params import SamplingParams

from tests.spec_helpers import StepLoop, dense_logits, random_head_dir, tiny_config
from tests.test_rejection_sampler import chi2_test

VOCAB = 8
START = 3
N_RUNS = 20_000


@pytest.fixture(scope="module")
def loop(tmp_path_factory):
    config = tiny_config(VOCAB)
    source = ModelSource("tiny8", config, None, "", [])
    head = random_head_dir(tmp_path_factory.mktemp("head"), "tiny8", config, seed=5)
    torch.manual_seed(0)
    loop = StepLoop(
        source,
        max_model_len=32,
        num_blocks=N_RUNS + 64,
        max_seqs=N_RUNS,
        block_size=8,
        enable_prefix_caching=False,
        speculative_model=head,
        num_speculative_tokens=2,
        speculative_disable_batch_size=10 * N_RUNS,
    )
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in loop.runner.model.parameters():
            if p.dim() == 2:  # a target whose next-token distributions vary with the context
                p.normal_(0.0, 0.3, generator=g)
    return loop


def _expected(model) -> torch.Tensor:
    seqs = [[START, a, b] for a in range(VOCAB) for b in range(VOCAB)]
    p = dense_logits(model, seqs).softmax(-1).double()  # [64, 3, V]
    p1 = p[0, 0]  # p(t1)
    p2 = p[::VOCAB, 1]  # p(t2 | t1), row t1
    p3 = p[:, 2].view(VOCAB, VOCAB, VOCAB)  # p(t3 | t1, t2)
    return torch.einsum("a,ab,abc->bc", p1, p2, p3)


def _run(loop: StepLoop, seed: int):
    stats = loop.scheduler.spec_stats
    before = (stats.num_draft_tokens, stats.num_accepted_tokens)
    torch.manual_seed(seed)
    params = SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True)
    reqs = loop.run([Request(f"r{seed}-{i}", [START], params, max_tokens=4) for i in range(N_RUNS)])
    out = torch.tensor([r.output_token_ids[1:3] for r in reqs])
    joint = torch.bincount(out[:, 0] * VOCAB + out[:, 1], minlength=VOCAB * VOCAB)
    drafted, accepted = stats.num_draft_tokens - before[0], stats.num_accepted_tokens - before[1]
    return joint, accepted / drafted


def test_first_two_speculative_tokens_follow_the_target(loop):
    expected = _expected(loop.runner.model)
    joint, rate = _run(loop, seed=11)
    stat, df, p = chi2_test(joint, expected)
    print(f"\nengine lossless: chi2={stat:.1f} df={df} p={p:.4f} acceptance={rate:.2f}")
    assert 0.15 < rate < 0.9  # the draft differs from the target, yet is often accepted
    assert p > 1e-3
    assert loop.scheduler.kv.num_free_blocks == loop.scheduler.kv.num_blocks


def test_broken_residual_is_detected(loop, monkeypatch):
    monkeypatch.setattr(rej, "_residual_probs", lambda p, q: p)  # resample from p instead of norm(max(p-q, 0))
    joint, _ = _run(loop, seed=12)
    stat, df, p = chi2_test(joint, _expected(loop.runner.model))
    print(f"\nbroken residual: chi2={stat:.1f} df={df} p={p:.3g}")
    assert p < 1e-3
