"""A mixture-of-experts layer for a few tokens (batch-1 decode): routing and experts as three GEMV launches.

At one token the grouped GEMM of `core/models/fused_moe.py` is a weight read like any decode projection, but its
layer is five kernels: the router's cuBLAS GEMM, the routing-and-sorting program, two grouped GEMMs and the sum of
each token's ``top_k`` rows, the three small ones each a launch and a wait in the step's chain. Here:

* `_router_top_k_kernel`: the router's logits, a GEMV over blocks of experts, then `softmax_top_k` in the program
  that finishes last (an arrival counter, reset by that program, as the split-K of `core/models/gemv.py`). The
  logits are rounded to the activation dtype first, as the router's linear layer returns them.
* `_gate_up_kernel`: one program per (tile of the intermediate dim, token-expert pair): that expert's gate and up
  rows against the token, SiLU-and-mul in the epilogue. No sort: a pair finds its expert by its id.
* `_down_sum_kernel`: one program per (tile of the hidden dim, token, split of its experts): the down rows of each
  of the token's experts against the pair's activation, each product scaled by its routing weight and summed in
  fp32, so the ``[pairs, H]`` rows and their sum kernel are gone. With ``SPLIT > 1`` the experts are shared among
  programs and the last to arrive adds the partials.

Every product runs on the tensor cores against the token's row zero-padded to 16 columns (`core/models/gemv.py`'s
form of a few-row GEMV). Each pair reads its expert's weights itself, so tokens that share an expert read it twice:
`fits` keeps this path to at most ``max(top_k, E / 4)`` pairs, the grouped GEMM beyond. Nothing is read back to the
host and the sizes depend on the shapes alone: CUDA-graph safe. Launched with programmatic dependent launch
(`kv/attention/pdl.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from sluice.core.models.fp8_kernels import num_sms
from sluice.core.models.fused_moe import softmax_top_k
from sluice.kv.attention.pdl import pdl_launch

# The padded row tile of x (the MMA's smallest N), and the narrowest output tile (sizes the counters)
BLOCK_M = 16
MIN_BLOCK_N = 16
_BLOCK_M = tl.constexpr(BLOCK_M)  # the kernels' copy: a kernel reads only constexpr globals


def fits(num_tokens: int, top_k: int, num_experts: int, intermediate: int) -> bool:
    """Whether `decode_moe` serves ``num_tokens``: few pairs for the experts (module doc), and an intermediate dim
    that a K step of at least 16 divides (a step of the down kernel stays within one expert)."""
    return num_tokens <= max_tokens(top_k, num_experts) and down_block_k(intermediate) > 0


# The fewest experts for which the few-token path is the default (`preferred`)
PREFERRED_MIN_EXPERTS = 64


def preferred(num_experts: int) -> bool:
    """Whether a layer of ``num_experts`` takes the few-token path unless told (``SLUICE_MOE_DECODE``): many small
    experts, where the grouped GEMMs' routing and sorting launches weigh most. Measured on an H100 in the engine
    at Qwen3-30B-A3B (128 experts) ahead of the grouped GEMMs at batch 1, and per layer in a CUDA graph at
    Mixtral-8x7B (8 experts) behind them (`docs/benchmarks.md`)."""
    return num_experts >= PREFERRED_MIN_EXPERTS


def max_tokens(top_k: int, num_experts: int) -> int:
    """The most tokens `fits` takes for these experts (at most a row tile: the router's last program routes all)."""
    return min(BLOCK_M, max(top_k, num_experts // 4) // top_k)


def counters_needed(top_k: int, num_experts: int, hidden: int) -> int:
    """Arrival counters `decode_moe` uses at most: one for the router, one per output tile and token for the down
    kernel's split."""
    return 1 + triton.cdiv(hidden, MIN_BLOCK_N) * max_tokens(top_k, num_experts)


def down_block_k(intermediate: int) -> int:
    """The largest power of two from 16 to 256 that divides ``intermediate`` (0: none)."""
    for bk in (256, 128, 64, 32, 16):
        if intermediate % bk == 0:
            return bk
    return 0


@triton.jit
def _dot(w, x, acc, DOT_F32: tl.constexpr):
    if DOT_F32:  # fp32 stays fp32 (fp32 models, and the CPU interpreter, whose 16-bit dot is wrong)
        return tl.dot(w.to(tl.float32), x.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(w, x, acc)


@triton.jit
def _router_top_k_kernel(
    x_ptr,
    w_ptr,
    logits_ptr,
    weights_ptr,
    ids_ptr,
    cnt_ptr,
    T,
    E,
    H,
    stride_xm,
    stride_we,
    TOP_K: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ALL_E: tl.constexpr,
    K_P2: tl.constexpr,
    DOT_F32: tl.constexpr,
    PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    if PDL:  # x is the previous kernel's output: wait for it
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    experts = pid * BLOCK_E + tl.arange(0, BLOCK_E)
    emask = experts < E
    tokens = tl.arange(0, _BLOCK_M)
    tmask = tokens < T
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_E, _BLOCK_M], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        k = k0 + offs_k
        kmask = k < H
        w = tl.load(w_ptr + experts[:, None] * stride_we + k[None, :], mask=emask[:, None] & kmask[None, :], other=0.0)
        xt = tl.load(x_ptr + tokens[None, :] * stride_xm + k[:, None], mask=kmask[:, None] & tmask[None, :], other=0.0)
        acc = _dot(w, xt, acc, DOT_F32)
    logits = acc.to(x_ptr.dtype.element_ty).to(tl.float32)  # what the router's linear layer returns
    tl.store(logits_ptr + tokens[None, :] * E + experts[:, None], logits, mask=emask[:, None] & tmask[None, :])
    tl.debug_barrier()  # every thread's logits are written before the counter moves
    if tl.atomic_add(cnt_ptr, 1, sem="acq_rel") == tl.num_programs(0) - 1:  # the last program routes
        cols = tl.arange(0, ALL_E)
        ok = tmask[:, None] & (cols[None, :] < E)
        lg = tl.load(logits_ptr + tokens[:, None] * E + cols[None, :], mask=ok, other=0.0, cache_modifier=".cg")
        top_w, top_id = softmax_top_k(lg, ok, _BLOCK_M, ALL_E, TOP_K, RENORMALIZE, K_P2)
        kcols = tl.arange(0, K_P2)
        pair_ok = tmask[:, None] & (kcols[None, :] < TOP_K)
        pair = tokens[:, None] * TOP_K + kcols[None, :]
        tl.store(weights_ptr + pair, top_w, mask=pair_ok)
        tl.store(ids_ptr + pair, top_id, mask=pair_ok)
        tl.atomic_xchg(cnt_ptr, 0)  # ready for the next launch (or graph replay)


@triton.jit
def _gate_up_kernel(
    x_ptr,
    w_ptr,
    ids_ptr,
    act_ptr,
    INTER,
    H,
    stride_xm,
    stride_we,
    stride_wn,
    stride_am,
    TOP_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_F32: tl.constexpr,
    PDL: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pair = tl.program_id(1)
    if PDL:  # the expert ids are the router kernel's output
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    token = pair // TOP_K
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < INTER
    gate_ptrs = w_ptr + expert * stride_we + rows[:, None].to(tl.int64) * stride_wn
    up_ptrs = gate_ptrs + INTER * stride_wn
    col = tl.arange(0, _BLOCK_M)
    first = col == 0  # the token's row is column 0 of the padded tile
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, _BLOCK_M], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N, _BLOCK_M], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        k = k0 + offs_k
        kmask = k < H
        wmask = rmask[:, None] & kmask[None, :]
        xmask = kmask[:, None] & first[None, :]
        xt = tl.load(x_ptr + token * stride_xm + k[:, None] + col[None, :] * 0, mask=xmask, other=0.0)
        acc = _dot(tl.load(gate_ptrs + k[None, :], mask=wmask, other=0.0), xt, acc, DOT_F32)
        acc_up = _dot(tl.load(up_ptrs + k[None, :], mask=wmask, other=0.0), xt, acc_up, DOT_F32)
    act = tl.sum(tl.where(first[None, :], acc / (1.0 + tl.exp(-acc)) * acc_up, 0.0), axis=1)  # the token's column
    tl.store(act_ptr + pair * stride_am + rows, act.to(act_ptr.dtype.element_ty), mask=rmask)


@triton.jit
def _down_sum_kernel(
    act_ptr,
    w_ptr,
    ids_ptr,
    weights_ptr,
    out_ptr,
    ws_ptr,
    cnt_ptr,
    T,
    H,
    INTER,
    stride_am,
    stride_we,
    stride_wn,
    stride_om,
    TOP_K: tl.constexpr,
    K_P2: tl.constexpr,
    PER_SPLIT: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_F32: tl.constexpr,
    PDL: tl.constexpr,
):
    pid_n = tl.program_id(0)
    token = tl.program_id(1)
    split = tl.program_id(2)
    if PDL:  # the activations are the gate/up kernel's output
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < H
    kcols = tl.arange(0, K_P2)
    # the token's experts and weights in registers: each step's weight address is arithmetic, not a load
    ids = tl.load(ids_ptr + token * TOP_K + kcols, mask=kcols < TOP_K, other=0)
    weights = tl.load(weights_ptr + token * TOP_K + kcols, mask=kcols < TOP_K, other=0.0)
    first_j = split * PER_SPLIT
    steps = tl.minimum(PER_SPLIT, TOP_K - first_j) * INTER  # one loop over this split's experts' K (whole steps)
    col = tl.arange(0, _BLOCK_M)
    first = col == 0
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, _BLOCK_M], dtype=tl.float32)
    for s in range(0, steps, BLOCK_K):
        j = first_j + s // INTER
        k = s % INTER + offs_k
        expert = tl.sum(tl.where(kcols == j, ids, 0)).to(tl.int64)
        w_rows = w_ptr + expert * stride_we + rows[:, None].to(tl.int64) * stride_wn
        w = tl.load(w_rows + k[None, :], mask=rmask[:, None], other=0.0)
        a = tl.load(
            act_ptr + (token * TOP_K + j) * stride_am + k[:, None] + col[None, :] * 0, mask=first[None, :], other=0.0
        )
        part = _dot(w, a, tl.zeros([BLOCK_N, _BLOCK_M], dtype=tl.float32), DOT_F32)
        acc += part * tl.sum(tl.where(kcols == j, weights, 0.0))
    total = tl.sum(tl.where(first[None, :], acc, 0.0), axis=1)  # the token's column
    out = out_ptr + token * stride_om + rows
    if SPLIT == 1:
        tl.store(out, total.to(out_ptr.dtype.element_ty), mask=rmask)
    else:  # workspace [SPLIT, T, H] fp32; counters [T, tiles]
        tl.store(ws_ptr + (split * T + token) * H + rows, total, mask=rmask)
        tl.debug_barrier()
        cnt = cnt_ptr + token * tl.num_programs(0) + pid_n
        if tl.atomic_add(cnt, 1, sem="acq_rel") == SPLIT - 1:
            total = tl.zeros([BLOCK_N], dtype=tl.float32)
            for p in tl.static_range(SPLIT):
                total += tl.load(ws_ptr + (p * T + token) * H + rows, mask=rmask, other=0.0, cache_modifier=".cg")
            tl.store(out, total.to(out_ptr.dtype.element_ty), mask=rmask)
            tl.atomic_xchg(cnt, 0)


@dataclass(frozen=True, slots=True)
class DecodeMoEConfig:
    """The few-token path's tiles; the defaults are the best of a coordinate descent timed in CUDA graphs on an H100
    at Qwen3-30B-A3B's shapes (`scripts/gpu_moe_check.py decode-sweep`)."""

    router_block_e: int = 16
    router_block_k: int = 512
    gate_up_block_n: int = 32
    gate_up_block_k: int = 256
    down_block_n: int = 32
    down_block_k: int | None = None  # a power of two dividing I (None: `down_block_k`)
    split: int | None = None  # the down kernel's split of a token's experts (None: `down_split`)
    num_warps: int = 4
    num_stages: int = 4


def stages_for(num_stages: int, element_size: int) -> int:
    """Pipeline stages for activations of ``element_size`` bytes: `DecodeMoEConfig.num_stages` is for 16-bit ones;
    fp32 tiles are twice the bytes, so half the stages keep the shared memory (the gate/up kernel's 120 KiB at 4
    stages in bf16 was 240 KiB in fp32, over the H100's 227 KiB: found by the GPU greedy check)."""
    return max(1, num_stages * 2 // element_size)


def down_split(tiles: int, tokens: int, top_k: int, sms: int) -> int:
    """A power of two up to ``top_k`` that brings the down kernel's grid to about two programs per SM."""
    split = 1
    while split * 2 <= top_k and tiles * tokens * split * 2 <= 2 * sms:
        split *= 2
    return split


def down_programs(split: int, top_k: int) -> tuple[int, int]:
    """``(SPLIT, PER_SPLIT)`` of the down kernel for a wanted split of ``top_k`` experts: each program takes
    ``PER_SPLIT`` of them, and no program is left without one (3 experts split 4 ways are 3 programs)."""
    per_split = triton.cdiv(top_k, split)
    return triton.cdiv(top_k, per_split), per_split


def decode_moe(
    x: torch.Tensor,
    router: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    top_k: int,
    renormalize: bool,
    counters: torch.Tensor,
    config: DecodeMoEConfig | None = None,
) -> torch.Tensor:
    """The layer's output ``[T, H]`` for ``x [T, H]`` (few tokens: `fits`): router ``[E, H]``, experts ``w13 [E, 2I,
    H]`` and ``w2 [E, H, I]``; ``counters``: int32 zeros, `counters_needed` of them."""
    t, h = x.shape
    e, two_i, _ = w13.shape
    i = two_i // 2
    c = config or DecodeMoEConfig()
    assert fits(t, top_k, e, i) and counters.numel() >= counters_needed(top_k, e, h)
    x = x.contiguous()
    dev = x.device
    interp = dev.type == "cpu"
    dot_f32 = x.dtype == torch.float32 or interp
    stages = stages_for(c.num_stages, x.element_size())
    launch = pdl_launch(dev) if interp else dict(num_warps=c.num_warps, num_stages=stages, **pdl_launch(dev))
    logits = torch.empty(t, e, dtype=torch.float32, device=dev)
    weights = torch.empty(t, top_k, dtype=torch.float32, device=dev)
    ids = torch.empty(t, top_k, dtype=torch.int32, device=dev)
    _router_top_k_kernel[(triton.cdiv(e, c.router_block_e),)](
        x, router, logits, weights, ids, counters, t, e, h, x.stride(0), router.stride(0),
        TOP_K=top_k, RENORMALIZE=renormalize, BLOCK_E=c.router_block_e, BLOCK_K=c.router_block_k,
        ALL_E=triton.next_power_of_2(e), K_P2=triton.next_power_of_2(top_k), DOT_F32=dot_f32, **launch,
    )  # fmt: skip
    act = torch.empty(t * top_k, i, dtype=x.dtype, device=dev)
    _gate_up_kernel[(triton.cdiv(i, c.gate_up_block_n), t * top_k)](
        x, w13, ids, act, i, h, x.stride(0), w13.stride(0), w13.stride(1), act.stride(0),
        TOP_K=top_k, BLOCK_N=c.gate_up_block_n, BLOCK_K=c.gate_up_block_k, DOT_F32=dot_f32, **launch,
    )  # fmt: skip
    tiles = triton.cdiv(h, c.down_block_n)
    split, per_split = down_programs(c.split or down_split(tiles, t, top_k, num_sms(dev)), top_k)
    out = torch.empty(t, h, dtype=x.dtype, device=dev)
    ws = torch.empty(split, t, h, dtype=torch.float32, device=dev) if split > 1 else out
    _down_sum_kernel[(tiles, t, split)](
        act, w2, ids, weights, out, ws, counters[1:], t, h, i, act.stride(0), w2.stride(0), w2.stride(1),
        out.stride(0), TOP_K=top_k, K_P2=triton.next_power_of_2(top_k), PER_SPLIT=per_split, SPLIT=split,
        BLOCK_N=c.down_block_n, BLOCK_K=c.down_block_k or down_block_k(i), DOT_F32=dot_f32, **launch,
    )  # fmt: skip
    return out
