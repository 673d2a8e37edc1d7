"""Fused Triton kernels for the per-token elementwise work of a decoder layer (GPU path).

Unfused, one layer's RMSNorm-with-residual is ~9 kernels, the neox RoPE of q and k ~14 and SiLU-and-mul
3; at decode batch sizes each kernel moves a few kilobytes, so a step is made of launch latencies (even
inside a CUDA graph each node costs ~2 us): ~40 kernels x 32 layers is ~2.5 ms against a weight-read
floor of 3.8 ms per step for an 8B model. Fused, they are 1 + 1 + 1 kernels per use.

Each kernel follows the rounding steps of the torch code in `core/models/layers.py` (the reference):
the residual sum is rounded to the activation dtype before it is normed, the normed value is rounded
before the weight multiply, SiLU is rounded before the product, and RoPE rounds ``q*cos`` and
``rotate_half(q)*sin`` before adding them. The fp32 arithmetic between those steps may be ordered or
contracted differently by the compiler, so outputs agree with the reference within one step of the
activation dtype (tests/test_fused_kernels.py), not bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from sluice.kv.attention.pdl import pdl_launch, wait_then_release
from sluice.kv.attention.rope import rotate_neox


@triton.jit
def _add_rmsnorm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    hidden,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_then_release(PDL)  # kv/attention/pdl.py
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # the residual stream keeps the input dtype
        tl.store(res_out_ptr + row * stride_ro + offs, x, mask=mask)
    h = x.to(tl.float32)
    var = tl.sum(h * h, axis=0) / hidden
    h = (h * tl.rsqrt(var + eps)).to(x.dtype)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    out = w.to(tl.float32) * h.to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(norm(x + residual) * weight, x + residual)``; without ``residual``: ``(norm(x) * weight, None)``."""
    hidden = x.shape[-1]
    x2 = x.reshape(-1, hidden)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows = x2.shape[0]
    out = torch.empty((rows, hidden), dtype=torch.result_type(weight, x2), device=x.device)
    res_out = None
    if residual is not None:
        r2 = residual.reshape(-1, hidden)
        if r2.stride(-1) != 1:
            r2 = r2.contiguous()
        res_out = torch.empty_like(x2)
    else:
        r2 = x2
    if rows:
        block = triton.next_power_of_2(hidden)
        _add_rmsnorm_kernel[(rows,)](
            x2, r2, weight, out, res_out if res_out is not None else out,
            x2.stride(0), r2.stride(0), out.stride(0), res_out.stride(0) if res_out is not None else 0,
            hidden, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=_warps(block),
            **pdl_launch(x.device),
        )  # fmt: skip
    out = out.view(x.shape)
    return out, (res_out.view(x.shape) if res_out is not None else None)


