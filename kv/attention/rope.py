"""RoPE's arithmetic in Triton, shared by the RoPE/KV-write kernel (`core/models/fused.py`) and the decode attention
kernel that rotates a decode step's queries and keys itself (`kv/attention/triton_kernels.py`): one rounding rule,
so the two paths agree to the bit."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def rotate_neox(x, partner, cos, signed_sin):
    """Neox RoPE of ``x`` given each element's partner in the other half (``rotate_half``'s sign folded into
    ``signed_sin``), as torch computes it in ``x``'s dtype: the tables rounded to it, each product rounded to it,
    the sum then rounded again. ``cos`` and ``signed_sin`` as loaded from the tables (any float dtype)."""
    c = cos.to(x.dtype).to(tl.float32)
    s = signed_sin.to(x.dtype).to(tl.float32)
    a = (x.to(tl.float32) * c).to(x.dtype).to(tl.float32)
    b = (partner.to(tl.float32) * s).to(x.dtype).to(tl.float32)
    return (a + b).to(x.dtype)
