"""The fused Triton kernels (RMSNorm+residual, SiLU-and-mul, RoPE) against the torch layers they replace.

Without a GPU they run under the Triton interpreter (conftest.py sets TRITON_INTERPRET before triton is
imported). fp32 results agree to rounding (reductions run in another order); bf16 results within one bf16
steps, since an fp32 intermediate that differs in its last bit can round the other way (and the interpreter
truncates fp32 -> bf16 casts where the GPU rounds to nearest).
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")
from sluice.core.models import fused  # noqa: E402
from sluice.core.models.layers import RMSNorm, RotaryEmbedding, SiluAndMul, enable_fused_kernels  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
pytestmark = pytest.mark.skipif(
    not ON_GPU and not isinstance(fused._rope_kernel, InterpretedFunction),
    reason="triton was imported without TRITON_INTERPRET=1 and there is no GPU",
)


# The folds' dtypes: fp32 on the CPU only. The engine folds 16-bit weights only, and an fp32 fold's tiles need more
# shared memory than the H200 has (240-250 KiB at the engine's configs: OutOfResources there, 2026-12-05).
FOLD_DTYPES = [
    pytest.param(torch.float32, marks=pytest.mark.skipif(ON_GPU, reason="fp32 folds exceed the H200's shared memory")),
    torch.bfloat16,
]


def _close_to_scale(a: torch.Tensor, b: torch.Tensor, rel: float) -> None:
    """``a`` within ``rel`` of ``b``, relative to each element and to ``b``'s largest magnitude: one rounding of an
    operand ahead of a cancellation (``x cos + rot(x) sin``, a softmax) moves small results by its operands' ulp."""
    a, b = a.float(), b.float()
    torch.testing.assert_close(a, b, rtol=rel, atol=rel * b.abs().max().item())


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    if a.dtype == torch.float32:
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    else:  # a bf16 step is up to 2^-7 relative; two chained roundings (sum, then product) may each differ
        torch.testing.assert_close(a.float(), b.float(), rtol=2**-5, atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [96, 64])
def test_add_rmsnorm_matches_layer(dtype, hidden):
    g = torch.Generator().manual_seed(hidden)
    norm = RMSNorm(hidden, 1e-5).to(DEVICE, dtype)
    norm.weight.data = (1 + 0.1 * torch.randn(hidden, generator=g)).to(DEVICE, dtype)
    x = torch.randn(7, hidden, generator=g).to(DEVICE, dtype)
    res = (3 * torch.randn(7, hidden, generator=g)).to(DEVICE, dtype)
    ref_out, ref_res = norm(x, res)
    out, new_res = fused.add_rmsnorm(x, res, norm.weight, norm.eps)
    _close(out, ref_out)
    _close(new_res, ref_res)
    assert x.shape == out.shape and not torch.equal(new_res, res)  # a new residual stream, inputs untouched
    only, none = fused.add_rmsnorm(x, None, norm.weight, norm.eps)
    assert none is None
    _close(only, norm(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 5])
