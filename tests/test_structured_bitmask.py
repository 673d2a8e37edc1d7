"""The packed-bitmask apply (`core/structured/bitmask.py`): the Triton kernel (under the interpreter without a
GPU) and the torch path agree with a bit-by-bit reference, only the named rows change, and every dtype works."""

from __future__ import annotations

import pytest
import torch
from sluice.core.structured.bitmask import (
    apply_token_bitmask_,
    apply_token_bitmask_torch_,
    unpack_bits_numpy,
    unpack_bits_torch,
)

triton = pytest.importorskip("triton")
from sluice.core.structured import bitmask_kernel  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")


def _reference(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    out = logits.clone()
    words = bitmask.cpu().tolist()
    for i, r in enumerate(rows.tolist()):
        for t in range(logits.shape[1]):
            if not (words[i][t // 32] >> (t % 32)) & 1:
                out[r, t] = float("-inf")
    return out


def _case(vocab: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(6, vocab, generator=g).to(dtype)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, (vocab + 31) // 32), generator=g, dtype=torch.int64)
    bitmask = bitmask.to(torch.int32)
    bitmask[1] = 0
    bitmask[1, 0] = 1 << 5  # one token allowed
    return logits, bitmask, torch.tensor([4, 0, 2])


@pytest.mark.parametrize("vocab", [1000, 1024, 1057])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_path_matches_the_reference(vocab, dtype):
    logits, bitmask, rows = _case(vocab, dtype, vocab)
    got = logits.clone()
    apply_token_bitmask_torch_(got, bitmask, rows)
    assert torch.equal(got, _reference(logits, bitmask, rows))
    assert torch.equal(got[[1, 3, 5]], logits[[1, 3, 5]])  # rows without a mask are untouched
    assert torch.isfinite(got[0]).sum() == 1 and torch.isfinite(got[0, 5])


@pytest.mark.parametrize("vocab", [1000, 1057])
def test_the_hosts_unpacking_equals_the_devices(vocab):
    _, bitmask, _ = _case(vocab, torch.float32, vocab)  # words with bit 31 set, a vocabulary past the last word
    got = unpack_bits_numpy(bitmask, vocab)
    assert got.dtype == torch.bool and got.shape == (3, vocab)
    assert torch.equal(got, unpack_bits_torch(bitmask, vocab))


@pytest.mark.skipif(
    not ON_GPU and not isinstance(bitmask_kernel.apply_bitmask_kernel, InterpretedFunction),
    reason="triton was imported without TRITON_INTERPRET=1 and there is no GPU",
)
@pytest.mark.parametrize("vocab", [1000, 2048 + 33])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_triton_kernel_matches_the_torch_path(vocab, dtype):
    from sluice.core.structured.bitmask import apply_token_bitmask_triton_

    logits, bitmask, rows = _case(vocab, dtype, vocab + 1)
    logits, bitmask, rows = logits.to(DEVICE), bitmask.to(DEVICE), rows.to(DEVICE)
    want = logits.clone()
    apply_token_bitmask_torch_(want, bitmask, rows)
    got = logits.clone()
    apply_token_bitmask_triton_(got, bitmask, rows)
    assert torch.equal(got, want)
    if ON_GPU:  # the dispatcher picks the kernel there
        again = logits.clone()
        apply_token_bitmask_(again, bitmask, rows)
        assert torch.equal(again, want)


def test_no_rows_is_a_no_op():
    logits = torch.randn(2, 64)
    got = logits.clone()
    apply_token_bitmask_(got, torch.zeros(0, 2, dtype=torch.int32), torch.zeros(0, dtype=torch.long))
    assert torch.equal(got, logits)


@pytest.mark.skipif(not ON_GPU, reason="pinned host memory read by a GPU kernel")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_reads_a_mask_in_pinned_host_memory(dtype):
    logits, bitmask, rows = _case(2048 + 33, dtype, 7)
    want = logits.clone()
    apply_token_bitmask_torch_(want, bitmask, rows)
    got = logits.to(DEVICE)
    apply_token_bitmask_(got, bitmask.pin_memory(), rows.pin_memory())  # the engine's buffers: no copy
    assert torch.equal(got.cpu(), want)