@triton.jit
def _head_rmsnorm_kernel(
    x_ptr, wq_ptr, wk_ptr, stride_t, num_q_heads, head_dim, eps, BLOCK: tl.constexpr, PDL: tl.constexpr
):
    """Head ``program_id(1)`` of token ``program_id(0)``, normed in place: the q heads by ``wq``, then the k heads
    by ``wk`` (`rmsnorm_qk_`); the arithmetic of `_add_rmsnorm_kernel` without a residual."""
    wait_then_release(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    mask = offs < head_dim
    ptrs = x_ptr + t * stride_t + h * head_dim + offs
    x = tl.load(ptrs, mask=mask, other=0.0)
    hf = x.to(tl.float32)
    var = tl.sum(hf * hf, axis=0) / head_dim
    hn = (hf * tl.rsqrt(var + eps)).to(x.dtype)
    wq = tl.load(wq_ptr + offs, mask=mask, other=0.0)
    wk = tl.load(wk_ptr + offs, mask=mask, other=0.0)
    w = tl.where(h < num_q_heads, wq, wk)
    tl.store(ptrs, (w.to(tl.float32) * hn.to(tl.float32)).to(x.dtype), mask=mask)


def rmsnorm_qk_(
    qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float, num_q_heads: int, num_kv_heads: int
) -> None:
    """Per-head RMSNorms of q and k (Qwen3's) in place over the qkv projection's output ``[T, (Hq + 2 Hk) * D]``,
    whose q and k heads lie side by side in each row: one launch, where two `add_rmsnorm` calls over the strided
    q and k views also copied each to contiguous rows first (four kernels a layer). The same result as those,
    to the bit (a weight of the qkv dtype: the caller's check)."""
    head_dim = q_weight.shape[0]
    t = qkv.shape[0]
    assert qkv.stride(-1) == 1 and q_weight.dtype == k_weight.dtype == qkv.dtype
    if t:
        block = triton.next_power_of_2(head_dim)
        _head_rmsnorm_kernel[(t, num_q_heads + num_kv_heads)](
            qkv, q_weight, k_weight, qkv.stride(0), num_q_heads, head_dim, eps,
            BLOCK=block, num_warps=_warps(block), **pdl_launch(qkv.device),
        )  # fmt: skip


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, d, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_then_release(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < d
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + d + offs, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    out = act.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up = [gate | up]`` along the last dimension."""
    d = gate_up.shape[-1] // 2
    x2 = gate_up.reshape(-1, 2 * d)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows = x2.shape[0]
    out = torch.empty((rows, d), dtype=gate_up.dtype, device=gate_up.device)
    if rows:
        block = min(1024, triton.next_power_of_2(d))
        _silu_and_mul_kernel[(rows, triton.cdiv(d, block))](
            x2, out, x2.stride(0), out.stride(0), d, BLOCK=block, num_warps=4, **pdl_launch(x2.device)
        )
    return out.view(*gate_up.shape[:-1], d)


@triton.jit
def _rope_kernel(
    pos_ptr,
    q_ptr,
    k_ptr,
    cos_ptr,
    sin_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cos,
    num_q_heads,
    num_k_heads,
    HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    PDL: tl.constexpr,
    v_ptr=None,
    cache_ptr=None,
    slot_ptr=None,
    stride_vt=0,
    stride_vh=0,
    stride_c_kv=0,
    stride_c_blk=0,
    stride_c_tok=0,
    stride_c_head=0,
    block_size=1,
    WRITE_KV: tl.constexpr = False,
):
    wait_then_release(PDL)
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    offs = tl.arange(0, HALF)
    # the table is [cos(f) | cos(f)] (neox); the first half is enough
    cos = tl.load(cos_ptr + pos * stride_cos + offs)
    sin = tl.load(sin_ptr + pos * stride_cos + offs)

    hq = tl.arange(0, BLOCK_HQ)
    qm = (hq < num_q_heads)[:, None]
    qp = q_ptr + t * stride_qt + hq[:, None] * stride_qh + offs[None, :]
    q1 = tl.load(qp, mask=qm, other=0.0)
    q2 = tl.load(qp + HALF, mask=qm, other=0.0)
    c = cos.to(q1.dtype).to(tl.float32)[None, :]
    s = sin.to(q1.dtype).to(tl.float32)[None, :]
    # out = x*cos + rotate_half(x)*sin, rotate_half(x) = [-x2 | x1]
    tl.store(qp, rotate_neox(q1, q2, c, -s), mask=qm)
    tl.store(qp + HALF, rotate_neox(q2, q1, c, s), mask=qm)

    hk = tl.arange(0, BLOCK_HK)
    km = (hk < num_k_heads)[:, None]
    kp = k_ptr + t * stride_kt + hk[:, None] * stride_kh + offs[None, :]
    k1 = tl.load(kp, mask=km, other=0.0)
    k2 = tl.load(kp + HALF, mask=km, other=0.0)
    o1 = rotate_neox(k1, k2, c, -s)
    o2 = rotate_neox(k2, k1, c, s)
    if WRITE_KV:  # the rotated key and the value go to the token's cache slot (-1: none); k itself is not kept
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if slot >= 0:
            dst = cache_ptr + (slot // block_size) * stride_c_blk + (slot % block_size) * stride_c_tok
            dst = dst + hk[:, None] * stride_c_head + offs[None, :]
            tl.store(dst, o1, mask=km)
            tl.store(dst + HALF, o2, mask=km)
            vp = v_ptr + t * stride_vt + hk[:, None] * stride_vh + offs[None, :]
            tl.store(dst + stride_c_kv, tl.load(vp, mask=km, other=0.0), mask=km)
            tl.store(dst + stride_c_kv + HALF, tl.load(vp + HALF, mask=km, other=0.0), mask=km)
    else:
        tl.store(kp, o1, mask=km)
        tl.store(kp + HALF, o2, mask=km)


def rope_(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate ``q [T, Hq, D]`` and ``k [T, Hk, D]`` in place (neox layout) with the ``[max_pos, D]`` tables."""
    _launch_rope(positions, q, k, cos, sin)


def rope_and_write_kv_(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """`rope_` on ``q`` (in place) and ``k``, and the rotated ``k`` with ``v`` stored at ``slot_mapping`` in a 16-bit
    ``kv_cache`` (the layout of `kv/attention/base.py`; -1 = no slot), in one kernel instead of the rotation and
    the backend's ``write_kv``; ``k`` is left as it was."""
    assert v.stride(-1) == 1 and kv_cache.dtype == k.dtype and kv_cache.stride(-1) == 1
    _launch_rope(
        positions, q, k, cos, sin,
        v_ptr=v, cache_ptr=kv_cache, slot_ptr=slot_mapping, stride_vt=v.stride(0), stride_vh=v.stride(1),
        stride_c_kv=kv_cache.stride(0), stride_c_blk=kv_cache.stride(1), stride_c_tok=kv_cache.stride(2),
        stride_c_head=kv_cache.stride(3), block_size=kv_cache.shape[2], WRITE_KV=True,
    )  # fmt: skip


def _launch_rope(positions, q, k, cos, sin, **write_kv) -> None:
    """`_rope_kernel` over ``q``'s tokens; ``write_kv``: the KV-write arguments of `rope_and_write_kv_`."""
    t, hq, d = q.shape
    hk = k.shape[1]
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and cos.stride(-1) == 1 and d % 2 == 0
    assert triton.next_power_of_2(d // 2) == d // 2, "head_dim/2 must be a power of two"
    if t:
        _rope_kernel[(t,)](
            positions, q, k, cos, sin,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0),
            hq, hk,
            HALF=d // 2, BLOCK_HQ=triton.next_power_of_2(hq), BLOCK_HK=triton.next_power_of_2(hk), num_warps=4,
            **write_kv, **pdl_launch(q.device),
        )  # fmt: skip


def _warps(block: int) -> int:
    return 4 if block <= 1024 else (8 if block <= 4096 else 16)
