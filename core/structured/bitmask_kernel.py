"""The Triton kernel behind `bitmask.apply_token_bitmask_` (its own module: importing it imports triton)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def apply_bitmask_kernel(logits_ptr, bitmask_ptr, rows_ptr, vocab, logits_stride, bitmask_stride, BLOCK: tl.constexpr):
    """Program (i, j): mask row ``rows[i]`` of the logits over vocabulary entries ``j * BLOCK ..``: each entry's
    bit is read from its int32 word; a clear bit writes -inf."""
    i = tl.program_id(0)
    j = tl.program_id(1)
    row = tl.load(rows_ptr + i).to(tl.int64)
    offs = j * BLOCK + tl.arange(0, BLOCK)
    in_vocab = offs < vocab
    words = tl.load(bitmask_ptr + i * bitmask_stride + offs // 32, mask=in_vocab, other=-1)
    allowed = ((words >> (offs % 32)) & 1) != 0
    dst = logits_ptr + row * logits_stride + offs
    tl.store(dst, tl.full((BLOCK,), float("-inf"), tl.float32).to(dst.dtype.element_ty), mask=in_vocab & ~allowed)
