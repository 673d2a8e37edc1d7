"""Sliding windows and logit soft-capping in the paged attention backends (the Triton kernels under the
interpreter on the CPU, the torch reference) against a dense attention written here from the definition:
a query at position ``p`` of a windowed layer sees keys ``p - window < key <= p``, and a soft-capped layer's
scaled logits are ``cap * tanh(logit / cap)`` before the softmax.

Windows are shorter than the contexts (several tiles and blocks fall outside), prompts run from scratch, as
chunks over a cached prefix, and as decode rows beside them. The interpreter set-up is the one of
`tests/test_triton_attention.py` (this module re-runs itself in a fresh process when triton was imported
without ``TRITON_INTERPRET``).
"""

from __future__ import annotations

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

from sluice.kv.attention import triton_kernels as tk  # noqa: E402
from sluice.kv.attention.torch_ref import TorchAttentionBackend  # noqa: E402
from sluice.kv.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from tests.helpers import random_paged_batch  # noqa: E402

IN_PROCESS = ON_GPU or isinstance(triton.language.standard.cdiv, InterpretedFunction)
if IN_PROCESS and not ON_GPU and not isinstance(tk._decode_kernel, InterpretedFunction):
    importlib.reload(importlib.import_module("sluice.kv.attention.rope"))
    importlib.reload(tk)

DEVICE = torch.device("cuda" if ON_GPU else "cpu")
SCALE = 0.125


@pytest.fixture(autouse=True)
def _needs_kernels(request):
    if not IN_PROCESS and request.node.name != "test_variants_in_fresh_process":
        pytest.skip("triton was imported without TRITON_INTERPRET=1; covered by test_variants_in_fresh_process")


def test_variants_in_fresh_process():
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


