"""The Triton paged-attention kernels against the torch reference backend.

Without a GPU the kernels run under the Triton interpreter. Triton reads ``TRITON_INTERPRET`` when a
function is decorated with ``@triton.jit``: its own library functions (``tl.cdiv``, ``tl.max``, ...) are
decorated when triton is first imported, ours when `kv.attention.triton_kernels` is. So the variable is
set here before either import. If triton was already imported in this process without it (another test
module got there first), the kernel tests cannot run in-process: they skip, and one test re-runs this
file in a fresh interpreter process instead.
"""

from __future__ import annotations

import functools
import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"

triton = pytest.importorskip("triton")

from sluice.kv.attention import get_attention_backend  # noqa: E402
from sluice.kv.attention import triton_kernels as tk  # noqa: E402
from sluice.kv.attention.base import AttentionBackend  # noqa: E402
from sluice.kv.attention.torch_ref import TorchAttentionBackend  # noqa: E402
from sluice.kv.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from tests.helpers import random_paged_batch  # noqa: E402

# triton's own jit library was decorated for the interpreter (or there is a GPU): kernels run in-process
IN_PROCESS = ON_GPU or isinstance(triton.language.standard.cdiv, InterpretedFunction)
if IN_PROCESS and not ON_GPU and not isinstance(tk._decode_kernel, InterpretedFunction):
    # decorated before TRITON_INTERPRET was set; the backend looks kernels up via `tk` (and tk its RoPE helper)
    importlib.reload(importlib.import_module("sluice.kv.attention.rope"))
    importlib.reload(tk)


@pytest.fixture(autouse=True)
def _needs_kernels(request):
    if not IN_PROCESS and request.node.name != "test_kernels_in_fresh_process":
        pytest.skip("triton was imported without TRITON_INTERPRET=1; covered by test_kernels_in_fresh_process")


def test_kernels_in_fresh_process():
    if IN_PROCESS:
        pytest.skip("kernels run in this process")
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), env.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(Path(__file__).resolve())],
        cwd=root, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


DEVICE = torch.device("cuda" if ON_GPU else "cpu")
REF = TorchAttentionBackend()


_build = functools.partial(random_paged_batch, device=DEVICE)


def _check(out, query, cache, meta, scale):
    """fp32: tight against the reference. 16-bit: against the reference run in fp32 on the same (rounded)
    inputs, within a bound derived from the 16-bit torch reference's own error."""
    assert out.dtype == query.dtype and out.shape == query.shape
    assert torch.isfinite(out).all()
    exact = REF.forward(query.float(), cache.float(), meta, scale)
    err = (out.float() - exact).abs().max().item()
    if query.dtype == torch.float32:
        assert err < 2e-5, err
    else:
        ref16 = REF.forward(query, cache, meta, scale)
        ref_err = (ref16.float() - exact).abs().max().item()
        floor = 2e-2 if query.dtype == torch.bfloat16 else 3e-3
        assert err < max(4 * ref_err, floor), (err, ref_err)
    return err


def test_kernels_are_interpreted_without_gpu():
    assert ON_GPU or isinstance(tk._decode_kernel, InterpretedFunction)


