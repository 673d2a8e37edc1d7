"""The fused-MoE Triton path (`core/models/fused_moe.py`; the interpreter on the CPU) against the torch loop, the
expert-sorting step it stands on, and the routing of each family."""

from __future__ import annotations

import pytest
import torch
from sluice.core.models.fused_moe import align_pairs, route, torch_experts, triton_experts

pytest.importorskip("triton")

SMALL = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32)


def _case(t: int, e: int, k: int, h: int, i: int, seed: int = 0, skew: bool = False, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g)
    w13 = torch.randn(e, 2 * i, h, generator=g) / h**0.5
    w2 = torch.randn(e, h, i, generator=g) / i**0.5
    logits = torch.randn(t, e, generator=g)
    if skew:  # most tokens to expert 1: one expert's run spans several row blocks, most experts get none
        logits[:, 1] += 4.0
    weights, ids = route(logits, k, renormalize=True)
    return x.to(dtype), w13.to(dtype), w2.to(dtype), weights, ids


@pytest.mark.parametrize(
    ("t", "e", "k", "h", "i", "skew"),
    [
        (1, 8, 2, 64, 48, False),  # one decode token: two blocks, the rest of the worst case unused
        (5, 4, 2, 48, 40, False),  # K and N not multiples of their tiles
        (37, 8, 3, 32, 32, True),  # expert 1's run over several blocks; padding inside runs
        (20, 16, 4, 32, 16, False),  # more experts than a block's worth of pairs
    ],
)
def test_triton_experts_match_the_torch_loop(t, e, k, h, i, skew):
    x, w13, w2, weights, ids = _case(t, e, k, h, i, skew=skew)
    want = torch_experts(x, w13, w2, weights, ids)
    got = triton_experts(x, w13, w2, weights, ids, SMALL)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert want.abs().max() > 0.1  # the experts did something


@pytest.mark.parametrize("block_m", [32, 64])
def test_wider_row_blocks_match_too(block_m):
    """The row blocks of prefill-sized batches: an expert's pairs fill part of a block, or several."""
    x, w13, w2, weights, ids = _case(50, 4, 2, 32, 32, seed=2, skew=True)
    cfg = dict(SMALL, BLOCK_M=block_m)
    torch.testing.assert_close(
        triton_experts(x, w13, w2, weights, ids, cfg), torch_experts(x, w13, w2, weights, ids), atol=1e-5, rtol=1e-5
    )


def test_triton_experts_in_bf16_stay_within_bf16_rounding():
    x, w13, w2, weights, ids = _case(9, 8, 2, 64, 32, seed=1, dtype=torch.bfloat16)
    want = torch_experts(x.float(), w13.float(), w2.float(), weights, ids)
    got = triton_experts(x, w13, w2, weights, ids, SMALL)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=3e-2)


def test_align_pairs_groups_every_pair_under_its_expert():
    ids = torch.tensor([[3, 1], [1, 0], [3, 3], [0, 1]])
    block_m, num_experts = 4, 5
    sorted_pairs, block_experts, total = align_pairs(ids, block_m, num_experts)
    n = ids.numel()
    assert sorted_pairs.numel() == -(-(n + min(n, num_experts) * (block_m - 1)) // block_m) * block_m
    used = int(total)
    assert used == 3 * block_m  # experts 0, 1 and 3, one block each
    assert (sorted_pairs[used:] == n).all()  # nothing past the padded total
    flat = ids.flatten()
    seen = []
    for b in range(used // block_m):
        rows = sorted_pairs[b * block_m : (b + 1) * block_m]
        real = rows[rows < n]
        assert (flat[real.long()] == block_experts[b]).all()
        assert real.tolist() == sorted(real.tolist())  # pair order kept within an expert
        seen += real.tolist()
    assert sorted(seen) == list(range(n))


def test_the_triton_path_reads_nothing_back_to_the_host(monkeypatch):
    """No ``.item()``, ``.tolist()``, truth value or data-dependent shape (``nonzero``, ``unique``) in the path a
    GPU runs, so a decode step's CUDA graph can hold it (the GPU check captures one)."""
    x, w13, w2, weights, ids = _case(3, 8, 2, 32, 32)
    want = torch_experts(x, w13, w2, weights, ids)

    def refuse(*_a, **_k):
        raise AssertionError("host sync")

    for name in ("item", "tolist", "__bool__", "nonzero", "unique"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    monkeypatch.setattr(torch, "nonzero", refuse)
    monkeypatch.setattr(torch, "unique", refuse)
    from sluice.core.models import fused_moe

    aligned = fused_moe.align_pairs(ids, 16, 8)
    monkeypatch.undo()  # the interpreter itself reads its arguments on the host
    assert len(aligned) == 3
    torch.testing.assert_close(triton_experts(x, w13, w2, weights, ids, SMALL), want, atol=1e-5, rtol=1e-5)


def test_routing_is_each_familys():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    probs = torch.softmax(logits, dim=-1)
    w, ids = route(logits, 2, renormalize=False)  # Qwen3-MoE without norm_topk_prob: the softmax's top two
    assert ids.tolist() == [[0, 1]]
    torch.testing.assert_close(w, probs[:, :2])
    w, _ = route(logits, 2, renormalize=True)  # Mixtral: a softmax over the two chosen logits
    torch.testing.assert_close(w, torch.softmax(logits[:, :2], dim=-1))


@pytest.mark.parametrize(("t", "e", "k", "renormalize"), [(1, 8, 2, True), (3, 128, 8, True), (13, 16, 4, False)])
def test_route_and_align_in_one_kernel_equals_its_torch_steps(t, e, k, renormalize):
    """The one-program kernel of a decode step against `route` then `align_pairs`: the same experts, weights,
    sorted pairs and blocks (and the rows past the padded total still mark no pair)."""
    from sluice.core.models.fused_moe import route_and_align

    logits = torch.randn(t, e, generator=torch.Generator().manual_seed(t))
    weights, ids, (pairs, blocks, total) = route_and_align(logits, k, renormalize, block_m=16)
    want_w, want_ids = route(logits, k, renormalize)
    want_pairs, want_blocks, want_total = align_pairs(want_ids, 16, e)
    assert torch.equal(ids.long(), want_ids)
    torch.testing.assert_close(weights, want_w)
    assert int(total) == int(want_total)
    assert torch.equal(pairs, want_pairs) and torch.equal(blocks, want_blocks)


def test_moe_forward_takes_the_same_path_on_both_sides():
    """`moe_forward` from router logits: the fused routing and the grouped GEMMs (Triton) against `route` and
    the torch loop."""
    from sluice.core.models.fused_moe import moe_forward

    x, w13, w2, _, _ = _case(6, 8, 2, 64, 32, seed=3)
    logits = torch.randn(6, 8, generator=torch.Generator().manual_seed(4))
    want = moe_forward(x, logits, w13, w2, 2, True, use_triton=False)
    got = moe_forward(x, logits, w13, w2, 2, True, use_triton=True)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
