"""Weight-only quantized matmuls ``y = x @ W^T (+ bias)``: Triton kernels for the GPU, a torch reference.

Formats (``W`` is ``[N, K]``, output features by input features):

* int8: ``qweight`` int8 ``[N, K]``, ``scales`` float32 ``[N]``; ``W[n, k] = q[n, k] * scales[n]``.
* int4: ``qweight`` uint8 ``[N, K // 2]``, ``scales`` and ``mins`` float16 ``[N, K // G]`` (group ``G`` along
  K); ``W[n, k] = q[n, k] * scales[n, g] + mins[n, g]`` with ``q`` in 0..15. Inside group ``g`` byte ``i``
  holds ``k = g*G + i`` in its low nibble and ``k = g*G + G/2 + i`` in its high nibble: the byte order of
  GGUF's Q4_1 blocks (G = 32), so those load as they are, and the order that lets a kernel multiply the
  low and the high nibbles of a tile by two contiguous slices of ``x``.

Kernels:

* ``_int4_gemv_kernel`` / ``_int8_gemv_kernel`` (one row of ``x``, the decode step at batch 1): a program
  owns ``BLOCK_N`` output features and one of ``SPLIT_K`` ranges of K; it streams its weight tile,
  dequantizes in registers and accumulates ``w * x`` elementwise in fp32 (no tensor cores: at one row
  the work is reading the weights). Nibbles become floats with the exponent trick
  (``bits(q | 0x4B000000) - 2^23`` is ``q``), which is a bitwise op and a subtraction instead of a
  conversion instruction (those run at a quarter of the rate). With ``SPLIT_K > 1`` each program writes
  its partial sums to a workspace and bumps a per-tile counter; the program that arrives last adds the
  partials, writes the output and resets the counter, so one launch does the whole product (no memset,
  no second kernel: it stays one node of a CUDA graph).
* ``_int4_gemv_tc_kernel`` (one row, int4): the same product on the tensor cores. Those kernels spend ~5
  ALU instructions per weight (unpack, float conversion, two multiply-adds) and top out well below the
  memory bandwidth; this one leaves only the unpack on the ALUs: raw nibbles (exact in fp16/bf16) times a
  block-diagonal tile of ``x`` give each group's ``sum q*x``, and scale and min apply once per row and group.
* ``_int4_gemm_kernel`` / ``_int8_gemm_kernel`` (several rows: decode batches, prefill): tiles of
  ``BLOCK_M x BLOCK_N``; each K step dequantizes a weight tile to the activation dtype and multiplies it
  on the tensor cores (``tl.dot``).

The GEMV tile shape that reads fastest depends on the matrix shape and the GPU; `GemvTuner` times a few
candidates once per shape (outside CUDA-graph capture) and remembers the winner.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl
from sluice.kv.attention.pdl import pdl_launch

logger = logging.getLogger("sluice")

# --------------------------------------------------------------------------------------------- kernels


@triton.jit
def _int4_nibbles(b):
    """The low and the high nibble of each byte of ``b`` (int32) as floats 0..15, by the exponent trick of the
    module doc: ``bits(q | 0x4B000000)`` is the float ``2^23 + q``."""
    lo = ((b & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
    hi = ((b >> 4) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
    return lo, hi


@triton.jit
def _gemv_tile(N, units, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr, STEP: tl.constexpr):
    """A GEMV program's share of the work: its ``BLOCK_N`` output rows (masked past ``N``; int64 for
    addressing) and its range ``[lo, hi)`` of ``units`` (groups, or K) when K is split ``SPLIT_K`` ways in whole
    steps of ``STEP``."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    per_split = tl.cdiv(tl.cdiv(units, SPLIT_K), STEP) * STEP
    lo = pid_k * per_split
    return pid_n, pid_k, rows, rows < N, rows.to(tl.int64), lo, tl.minimum(lo + per_split, units)


