"""The fp8 W8A8 linear layer on a GPU (`core/models/fp8_linear.py` has the format and the numerics).

`fp8_linear` chooses by the row count of ``x``, known on the host (no sync):

* up to `gemv_rows` rows (decode steps at small batch): `_fp8_gemv_kernel`. At these sizes the layer is a read of
  its weight, and the fp8 weight is half the bf16 one's bytes. Each program first takes the per-row amax of ``x``
  over the whole of K (``x`` is a few KiB, read from L2 by every program: cheaper than a kernel launch of its own
  and the round trip of a quantized copy), then streams its ``[BLOCK_N, BLOCK_K]`` weight tiles against
  ``[BLOCK_K, BLOCK_M]`` tiles of ``x`` quantized in registers (rows zero-padded to 16, 32 or 64), and scales the
  fp32 sums by both scales in the epilogue. K may be split ``SPLIT_K`` ways when the output tiles are short of the
  SMs; the last program of a tile adds the partials (an arrival counter per tile, reset by that program: one
  launch, one node of a CUDA graph), as in `core/models/gemv.py`. The product runs on the tensor cores with both
  operands converted to fp16 (``DOT=1``: every e4m3 value is exact in fp16, the products exact in fp32) or as an
  fp8 dot (``DOT=2``, row tiles of 16: no conversion of the weight tile, which was the loop's cost at one row);
  ``DOT=0`` is the fp32 path of the CPU interpreter. Hopper's fp8 MMA adds its products into the accumulator with
  fewer mantissa bits than fp32 (~0.2% of a K = 4,096 output's norm on an H100), so ``PROMOTE_K`` has Triton add them
  into an fp32 accumulator every 128 products (DeepSeek-V3's recipe; Triton's ``max_num_imprecise_acc``).
  Launched with programmatic dependent launch (`kv/attention/pdl.py`) like the bf16 GEMV.
* more rows: `_quant_rows_kernel` (one program per row: amax, then the e4m3 codes and the row's scale), then
  ``torch._scaled_mm`` with row-wise scales (fp8 tensor cores, bf16 out). Shapes ``_scaled_mm`` refuses (K or N
  not a multiple of 16, a non-bf16 ``x``) take the GEMV kernel over tiles of 64 rows instead.

Rounding: Triton's fp32 -> e4m3 cast on the GPU rounds to nearest even and saturates (as torch's); the CPU
interpreter's cast is wrong across binade edges (126.04 -> 64, not 128), so under the interpreter
(``EXACT_ROUND``) values are rounded explicitly first (`_round_e4m3`, the fp8 KV cache's), after which the cast
is exact.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from sluice.core.models.fp8_format import F32_MAX, MIN_AMAX
from sluice.kv.attention.pdl import pdl_launch
from sluice.kv.attention.triton_kernels import _round_e4m3

# Rows up to which `fp8_linear` takes the GEMV kernel (`set_gemv_rows` moves it). At 32 rows `_scaled_mm` after the
# row quantizer was faster on every Llama-3-8B projection on an H100, the GEMV at 8 rows on three of four
# (docs/benchmarks.md, 2026-12-07).
GEMV_ROWS = 16
# The largest row tile of x the GEMV kernel takes; more rows are more tiles.
MAX_BLOCK_M = 64
# Row tiles up to which the GEMV multiplies fp8 operands (``DOT=2``); larger tiles convert to fp16 (``DOT=1``).
DOT_FP8_MAX_BLOCK_M = 16
# Products of an fp8 MMA between promotions of its sums to fp32 (module doc).
PROMOTE_K = 128
# Elements of x per step of a GEMV program's amax prologue (`_rows_amax`) at few rows: 32 a thread at 4 warps
# (at 16 rows and more the step is the loop's own x tile, which was faster at 32 rows on the H100).
AMAX_ELEMENTS = 4096
_MIN_AMAX = tl.constexpr(MIN_AMAX)
_F32_MAX = tl.constexpr(F32_MAX)
_gemv_rows = GEMV_ROWS
# The fewest K elements of one split-K range (`set_split_min_k` moves it). At one row on an H100 the o projection
# of Llama-3-8B (N = K = 4096) took 7.8 us split in 4 against 11.0 us in 2, its ranges then 1024 long, the other
# projections' splits the same under either bound (`scripts/gpu_fp8_check.py kernels --sweep`, docs/benchmarks.md).
SPLIT_MIN_K = 1024
_split_min_k = SPLIT_MIN_K


def set_gemv_rows(rows: int | None) -> None:
    """Rows up to which `fp8_linear` takes the GEMV (None: `GEMV_ROWS`; ``SLUICE_FP8_GEMV_ROWS``)."""
    global _gemv_rows
    _gemv_rows = GEMV_ROWS if rows is None else rows


def gemv_rows() -> int:
    return _gemv_rows


def set_split_min_k(k: int | None) -> None:
    """The fewest K elements of a split-K range (None: `SPLIT_MIN_K`; ``SLUICE_FP8_GEMV_SPLIT_MIN_K``)."""
    global _split_min_k
    _split_min_k = SPLIT_MIN_K if k is None else k


@triton.jit
def _to_e4m3(x, EXACT_ROUND: tl.constexpr):
    """fp32 ``x`` (within +-448) to e4m3, rounded to nearest even (the module doc)."""
    if EXACT_ROUND:
        x = _round_e4m3(x)
    return x.to(tl.float8e4nv)


@triton.jit
def _rows_amax(x_ptr, row0, M, K, stride_xm, BLOCK_M: tl.constexpr, AMAX_M: tl.constexpr, AMAX_K: tl.constexpr):
    """``[BLOCK_M]`` max |x| over all of K of rows ``row0 + arange(BLOCK_M)``, clamped as
    `fp8_linear.quantize_rows` clamps it. Read in ``[AMAX_M, AMAX_K]`` tiles, AMAX_M the rows the tile can hold
    (a power of two): at one row each step reads AMAX_K of its elements, not a row tile padded to BLOCK_M, so a
    program's prologue before its first weight tile is a few steps even at K = 14,336."""
    offs_r = tl.arange(0, AMAX_M)
    r = row0 + offs_r
    rmask = r < M
    offs_k = tl.arange(0, AMAX_K)
    peak = tl.zeros([AMAX_M, AMAX_K], dtype=tl.float32)
    for k0 in range(0, K, AMAX_K):
        k = k0 + offs_k
        xt = tl.load(
            x_ptr + r[:, None].to(tl.int64) * stride_xm + k[None, :], mask=rmask[:, None] & (k < K)[None, :], other=0.0
        )
        peak = tl.maximum(peak, tl.abs(xt.to(tl.float32)))
    small = tl.max(peak, axis=1)
    if AMAX_M == BLOCK_M:
        amax = small
    else:  # the AMAX_M values into the first places of a [BLOCK_M] vector (the rows past them are padding)
        offs_m = tl.arange(0, BLOCK_M)
        amax = tl.zeros([BLOCK_M], dtype=tl.float32)
        for i in tl.static_range(AMAX_M):
            amax = tl.where(offs_m == i, tl.max(tl.where(offs_r == i, small, 0.0), axis=0), amax)
    return tl.clamp(amax, _MIN_AMAX, _F32_MAX)


