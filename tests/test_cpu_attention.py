"""The CPU decode-attention kernel (`core/models/cpu_attention.cpp`) against the torch-ops backend it replaces in
the compiled CPU step (`kv/attention/torch_decode.py`), and where the step takes it (its tokens through a compiled
engine: `tests/test_cpu_compiled.py`)."""

from __future__ import annotations

import pytest
import sluice.core.worker.cpu_compiled as compiled
import torch
from sluice.core.models import cpu_vnni
from sluice.core.worker.cpu_compiled import decode_attention_backend
from sluice.kv.attention.base import AttentionMetadata
from sluice.kv.attention.cpu_decode import CpuKernelDecodeAttentionBackend
from sluice.kv.attention.torch_decode import TorchDecodeAttentionBackend

needs_kernel = pytest.mark.skipif(not cpu_vnni.load(), reason="the kernel needs AVX-512 and a C++ compiler")


def _case(lens, hq, hk, d, block, dtype, seed=0, blocks=64):
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(2, blocks, block, hk, d, generator=g).to(dtype)
    width = max(2, -(-max(lens) // block) + 1)  # one block more than the longest row needs: padding to ignore
    tables = torch.stack([torch.randperm(blocks, generator=g)[:width] for _ in lens]).int()
    query = torch.randn(len(lens), hq, d, generator=g).to(dtype)
    return query, kv, tables, torch.tensor(lens, dtype=torch.int32)


def _both(query, kv, tables, seq_lens, window=0, softcap=0.0):
    meta = AttentionMetadata(None, seq_lens, seq_lens, tables, 1, 0, [], [])
    scale = query.shape[-1] ** -0.5
    args = (query, kv, meta, scale)
    got = CpuKernelDecodeAttentionBackend().forward(*args, window=window, softcap=softcap)
    want = TorchDecodeAttentionBackend().forward(*args, window=window, softcap=softcap)
    return got, want


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "lens,hq,hk,d,block,window,softcap",
    [
        ([1, 15, 16, 17, 300], 9, 3, 64, 16, 0, 0.0),  # the default model's heads; rows at block edges
        ([40, 7], 8, 2, 128, 16, 0, 0.0),
        ([33], 4, 4, 32, 8, 0, 0.0),
        ([50, 3], 6, 2, 80, 16, 0, 0.0),  # a head size the register path does not take
        ([20, 9, 64], 8, 4, 256, 16, 6, 0.0),  # a sliding window, shorter and longer than rows
        ([70], 4, 1, 64, 16, 0, 30.0),  # logit soft-capping
    ],
)
def test_the_kernel_equals_the_torch_backend(dtype, lens, hq, hk, d, block, window, softcap):
    got, want = _both(*_case(lens, hq, hk, d, block, dtype), window=window, softcap=softcap)
    assert got.dtype == dtype and got.shape == want.shape
    tol = 1e-5 if dtype == torch.float32 else 2.0**-7
    assert (got.float() - want.float()).abs().max() <= tol * want.float().abs().max()


@needs_kernel
def test_each_row_reads_only_its_own_keys():
    """NaN in every cache slot a row does not own (padding in its table, slots past its length, other blocks): the
    outputs equal the ones over a clean cache."""
    query, kv, tables, seq_lens = _case([5, 18, 33], 9, 3, 64, 16, torch.bfloat16)
    clean, _ = _both(query, kv, tables, seq_lens)
    poisoned = torch.full_like(kv, float("nan"))
    for row, length in enumerate(seq_lens.tolist()):
        for pos in range(length):
            block, offset = tables[row, pos // 16].item(), pos % 16
            poisoned[:, block, offset] = kv[:, block, offset]
    got, _ = _both(query, poisoned, tables, seq_lens)
    assert torch.equal(got, clean)


@needs_kernel
def test_large_logits_keep_a_finite_softmax():
    """Logits in the thousands (the max is subtracted before the exponent); bf16's largest values in V."""
    query, kv, tables, seq_lens = _case([40], 4, 2, 64, 16, torch.float32)
    got, want = _both(query * 300.0, kv, tables, seq_lens)
    assert torch.isfinite(got).all() and torch.allclose(got, want, rtol=1e-4, atol=1e-4)
    kv[1] = torch.finfo(torch.bfloat16).max / 2
    got, want = _both(query.bfloat16(), kv.bfloat16(), tables, seq_lens)
    assert torch.isfinite(got).all() and torch.equal(got, want)


def test_the_compiled_step_takes_the_kernel_where_it_runs_and_fits(monkeypatch):
    cache = torch.zeros(2, 4, 16, 3, 64, dtype=torch.bfloat16)
    monkeypatch.setattr(compiled, "cpu_isa", lambda: "AVX512_VNNI")
    assert isinstance(decode_attention_backend(cache), CpuKernelDecodeAttentionBackend)
    assert isinstance(decode_attention_backend(cache.float()), CpuKernelDecodeAttentionBackend)
    for other in (cache.half(), cache[..., :40]):  # a dtype and a head size the kernel does not take
        assert type(decode_attention_backend(other)) is TorchDecodeAttentionBackend
    monkeypatch.setattr(compiled, "cpu_isa", lambda: "AVX512")  # no library, or SLUICE_CPU_VNNI=0
    assert type(decode_attention_backend(cache)) is TorchDecodeAttentionBackend