def test_registry_returns_triton_backend():
    backend = get_attention_backend("triton")
    assert isinstance(backend, TritonAttentionBackend) and backend.name == "triton"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv(dtype):
    g = torch.Generator().manual_seed(1)
    num_blocks, block_size, num_kv_heads, head_dim = 6, 16, 3, 64
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype).to(DEVICE)
    num_tokens = 11
    # K and V as strided views into a fused qkv-like projection (non-contiguous token stride)
    fused = torch.randn(num_tokens, 3 * num_kv_heads, head_dim, generator=g).to(DEVICE)
    key, value = fused[:, num_kv_heads : 2 * num_kv_heads], fused[:, 2 * num_kv_heads :]
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    slots[[2, 5, 10]] = -1
    slots = slots.to(DEVICE)
    expected = cache.clone()
    keep = slots >= 0
    AttentionBackend().write_kv(key[keep], value[keep], expected, slots[keep])

    TritonAttentionBackend().write_kv(key, value, cache, slots)
    if dtype == torch.float32:
        assert torch.equal(cache, expected)
    else:  # the interpreter may round fp32 -> bf16 differently from torch: allow one bf16 ulp
        torch.testing.assert_close(cache.float(), expected.float(), rtol=8e-3, atol=1e-6)
        assert (cache != expected).float().mean() < 0.05


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group", [1, 3])
def test_decode(group, dtype):
    """Seq lens around block boundaries, 1, and long enough for several splits of one 64-key tile."""
    seq_lens = [1, 15, 16, 17, 100, 200]
    query, cache, meta = _build(seq_lens, [1] * len(seq_lens), 2, group, 64, dtype=dtype, seed=group)
    for splits, fused in ((1, True), (4, True), (4, False)):
        backend = TritonAttentionBackend(decode_num_splits=splits, fused_reduce=fused)
        _check(backend.forward(query, cache, meta, 0.125), query, cache, meta, 0.125)
        counters = backend.split_counters(query.device)
        assert (counters is not None) == fused
        if fused:  # the merging programs left every arrival counter at zero (a graph replay needs that)
            assert not counters.any()


@pytest.mark.parametrize("group", [1, 3])
def test_decode_split_heuristic_and_graph_bound(group):
    """The split count is chosen from bounds only; a larger (captured) max_seq_len stays correct."""
    query, cache, meta = _build([3, 16, 33, 64, 150], [1] * 5, 2, group, 64, seed=7)
    backend = TritonAttentionBackend(min_tokens_per_split=32, max_splits=16)
    assert backend.decode_splits(meta.max_seq_len, meta.num_seqs, 2, DEVICE) == 8  # 256-bucket / 32
    _check(backend.forward(query, cache, meta, 0.1), query, cache, meta, 0.1)
    meta.max_seq_len = 8192  # as if captured in a CUDA graph for contexts up to 8k
    splits = backend.decode_splits(meta.max_seq_len, meta.num_seqs, 2, DEVICE)
    assert splits == backend.max_splits
    _check(backend.forward(query, cache, meta, 0.1), query, cache, meta, 0.1)


def test_decode_key_tile_from_the_backends_switch(monkeypatch):
    """``decode_block_n`` (the engine's SLUICE_DECODE_BLOCK_N, tests/test_envs.py) sets the decode kernel's keys
    per tile (128 unless said): both tiles give the reference's output, and the launch takes the backend's tile."""
    query, cache, meta = _build([5, 70, 200], [1] * 3, 2, 2, 64, seed=11)
    assert TritonAttentionBackend().decode_block_n == 128
    backend = TritonAttentionBackend(decode_num_splits=2, decode_block_n=64)
    tiles = []
    real = tk.paged_decode
    monkeypatch.setattr(tk, "paged_decode", lambda *a, **kw: tiles.append(kw["block_n"]) or real(*a, **kw))
    _check(backend.forward(query, cache, meta, 0.1), query, cache, meta, 0.1)
    assert tiles == [64]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("splits", [1, 4])
