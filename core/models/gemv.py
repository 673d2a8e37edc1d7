"""``y = x @ W^T (+ bias)`` for a few rows of ``x`` (decode steps at small and medium batch) over a 16-bit ``W``.

At one to a few rows a linear layer is a read of its weight: a batch-1 decode step of an 8B model reads
~15 GiB, and the step takes as long as that read. cuBLAS's kernels for these shapes reach ~4.1 TB/s on the
largest projections of Llama-3-8B but ~3.1 TB/s on the small ones (q/k/v, o), whose launch and ramp-up are
a larger share of their time (docs/benchmarks.md).

`_gemv_kernel` streams the weight in ``[BLOCK_N, BLOCK_K]`` tiles through the tensor cores against a
``[BLOCK_K, BLOCK_M]`` tile of ``x`` (its rows, zero-padded to 16, 32 or 64), so every weight byte is read once
for all rows, with the software pipelining Triton gives ``tl.dot`` loops. K may be split ``SPLIT_K`` ways to
fill the GPU when ``N / BLOCK_N`` is short of the SM count; the program that finishes a tile's last split
adds the partials (an arrival counter per tile, reset by that program: one launch, no memset, one node of
a CUDA graph). It is launched with programmatic dependent launch (`kv/attention/pdl.py`): its programs
become resident while the kernel before them (a fused norm, SiLU-and-mul, attention) finishes, and read
``x`` once that kernel's writes are visible.

The kernels beside a projection at these sizes (the RMSNorm before it, the SiLU-and-mul after the gate/up one) are
latency-bound launches of their own on the step's critical path; `gemv_rmsnorm` folds the norm into the GEMV's
loads of x, `gemv_silu` the SiLU-and-mul into the gate/up GEMV's epilogue (`configure`'s ``folds``; off: on the H200
the folded steps were slower, up to twice as slow in CUDA graphs, for reasons not yet found: docs/benchmarks.md).

Accumulation is fp32 like cuBLAS's; the sums run in another order, so outputs agree with ``F.linear`` to
the rounding of the output dtype, not bit for bit.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from sluice.kv.attention.pdl import pdl_launch

# Rows of x one launch serves; more rows go to cuBLAS, which was faster at 96 and 128 rows on the H200
# (docs/benchmarks.md). `configure`'s ``rows`` lowers it (to 32 or 16, the earlier limits, for timing).
MAX_ROWS = 64
# The kernel itself takes up to 128 rows (a 128-row tile of x), for timing past `MAX_ROWS`.
KERNEL_MAX_ROWS = 128
# Rows are padded to the MMA's smallest N (16), else to a power of two.
MIN_BLOCK_M = 16
# The smallest BLOCK_N of any config: sizes the split-K counters.
MIN_BLOCK_N = 32
# Smaller weights keep cuBLAS: the sweep measured Llama-3-8B's projections (32 MiB and up), and a weight of a
# few megabytes is a grid of a few programs here.
MIN_WEIGHT_BYTES = 8 * 2**20


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    out_ptr,
    ws_ptr,
    cnt_ptr,
    res_ptr,
    nw_ptr,
    res_out_ptr,
    eps,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    stride_rm,
    stride_rom,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    SPLIT_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
    DOT_F32: tl.constexpr,
    PDL: tl.constexpr,
    NORM: tl.constexpr,
    HAS_RES: tl.constexpr,
    GATED: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    rows64 = rows.to(tl.int64)
    per_split = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    lo = pid_k * per_split
    hi = tl.minimum(lo + per_split, K)
    if PDL:  # the next kernel may launch; x is the previous kernel's output: wait for it
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    offs_k = tl.arange(0, BLOCK_K)
    offs_m = tl.arange(0, BLOCK_M)
    mmask = offs_m < M
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    if GATED:  # the weight is [gate; up], N rows each: this program's gate rows and the same rows of up
        acc_up = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        up_rows64 = rows64 + N
    if NORM:  # squares summed per element in the loop, across K once at the end (no reduction per step)
        squares = tl.zeros([BLOCK_K, BLOCK_M], dtype=tl.float32)
    for k0 in range(lo, hi, BLOCK_K):
        k = k0 + offs_k
        if EVEN_K:  # every step whole: no per-element K mask (it would split the vector loads)
            kmask = offs_k >= 0
        else:
            kmask = k < hi
        wmask = rmask[:, None] & kmask[None, :]
        w = tl.load(w_ptr + rows64[:, None] * stride_wn + k[None, :], mask=wmask, other=0.0)
        if GATED:
            w_up = tl.load(w_ptr + up_rows64[:, None] * stride_wn + k[None, :], mask=wmask, other=0.0)
        xmask = kmask[:, None] & mmask[None, :]
        xt = tl.load(x_ptr + offs_m[None, :] * stride_xm + k[:, None], mask=xmask, other=0.0)
        if NORM:  # x (+ residual) through the RMSNorm's weight now; its 1 / rms, a factor per row, at the end
            if HAS_RES:
                r = tl.load(res_ptr + offs_m[None, :] * stride_rm + k[:, None], mask=xmask, other=0.0)
                xt = (xt.to(tl.float32) + r.to(tl.float32)).to(xt.dtype)  # the residual stream keeps its dtype
                if pid_n == 0:  # one column of programs writes the new residual stream
                    tl.store(res_out_ptr + offs_m[None, :] * stride_rom + k[:, None], xt, mask=xmask)
            h = xt.to(tl.float32)
            squares += h * h
            nw = tl.load(nw_ptr + k, mask=kmask, other=0.0).to(tl.float32)
            xt = (h * nw[:, None]).to(xt.dtype)
        if DOT_F32:  # fp32 activations stay fp32; the CPU interpreter's bf16 dot is wrong (see triton_kernels)
            acc = tl.dot(w.to(tl.float32), xt.to(tl.float32), acc, input_precision="ieee")
            if GATED:
                acc_up = tl.dot(w_up.to(tl.float32), xt.to(tl.float32), acc_up, input_precision="ieee")
        else:
            acc = tl.dot(w, xt, acc)
            if GATED:
                acc_up = tl.dot(w_up, xt, acc_up)
    if NORM:  # the norm's scale, one per row of x (whole rows: SPLIT_K is 1)
        scale = tl.rsqrt(tl.sum(squares, axis=0) / K + eps)[None, :]
        acc = acc * scale
        if GATED:
            acc_up = acc_up * scale
    omask = rmask[:, None] & mmask[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(b_ptr + rows, mask=rmask, other=0.0).to(tl.float32)[:, None]
            if GATED:
                acc_up += tl.load(b_ptr + up_rows64, mask=rmask, other=0.0).to(tl.float32)[:, None]
        if GATED:  # silu(gate) * up from the two rounded outputs, as `fused.silu_and_mul` computes it from them
            g = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
            act = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty)
            acc = act.to(tl.float32) * acc_up.to(out_ptr.dtype.element_ty).to(tl.float32)
        tl.store(out_ptr + offs_m[None, :] * stride_om + rows[:, None], acc.to(out_ptr.dtype.element_ty), mask=omask)
    else:
        tile = ws_ptr + offs_m[None, :] * N + rows[:, None]  # workspace [SPLIT_K, BLOCK_M, N] fp32
        tl.store(tile + pid_k * BLOCK_M * N, acc, mask=omask)
        tl.debug_barrier()  # every thread's partials are written before the counter moves
        count = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel")
        if count == SPLIT_K - 1:
            total = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):
                total += tl.load(tile + s * BLOCK_M * N, mask=omask, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                total += tl.load(b_ptr + rows, mask=rmask, other=0.0).to(tl.float32)[:, None]
            out = out_ptr + offs_m[None, :] * stride_om + rows[:, None]
            tl.store(out, total.to(out_ptr.dtype.element_ty), mask=omask)
            tl.atomic_xchg(cnt_ptr + pid_n, 0)  # ready for the next launch (or graph replay)


@dataclass(frozen=True, slots=True)
class GemvConfig:
    block_n: int
    block_k: int
    split_k: int
    num_warps: int = 4
    num_stages: int = 4


def block_m(m: int) -> int:
    """The row tile for ``m`` rows of ``x``: 16 or 32."""
    return max(MIN_BLOCK_M, triton.next_power_of_2(m))


# Rows up to which a decoder layer folds its RMSNorm into the next projection's GEMV (`gemv_rmsnorm`), and the MLP
# its SiLU-and-mul into the gate/up projection's (`gemv_silu`): every program then also reads the rows' residual
# and the norm's weight, which outweighs the folded kernel's own launch at larger batches.
FOLD_NORM_ROWS = 16


# `configure`'s switches; the functions below answer them cached, as they are asked at every decoder layer and
# few-row linear call
_fold_norm_rows = 0
_fold_silu_rows = 0
_max_rows = MAX_ROWS


def configure(rows: int | None = None, folds: frozenset[str] | set[str] = frozenset()) -> None:
    """This process's GEMV switches (the engine sets them from ``SLUICE_GEMV_ROWS`` and ``SLUICE_GEMV_FOLD``,
    `core/envs.py`): ``rows``, up to which `linear` takes the GEMV (at most `MAX_ROWS`; None: `MAX_ROWS`), and
    the kernels folded into a GEMV (``norm``: into the one after it, ``silu``: into the gate/up one before it;
    none by default: on the H200 slower than their own kernels, `scripts/gpu_engine_bench.sh fold`)."""
    global _fold_norm_rows, _fold_silu_rows, _max_rows
    _fold_norm_rows = FOLD_NORM_ROWS if "norm" in folds else 0
    _fold_silu_rows = FOLD_NORM_ROWS if "silu" in folds else 0
    _max_rows = MAX_ROWS if rows is None else min(MAX_ROWS, rows)
    for f in (fold_norm_rows, fold_silu_rows, max_rows):
        f.cache_clear()


@functools.cache
def fold_norm_rows() -> int:
    """Rows up to which `gemv_rmsnorm` serves: none unless `configure` folds ``norm``."""
    return _fold_norm_rows


@functools.cache
def fold_silu_rows() -> int:
    """Rows up to which `gemv_silu` serves: none unless `configure` folds ``silu``."""
    return _fold_silu_rows


@functools.cache
def max_rows() -> int:
    """Rows up to which `linear` takes the GEMV (`MAX_ROWS`, or fewer by `configure`)."""
    return _max_rows


def gemv_config(n: int, k: int, num_sms: int, m: int = 1) -> GemvConfig:
    """The config for an ``N x K`` weight and ``m`` rows of x, from the H200 sweeps at Llama-3-8B shapes
    (`scripts/gpu_kernel_sweep.py dense`, docs/benchmarks.md): tiles of 64 rows, 4 stages. Where 64-row tiles are
    short of ~2 per SM (q/k/v, o, down), steps of 256 columns, and K split in ranges of at least 4096 (down: 2);
    split-K 4 and 8 with 128-column steps were up to 1.2x slower there. Wide weights (gate/up, the LM head) take
    128-column steps. A 64-row tile of x (33-64 rows) takes 128-column steps everywhere (four 256-column stages of
    both tiles would not fit in shared memory), wide weights 128-row tiles with 8 warps, and K is split in two
    where the tiles would fill at most half the SMs (o: 15.0 against 15.8 us unsplit)."""
    tiles = triton.cdiv(n, 64)
    wide = tiles >= 2 * num_sms
    if block_m(m) >= 64:
        if wide:
            return GemvConfig(128, 128, 1, num_warps=8)
        return GemvConfig(64, 128, max(_split_k(k), 2 if 2 * tiles <= num_sms else 1))
    return GemvConfig(64, 128, 1) if wide else GemvConfig(64, 256, _split_k(k))


def _split_k(k: int) -> int:
    """K split in ranges of at least 4096, at most 8 ways."""
    split = 1
    while split < 8 and k // (split * 2) >= 4096:
        split *= 2
    return split


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    counters: torch.Tensor,
    config: GemvConfig | None = None,
) -> torch.Tensor:
    """``x [M, K] @ weight[N, K]^T (+ bias)`` for ``M <= KERNEL_MAX_ROWS``; ``counters``: int32 zeros, at least one per
    ``MIN_BLOCK_N`` output features (the split-K arrival counters)."""
    assert weight.shape[1] == x.shape[1]
    return _run(x, weight, bias, counters, config)


def gemv_silu(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    counters: torch.Tensor,
    config: GemvConfig | None = None,
) -> torch.Tensor:
    """``silu(gate) * up`` for ``[gate | up] = x @ weight^T (+ bias)``, ``weight`` ``[gate; up]`` (``[2I, K]``), few
    rows, in one launch: each program computes a tile of gate rows and the same tile of up rows, and applies
    SiLU-and-mul to the two (rounded to the output's dtype first) in its epilogue, so the result is
    `fused.silu_and_mul` of `gemv`'s output to the bit (with the same tiles), without that kernel's launch or
    the ``[M, 2I]`` round trip. Returns ``[M, I]``."""
    assert weight.shape[1] == x.shape[1] and weight.shape[0] % 2 == 0
    return _run(x, weight, bias, counters, config, gated=True)


def gemv_rmsnorm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    counters: torch.Tensor,
    config: GemvConfig | None = None,
    silu: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rmsnorm(x + residual) @ weight^T (+ bias), x + residual)`` in one launch, for few rows (without
    ``residual``: ``(rmsnorm(x) @ weight^T, x)``): the norm's weight scales x's tiles as they are loaded, the
    rows' sums of squares accumulate beside the product, and each row's 1/rms multiplies its results at the end
    (a factor per row of x commutes with the product). Each program reads whole rows (no K split); the
    programs of the first column of tiles write the new residual stream. This saves a decode step the norm's
    own launch and its wait before each of two projections per layer. x is rounded once between the norm's
    factors instead of twice: results agree with `fused.add_rmsnorm` then `gemv` to the output's rounding. With
    ``silu``, the projection is a gate/up one and the first result SiLU-and-mul of it (`gemv_silu`)."""
    assert weight.shape[1] == x.shape[1]
    assert residual is None or (residual.shape == x.shape and residual.stride(1) == 1)
    res_out = torch.empty_like(x) if residual is not None else x
    norm = (residual, norm_weight, eps, res_out)
    return _run(x, weight, bias, counters, config, norm=norm, gated=silu), res_out


def _run(x, weight, bias, counters, config: GemvConfig | None, norm=None, gated: bool = False) -> torch.Tensor:
    """`_gemv_kernel` over ``x`` ``[M, K]`` and ``weight`` ``[N, K]``: the config for the shape (or ``config``), K
    split unless there are too few counters, a norm is folded in (``norm``: ``(residual or None, norm weight,
    eps, residual out)``, `gemv_rmsnorm`) or the output is gated (``gated``: ``weight`` is ``[gate; up]``, the
    output SiLU-and-mul of the two halves, `gemv_silu`). Returns ``[M, N]`` (``[M, N / 2]`` gated)."""
    m = x.shape[0]
    n, k = weight.shape
    assert m <= KERNEL_MAX_ROWS and x.stride(1) == 1 and weight.stride(1) == 1
    num_sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 132
    c = config or gemv_config(n, k, num_sms, m)
    if gated:  # each program reads a tile of gate rows and one of up rows: half the tile each, as many programs
        n //= 2
        if config is None:
            c = replace(c, block_n=max(MIN_BLOCK_N, c.block_n // 2))
    split = c.split_k
    if norm is not None or gated or (split > 1 and counters.numel() < triton.cdiv(n, c.block_n)):
        split = 1
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    ws = torch.empty((split, block_m(m), n), dtype=torch.float32, device=x.device) if split > 1 else out
    even_k = k % (c.block_k * split) == 0
    dot_f32 = x.dtype == torch.float32 or x.device.type == "cpu"
    res, nw, eps, res_out = norm if norm is not None else (None, weight, 0.0, out)
    has_res = res is not None
    res = res if has_res else x
    _gemv_kernel[(triton.cdiv(n, c.block_n), split)](
        x, weight, bias if bias is not None else weight, out, ws, counters, res, nw, res_out, eps,
        m, n, k, x.stride(0), weight.stride(0), out.stride(0), res.stride(0), res_out.stride(0),
        BLOCK_N=c.block_n, BLOCK_K=c.block_k, BLOCK_M=block_m(m), SPLIT_K=split, HAS_BIAS=bias is not None,
        EVEN_K=even_k, DOT_F32=dot_f32, NORM=norm is not None, HAS_RES=has_res, GATED=gated, num_warps=c.num_warps,
        num_stages=c.num_stages, **pdl_launch(x.device),
    )  # fmt: skip
    return out


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, counters: torch.Tensor) -> torch.Tensor:
    """``F.linear``, through `gemv` when ``x`` has at most `max_rows` rows."""
    x2 = x.reshape(-1, x.shape[-1])
    if x2.shape[0] == 0 or x2.shape[0] > max_rows():
        return F.linear(x, weight, bias)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    return gemv(x2, weight, bias, counters).reshape(*x.shape[:-1], weight.shape[0])