def dense_attention(query, cache, meta, scale: float, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """Each sequence's K/V gathered position by position, then attention with explicit masks, in fp64."""
    out = torch.empty(query.shape, dtype=torch.float64)
    block_size = cache.shape[2]
    group = query.shape[1] // cache.shape[3]
    for i, seq_len in enumerate(meta.seq_lens_host):
        s, e = meta.query_start_loc_host[i], meta.query_start_loc_host[i + 1]
        pos = torch.arange(seq_len)
        blocks = meta.block_tables[i].cpu().long()[pos // block_size]
        k = cache[0, blocks, pos % block_size].double().cpu().repeat_interleave(group, dim=1)  # [L, Hq, D]
        v = cache[1, blocks, pos % block_size].double().cpu().repeat_interleave(group, dim=1)
        q = query[s:e].double().cpu()  # [n, Hq, D]
        logits = torch.einsum("nhd,lhd->hnl", q, k) * scale
        if softcap:
            logits = softcap * torch.tanh(logits / softcap)
        q_pos = torch.arange(seq_len - (e - s), seq_len)[:, None]
        seen = pos[None, :] <= q_pos
        if window:
            seen &= pos[None, :] > q_pos - window
        probs = torch.softmax(logits.masked_fill(~seen, float("-inf")), dim=-1)
        out[s:e] = torch.einsum("hnl,lhd->nhd", probs, v)
    return out


def _assert_close(out, want, dtype):
    assert torch.isfinite(out).all()
    err = (out.double().cpu() - want).abs().max().item()
    assert err < (2e-5 if dtype == torch.float32 else 3e-2), err


# (seq_lens, q_lens): from scratch; chunks over a cached prefix with decode rows beside them
BATCHES = {
    "prefill": ([1, 16, 40, 70, 130], [1, 16, 40, 70, 130]),
    "chunks_and_decodes": ([100, 40, 150, 5, 47, 90], [20, 16, 64, 5, 1, 1]),
}


@pytest.mark.parametrize("batch", sorted(BATCHES))
@pytest.mark.parametrize(("window", "softcap"), [(24, 0.0), (0, 5.0), (37, 5.0)])
def test_prefill_and_mixed_steps(batch, window, softcap):
    seq_lens, q_lens = BATCHES[batch]
    query, cache, meta = random_paged_batch(seq_lens, q_lens, 2, 3, 32, dtype=torch.float32, seed=7, device=DEVICE)
    query = query * 4  # logits of several units, so the cap bends them
    want = dense_attention(query, cache, meta, SCALE, window, softcap)
    plain = dense_attention(query, cache, meta, SCALE)
    assert (want - plain).abs().max() > 1e-2  # the variant changes the answer: the test can tell
    for backend in (TorchAttentionBackend(), TritonAttentionBackend()):
        _assert_close(backend.forward(query, cache, meta, SCALE, window=window, softcap=softcap), want, query.dtype)


@pytest.mark.parametrize(("splits", "dtype"), [(1, torch.float32), (4, torch.float32), (4, torch.bfloat16)])
def test_decode(splits, dtype):
    """Contexts shorter and longer than the window, split into ranges of the window only."""
    seq_lens = [1, 15, 30, 31, 100, 200]
    query, cache, meta = random_paged_batch(seq_lens, [1] * 6, 2, 2, 32, dtype=dtype, seed=3, device=DEVICE)
    query = query * 4
    for window, softcap in ((30, 0.0), (0, 4.0), (17, 4.0)):
        want = dense_attention(query, cache, meta, SCALE, window, softcap)
        backend = TritonAttentionBackend(decode_num_splits=splits, decode_block_n=16)
        _assert_close(backend.forward(query, cache, meta, SCALE, window=window, softcap=softcap), want, dtype)
        _assert_close(TorchAttentionBackend().forward(query, cache, meta, SCALE, window=window, softcap=softcap),
                      want, dtype)  # fmt: skip


def test_no_variant_is_the_plain_kernel():
    """Window 0 and no cap launch the kernels without the switches: the plain variant, bit for bit."""
    assert tk._variant_args(0, 0.0) == {}
    seq_lens = [40, 70]
    query, cache, meta = random_paged_batch(seq_lens, seq_lens, 2, 2, 32, seed=5, device=DEVICE)
    backend = TritonAttentionBackend()
    assert torch.equal(
        backend.forward(query, cache, meta, SCALE), backend.forward(query, cache, meta, SCALE, window=0, softcap=0.0)
    )
    _assert_close(backend.forward(query, cache, meta, SCALE), dense_attention(query, cache, meta, SCALE), query.dtype)


@pytest.mark.parametrize(("q_lens", "splits"), [([100, 40, 150], 1), ([1, 1, 1], 4)])
def test_fp8_cache_with_window_and_softcap(q_lens, splits):
    """An fp8 cache (scales per head) under a windowed, soft-capped layer: what the dense attention gives over
    the dequantized cache, prefill and decode alike."""
    from sluice.kv.attention import fp8

    seq_lens = [100, 40, 150]
    query, cache, meta = random_paged_batch(seq_lens, q_lens, 2, 2, 32, seed=9, device=DEVICE)
    kv_scale = torch.tensor([[0.03, 0.05], [0.02, 0.04]], device=DEVICE)
    shape = cache.shape[1:]
    q8 = [fp8.quantize(cache[i].reshape(-1, 2, 32), kv_scale[i]).reshape(shape) for i in range(2)]
    cache8 = torch.stack(q8)
    deq = torch.stack([fp8.dequantize(c.reshape(-1, 2, 32), kv_scale[i], torch.float32) for i, c in enumerate(q8)])
    want = dense_attention(query * 4, deq.reshape(cache.shape), meta, SCALE, 33, 5.0)
    backends = (TorchAttentionBackend(), TritonAttentionBackend(decode_num_splits=splits))
    for backend in backends:
        out = backend.forward(query * 4, cache8, meta, SCALE, kv_scale=kv_scale, window=33, softcap=5.0)
        _assert_close(out, want, torch.float32)