def test_decode_with_rope_and_kv_write_matches_the_two_kernels(splits, dtype):
    """`paged_decode` with ``rope``: the unrotated q/k/v views of one qkv block, rotated
    and stored by the decode kernel, give the output and cache that `rope_and_write_kv_` then the decode kernel
    give; a row with slot -1 and a graph's padding row (no context either) store nothing; the qkv block is left as
    it was."""
    from sluice.core.models import fused
    from sluice.kv.attention.base import DecodeRope

    seq_lens, hk, group, d = [1, 16, 17, 100, 200], 2, 2, 64
    _, cache, meta = _build(seq_lens, [1] * len(seq_lens), hk, group, d, dtype=dtype, seed=13 + splits)
    # one padding row, as a decode graph pads its batch: no context, no slot
    n = len(seq_lens) + 1
    meta.seq_lens = torch.cat([meta.seq_lens, torch.zeros(1, dtype=torch.int32, device=DEVICE)])
    meta.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=DEVICE)
    meta.slot_mapping = torch.cat([meta.slot_mapping, torch.full((1,), -1, dtype=torch.int64, device=DEVICE)])
    meta.slot_mapping[1] = -1  # a row whose key and value are not to be stored (-1), context and all
    meta.block_tables = torch.cat([meta.block_tables, torch.zeros_like(meta.block_tables[:1])])
    meta.seq_lens_host, meta.query_start_loc_host = [*seq_lens, 0], list(range(n + 1))
    g = torch.Generator().manual_seed(splits)
    hq = hk * group
    qkv = torch.randn(n, (hq + 2 * hk) * d, generator=g).to(DEVICE, dtype)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float) / d))
    freqs = torch.outer(torch.arange(256, dtype=torch.float), inv)
    cos, sin = torch.cat([freqs, freqs], -1).cos().to(DEVICE), torch.cat([freqs, freqs], -1).sin().to(DEVICE)
    pos = torch.tensor([s - 1 for s in seq_lens] + [0], device=DEVICE)

    def views(x):
        return (
            x[:, : hq * d].view(n, hq, d),
            x[:, hq * d : (hq + hk) * d].view(n, hk, d),
            x[:, (hq + hk) * d :].view(n, hk, d),
        )

    def decode(q, c, rope=None):
        out = torch.empty_like(q)
        counters = torch.zeros(n * hk, dtype=torch.int32, device=DEVICE)
        return tk.paged_decode(
            q, c, meta.block_tables, meta.seq_lens, meta.query_start_loc, out, 0.1, n, splits, block_n=64,
            counters=counters, rope=rope,
        )  # fmt: skip

    two, cache_two = qkv.clone(), cache.clone()
    q, k, v = views(two)
    fused.rope_and_write_kv_(pos, q, k, v, cos, sin, cache_two, meta.slot_mapping)
    out_two = decode(q, cache_two)
    one, cache_one = qkv.clone(), cache.clone()
    q1, k1, v1 = views(one)
    out_one = decode(q1, cache_one, DecodeRope(pos, k1, v1, cos, sin, meta.slot_mapping))
    assert torch.equal(one, qkv)  # q is rotated in registers, k and v only stored
    assert not torch.equal(cache_one, cache)
    if ON_GPU:  # the same arithmetic in another kernel: the compiler may contract it otherwise (one rounding)
        tol = 2**-7 if dtype == torch.bfloat16 else 1e-6
        torch.testing.assert_close(cache_one.float(), cache_two.float(), rtol=tol, atol=tol * 4)
        torch.testing.assert_close(out_one[:-1].float(), out_two[:-1].float(), rtol=2**-5, atol=2**-5)
    else:
        assert torch.equal(cache_one, cache_two)
        assert torch.equal(out_one[:-1], out_two[:-1])  # the padding row's output is unspecified


def test_decode_head_dim_128_block_32_gqa4():
    query, cache, meta = _build([1, 31, 32, 33, 95], [1] * 5, 2, 4, 128, block_size=32, seed=3)
    _check(
        TritonAttentionBackend(decode_num_splits=2).forward(query, cache, meta, 0.09),
        query,
        cache,
        meta,
        0.09,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 3])
def test_prefill_from_scratch(group, dtype):
    seq_lens = [1, 16, 17, 70, 130]
    query, cache, meta = _build(seq_lens, seq_lens, 2, group, 64, dtype=dtype, seed=11 + group)
    _check(TritonAttentionBackend().forward(query, cache, meta, 0.125), query, cache, meta, 0.125)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 3])
def test_chunked_prefill_over_cached_context(group, dtype):
    """New chunks on top of cached tokens; this step's K/V are written first, by each backend's write_kv."""
    seq_lens, q_lens = [100, 40, 150, 5, 47], [20, 16, 64, 5, 15]
    query, cache, meta = _build(seq_lens, q_lens, 2, group, 64, dtype=dtype, seed=21 + group)
    g = torch.Generator().manual_seed(5)
    key = torch.randn(query.shape[0], 2, 64, generator=g).to(dtype).to(DEVICE)
    value = torch.randn(query.shape[0], 2, 64, generator=g).to(dtype).to(DEVICE)
    ref_cache = cache.clone()
    REF.write_kv(key, value, ref_cache, meta.slot_mapping)
    backend = TritonAttentionBackend()
    backend.write_kv(key, value, cache, meta.slot_mapping)
    assert torch.equal(cache, ref_cache)
    _check(backend.forward(query, cache, meta, 0.125), query, cache, meta, 0.125)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 3])
