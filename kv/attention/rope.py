"""RoPE's arithmetic in Triton, shared by the RoPE/KV-write kernel (`core/models/fused.py`) and the decode attention
kernel that rotates a decode step's queries and keys itself (`kv/attention/triton_kernels.py`): one rounding rule,
so the two paths agree to the bit."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def rotate_neox(x, partner, cos, signed_sin):
    """Neox RoPE of ``x`` given each element's partner in the other half (``rotate_half``'s sign folded into
    ``signed_sin``), each product rounded to ``x``'s dtype as torch does, the sum then rounded again. The caller
    passes the tables already rounded to ``x``'s dtype (in fp32), once for every call that shares them: rounding
    them here, per call, cost the decode kernel's RoPE variant 33 more registers under the H200's Triton (3.6.0)."""
    a = (x.to(tl.float32) * cos).to(x.dtype).to(tl.float32)
    b = (partner.to(tl.float32) * signed_sin).to(x.dtype).to(tl.float32)
    return (a + b).to(x.dtype)
