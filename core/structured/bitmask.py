"""Apply a packed next-token bitmask to logits, in place: ``logits[rows[i], t] = -inf`` wherever bit ``t % 32`` of
``bitmask[i, t // 32]`` is clear. Only the constrained rows are named (``rows``): the others are not touched.

One Triton kernel on the GPU (a program per row and block of the vocabulary: one read of the row's words, one
masked store), vectorised torch on the CPU (the bits unpacked by numpy, one byte each). On the GPU the mask and
its row indices may sit in pinned host memory, which the device addresses directly (unified addressing): the kernel
reads them over the bus as it runs, so the host launches one kernel, not two copies and a kernel, and waits for
nothing (a launch behind a queued forward costs the host far more than one on an idle stream).
"""

from __future__ import annotations

import numpy as np
import torch

_BLOCK = 1024  # vocabulary entries per program: 32 words


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """``logits`` [R, V] (any float dtype), ``bitmask`` [C, ceil(V / 32)] int32 and ``rows`` [C] int64 (which
    row of ``logits`` each mask row constrains), on the logits' device or, for CUDA logits, in pinned host memory."""
    if rows.numel() == 0:
        return
    if logits.is_cuda:
        _apply_triton(logits, bitmask, rows)
    else:
        apply_token_bitmask_torch_(logits, bitmask, rows)


def apply_token_bitmask_torch_(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """The vectorised torch path (the CPU's, and the kernel's reference)."""
    allowed = _allowed(bitmask, logits.shape[-1])
    logits.index_copy_(0, rows, torch.where(allowed, logits.index_select(0, rows), float("-inf")))


def _allowed(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """``[C, vocab]`` bool: the mask's bits one per entry. On the CPU numpy's ``unpackbits`` writes them in one pass
    (a byte each; the words' bytes in memory order, little-endian as every machine torch runs on); elsewhere a
    shift against ``arange(32)``, an int32 per entry first."""
    return unpack_bits_numpy(bitmask, vocab) if bitmask.device.type == "cpu" else unpack_bits_torch(bitmask, vocab)


def unpack_bits_numpy(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, count=vocab, bitorder="little")
    return torch.from_numpy(bits.view(np.bool_))


def unpack_bits_torch(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    return ((bitmask[:, :, None] >> shifts) & 1).flatten(1)[:, :vocab].bool()


def _apply_triton(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    from sluice.core.structured.bitmask_kernel import apply_bitmask_kernel

    vocab = logits.shape[-1]
    grid = (rows.numel(), triton_cdiv(vocab, _BLOCK))
    apply_bitmask_kernel[grid](
        logits, bitmask, rows, vocab, logits.stride(0), bitmask.stride(0), BLOCK=_BLOCK, num_warps=4
    )


def apply_token_bitmask_triton_(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """The Triton kernel on any device Triton runs on (the GPU; the CPU under ``TRITON_INTERPRET=1``, for tests)."""
    if rows.numel():
        _apply_triton(logits, bitmask, rows)


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)