def test_q_and_k_head_norms_in_one_launch_equal_two_norms_bit_for_bit(dtype, tokens):
    # Qwen3's per-head norms in place over the qkv rows (`rmsnorm_qk_`) against `add_rmsnorm` over each strided
    # view (the path before it): the same arithmetic, so the same bits; v untouched
    hq, hk, d = 4, 2, 64
    g = torch.Generator().manual_seed(tokens)
    qkv = (torch.randn(tokens, (hq + 2 * hk) * d, generator=g) * 3).to(dtype).to(DEVICE)
    wq, wk = (torch.randn(d, generator=g).to(dtype).to(DEVICE) for _ in range(2))
    q, k, v = qkv.split([hq * d, hk * d, hk * d], dim=-1)
    want_q = fused.add_rmsnorm(q.reshape(tokens, hq, d), None, wq, 1e-6)[0]
    want_k = fused.add_rmsnorm(k.reshape(tokens, hk, d), None, wk, 1e-6)[0]
    v_before = v.clone()
    fused.rmsnorm_qk_(qkv, wq, wk, 1e-6, hq, hk)
    assert torch.equal(q.reshape(tokens, hq, d), want_q) and torch.equal(k.reshape(tokens, hk, d), want_k)
    assert torch.equal(v, v_before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_matches_layer(dtype):
    g = torch.Generator().manual_seed(1)
    x = (4 * torch.randn(5, 2 * 80, generator=g)).to(DEVICE, dtype)  # 80: not a power of two
    _close(fused.silu_and_mul(x), SiluAndMul()(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_in_place_matches_layer(dtype):
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=96, num_attention_heads=6, num_key_value_heads=2, head_dim=16, rope_theta=500.0)
    rot = RotaryEmbedding(cfg, 16, 300).to(DEVICE)
    g = torch.Generator().manual_seed(2)
    qkv = torch.randn(9, (6 + 2 * 2) * 16, generator=g).to(DEVICE, dtype)
    q = qkv[:, : 6 * 16].view(9, 6, 16)  # strided views into the projection's output, as in the model
    k = qkv[:, 6 * 16 : 8 * 16].view(9, 2, 16)
    v_before = qkv[:, 8 * 16 :].clone()
    pos = torch.tensor([0, 1, 7, 299, 50, 50, 3, 128, 2], device=DEVICE)
    ref_q, ref_k = rot(pos, q, k)
    ref_q, ref_k = ref_q.clone(), ref_k.clone()
    fused.rope_(pos, q, k, rot.cos, rot.sin)
    _close(q, ref_q)
    _close(k, ref_k)
    assert torch.equal(qkv[:, 8 * 16 :], v_before)  # V is not touched
    assert not torch.equal(q[1], qkv.new_zeros(6, 16))


def test_model_with_fused_kernels_gives_the_same_logits():
    from sluice.core.models.layers import ForwardContext
    from sluice.core.models.loader import load_model, resolve_model
    from sluice.kv.attention import AttentionMetadata, allocate_kv_cache, get_attention_backend

    source = resolve_model("dummy:tiny")
    model = load_model(source, torch.float32, DEVICE, max_position=64)
    ids = torch.tensor([3, 14, 15, 92, 65, 35], device=DEVICE)
    pos = torch.arange(6, device=DEVICE)

    def logits() -> torch.Tensor:
        kv = allocate_kv_cache(2, 2, 16, model.num_kv_heads, model.head_dim, torch.float32, DEVICE)
        meta = AttentionMetadata(
            slot_mapping=torch.arange(6, device=DEVICE),
            query_start_loc=torch.tensor([0, 6], dtype=torch.int32, device=DEVICE),
            seq_lens=torch.tensor([6], dtype=torch.int32, device=DEVICE),
            block_tables=torch.tensor([[0]], dtype=torch.int32, device=DEVICE),
            max_query_len=6,
            max_seq_len=6,
            query_start_loc_host=[0, 6],
            seq_lens_host=[6],
        )
        with torch.inference_mode():
            return model.compute_logits(model(ids, pos, ForwardContext(meta, kv, get_attention_backend("torch"))))

    ref = logits()
    assert enable_fused_kernels(model) == 2 * 2 + 1 + 2 + 1  # 2 norms per layer + final, 2 MLPs, rotary
    torch.testing.assert_close(logits(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 16, 17, 32, 33, 64])
def test_gemv_matches_linear(dtype, rows):
    """The few-row GEMV against F.linear: N not a multiple of the tile, K split unevenly and evenly, a bias,
    and the split-K counters left at zero for the next launch (as a graph replay needs); the engine's own
    config for the rows too (None)."""
    from sluice.core.models import gemv

    g = torch.Generator().manual_seed(rows)
    n, k = 100, 320
    w = torch.randn(n, k, generator=g).to(DEVICE, dtype)
    x = torch.randn(rows, k, generator=g).to(DEVICE, dtype)
    bias = torch.randn(n, generator=g).to(DEVICE, dtype)
    counters = torch.zeros(-(-n // gemv.MIN_BLOCK_N), dtype=torch.int32, device=DEVICE)
    ref = torch.nn.functional.linear(x.float(), w.float(), bias.float())
    configs = [gemv.GemvConfig(32, 64, 1), gemv.GemvConfig(64, 64, 3), gemv.GemvConfig(32, 32, 2)]
    if dtype == torch.bfloat16:  # the engine's rule is for 16-bit weights (fp32 tiles of its size overflow smem)
        configs.append(None)
    for cfg in configs:
        for b in (bias, None):
            out = gemv.gemv(x, w, b, counters, cfg)
            expect = ref if b is not None else ref - bias.float()
            assert out.shape == (rows, n) and out.dtype == dtype
            if dtype == torch.float32:
                torch.testing.assert_close(out, expect, rtol=1e-4, atol=1e-4)
            else:  # inputs are bf16-exact; only the output's rounding differs
                torch.testing.assert_close(out.float(), expect, rtol=2**-7, atol=2e-2)
            assert not counters.any()


@pytest.mark.parametrize("dtype", FOLD_DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 16])
def test_gemv_with_the_rmsnorm_folded_in_matches_norm_then_gemv(dtype, rows):
    """`gemv_rmsnorm` against the norm's kernel then the GEMV: with and without a residual (the first layer's
    norm has none), K a multiple of the step and not, a bias; the new residual stream is x + residual rounded to
    the dtype, as the norm's kernel leaves it, and the inputs are left as they were."""
    from sluice.core.models import gemv

    g = torch.Generator().manual_seed(rows)
    n = 100
    for k, cfg in ((320, gemv.GemvConfig(32, 64, 1)), (300, gemv.GemvConfig(64, 128, 1)), (256, None)):
        w = torch.randn(n, k, generator=g).to(DEVICE, dtype)
        nw = (1 + 0.5 * torch.randn(k, generator=g)).to(DEVICE, dtype)
        x = (3 * torch.randn(rows, k, generator=g)).to(DEVICE, dtype)
        res = torch.randn(rows, k, generator=g).to(DEVICE, dtype)
        bias = torch.randn(n, generator=g).to(DEVICE, dtype)
        counters = torch.zeros(-(-n // gemv.MIN_BLOCK_N), dtype=torch.int32, device=DEVICE)
        x0, res0 = x.clone(), res.clone()
        for r, b in ((res, bias), (None, None)):
            h, expect_res = fused.add_rmsnorm(x, r, nw, 1e-5)
            expect = gemv.gemv(h, w, b, counters, cfg)
            out, new_res = gemv.gemv_rmsnorm(x, r, nw, 1e-5, w, b, counters, cfg)
            assert out.shape == (rows, n) and out.dtype == dtype
            if r is None:
                assert new_res is x
            else:
                assert torch.equal(new_res, expect_res)  # the same sum, rounded the same way
            if dtype == torch.float32:
                torch.testing.assert_close(out, expect, rtol=1e-4, atol=1e-4)
            else:  # x rounded once between the norm's factors instead of twice
                _close_to_scale(out, expect, 2**-7)
            assert torch.equal(x, x0) and torch.equal(res, res0) and not counters.any()


@pytest.mark.parametrize("dtype", FOLD_DTYPES)
@pytest.mark.parametrize("rows", [1, 5, 16])
def test_gate_up_gemv_with_silu_and_mul_in_its_epilogue_is_gemv_then_silu_and_mul_bit_for_bit(dtype, rows):
    """`gemv_silu` applies SiLU-and-mul to each program's gate and up tiles as `silu_and_mul` does to the GEMV's
    output: the same result to the bit with the same tiles, with a bias, K a multiple of the step and not; the
    engine's own config (half-height tiles) to the rounding; with the norm folded in too (`gemv_rmsnorm(...,
    silu=True)`), the same as the norm's fold then `silu_and_mul`."""
    from sluice.core.models import gemv

    g = torch.Generator().manual_seed(rows)
    inter = 96  # I: the weight is [gate; up], 2I rows
    for k, cfg in ((320, gemv.GemvConfig(32, 64, 1)), (300, gemv.GemvConfig(64, 128, 1))):
        w = torch.randn(2 * inter, k, generator=g).to(DEVICE, dtype)
        x = torch.randn(rows, k, generator=g).to(DEVICE, dtype)
        nw = (1 + 0.5 * torch.randn(k, generator=g)).to(DEVICE, dtype)
        res = torch.randn(rows, k, generator=g).to(DEVICE, dtype)
        bias = torch.randn(2 * inter, generator=g).to(DEVICE, dtype)
        counters = torch.zeros(-(-2 * inter // gemv.MIN_BLOCK_N), dtype=torch.int32, device=DEVICE)
        for b in (bias, None):
            expect = fused.silu_and_mul(gemv.gemv(x, w, b, counters, cfg))
            out = gemv.gemv_silu(x, w, b, counters, cfg)
            assert out.shape == (rows, inter) and torch.equal(out, expect)
            h, expect_res = gemv.gemv_rmsnorm(x, res, nw, 1e-5, w, b, counters, cfg)
            out, new_res = gemv.gemv_rmsnorm(x, res, nw, 1e-5, w, b, counters, cfg, silu=True)
            assert torch.equal(out, fused.silu_and_mul(h)) and torch.equal(new_res, expect_res)
        if dtype == torch.bfloat16:  # the engine's rule: tiles half as high, sums in another grouping
            _close_to_scale(
                gemv.gemv_silu(x, w, bias, counters), fused.silu_and_mul(gemv.gemv(x, w, bias, counters)), 2**-7
            )
        assert not counters.any()


@pytest.mark.parametrize("folds", ["norm,silu", "norm", "silu"])
def test_decoder_layers_fold_their_norms_and_silu_into_the_gemv_for_few_rows(monkeypatch, folds):
    """A bf16 model whose projections take the GEMV, the folds switched on: for a few rows each layer's two norms go
    into the projections after them (two `gemv_rmsnorm` launches per layer) and its SiLU-and-mul into the gate/up
    projection's epilogue (with the norm's fold: the second of those launches; without: `gemv_silu`), and the
    logits are those of the separate kernels, to rounding; past the folds' rows, and with the folds off, the
    norms and the SiLU run their own kernels."""
    from sluice.core.models import gemv
    from sluice.core.models.layers import ForwardContext
    from sluice.core.models.loader import load_model, resolve_model
    from sluice.kv.attention import AttentionMetadata, allocate_kv_cache, get_attention_backend

    norm_rows = gemv.FOLD_NORM_ROWS if "norm" in folds else 0
    silu_rows = gemv.FOLD_NORM_ROWS if "silu" in folds else 0
    monkeypatch.setattr(gemv, "MIN_WEIGHT_BYTES", 0)
    monkeypatch.setattr(gemv, "fold_norm_rows", lambda: norm_rows)  # the switch (SLUICE_GEMV_FOLD=...)
    monkeypatch.setattr(gemv, "fold_silu_rows", lambda: silu_rows)
    model = load_model(resolve_model("dummy:tiny"), torch.bfloat16, DEVICE, max_position=64)
    enable_fused_kernels(model)
    calls = []
    real, real_silu = gemv.gemv_rmsnorm, gemv.gemv_silu

    def rmsnorm(*a, **kw):
        calls.append(("norm", a[0].shape[0], kw.get("silu", False)))
        return real(*a, **kw)

    def silu(*a, **kw):
        calls.append(("silu", a[0].shape[0]))
        return real_silu(*a, **kw)

    monkeypatch.setattr(gemv, "gemv_rmsnorm", rmsnorm)
    monkeypatch.setattr(gemv, "gemv_silu", silu)

    def logits(t: int) -> torch.Tensor:
        ids = torch.arange(3, 3 + t, device=DEVICE) * 7 % 1000
        kv = allocate_kv_cache(2, 4, 16, model.num_kv_heads, model.head_dim, torch.bfloat16, DEVICE)
        meta = AttentionMetadata(
            slot_mapping=torch.arange(t, device=DEVICE),
            query_start_loc=torch.tensor([0, t], dtype=torch.int32, device=DEVICE),
            seq_lens=torch.tensor([t], dtype=torch.int32, device=DEVICE),
            block_tables=torch.tensor([[0, 1, 2, 3]], dtype=torch.int32, device=DEVICE),
            max_query_len=t,
            max_seq_len=t,
            query_start_loc_host=[0, t],
            seq_lens_host=[t],
        )
        with torch.inference_mode():
            ctx = ForwardContext(meta, kv, get_attention_backend("torch"))
            hidden = model(ids, torch.arange(t, device=DEVICE), ctx)
            return model.compute_logits(hidden).float()

    folded = logits(6)
    per_layer = {
        "norm,silu": [("norm", 6, False), ("norm", 6, True)],
        "norm": [("norm", 6, False), ("norm", 6, False)],
        "silu": [("silu", 6)],
    }[folds]
    assert calls == per_layer * len(model.model.layers)  # in their order
    calls.clear()
    monkeypatch.setattr(gemv, "fold_norm_rows", lambda: 0)
    monkeypatch.setattr(gemv, "fold_silu_rows", lambda: 0)
    separate = logits(6)
    assert calls == []
    _close_to_scale(folded, separate, 2**-5)
    monkeypatch.setattr(gemv, "fold_norm_rows", lambda: norm_rows)
    monkeypatch.setattr(gemv, "fold_silu_rows", lambda: silu_rows)
    logits(gemv.FOLD_NORM_ROWS + 1)
    assert calls == []  # past the folds' rows: the norm's and the SiLU's own kernels


def test_linear_layer_takes_the_gemv_only_for_few_rows():
    from sluice.core.models import gemv
    from sluice.core.models.layers import Linear

    assert enable_fused_kernels(Linear(64, 48).to(DEVICE, torch.bfloat16)) == 0  # small weights keep cuBLAS
    lin = Linear(64, 48, bias=False).to(DEVICE, torch.bfloat16)
    old, gemv.MIN_WEIGHT_BYTES = gemv.MIN_WEIGHT_BYTES, 0
    try:
        assert enable_fused_kernels(lin) == 1 and lin.fused is gemv.linear
    finally:
        gemv.MIN_WEIGHT_BYTES = old
    calls = []
    real = gemv.gemv
    gemv.gemv = lambda *a, **kw: calls.append(a[0].shape) or real(*a, **kw)
    try:
        for m in (1, 16, 33, 64, 65):
            x = torch.randn(m, 64).to(DEVICE, torch.bfloat16)
            torch.testing.assert_close(
                lin(x).float(), torch.nn.functional.linear(x, lin.weight).float(), rtol=2**-7, atol=2e-2
            )
    finally:
        gemv.gemv = real
    assert calls == [(1, 64), (16, 64), (33, 64), (64, 64)]  # 65 rows: cuBLAS (F.linear)
    gemv.MIN_WEIGHT_BYTES = 0
    try:
        assert enable_fused_kernels(Linear(8, 8)) == 0  # fp32 weights keep F.linear
    finally:
        gemv.MIN_WEIGHT_BYTES = old


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_and_kv_write_in_one_kernel_match_the_two(dtype):
    """`rope_and_write_kv_` on views of one qkv row block (as the attention layer has them): q rotated in place
    and the cache's slots (-1 skipped, shuffled blocks) hold what `rope_` then the backend's write leave there."""
    from sluice.kv.attention import triton_kernels as tk

    g = torch.Generator().manual_seed(5)
    t, hq, hk, d = 6, 4, 2, 32
    qkv = torch.randn(t, (hq + 2 * hk) * d, generator=g).to(DEVICE, dtype)
    cos, sin = torch.randn(64, d, generator=g).to(DEVICE), torch.randn(64, d, generator=g).to(DEVICE)
    pos = torch.tensor([3, 7, 1, 50, 9, 9], device=DEVICE)
    slots = torch.tensor([21, -1, 5, 0, 30, 12], device=DEVICE)
    cache = torch.randn(2, 4, 8, hk, d, generator=g).to(DEVICE, dtype)

    def views(x):
        return (
            x[:, : hq * d].view(t, hq, d),
            x[:, hq * d : (hq + hk) * d].view(t, hk, d),
            x[:, (hq + hk) * d :].view(t, hk, d),
        )

    two, one = qkv.clone(), qkv.clone()
    cache_two, cache_one = cache.clone(), cache.clone()
    q, k, v = views(two)
    fused.rope_(pos, q, k, cos, sin)
    tk.write_kv(k, v, cache_two, slots)
    q1, k1, v1 = views(one)
    fused.rope_and_write_kv_(pos, q1, k1, v1, cos, sin, cache_one, slots)
    if ON_GPU:  # the same arithmetic in another kernel: the compiler may contract it otherwise (one rounding)
        _close_to_scale(q1, q, 2**-7 if dtype == torch.bfloat16 else 1e-6)
        _close_to_scale(cache_one, cache_two, 2**-7 if dtype == torch.bfloat16 else 1e-6)
    else:
        assert torch.equal(q1, q) and torch.equal(cache_one, cache_two)
    assert torch.equal(k1, views(qkv)[1])  # k itself is not kept rotated: only the cache reads it
    assert torch.equal(cache_one[:, 0, 1], cache[:, 0, 1])  # a slot no token maps to is untouched


def test_attention_layer_with_rope_in_the_decode_kernel_matches_two_kernels(monkeypatch):
    """With SLUICE_DECODE_ROPE=1 (the default) a pure decode step's attention layer launches no RoPE/KV-write
    kernel: the decode kernel rotates and stores, and the layer's output and cache equal those of
    `rope_and_write_kv_` then the decode kernel (SLUICE_DECODE_ROPE=0); a step with prompt rows, or with more than
    `DECODE_ROPE_MAX_SEQS` decodes, still takes the RoPE kernel."""
    from types import SimpleNamespace

    from sluice.core.models.layers import ForwardContext
    from sluice.core.models.llama import LlamaAttention
    from sluice.kv.attention.triton_backend import TritonAttentionBackend

    from tests.helpers import random_paged_batch

    cfg = SimpleNamespace(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0)
    g = torch.Generator().manual_seed(10)
    attn = LlamaAttention(cfg, 0, qkv_bias=False).to(DEVICE, torch.bfloat16)
    for p in attn.parameters():
        p.data.copy_(0.3 * torch.randn(p.shape, generator=g))
    r = RotaryEmbedding(cfg, attn.head_dim, 256).to(DEVICE)
    assert enable_fused_kernels(r) == 1 and r.fused_write is not None
    rope_kv_calls = []
    real = r.fused_write
    r.fused_write = lambda *a: rope_kv_calls.append(a[0].shape[0]) or real(*a)

    def run(rope_in_decode: bool, seq_lens: list[int], q_lens: list[int]):
        backend = TritonAttentionBackend(rope_in_decode=rope_in_decode)  # the engine's SLUICE_DECODE_ROPE
        assert backend.rope_in_decode == rope_in_decode
        _, cache, meta = random_paged_batch(seq_lens, q_lens, 2, 2, 16, dtype=torch.bfloat16, device=DEVICE, seed=4)
        x = torch.randn(sum(q_lens), 64, generator=torch.Generator().manual_seed(2)).to(DEVICE, torch.bfloat16)
        positions = torch.tensor([p for s, q in zip(seq_lens, q_lens) for p in range(s - q, s)], device=DEVICE)
        c = cache.clone()
        return attn(x, positions, r, ForwardContext(meta, [c], backend)), c

    (out1, c1), (out0, c0) = run(True, [9, 40, 17], [1, 1, 1]), run(False, [9, 40, 17], [1, 1, 1])
    assert rope_kv_calls == [3]  # only the default's step launched the RoPE/KV-write kernel
    if ON_GPU:  # the same arithmetic in another kernel: the compiler may contract it otherwise (one rounding)
        _close_to_scale(c1, c0, 2**-7)
        _close_to_scale(out1, out0, 2**-5)
    else:
        assert torch.equal(out1, out0) and torch.equal(c1, c0)
    run(True, [20, 7], [20, 1])  # prompt rows: the RoPE kernel as before
    assert rope_kv_calls == [3, 21]
    run(True, [5 + i for i in range(17)], [1] * 17)  # more decodes than the decode kernel rotates for
    assert rope_kv_calls == [3, 21, 17]


def test_attention_layer_with_rope_and_kv_write_fused_matches_unfused(monkeypatch):
    """By default the attention layer rotates and writes the KV in one kernel; its output and the
    cache equal the layer's with the two kernels (prefill and decode rows, the Triton backend)."""
    from types import SimpleNamespace

    from sluice.core.models.layers import ForwardContext
    from sluice.core.models.llama import LlamaAttention
    from sluice.kv.attention.triton_backend import TritonAttentionBackend

    from tests.helpers import random_paged_batch

    cfg = SimpleNamespace(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0)
    g = torch.Generator().manual_seed(9)
    attn = LlamaAttention(cfg, 0, qkv_bias=False).to(DEVICE, torch.bfloat16)
    for p in attn.parameters():
        p.data.copy_(0.3 * torch.randn(p.shape, generator=g))
    _, cache, meta = random_paged_batch([20, 7, 33], [20, 1, 1], 2, 2, 16, dtype=torch.bfloat16, device=DEVICE)
    x = torch.randn(22, 64, generator=g).to(DEVICE, torch.bfloat16)
    positions = torch.tensor(list(range(20)) + [6, 32], device=DEVICE)
    backend = TritonAttentionBackend()

    def run(fused_write: bool):
        r = RotaryEmbedding(cfg, attn.head_dim, 256).to(DEVICE)
        # the default, or two kernels (the engine's SLUICE_FUSED_ROPE_KV=0)
        switched = enable_fused_kernels(r) if fused_write else enable_fused_kernels(r, fused_rope_kv=False)
        assert switched == 1 and (r.fused_write is not None) == fused_write
        c = cache.clone()
        return attn(x, positions, r, ForwardContext(meta, [c], backend)), c

    (out1, c1), (out0, c0) = run(True), run(False)
    assert not torch.equal(c0, cache)
    if ON_GPU:  # the same arithmetic in another kernel: the compiler may contract it otherwise (one rounding)
        _close_to_scale(c1, c0, 2**-7)
        _close_to_scale(out1, out0, 2**-5)
    else:
        assert torch.equal(out1, out0) and torch.equal(c1, c0)