@triton.jit
def _fp8_gemv_kernel(
    x_ptr,
    w_ptr,
    sw_ptr,
    b_ptr,
    out_ptr,
    ws_ptr,
    cnt_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    AMAX_M: tl.constexpr,
    AMAX_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
    DOT: tl.constexpr,
    PROMOTE_K: tl.constexpr,
    EXACT_ROUND: tl.constexpr,
    PDL: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    rows64 = rows.to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mmask = offs_m < M
    m64 = offs_m.to(tl.int64)
    per_split = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    lo = pid_k * per_split
    hi = tl.minimum(lo + per_split, K)
    if PDL:  # the next kernel may launch; x is the previous kernel's output: wait for it
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    amax = _rows_amax(x_ptr, pid_m * BLOCK_M, M, K, stride_xm, BLOCK_M, AMAX_M, AMAX_K)
    inv = 448.0 / amax
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(lo, hi, BLOCK_K):
        k = k0 + offs_k
        if EVEN_K:  # every step whole: no per-element K mask (it would split the vector loads)
            kmask = offs_k >= 0
        else:
            kmask = k < hi
        w = tl.load(w_ptr + rows64[:, None] * stride_wn + k[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
        xt = tl.load(x_ptr + m64[None, :] * stride_xm + k[:, None], mask=kmask[:, None] & mmask[None, :], other=0.0)
        xq = _to_e4m3(tl.clamp(xt.to(tl.float32) * inv[None, :], -448.0, 448.0), EXACT_ROUND)
        if DOT == 0:
            acc = tl.dot(w.to(tl.float32), xq.to(tl.float32), acc, input_precision="ieee")
        elif DOT == 1:
            acc = tl.dot(w.to(tl.float16), xq.to(tl.float16), acc)
        elif PROMOTE_K > 0:  # the tensor cores' sums into fp32 every PROMOTE_K products (module doc)
            acc = tl.dot(w, xq, acc, max_num_imprecise_acc=PROMOTE_K)
        else:
            acc = tl.dot(w, xq, acc)
    sw = tl.load(sw_ptr + rows, mask=rmask, other=0.0)
    acc = acc * sw[:, None] * (amax / 448.0)[None, :]
    omask = rmask[:, None] & mmask[None, :]
    out = out_ptr + m64[None, :] * stride_om + rows[:, None]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(b_ptr + rows, mask=rmask, other=0.0).to(tl.float32)[:, None]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=omask)
    else:  # one row tile (the launcher's rule): the workspace is [SPLIT_K, BLOCK_M, N] fp32
        tile = ws_ptr + offs_m[None, :] * N + rows[:, None]
        tl.store(tile + pid_k * BLOCK_M * N, acc, mask=omask)
        tl.debug_barrier()  # every thread's partials are written before the counter moves
        count = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel")
        if count == SPLIT_K - 1:
            total = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):
                total += tl.load(tile + s * BLOCK_M * N, mask=omask, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                total += tl.load(b_ptr + rows, mask=rmask, other=0.0).to(tl.float32)[:, None]
            tl.store(out, total.to(out_ptr.dtype.element_ty), mask=omask)
            tl.atomic_xchg(cnt_ptr + pid_n, 0)  # ready for the next launch (or graph replay)


@triton.jit
def _quant_rows_kernel(
    x_ptr, q_ptr, s_ptr, K, stride_xm, stride_qm, BLOCK_K: tl.constexpr, EXACT_ROUND: tl.constexpr, PDL: tl.constexpr
):
    """Row ``program_id`` of ``x``: its amax, e4m3 codes and scale (`fp8_linear.quantize_rows`)."""
    m = tl.program_id(0).to(tl.int64)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    offs = tl.arange(0, BLOCK_K)
    peak = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(x_ptr + m * stride_xm + k0 + offs, mask=k0 + offs < K, other=0.0)
        peak = tl.maximum(peak, tl.abs(x.to(tl.float32)))
    amax = tl.clamp(tl.max(peak, axis=0), _MIN_AMAX, _F32_MAX)
    inv = 448.0 / amax
    for k0 in range(0, K, BLOCK_K):
        kmask = k0 + offs < K
        x = tl.load(x_ptr + m * stride_xm + k0 + offs, mask=kmask, other=0.0).to(tl.float32)
        q = _to_e4m3(tl.clamp(x * inv, -448.0, 448.0), EXACT_ROUND)
        tl.store(q_ptr + m * stride_qm + k0 + offs, q, mask=kmask)
    tl.store(s_ptr + m, amax / 448.0)


# ------------------------------------------------------------------------------------------- launchers


@dataclass(frozen=True, slots=True)
class Fp8GemvConfig:
    block_n: int
    block_k: int  # weight bytes per row and K step
    split_k: int
    num_warps: int = 4
    num_stages: int = 4
    dot: int = 1  # 1: fp16 operands, 2: fp8 operands (module doc)
    promote_k: int = PROMOTE_K  # with fp8 operands: products per fp32 promotion (0: the MMA's own accumulation)

    @property
    def promote(self) -> int:
        """The kernel's ``PROMOTE_K``: Triton takes at most the dot's K (``block_k``)."""
        return min(self.promote_k, self.block_k)


@functools.cache
def num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


def gemv_config(n: int, k: int, sms: int, bm: int) -> Fp8GemvConfig:
    """Tiles of 64 output rows by 256 bytes of K; K split (in ranges of at least `SPLIT_MIN_K`) while the grid
    stays within ~2 programs per SM. A 64-row tile of x takes 128-byte steps (shared memory). Row tiles up to
    `DOT_FP8_MAX_BLOCK_M` multiply fp8 operands."""
    return _gemv_config(n, k, sms, bm, _split_min_k)


@functools.cache
def _gemv_config(n: int, k: int, sms: int, bm: int, split_min_k: int) -> Fp8GemvConfig:
    tiles = triton.cdiv(n, 64)
    split = 1
    while split < 8 and tiles * split * 2 <= 2 * sms and k // (split * 2) >= split_min_k:
        split *= 2
    return Fp8GemvConfig(64, 128 if bm >= 64 else 256, split, dot=2 if bm <= DOT_FP8_MAX_BLOCK_M else 1)


def block_m(m: int) -> int:
    return min(MAX_BLOCK_M, max(16, triton.next_power_of_2(m)))


def amax_tile(m: int, bm: int, block_k: int) -> tuple[int, int]:
    """``(AMAX_M, AMAX_K)``: the amax prologue's tile of x for ``m`` rows in row tiles of ``bm``; from 16 rows it
    is the loop's own x tile (``block_k`` wide)."""
    amax_m = min(bm, triton.next_power_of_2(m))
    return amax_m, max(AMAX_ELEMENTS // amax_m, block_k)


def fp8_gemv(
    x: torch.Tensor,
    qweight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    counters: torch.Tensor | None,
    config: Fp8GemvConfig | None = None,
) -> torch.Tensor:
    """``x [M, K]`` (any float dtype, unit stride along K) times the fp8 weight ``[N, K]``, ``x`` quantized per row
    inside the kernel; ``counters``: int32 zeros, one per `MIN_BLOCK_N` output features (split-K), or None."""
    m, k = x.shape
    n = qweight.shape[0]
    assert qweight.shape[1] == k and x.stride(1) == 1 and qweight.stride(1) == 1 and m > 0
    bm = block_m(m)
    c = config or gemv_config(n, k, num_sms(x.device), bm)
    m_tiles = triton.cdiv(m, bm)
    amax_m, amax_k = amax_tile(m, bm, c.block_k)
    split = c.split_k
    if m_tiles > 1 or counters is None or counters.numel() < triton.cdiv(n, c.block_n):
        split = 1
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    ws = torch.empty((split, bm, n), dtype=torch.float32, device=x.device) if split > 1 else out
    interp = x.device.type == "cpu"
    _fp8_gemv_kernel[(triton.cdiv(n, c.block_n), split, m_tiles)](
        x, qweight, weight_scale, bias if bias is not None else weight_scale, out, ws,
        counters if counters is not None else weight_scale, m, n, k, x.stride(0), qweight.stride(0), out.stride(0),
        BLOCK_N=c.block_n, BLOCK_K=c.block_k, BLOCK_M=bm, AMAX_M=amax_m, AMAX_K=amax_k,
        SPLIT_K=split, HAS_BIAS=bias is not None,
        EVEN_K=k % (c.block_k * split) == 0, DOT=0 if interp else c.dot, PROMOTE_K=c.promote,
        EXACT_ROUND=interp,
        num_warps=c.num_warps, num_stages=c.num_stages, **pdl_launch(x.device),
    )  # fmt: skip
    return out


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` -> (e4m3 ``[M, K]``, float32 scales ``[M]``) in one launch (`fp8_linear.quantize_rows`)."""
    m, k = x.shape
    assert x.stride(1) == 1
    q = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty((m,), dtype=torch.float32, device=x.device)
    if m:
        block = min(4096, triton.next_power_of_2(k))
        _quant_rows_kernel[(m,)](
            x, q, s, k, x.stride(0), q.stride(0), BLOCK_K=block, EXACT_ROUND=x.device.type == "cpu",
            num_warps=4 if block <= 2048 else 8, **pdl_launch(x.device),
        )  # fmt: skip
    return q, s


def scaled_mm_fits(x: torch.Tensor, n: int) -> bool:
    """``torch._scaled_mm``'s row-wise fp8 GEMM: bf16 out, K and N multiples of 16, a GPU."""
    return x.is_cuda and x.dtype == torch.bfloat16 and x.shape[1] % 16 == 0 and n % 16 == 0


def fp8_scaled_mm(
    x: torch.Tensor, qweight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """``x [M, K]`` bf16: quantized per row (`quantize_rows`), then ``torch._scaled_mm`` with row-wise scales."""
    xq, sx = quantize_rows(x)
    n = qweight.shape[0]
    y = torch._scaled_mm(  # noqa: SLF001 - torch's fp8 GEMM has no public name yet
        xq, qweight.t(), scale_a=sx.view(-1, 1), scale_b=weight_scale.view(1, n), out_dtype=torch.bfloat16
    )
    if bias is not None:
        y += bias
    return y


def fp8_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    counters: torch.Tensor | None,
) -> torch.Tensor:
    """``x [..., K] @ W^T (+ bias)`` for the fp8 ``W``: the GEMV for few rows, ``_scaled_mm`` for more (module doc)."""
    shape = x.shape
    n = qweight.shape[0]
    x2 = x.reshape(-1, shape[-1])
    if x2.shape[0] == 0:
        return x.new_empty((*shape[:-1], n))
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if x2.shape[0] <= _gemv_rows or not scaled_mm_fits(x2, n):
        y = fp8_gemv(x2, qweight, weight_scale, bias, counters)
    else:
        y = fp8_scaled_mm(x2, qweight, weight_scale, bias)
    return y.reshape(*shape[:-1], n)