@triton.jit
def _gemv_epilogue(
    part, rows, rmask, pid_n, pid_k, N, b_ptr, out_ptr, ws_ptr, cnt_ptr, SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr
):
    """Write ``part [BLOCK_N]`` (one K range's sums) or, split, combine the ranges (see the module doc)."""
    if SPLIT_K == 1:
        if HAS_BIAS:
            part += tl.load(b_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
        tl.store(out_ptr + rows, part.to(out_ptr.dtype.element_ty), mask=rmask)
    else:
        tl.store(ws_ptr + pid_k * N + rows, part, mask=rmask)
        tl.debug_barrier()  # every thread's partials are written before the counter moves
        count = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel")
        if count == SPLIT_K - 1:
            offs_s = tl.arange(0, SPLIT_K)
            parts = tl.load(
                ws_ptr + offs_s[:, None] * N + rows[None, :], mask=rmask[None, :], other=0.0, cache_modifier=".cg"
            )
            total = tl.sum(parts, axis=0)
            if HAS_BIAS:
                total += tl.load(b_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
            tl.store(out_ptr + rows, total.to(out_ptr.dtype.element_ty), mask=rmask)
            tl.atomic_xchg(cnt_ptr + pid_n, 0)  # ready for the next launch (or graph replay)


@triton.jit
def _int4_gemv_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    z_ptr,
    b_ptr,
    out_ptr,
    ws_ptr,
    cnt_ptr,
    N,
    K,
    stride_wn,
    stride_sn,
    G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_G: tl.constexpr,
    SPLIT_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    HALF: tl.constexpr = G // 2
    pid_n, pid_k, rows, rmask, rows64, g_lo, g_hi = _gemv_tile(N, K // G, BLOCK_N, SPLIT_K, BLOCK_G)
    offs_g = tl.arange(0, BLOCK_G)
    offs_i = tl.arange(0, HALF)
    acc = tl.zeros([BLOCK_N, BLOCK_G, HALF], dtype=tl.float32)
    for g0 in range(g_lo, g_hi, BLOCK_G):
        g = g0 + offs_g
        gmask = g < g_hi
        m2 = rmask[:, None] & gmask[None, :]
        b = tl.load(
            w_ptr + rows64[:, None, None] * stride_wn + g[None, :, None] * HALF + offs_i[None, None, :],
            mask=m2[:, :, None],
            other=0,
        ).to(tl.int32)
        s = tl.load(s_ptr + rows64[:, None] * stride_sn + g[None, :], mask=m2, other=0.0).to(tl.float32)[:, :, None]
        z = tl.load(z_ptr + rows64[:, None] * stride_sn + g[None, :], mask=m2, other=0.0).to(tl.float32)[:, :, None]
        xk = g[:, None] * G + offs_i[None, :]
        x_lo = tl.load(x_ptr + xk, mask=gmask[:, None], other=0.0).to(tl.float32)[None, :, :]
        x_hi = tl.load(x_ptr + xk + HALF, mask=gmask[:, None], other=0.0).to(tl.float32)[None, :, :]
        lo, hi = _int4_nibbles(b)
        acc += (lo * s + z) * x_lo + (hi * s + z) * x_hi
    part = tl.sum(tl.sum(acc, axis=2), axis=1)
    _gemv_epilogue(part, rows, rmask, pid_n, pid_k, N, b_ptr, out_ptr, ws_ptr, cnt_ptr, SPLIT_K, HAS_BIAS)


@triton.jit
def _int4_gemv2d_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    z_ptr,
    b_ptr,
    out_ptr,
    ws_ptr,
    cnt_ptr,
    N,
    K,
    stride_wn,
    stride_sn,
    G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UNROLL: tl.constexpr,
    SPLIT_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    """`_int4_gemv_kernel` on 2-D tiles: one group (``[BLOCK_N, G/2]`` bytes, one scale and min per row) per
    inner step, ``UNROLL`` independent groups per loop iteration."""
    HALF: tl.constexpr = G // 2
    pid_n, pid_k, rows, rmask, rows64, g_lo, g_hi = _gemv_tile(N, K // G, BLOCK_N, SPLIT_K, UNROLL)
    offs_i = tl.arange(0, HALF)
    acc = tl.zeros([BLOCK_N, HALF], dtype=tl.float32)
    for g0 in range(g_lo, g_hi, UNROLL):
        for u in tl.static_range(UNROLL):
            g = g0 + u
            m = rmask & ((rows * 0 + g) < g_hi)  # vector compares: the interpreter rejects scalar masks here
            xm = (offs_i * 0 + g) < g_hi
            b = tl.load(w_ptr + rows64[:, None] * stride_wn + g * HALF + offs_i[None, :], mask=m[:, None], other=0)
            b = b.to(tl.int32)
            s = tl.load(s_ptr + rows64 * stride_sn + g, mask=m, other=0.0).to(tl.float32)[:, None]
            z = tl.load(z_ptr + rows64 * stride_sn + g, mask=m, other=0.0).to(tl.float32)[:, None]
            x_lo = tl.load(x_ptr + g * G + offs_i, mask=xm, other=0.0).to(tl.float32)[None, :]
            x_hi = tl.load(x_ptr + g * G + HALF + offs_i, mask=xm, other=0.0).to(tl.float32)[None, :]
            lo, hi = _int4_nibbles(b)
            acc += (lo * s + z) * x_lo + (hi * s + z) * x_hi
    part = tl.sum(acc, axis=1)
    _gemv_epilogue(part, rows, rmask, pid_n, pid_k, N, b_ptr, out_ptr, ws_ptr, cnt_ptr, SPLIT_K, HAS_BIAS)


# 16-bit floats ``MAGIC + q`` for a nibble ``q``: its bits OR-ed into the mantissa of MAGIC (1024 in fp16, 128
# in bf16, whose last mantissa bits are zero), the unpack of `_int4_gemv_tc_kernel`
_MAGIC_BITS_FP16 = tl.constexpr(0x6400)
_MAGIC_FP16 = tl.constexpr(1024.0)
_MAGIC_BITS_BF16 = tl.constexpr(0x4300)
_MAGIC_BF16 = tl.constexpr(128.0)


def _nibble_unpack_asm(magic_bits: int) -> str:
    """PTX for `_int4_nibbles16_asm`: four bytes in ``$4``; out ``$0 $1`` the low nibbles of bytes 0-1 and 2-3,
    ``$2 $3`` the high ones, each a pair of 16-bit floats ``MAGIC + q`` (``magic_bits``: MAGIC's bits)."""
    pair = f"0x{magic_bits:04X}{magic_bits:04X}"
    return f"""{{
    .reg .b32 t0, t1;
    prmt.b32 t0, $4, 0, 0x4140;
    prmt.b32 t1, $4, 0, 0x4342;
    lop3.b32 $0, t0, 0x000F000F, {pair}, 0xEA;
    lop3.b32 $1, t1, 0x000F000F, {pair}, 0xEA;
    shr.u32 t0, t0, 4;
    shr.u32 t1, t1, 4;
    lop3.b32 $2, t0, 0x000F000F, {pair}, 0xEA;
    lop3.b32 $3, t1, 0x000F000F, {pair}, 0xEA;
    }}"""


_UNPACK_ASM_BF16 = tl.constexpr(_nibble_unpack_asm(_MAGIC_BITS_BF16.value))
_UNPACK_ASM_FP16 = tl.constexpr(_nibble_unpack_asm(_MAGIC_BITS_FP16.value))


@triton.jit
def _int4_nibbles16_asm(b, DT: tl.constexpr):
    """The nibbles of ``b`` (uint8) as ``DT`` (fp16 or bf16) floats ``MAGIC + q`` (see `_int4_gemv_tc_kernel`),
    four bytes per register: two byte permutes spread bytes 0,1 and 2,3 over 16-bit halves, an AND-OR each
    makes two floats of the low nibbles, a shift and an AND-OR two of the high ones (1 instruction per
    weight; the compiler's own unpack takes ~3: it extracts and repacks every byte)."""
    if DT == tl.bfloat16:
        return tl.inline_asm_elementwise(
            _UNPACK_ASM_BF16, "=r,=r,=r,=r,r", [b], dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4
        )
    else:
        return tl.inline_asm_elementwise(
            _UNPACK_ASM_FP16, "=r,=r,=r,=r,r", [b], dtype=(tl.float16, tl.float16), is_pure=True, pack=4
        )


_PREFETCH_L2_ASM = tl.constexpr(
    """{
    .reg .pred p;
    setp.gt.s32 p, $2, 0;
    @p cp.async.bulk.prefetch.L2.global [$1], $2;
    mov.u32 $0, 0;
    }"""
)


@triton.jit
def _prefetch_l2(addr, nbytes):
    """Ask L2 for ``nbytes`` (a multiple of 16; none if <= 0) from each address of ``addr`` (int64, 16-byte
    aligned): one bulk prefetch per address, which returns at once (sm_90)."""
    return tl.inline_asm_elementwise(_PREFETCH_L2_ASM, "=r,l,r", [addr, nbytes], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _int4_gemv_tc_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    z_ptr,
    b_ptr,
    out_ptr,
    ws_ptr,
    cnt_ptr,
    N,
    K,
    stride_wn,
    stride_sn,
    G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUPS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DOT_F32: tl.constexpr,
    EVEN_K: tl.constexpr,
    ASM: tl.constexpr,
    PDL: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    """The int4 GEMV on the tensor cores: per step ``GROUPS`` groups of raw nibbles (``[BLOCK_N, GROUPS*G/2]``
    bytes) times a block-diagonal ``[GROUPS*G/2, GROUPS]`` tile of ``x`` (column ``j`` holds group ``j``'s
    slice) gives every group's ``sum q*x`` at once; scale and min then apply once per row and group,
    ``s * dot + (z - MAGIC*s) * sum(x)``, on ``[BLOCK_N, GROUPS]`` (1/G of the per-weight work). Nibbles
    enter the mantissa of ``MAGIC`` (1024 in fp16, 128 in bf16; ``ASM``: `_int4_nibbles16_asm`), which the
    ``sum(x)`` term takes back out: the unpack is the only per-weight ALU work. That cancellation costs
    ~7 of fp32's 24 bits of each group's sum, far below the rounding of the fp16/bf16 output; fp32
    activations (``DOT_F32``) keep the exact fp32 path instead.

    ``PDL`` (launched with programmatic dependent launch, `kv/attention/pdl.py`): the next kernel is released
    at once; ``x`` is read, and anything written, only after ``gdc_wait``. Before that wait, ``PREFETCH > 0``
    asks L2 for that many bytes of each of the program's rows (off by default: it measured slower)."""
    HALF: tl.constexpr = G // 2
    BK: tl.constexpr = GROUPS * HALF  # weight bytes per row and step
    pid_n, pid_k, rows, rmask, rows64, g_lo, g_hi = _gemv_tile(N, K // G, BLOCK_N, SPLIT_K, GROUPS)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        if PREFETCH > 0:
            nbytes = tl.minimum((g_hi - g_lo) * HALF, PREFETCH) + rows * 0
            _prefetch_l2((w_ptr + tl.where(rmask, rows64, 0) * stride_wn + g_lo * HALF).to(tl.int64), nbytes)
        tl.extra.cuda.gdc_wait()
    offs_c = tl.arange(0, BK)
    offs_j = tl.arange(0, GROUPS)
    diag = (offs_c // HALF)[:, None] == offs_j[None, :]  # byte c belongs to the step's group c // HALF
    xoff = (offs_c // HALF) * G + offs_c % HALF
    acc = tl.zeros([BLOCK_N, GROUPS], dtype=tl.float32)
    for g0 in range(g_lo, g_hi, GROUPS):
        if EVEN_K:  # every step whole: no per-byte masks (they would split the loads into bytes)
            cmask = offs_c >= 0
            jmask = offs_j >= 0
        else:
            cmask = (g0 * HALF + offs_c) < g_hi * HALF
            jmask = (g0 + offs_j) < g_hi
        b = tl.load(
            w_ptr + rows64[:, None] * stride_wn + g0 * HALF + offs_c[None, :],
            mask=rmask[:, None] & cmask[None, :],
            other=0,
        )
        m2 = rmask[:, None] & jmask[None, :]
        s = tl.load(s_ptr + rows64[:, None] * stride_sn + g0 + offs_j[None, :], mask=m2, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + rows64[:, None] * stride_sn + g0 + offs_j[None, :], mask=m2, other=0.0).to(tl.float32)
        xm = diag & cmask[:, None]
        x_lo = tl.load(x_ptr + g0 * G + xoff[:, None] + offs_j[None, :] * 0, mask=xm, other=0.0)
        x_hi = tl.load(x_ptr + g0 * G + HALF + xoff[:, None] + offs_j[None, :] * 0, mask=xm, other=0.0)
        # [GROUPS]: each group's sum of x (x_lo, x_hi: the block diagonal, zero off it)
        sx = tl.sum(x_lo.to(tl.float32) + x_hi.to(tl.float32), axis=0)
        if DOT_F32:
            lo, hi = _int4_nibbles(b.to(tl.int32))
            d = _dot(lo, x_lo, True) + _dot(hi, x_hi, True)
        else:
            if x_ptr.dtype.element_ty == tl.bfloat16:
                bits: tl.constexpr = _MAGIC_BITS_BF16
                magic: tl.constexpr = _MAGIC_BF16
            else:
                bits: tl.constexpr = _MAGIC_BITS_FP16
                magic: tl.constexpr = _MAGIC_FP16
            if ASM:
                lo, hi = _int4_nibbles16_asm(b, x_ptr.dtype.element_ty)
            else:
                b16 = b.to(tl.int16)
                lo = ((b16 & 0xF) | bits).to(x_ptr.dtype.element_ty, bitcast=True)
                hi = ((b16 >> 4) | bits).to(x_ptr.dtype.element_ty, bitcast=True)
            d = tl.dot(hi, x_hi, tl.dot(lo, x_lo))
            z -= magic * s
        acc += d * s + z * sx[None, :]
    part = tl.sum(acc, axis=1)
    _gemv_epilogue(part, rows, rmask, pid_n, pid_k, N, b_ptr, out_ptr, ws_ptr, cnt_ptr, SPLIT_K, HAS_BIAS)


@triton.jit
def _int8_gemv_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    b_ptr,
    out_ptr,
    ws_ptr,
    cnt_ptr,
    N,
    K,
    stride_wn,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    pid_n, pid_k, rows, rmask, rows64, k_lo, k_hi = _gemv_tile(N, K, BLOCK_N, SPLIT_K, BLOCK_K)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k = k0 + offs_k
        kmask = k < k_hi
        q = tl.load(w_ptr + rows64[:, None] * stride_wn + k[None, :], mask=rmask[:, None] & kmask[None, :], other=0)
        # (q & 0xFF) ^ 0x80 is q + 128 in 0..255; with the exponent bits: 2^23 + 128 + q
        w = ((q.to(tl.int32) & 0xFF) ^ 0x4B000080).to(tl.float32, bitcast=True) - 8388736.0
        x = tl.load(x_ptr + k, mask=kmask, other=0.0).to(tl.float32)
        acc += w * x[None, :]
    part = tl.sum(acc, axis=1) * tl.load(s_ptr + rows, mask=rmask, other=0.0)
    _gemv_epilogue(part, rows, rmask, pid_n, pid_k, N, b_ptr, out_ptr, ws_ptr, cnt_ptr, SPLIT_K, HAS_BIAS)


@triton.jit
def _dot(a, b, DOT_F32: tl.constexpr):
    if DOT_F32:  # the interpreter multiplies bf16 tensors as raw integers
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _int4_gemm_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    z_ptr,
    b_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_om,
    stride_wn,
    stride_sn,
    G: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    HALF: tl.constexpr = G // 2
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mmask = rm < M
    nmask = rn < N
    rm64 = rm.to(tl.int64)
    rn64 = rn.to(tl.int64)
    offs_i = tl.arange(0, HALF)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for g in range(0, K // G):
        b = tl.load(w_ptr + rn64[:, None] * stride_wn + g * HALF + offs_i[None, :], mask=nmask[:, None], other=0)
        b = b.to(tl.int32)
        s = tl.load(s_ptr + rn64 * stride_sn + g, mask=nmask, other=0.0).to(tl.float32)[:, None]
        z = tl.load(z_ptr + rn64 * stride_sn + g, mask=nmask, other=0.0).to(tl.float32)[:, None]
        x_lo = tl.load(x_ptr + rm64[:, None] * stride_xm + g * G + offs_i[None, :], mask=mmask[:, None], other=0.0)
        x_hi = tl.load(
            x_ptr + rm64[:, None] * stride_xm + g * G + HALF + offs_i[None, :], mask=mmask[:, None], other=0.0
        )
        lo, hi = _int4_nibbles(b)
        lo, hi = lo * s + z, hi * s + z
        acc += _dot(x_lo, tl.trans(lo.to(x_lo.dtype)), DOT_F32)
        acc += _dot(x_hi, tl.trans(hi.to(x_hi.dtype)), DOT_F32)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=nmask, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rm64[:, None] * stride_om + rn[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mmask[:, None] & nmask[None, :])


@triton.jit
def _int8_gemm_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    b_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_om,
    stride_wn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mmask = rm < M
    nmask = rn < N
    rm64 = rm.to(tl.int64)
    rn64 = rn.to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        kmask = k < K
        q = tl.load(w_ptr + rn64[:, None] * stride_wn + k[None, :], mask=nmask[:, None] & kmask[None, :], other=0)
        x = tl.load(x_ptr + rm64[:, None] * stride_xm + k[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
        # |q| <= 127 is exact in bf16 (through fp32: the interpreter's int8 -> bf16 cast is broken)
        acc += _dot(x, tl.trans(q.to(tl.float32).to(x.dtype)), DOT_F32)
    acc = acc * tl.load(s_ptr + rn, mask=nmask, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=nmask, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rm64[:, None] * stride_om + rn[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mmask[:, None] & nmask[None, :])


# ------------------------------------------------------------------------------------------- launchers


@dataclass(frozen=True, slots=True)
class GemvConfig:
    block_n: int
    row_bytes: int  # weight bytes per row and K step
    split_k: int
    num_warps: int
    # int4: "3d" = `_int4_gemv_kernel`, "2d" = `_int4_gemv2d_kernel`, "tc" = `_int4_gemv_tc_kernel`, "tcx" = the
    # same with the inline-PTX unpack (GPU only; int8 has one kernel)
    layout: str = "3d"
    num_stages: int = 3
    # "tc"/"tcx" on a GPU with PDL (`kv/attention/pdl.py`): launched to overlap the kernel before, optionally
    # prefetching ``prefetch`` weight bytes per row into L2 meanwhile (slower at 512-4096 on the H200: off)
    pdl: bool = True
    prefetch: int = 0


# Candidates for the tuner; the first is the default where nothing was tuned (the CPU, or during capture).
# On the H200 the 3-D int4 kernel reached 1.1-1.4 TB/s at Llama-3-8B shapes (ALU-bound), hence the 2-D one.
GEMV_CONFIGS = (
    GemvConfig(16, 256, 1, 4),
    GemvConfig(8, 512, 1, 4),
    GemvConfig(16, 512, 1, 8),
    GemvConfig(32, 256, 1, 8),
    GemvConfig(16, 256, 2, 4),
    GemvConfig(8, 512, 2, 4),
    GemvConfig(8, 256, 4, 2),
    GemvConfig(16, 256, 4, 4),
    GemvConfig(32, 128, 1, 4, "2d"),
    GemvConfig(64, 128, 1, 4, "2d"),
    GemvConfig(16, 256, 1, 4, "2d"),
    GemvConfig(32, 256, 1, 8, "2d"),
    GemvConfig(64, 64, 1, 4, "2d"),
    GemvConfig(128, 64, 1, 8, "2d"),
    GemvConfig(128, 128, 1, 4, "2d"),
    GemvConfig(64, 64, 1, 2, "2d"),
    GemvConfig(32, 128, 2, 4, "2d"),
    GemvConfig(16, 256, 2, 4, "2d"),
    GemvConfig(32, 128, 4, 4, "2d"),
    GemvConfig(64, 128, 1, 4, "2d", 4),
    GemvConfig(64, 128, 1, 4, "2d", 1),
    # tensor cores (`_int4_gemv_tc_kernel`): the MMA tile wants BLOCK_N >= 16 per warp; split-K fills the
    # GPU where N / BLOCK_N is short of the SM count (N = 4096: 64 tiles)
    GemvConfig(64, 128, 1, 4, "tcx"),
    GemvConfig(128, 128, 1, 4, "tcx"),
    GemvConfig(64, 256, 1, 4, "tcx"),
    GemvConfig(128, 128, 1, 8, "tcx"),
    GemvConfig(64, 128, 4, 4, "tcx"),
    # split-K 2 for K = 4096 (q/k/v, o: 64-96 tiles); the H200 sweep timed them behind split-K 4 there
    GemvConfig(64, 128, 2, 4, "tcx"),
    GemvConfig(64, 256, 2, 4, "tcx"),
    GemvConfig(128, 128, 2, 8, "tcx"),
    GemvConfig(64, 128, 1, 4, "tc"),
)


@dataclass(slots=True)
class GemvTuner:
    """Per-shape choice of `GemvConfig`, timed on first use on a GPU; shared by a model's linear layers."""

    configs: tuple[GemvConfig, ...] = GEMV_CONFIGS
    choice: dict[tuple, GemvConfig] = field(default_factory=dict)
    timings: dict[tuple, dict[GemvConfig, float]] = field(default_factory=dict)  # ms per candidate, as timed

    def pick(
        self,
        key: tuple,
        run,
        device: torch.device,
        layouts: tuple[str, ...] | None = None,
        preferred: GemvConfig | None = None,
    ) -> GemvConfig:
        """The config for ``key``; ``run(config)`` launches the kernel once and returns its output (it is timed
        on a GPU). A candidate whose output strays from that of the first one that runs is dropped: a fast
        kernel that is wrong on this GPU or shape (inline PTX, say) must never be chosen. ``preferred`` (a
        config chosen offline, `int4_gemv_config`) is taken untimed once its output matches the first
        candidate's; if it does not, the candidates are timed as usual."""
        cfg = self.choice.get(key)
        if cfg is not None:
            return cfg
        candidates = [c for c in self.configs if layouts is None or c.layout in layouts] or list(self.configs)
        if device.type != "cuda" or torch.cuda.is_current_stream_capturing():
            return candidates[0]
        if preferred is not None:
            try:
                if _close(run(preferred).float().clone(), run(candidates[0]).float()):
                    self.choice[key] = preferred
                    return preferred
            except Exception:  # noqa: BLE001 - fall back to timing the candidates
                pass
            logger.warning("GEMV config %s gives wrong results for %s: timing the candidates", preferred, key)
        from triton.testing import do_bench

        reference = None  # the output of the first candidate that runs
        times = {}
        for c in candidates:
            try:
                out = run(c).float()
                if reference is None:
                    reference = out.clone()
                elif not _close(out, reference):
                    logger.warning("GEMV config %s gives wrong results for %s: not a candidate", c, key)
                    continue
                times[c] = do_bench(lambda c=c: run(c), warmup=5, rep=25)
            except Exception:  # a config that does not compile for this shape is not a candidate
                continue
        cfg = min(times, key=times.get) if times else candidates[0]
        self.choice[key], self.timings[key] = cfg, times
        return cfg


def int4_gemv_config(n: int, k: int, num_sms: int) -> GemvConfig:
    """The int4 GEMV config for an ``N x K`` weight on a GPU of ``num_sms`` SMs, from the H200 sweep
    (`scripts/gpu_kernel_sweep.py gemv`, docs/benchmarks.md): tiles of 64 rows by 128-byte steps on the tensor
    cores (``tcx``, 4 warps, 3 stages) were the fastest at every Llama-3-8B shape; what varied was split-K, which
    pays while the grid is short of ~4 programs per SM and each split keeps >= 1024 of K (q/k/v and o: 4, down:
    8, gate/up and the LM head: 1). The engine's own timing (`GemvTuner`, one launch at a time) does not see what
    the sweep measures, back-to-back launches in a CUDA graph over weights not in L2: its picks for the small
    projections ran up to 1.3x slower there."""
    tiles = triton.cdiv(n, 64)
    split = 1
    while split < 8 and tiles * split * 2 <= 4 * num_sms and k // (split * 2) >= 1024:
        split *= 2
    return GemvConfig(64, 128, split, 4, "tcx", 3)


def _close(out: torch.Tensor, reference: torch.Tensor) -> bool:
    # bf16 outputs of differently ordered sums differ by a few units in the last place, never by 2%
    return bool(((out - reference).norm() <= 0.02 * reference.norm() + 1e-6).item())


def _dot_f32(x: torch.Tensor) -> bool:
    # the GEMMs: exact fp32 products on the CPU (see `_dot`) and for fp32 activations on a GPU, whose tensor
    # cores would otherwise round them to tf32 (~1e-3 off; the H200 run of tests/test_quant_weights.py)
    return x.device.type == "cpu" or x.dtype == torch.float32


def _gemv_dot_f32(x: torch.Tensor) -> bool:
    # fp32 activations stay fp32 (the tensor cores would round them); bf16 on the CPU too (see `_dot`)
    return x.dtype == torch.float32 or (x.device.type == "cpu" and x.dtype == torch.bfloat16)


def _rows_16b_aligned(w: torch.Tensor) -> bool:
    # what `_prefetch_l2`'s bulk prefetches need of every row start
    return w.data_ptr() % 16 == 0 and w.stride(0) % 16 == 0


def _gemm_blocks(m: int) -> tuple[int, int]:
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    return block_m, 64


def int4_matmul(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
    counters: torch.Tensor | None = None,
    tuner: GemvTuner | None = None,
) -> torch.Tensor:
    """``x [M, K] @ W^T`` for an int4 ``W`` (module doc); ``counters`` (int32 zeros, one per output tile) are
    needed for split-K GEMV configs."""
    m, k = x.shape
    n = qweight.shape[0]
    assert qweight.shape[1] * 2 == k and k % group_size == 0 and x.stride(1) == 1
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    bias_arg = bias if bias is not None else scales
    if m == 1:
        half = group_size // 2

        def run(c: GemvConfig) -> torch.Tensor:
            split = c.split_k if counters is not None and counters.numel() >= triton.cdiv(n, c.block_n) else 1
            ws = torch.empty((split, n), dtype=torch.float32, device=x.device) if split > 1 else out
            steps = max(1, c.row_bytes // half)
            if c.layout in ("tc", "tcx"):
                kernel = _int4_gemv_tc_kernel
                even_k = (k // group_size) % (steps * split) == 0
                asm = c.layout == "tcx" and x.is_cuda  # inline PTX: the interpreter runs the plain unpack
                launch = pdl_launch(x.device) if c.pdl else {"PDL": False}
                prefetch = c.prefetch if c.prefetch and launch["PDL"] and _rows_16b_aligned(qweight) else 0
                meta = {
                    "GROUPS": steps,
                    "DOT_F32": _gemv_dot_f32(x),
                    "EVEN_K": even_k,
                    "ASM": asm,
                    "PREFETCH": prefetch,
                    **launch,
                }
            elif c.layout == "2d":
                kernel, meta = _int4_gemv2d_kernel, {"UNROLL": steps}
            else:
                kernel, meta = _int4_gemv_kernel, {"BLOCK_G": steps}
            kernel[(triton.cdiv(n, c.block_n), split)](
                x, qweight, scales, mins, bias_arg, out, ws, counters if counters is not None else out,
                n, k, qweight.stride(0), scales.stride(0),
                G=group_size, BLOCK_N=c.block_n, SPLIT_K=split, HAS_BIAS=bias is not None, num_warps=c.num_warps,
                num_stages=c.num_stages, **meta,
            )  # fmt: skip
            return out

        if tuner is None:
            cfg = GEMV_CONFIGS[0]
        else:
            key, preferred = ("int4", n, k, group_size), None
            if x.is_cuda and key not in tuner.choice:  # once per shape: pick() remembers its choice
                preferred = int4_gemv_config(n, k, torch.cuda.get_device_properties(x.device).multi_processor_count)
            cfg = tuner.pick(key, run, x.device, preferred=preferred)
        run(cfg)
        return out
    block_m, block_n = _gemm_blocks(m)
    _int4_gemm_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, block_n))](
        x, qweight, scales, mins, bias_arg, out, m, n, k,
        x.stride(0), out.stride(0), qweight.stride(0), scales.stride(0),
        G=group_size, BLOCK_M=block_m, BLOCK_N=block_n, HAS_BIAS=bias is not None, DOT_F32=_dot_f32(x),
        num_warps=4, num_stages=3,
    )  # fmt: skip
    return out


def int8_matmul(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None = None,
    counters: torch.Tensor | None = None,
    tuner: GemvTuner | None = None,
) -> torch.Tensor:
    """``x [M, K] @ W^T`` for an int8 ``W`` with per-output-channel ``scales``."""
    m, k = x.shape
    n = qweight.shape[0]
    assert qweight.shape[1] == k and x.stride(1) == 1
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    bias_arg = bias if bias is not None else scales
    if m == 1:

        def run(c: GemvConfig) -> torch.Tensor:
            split = c.split_k if counters is not None and counters.numel() >= triton.cdiv(n, c.block_n) else 1
            ws = torch.empty((split, n), dtype=torch.float32, device=x.device) if split > 1 else out
            _int8_gemv_kernel[(triton.cdiv(n, c.block_n), split)](
                x, qweight, scales, bias_arg, out, ws, counters if counters is not None else out,
                n, k, qweight.stride(0),
                BLOCK_N=c.block_n, BLOCK_K=c.row_bytes, SPLIT_K=split, HAS_BIAS=bias is not None,
                num_warps=c.num_warps, num_stages=c.num_stages,
            )  # fmt: skip
            return out

        cfg = tuner.pick(("int8", n, k), run, x.device, ("3d",)) if tuner is not None else GEMV_CONFIGS[0]
        run(cfg)
        return out
    block_m, block_n = _gemm_blocks(m)
    _int8_gemm_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, block_n))](
        x, qweight, scales, bias_arg, out, m, n, k, x.stride(0), out.stride(0), qweight.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=64, HAS_BIAS=bias is not None, DOT_F32=_dot_f32(x),
        num_warps=4, num_stages=3,
    )  # fmt: skip
    return out
