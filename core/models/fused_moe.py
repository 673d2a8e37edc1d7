"""The experts of a mixture-of-experts layer on a flattened batch: a grouped GEMM in Triton (GPU) and a torch loop
(CPU, and the reference the kernel is tested against).

The Triton path works on token-expert *pairs*: ``T`` tokens with ``top_k`` experts each are ``T * top_k`` pairs,
pair ``p`` being token ``p // top_k``'s ``p % top_k``-th choice. `align_pairs` sorts the pairs by expert and pads
each expert's run to a multiple of ``BLOCK_M`` (the idea of vLLM's ``moe_align_block_size``), so every row block of
the grouped GEMM belongs to one expert and reads that expert's weights once for up to ``BLOCK_M`` pairs. Two
launches of `_grouped_gemm_kernel` follow: gate/up with the SiLU-and-mul in the epilogue (``[pairs, I]``), then down
with each pair's routing weight applied (``[pairs, H]``); the ``top_k`` rows of each token are summed last. For a
decode step's few pairs, the routing (`route`) and that sort are one Triton program (`route_and_align`): in torch
ops they are a dozen small kernels per layer, each a node of the step's CUDA graph.

Nothing is read back to the host: the sort runs on the device into buffers of a size fixed by ``T``, ``top_k``,
``E`` and ``BLOCK_M`` alone (the worst case of padding), and blocks past the padded total (a device scalar the
kernel loads) return at once. So the forward is CUDA-graph safe at decode, and a step reads only the weights of
the experts its tokens chose: a block is launched per used expert (and the empty worst-case tail exits).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights, expert ids)``, each ``[T, top_k]``: the fp32 softmax's ``top_k`` largest, renormalized to sum to
    one when ``renormalize``."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = probs.topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def torch_experts(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> torch.Tensor:
    """The reference: each expert that received tokens, in ascending order, on its tokens, its output scaled by the
    routing weight and added into the token's row (transformers' order of operations)."""
    out = torch.zeros_like(x)
    top_k = topk_ids.shape[1]
    flat_ids = topk_ids.flatten()
    flat_weights = topk_weights.flatten()
    for e in flat_ids.unique().tolist():  # host sync: the CPU path only
        pairs = (flat_ids == e).nonzero().squeeze(1)
        tokens = pairs // top_k
        gate, up = F.linear(x[tokens], w13[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[e]) * flat_weights[pairs, None]
        out.index_add_(0, tokens, y.to(x.dtype))
    return out


def align_pairs(topk_ids: torch.Tensor, block_m: int, num_experts: int):
    """The pairs sorted by expert, each expert's run padded to a multiple of ``block_m``, on the device.

    Returns ``(sorted_pairs [P], block_experts [P / block_m], padded_total [1])``: ``sorted_pairs[i]`` is a pair
    index, or ``T * top_k`` (no pair) in padding; block ``b`` (rows ``b * block_m ...``) serves expert
    ``block_experts[b]``; rows past ``padded_total`` are unused. ``P`` is the worst case, ``n + min(n, E) *
    (block_m - 1)`` rounded up to ``block_m``, for ``n`` pairs: it depends on shapes only."""
    dev = topk_ids.device
    flat = topk_ids.flatten().to(torch.int64)
    n = flat.numel()
    cap = n + min(n, num_experts) * (block_m - 1)
    cap = -(-cap // block_m) * block_m
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)  # pair indices grouped by expert, in pair order within one
    expert_of = flat[order]
    rank = torch.arange(n, device=dev) - (counts.cumsum(0) - counts)[expert_of]  # position within its expert
    sorted_pairs = torch.full((cap,), n, dtype=torch.int32, device=dev)
    sorted_pairs[(ends - padded)[expert_of] + rank] = order.to(torch.int32)
    block_starts = torch.arange(0, cap, block_m, device=dev)
    block_experts = torch.searchsorted(ends, block_starts, right=True).clamp_(max=num_experts - 1).to(torch.int32)
    return sorted_pairs, block_experts, ends[-1:]


@triton.jit
def softmax_top_k(
    logits,
    ok,
    ROWS: tl.constexpr,
    COLS: tl.constexpr,
    TOP_K: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    K_P2: tl.constexpr,
):
    """`route` on a ``[ROWS, COLS]`` tile of router logits (``ok``: the real rows and experts): ``(weights, ids)``,
    each ``[ROWS, K_P2]``, the first ``TOP_K`` columns of each row its largest softmax probabilities (fp32) and
    their experts, the leftmost expert first among equal ones (as ``topk``)."""
    cols = tl.arange(0, COLS)
    kcols = tl.arange(0, K_P2)
    lg = tl.where(ok, logits.to(tl.float32), -1e30)  # finite, in fp32: a padding row stays free of NaN
    p = tl.exp(lg - tl.max(lg, axis=1)[:, None])
    p = p / tl.sum(p, axis=1)[:, None]
    top_w = tl.zeros((ROWS, K_P2), dtype=tl.float32)
    top_id = tl.zeros((ROWS, K_P2), dtype=tl.int32)
    for j in tl.static_range(TOP_K):  # the largest left, TOP_K times
        best = tl.argmax(p, axis=1, tie_break_left=True)
        top_w = tl.where(kcols[None, :] == j, tl.max(p, axis=1)[:, None], top_w)
        top_id = tl.where(kcols[None, :] == j, best[:, None], top_id)
        p = tl.where(cols[None, :] == best[:, None], -1.0, p)
    if RENORMALIZE:
        top_w = top_w / tl.sum(top_w, axis=1)[:, None]
    return top_w, top_id


@triton.jit
def _route_align_kernel(
    logits_ptr,
    weights_ptr,
    ids_ptr,
    sorted_pairs_ptr,
    block_experts_ptr,
    padded_total_ptr,
    T,
    E,
    stride_l,
    cap,
    num_blocks,
    TOP_K: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    K_P2: tl.constexpr,
    BLOCKS_P2: tl.constexpr,
    FILL: tl.constexpr,
):
    """`route` and `align_pairs` in one program, for a few tokens (a decode step): their torch forms are a dozen
    small kernels per layer, each a node of the step's graph. Pairs live in a ``[BLOCK_T * K_P2]`` vector in pair
    order; an expert's rank of a pair is the running count of the one-hot ``[pairs, experts]`` tile."""
    rows = tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    kcols = tl.arange(0, K_P2)
    row_ok = rows < T
    ok = row_ok[:, None] & (cols[None, :] < E)
    lg = tl.load(logits_ptr + rows[:, None] * stride_l + cols[None, :], mask=ok, other=0.0)
    top_w, top_id = softmax_top_k(lg, ok, BLOCK_T, BLOCK_E, TOP_K, RENORMALIZE, K_P2)
    pair_ok2 = row_ok[:, None] & (kcols[None, :] < TOP_K)
    pair2 = rows[:, None] * TOP_K + kcols[None, :]
    tl.store(weights_ptr + pair2, top_w, mask=pair_ok2)
    tl.store(ids_ptr + pair2, top_id, mask=pair_ok2)
    # the pairs, flattened in pair order (a row's padding columns are invalid)
    pair = tl.reshape(pair2, (BLOCK_T * K_P2,))
    pair_ok = tl.reshape(pair_ok2, (BLOCK_T * K_P2,))
    expert = tl.reshape(top_id, (BLOCK_T * K_P2,))
    onehot = ((expert[:, None] == cols[None, :]) & pair_ok[:, None]).to(tl.int32)
    rank = tl.sum(tl.cumsum(onehot, axis=0) * onehot, axis=1) - 1
    counts = tl.sum(onehot, axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    dest = tl.sum(onehot * (ends - padded)[None, :], axis=1) + rank
    n = T * TOP_K
    for off in range(0, cap, FILL):  # padding first, then the pairs over it
        offs = off + tl.arange(0, FILL)
        tl.store(sorted_pairs_ptr + offs, tl.full((FILL,), 0, tl.int32) + n, mask=offs < cap)
    tl.debug_barrier()
    tl.store(sorted_pairs_ptr + dest, pair, mask=pair_ok)
    blocks = tl.arange(0, BLOCKS_P2)
    below = (ends[None, :] <= (blocks * BLOCK_M)[:, None]) & (cols[None, :] < E)
    block_expert = tl.minimum(tl.sum(below.to(tl.int32), axis=1), E - 1)
    tl.store(block_experts_ptr + blocks, block_expert, mask=blocks < num_blocks)
    tl.store(padded_total_ptr, tl.sum(padded, axis=0))


# `route_and_align` runs the one-program kernel up to this many token-expert pairs (and experts), torch beyond
MAX_FUSED_PAIRS = 256
MAX_FUSED_EXPERTS = 256


def route_and_align(logits: torch.Tensor, top_k: int, renormalize: bool, block_m: int):
    """``(weights, ids, (sorted_pairs, block_experts, padded_total))``: `route` then `align_pairs`, in one kernel
    for few pairs (a decode step) and in torch ops beyond; the same values either way."""
    t, e = logits.shape
    if t * top_k > MAX_FUSED_PAIRS or e > MAX_FUSED_EXPERTS:
        weights, ids = route(logits, top_k, renormalize)
        return weights, ids, align_pairs(ids, block_m, e)
    dev = logits.device
    n = t * top_k
    cap = -(-(n + min(n, e) * (block_m - 1)) // block_m) * block_m
    weights = torch.empty(t, top_k, dtype=torch.float32, device=dev)
    ids = torch.empty(t, top_k, dtype=torch.int32, device=dev)
    sorted_pairs = torch.empty(cap, dtype=torch.int32, device=dev)
    block_experts = torch.empty(cap // block_m, dtype=torch.int32, device=dev)
    padded_total = torch.empty(1, dtype=torch.int32, device=dev)
    _route_align_kernel[(1,)](
        logits,
        weights,
        ids,
        sorted_pairs,
        block_experts,
        padded_total,
        t,
        e,
        logits.stride(0),
        cap,
        cap // block_m,
        TOP_K=top_k,
        RENORMALIZE=renormalize,
        BLOCK_M=block_m,
        BLOCK_T=triton.next_power_of_2(t),
        BLOCK_E=triton.next_power_of_2(e),
        K_P2=triton.next_power_of_2(top_k),
        BLOCKS_P2=triton.next_power_of_2(cap // block_m),
        FILL=256,
        **({} if dev.type == "cpu" else {"num_warps": 8}),
    )
    return weights, ids, (sorted_pairs, block_experts, padded_total)


@triton.jit
def _grouped_gemm_kernel(
    a_ptr,
    w_ptr,
    out_ptr,
    pair_weights_ptr,
    sorted_pairs_ptr,
    block_experts_ptr,
    padded_total_ptr,
    num_pairs,
    N,
    K,
    pairs_per_row,
    stride_am,
    stride_we,
    stride_wn,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GATED: tl.constexpr,
    WEIGHTED: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    """``out[pair, n] = a[pair // pairs_per_row] . w[expert, n]`` for the pairs of one row block (one expert) and
    ``BLOCK_N`` outputs. ``GATED``: ``w``'s rows ``[0, N)`` are the gate and ``[N, 2N)`` the up projection, and the
    output is ``silu(gate) * up``; ``WEIGHTED``: scaled by the pair's routing weight. ``w`` is ``[E, *, K]`` with
    unit stride along K; accumulation in fp32."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(padded_total_ptr):
        return  # the worst case's unused tail
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_pairs_ptr + offs_m)
    valid = pairs < num_pairs
    rows = (pairs // pairs_per_row).to(tl.int64)
    expert = tl.load(block_experts_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :]
    w_ptrs = w_ptr + expert * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]  # [K, N]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = offs_k < K - k0
        a = tl.load(a_ptrs, mask=valid[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if DOT_F32:  # fp32 stays fp32 (the CPU interpreter, and fp32 models: no tf32 rounding)
            acc = tl.dot(a.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, w, acc)
        if GATED:
            w_up = tl.load(w_ptrs + N * stride_wn, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
            if DOT_F32:
                acc_up = tl.dot(a.to(tl.float32), w_up.to(tl.float32), acc_up, input_precision="ieee")
            else:
                acc_up = tl.dot(a, w_up, acc_up)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if GATED:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    if WEIGHTED:
        acc = acc * tl.load(pair_weights_ptr + pairs, mask=valid, other=0.0)[:, None]
    out_ptrs = out_ptr + pairs[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & n_mask[None, :])


def gemm_config(num_tokens: int, top_k: int = 1, num_experts: int = 1) -> dict:
    """Tile sizes by the pairs an expert gets on average: a few (decode) want the smallest row block (rows past an
    expert's pairs are wasted work) and narrow N tiles, so that more programs share the weight read (the cost);
    many want wide tiles for reuse."""
    per_expert = num_tokens * top_k / num_experts
    if per_expert <= 16:
        return dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3)
    if per_expert <= 48:
        return dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=4)
    return dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3)


def _grouped_gemm(a, w, out, pair_weights, aligned, n_out, gated, weighted, pairs_per_row, cfg):
    sorted_pairs, block_experts, padded_total = aligned
    cfg = dict(cfg)
    dot_f32 = a.dtype == torch.float32 or a.device.type == "cpu"  # the interpreter's 16-bit dot is wrong
    if a.device.type == "cpu":
        cfg.pop("num_warps", None), cfg.pop("num_stages", None)
    grid = (block_experts.numel(), triton.cdiv(n_out, cfg["BLOCK_N"]))
    _grouped_gemm_kernel[grid](
        a,
        w,
        out,
        pair_weights,
        sorted_pairs,
        block_experts,
        padded_total,
        out.shape[0],
        n_out,
        w.shape[2],
        pairs_per_row,
        a.stride(0),
        w.stride(0),
        w.stride(1),
        out.stride(0),
        GATED=gated,
        WEIGHTED=weighted,
        DOT_F32=dot_f32,
        **cfg,
    )


def triton_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    config: dict | None = None,
    aligned: tuple | None = None,
) -> torch.Tensor:
    """The experts as two grouped GEMMs over the stacked weights (the module doc); the same result as
    `torch_experts` up to the order of the sums. ``aligned``: `align_pairs` of ``topk_ids`` at the config's
    ``BLOCK_M``, when already made."""
    t, top_k = topk_ids.shape
    e, two_i, h = w13.shape
    cfg = config or gemm_config(t, top_k, e)
    x = x.contiguous()
    aligned = aligned or align_pairs(topk_ids, cfg["BLOCK_M"], e)
    pair_weights = topk_weights.flatten().to(torch.float32).contiguous()
    act = torch.empty(t * top_k, two_i // 2, dtype=x.dtype, device=x.device)
    _grouped_gemm(x, w13, act, pair_weights, aligned, two_i // 2, True, False, top_k, cfg)
    out = torch.empty(t * top_k, h, dtype=x.dtype, device=x.device)
    _grouped_gemm(act, w2, out, pair_weights, aligned, h, False, True, 1, cfg)
    return out.view(t, top_k, h).sum(dim=1)


def moe_forward(
    x: torch.Tensor,
    router_logits: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    top_k: int,
    renormalize: bool,
    use_triton: bool,
) -> torch.Tensor:
    """The experts' weighted sum for every token of ``x`` from its router logits: on the Triton path routing and
    sorting in one kernel (few tokens) and the two grouped GEMMs; otherwise `route` and the torch loop."""
    if not use_triton:
        weights, ids = route(router_logits, top_k, renormalize)
        return torch_experts(x, w13, w2, weights, ids)
    cfg = gemm_config(x.shape[0], top_k, w13.shape[0])
    weights, ids, aligned = route_and_align(router_logits.contiguous(), top_k, renormalize, cfg["BLOCK_M"])
    return triton_experts(x, w13, w2, weights, ids, cfg, aligned)