def test_mixed_prefill_and_decode_rows(group, dtype):
    seq_lens, q_lens = [50, 17, 1, 130, 16, 65], [50, 1, 1, 10, 1, 1]
    query, cache, meta = _build(seq_lens, q_lens, 2, group, 64, dtype=dtype, seed=31 + group)
    _check(TritonAttentionBackend().forward(query, cache, meta, 0.125), query, cache, meta, 0.125)


def test_one_long_prompt_beside_many_decodes():
    """The grid follows the tokens, not (sequences x the longest query): every tile of the long prompt and
    every decode row is computed, and each by one program only."""
    seq_lens = [3, 40, 17, 200, 1, 33, 64, 150, 9]
    q_lens = [1, 1, 1, 150, 1, 1, 1, 1, 1]
    query, cache, meta = _build(seq_lens, q_lens, 2, 3, 64, seed=51)
    _check(TritonAttentionBackend().forward(query, cache, meta, 0.125), query, cache, meta, 0.125)


@pytest.mark.parametrize("group", [1, 4])
def test_prefill_over_graph_padding(group):
    """A step padded to a CUDA graph's size: tokens past the last sequence's belong to no sequence, padding
    sequences own no tokens and no context. The real rows come out as without padding; the padding rows are
    never written (the output stays as it was allocated)."""
    seq_lens, q_lens = [30, 5, 81], [12, 1, 40]
    query, cache, meta = _build(seq_lens, q_lens, 2, group, 64, seed=61 + group)
    n, t = len(seq_lens), query.shape[0]
    pad_seqs, pad_tokens = 8, 96
    padded_q = torch.full((pad_tokens, *query.shape[1:]), 7.0, dtype=query.dtype, device=DEVICE)
    padded_q[:t] = query
    tables = torch.zeros(pad_seqs, meta.block_tables.shape[1], dtype=torch.int32, device=DEVICE)
    tables[:n] = meta.block_tables
    qsl = torch.full((pad_seqs + 1,), t, dtype=torch.int32, device=DEVICE)
    qsl[: n + 1] = meta.query_start_loc
    lens = torch.zeros(pad_seqs, dtype=torch.int32, device=DEVICE)
    lens[:n] = meta.seq_lens
    out = torch.full_like(padded_q, 5.0)
    tk.paged_prefill(padded_q, cache, tables, lens, qsl, out, 0.125, pad_seqs)
    _check(out[:t], query, cache, meta, 0.125)
    assert (out[t:] == 5.0).all()


def test_prefill_head_dim_128_block_32_gqa4():
    seq_lens, q_lens = [90, 33, 64], [40, 33, 1]
    query, cache, meta = _build(seq_lens, q_lens, 1, 4, 128, block_size=32, seed=41)
    _check(TritonAttentionBackend().forward(query, cache, meta, 0.09), query, cache, meta, 0.09)


def test_wide_fp32_heads_take_small_key_tiles_and_stay_exact():
    """fp32 at head size 256 (Gemma 2's, as the GPU parity checks run it): tiles shrink to fit shared memory,
    and both kernels still match the reference, prefill and decode rows together."""
    assert tk._wide_head_tiles(64, 2, 256, 4) == (32, 2)
    assert tk._wide_head_tiles(128, 3, 256, 4) == (32, 2)
    assert tk._wide_head_tiles(128, 3, 256, 2) == (128, 3)  # 16-bit rows of 512 bytes keep the swept tiles
    assert tk._wide_head_tiles(64, 2, 128, 4) == (64, 2)
    seq_lens, q_lens = [70, 40, 33], [70, 1, 1]
    query, cache, meta = _build(seq_lens, q_lens, 1, 2, 256, dtype=torch.float32, seed=5)
    _check(TritonAttentionBackend().forward(query, cache, meta, 0.0625), query, cache, meta, 0.0625)
    query, cache, meta = _build([70, 40, 33], [1, 1, 1], 1, 2, 256, dtype=torch.float32, seed=6)
    _check(TritonAttentionBackend(decode_num_splits=2).forward(query, cache, meta, 0.0625), query, cache, meta, 0.0625)
