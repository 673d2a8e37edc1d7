"""The few-token mixture-of-experts path (`core/models/moe_decode.py`; the Triton interpreter on the CPU): its
routing against `route` of the router's logits, its output against the torch loop, the split of a token's experts,
the arrival counters left at zero for the next launch, and which calls it takes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from sluice.core.models import moe_decode
from sluice.core.models.fused_moe import route, torch_experts

pytest.importorskip("triton")

# short K steps: the interpreter's time grows with a tile's size; the kernels' masks are what is under test
SMALL = dict(router_block_k=32, gate_up_block_k=32)


def _layer(t: int, e: int, h: int, i: int, seed: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g)
    router = torch.randn(e, h, generator=g) / h**0.5
    w13 = torch.randn(e, 2 * i, h, generator=g) / h**0.5
    w2 = torch.randn(e, h, i, generator=g) / i**0.5
    return x.to(dtype), router.to(dtype), w13.to(dtype), w2.to(dtype)


def _run(x, router, w13, w2, k, renormalize, split=None):
    counters = torch.zeros(moe_decode.counters_needed(k, w13.shape[0], x.shape[1]), dtype=torch.int32)
    config = moe_decode.DecodeMoEConfig(**SMALL, split=split)
    out = moe_decode.decode_moe(x, router, w13, w2, k, renormalize, counters, config)
    return out, counters


@pytest.mark.parametrize(
    ("t", "e", "k", "h", "i", "split", "renormalize"),
    [
        (1, 8, 2, 64, 48, None, True),  # Mixtral's form: I a multiple of 16, not of 32
        (1, 128, 8, 64, 32, None, True),  # Qwen3-30B-A3B's form: 128 experts in 8 router programs
        (2, 16, 2, 40, 32, 2, False),  # two tokens, H not a multiple of the K step, experts split in two
        (1, 8, 3, 64, 32, 4, True),  # 3 experts over a split of 4: three programs of one, no empty split
        (1, 8, 2, 32, 256, 1, True),  # K steps of 256 (the largest), one per expert, both in one program
    ],
)
def test_the_decode_path_equals_the_torch_loop(t, e, k, h, i, split, renormalize):
    x, router, w13, w2 = _layer(t, e, h, i, seed=t + e)
    weights, ids = route(F.linear(x, router), k, renormalize)
    want = torch_experts(x, w13, w2, weights, ids)
    got, counters = _run(x, router, w13, w2, k, renormalize, split)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert not counters.any()  # every arrival counter reset: a graph replay starts from zero
    again, _ = _run(x, router, w13, w2, k, renormalize, split)
    assert torch.equal(again, got)


def test_the_router_rounds_its_logits_as_the_linear_layer_does():
    """In bf16 the router's logits are rounded to bf16 before the softmax (what `F.linear` returns): the experts
    and weights are `route` of those logits, and the output is within bf16 rounding of the torch loop."""
    x, router, w13, w2 = _layer(1, 16, 64, 32, seed=5, dtype=torch.bfloat16)
    weights, ids = route(F.linear(x, router), 4, True)
    want = torch_experts(x, w13, w2, weights, ids).float()
    got, _ = _run(x, router, w13, w2, 4, True)
    err = (got.float() - want).abs().max() / want.abs().max()
    assert err < 2e-2, err


def test_a_shared_expert_across_tokens_is_read_by_each():
    """Two tokens routed to the same experts: each pair reads its expert itself, no sort to merge them."""
    x, router, w13, w2 = _layer(1, 16, 64, 32, seed=7)
    x = torch.cat([x, 2 * x])  # the same direction: the same experts
    weights, ids = route(F.linear(x, router), 2, True)
    assert torch.equal(ids[0], ids[1])
    got, _ = _run(x, router, w13, w2, 2, True)
    torch.testing.assert_close(got, torch_experts(x, w13, w2, weights, ids), atol=1e-5, rtol=1e-5)


def test_which_calls_take_the_decode_path():
    assert [moe_decode.fits(t, 8, 128, 768) for t in (1, 4, 5)] == [True, True, False]  # Qwen3-30B-A3B
    assert [moe_decode.fits(t, 2, 8, 14336) for t in (1, 2)] == [True, False]  # Mixtral-8x7B: batch 1 only
    assert not moe_decode.fits(1, 2, 8, 40)  # no K step of 16 divides I
    assert moe_decode.max_tokens(1, 256) == moe_decode.BLOCK_M  # the router's last program routes one row tile
    assert moe_decode.down_split(tiles=128, tokens=1, top_k=8, sms=132) == 2
    assert moe_decode.down_split(tiles=256, tokens=1, top_k=2, sms=132) == 1


def test_fp32_activations_take_half_the_stages():
    """The stages' shared memory stays what the 16-bit tiles need (fp32 at 4 stages overflowed an H100's)."""
    assert moe_decode.stages_for(4, 2) == 4
    assert moe_decode.stages_for(4, 4) == 2
    assert moe_decode.stages_for(1, 4) == 1


@pytest.mark.parametrize("switch", [None, True, False])
def test_which_models_take_the_path_by_default(switch):
    """Unset (None): the layers of many small experts (Qwen3-MoE's 128), not Mixtral's 8; 1 and 0 for every layer."""
    from sluice.core.models.layers import enable_fused_kernels
    from sluice.core.models.moe import SparseMoeBlock

    many, few = (SparseMoeBlock(32, 16, e, 2, True) for e in (moe_decode.PREFERRED_MIN_EXPERTS, 8))
    for block in (many, few):
        enable_fused_kernels(block, moe_decode=switch)
    on = [block.experts.decode_counters is not None for block in (many, few)]
    assert on == ([True, False] if switch is None else [switch, switch])
