"""Triton kernels for paged attention over the KV layout of `kv/attention/base.py`.

Cache per layer: ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (0 = K, 1 = V). Keys are read
token by token through the block table (``block_tables[seq, pos // block_size]``), so a tile of
``BLOCK_N`` keys may span several (shuffled) physical blocks and ``BLOCK_N`` need not equal the block size.

* ``_kv_write_kernel``: one program per token, stores its K and V at ``slot_mapping[t]`` (``-1`` = skip).
* ``_decode_kernel`` (+ ``_decode_reduce_kernel``): one query per sequence. A program owns one
  (sequence, KV head, split) and all ``GROUP`` query heads that share that KV head (padded to 16 rows for
  ``tl.dot``). The context is cut into ``NUM_SPLITS`` equal ranges (flash-decoding); each program writes
  its unnormalised partial output and its (max, sum) in the log2 domain, and they are merged: by the
  program that writes its partials last (``FUSED_REDUCE``: an arrival counter per (sequence, KV head), reset
  by that program, as the split-K GEMV of `core/models/gemv.py` does; one kernel, one CUDA graph node) or by
  the reduce kernel. With ``NUM_SPLITS == 1`` the decode kernel writes the final output itself. Any split
  count is correct for any sequence length (empty splits contribute nothing), so a CUDA graph captured with
  one count stays valid for every shorter context. With ``ROPE_KV`` (`DecodeRope`; the engine's decode steps of up
  to 16 sequences) it also does what `core/models/fused.py`'s RoPE/KV-write kernel would have done before it: each
  program rotates its queries, and the program whose range ends with the new token rotates that token's key and
  stores it and its value in the cache before reading its range, so its results are the two kernels' to the bit.
* ``_prefill_kernel``: several queries per sequence (prefill, chunked prefill, or q=1 rows in a mixed
  batch). A program owns (sequence, tile of queries, KV head); its ``BLOCK_M`` rows are (query, head of
  the GQA group) pairs, so K/V tiles are loaded once per group. Keys every query of the tile can see are
  processed without a mask, the causal tail with one.

Sliding windows and logit soft-capping (``SLIDING``, ``SOFTCAP``; Mistral, Gemma 2/3, Phi-3): a windowed query
at position ``p`` sees keys ``p - window < key <= p`` (transformers' ``sliding_window_overlay``). The decode
kernel splits only the last ``window`` keys of the context; the prefill kernel starts at the first tile its
first query sees and masks every tile (rows of a tile see different ranges). Soft-capping,
``cap * tanh(logit / cap)``, applies to the scaled logits before any mask. Both are compile-time switches over
runtime values (``window``, ``softcap_log2``): a layer without them runs the very kernel it did before, and the
layers of one model share at most two variants (windowed or not), never one per layer.

fp8 caches (``KV_FP8``, e4m3 with a static scale per KV head, `kv/attention/fp8.py`): the write kernel divides
by the head's scale, saturates and rounds to nearest even explicitly (so it agrees bit for bit with torch's
cast, and with itself under the interpreter, whose own fp8 cast rounds differently). The attention kernels
never dequantize element by element: a head's scale is one number per program, so the K scale is folded
into the logit scale (``q . (k8 * s) == (q . k8) * s``) and the V scale multiplies the fp32 accumulator once,
before it is normalised or written as a split partial (every split of a head shares it, so the reduce is
unchanged). The raw e4m3 tiles are converted straight to the dot's dtype, the only per-element work left:
fp16 under a 16-bit query (``F16_DOT``; every e4m3 value, +-448 and subnormals included, is exact in fp16,
and Hopper converts two per instruction), fp32 under an fp32 query. Under ``F16_DOT`` the query is cast
to fp16 once per program (queries are far inside its range) and the probabilities in [0, 1] are fp16 for
the PV dot, which keeps 3 more mantissa bits than bf16 would; accumulation stays fp32.

Softmax runs online in fp32 with ``exp2`` (the scale is pre-multiplied by log2(e)); inputs may be fp32,
fp16 or bf16. ``DOT_F32`` upcasts the ``tl.dot`` operands to fp32: the Triton interpreter (CPU) multiplies
bf16 tensors as raw integers, so the wrappers set it for bf16 on the CPU only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from sluice.kv.attention import fp8
from sluice.kv.attention.base import DecodeRope
from sluice.kv.attention.pdl import pdl_launch, wait_then_release
from sluice.kv.attention.rope import rotate_neox

LOG2E = 1.4426950408889634
IEEE_DIV = hasattr(tl.math, "div_rn")


@triton.jit
def _dot(a, b, DOT_F32: tl.constexpr, PRECISION: tl.constexpr):
    if DOT_F32:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _softcap(x, cap):
    """``cap * tanh(x / cap)`` (the logit soft-cap), tanh from ``exp2`` of a non-positive argument: exact at
    the tails and free of overflow; ``x`` and ``cap`` are both in the log2 domain, which the cap commutes with."""
    y = x / cap
    e = tl.exp2(-2.0 * 1.4426950408889634 * tl.abs(y))
    t = (1.0 - e) / (1.0 + e)
    return cap * tl.where(y < 0, -t, t)


@triton.jit
def _round_e4m3(x):
    """fp32 ``x`` (already within +-448) rounded to the nearest e4m3 value, ties to even."""
    bits = x.to(tl.int32, bitcast=True)
    # normal range: keep 3 of the 23 mantissa bits
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000).to(tl.float32, bitcast=True)
    # subnormals (|x| < 2^-6) are multiples of 2^-9: adding 1.5 * 2^23 rounds to an integer, ties to even
    ax = tl.abs(x)
    sub = ((ax * 512.0 + 12582912.0) - 12582912.0) * 0.001953125
    # the sign bit put back as a bit, so -0.0 stays -0.0 as in torch's cast: a float negation under
    # tl.where let the H200 build write +0 for 46 of 8.5 M values (signed zeros may be folded away)
    sub = (sub.to(tl.int32, bitcast=True) | (bits & -0x80000000)).to(tl.float32, bitcast=True)
    return tl.where(ax < 0.015625, sub, normal)


@triton.jit
def _div(x, scale, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, IEEE: tl.constexpr):
    """``x [BLOCK_H, BLOCK_D] / scale [BLOCK_H]``, IEEE-rounded where this Triton has it (``/`` compiles to an
    approximate division), so the quotient is torch's to the bit."""
    if IEEE:
        x = tl.math.div_rn(x, tl.broadcast_to(scale[:, None], (BLOCK_H, BLOCK_D)))  # div_rn does not broadcast
    else:
        x = x / scale[:, None]
    return x


@triton.jit
def _kv_write_kernel(
    key_ptr,
    value_ptr,
    cache_ptr,
    slot_ptr,
    kv_scale_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_c_kv,
    stride_c_blk,
    stride_c_tok,
    stride_c_head,
    num_kv_heads,
    head_dim,
    block_size,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    KV_FP8: tl.constexpr,
    IEEE_DIV: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_then_release(PDL)
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    blk = slot // block_size
    off = slot % block_size
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < num_kv_heads) & (offs_d[None, :] < head_dim)
    k = tl.load(key_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(value_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    dst = cache_ptr + blk * stride_c_blk + off * stride_c_tok + offs_h[:, None] * stride_c_head + offs_d[None, :]
    if KV_FP8:
        hmask = offs_h < num_kv_heads
        k_scale = tl.load(kv_scale_ptr + offs_h, mask=hmask, other=1.0)
        v_scale = tl.load(kv_scale_ptr + num_kv_heads + offs_h, mask=hmask, other=1.0)
        k = _round_e4m3(tl.clamp(_div(k.to(tl.float32), k_scale, BLOCK_H, BLOCK_D, IEEE_DIV), -448.0, 448.0))
        v = _round_e4m3(tl.clamp(_div(v.to(tl.float32), v_scale, BLOCK_H, BLOCK_D, IEEE_DIV), -448.0, 448.0))
    tl.store(dst, k.to(cache_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + stride_c_kv, v.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _load_kv_tile(
    cache_ptr,
    bt_ptr,
    pos,
    load_mask,
    offs_d,
    dmask,
    stride_c_kv,
    stride_c_blk,
    stride_c_tok,
    BLOCK_SIZE: tl.constexpr,
):
    """K and V ``[BLOCK_N, BLOCK_D]`` of the context positions ``pos`` (``cache_ptr`` at the KV head)."""
    phys = tl.load(bt_ptr + pos // BLOCK_SIZE, mask=load_mask, other=0).to(tl.int64)
    tok = phys * stride_c_blk + (pos % BLOCK_SIZE).to(tl.int64) * stride_c_tok
    ptrs = cache_ptr + tok[:, None] + offs_d[None, :]
    m = load_mask[:, None] & dmask[None, :]
    k = tl.load(ptrs, mask=m, other=0.0)
    v = tl.load(ptrs + stride_c_kv, mask=m, other=0.0)
    return k, v


@triton.jit
def _fp8_v_operand(v, nmask, DT: tl.constexpr):
    """An e4m3 V tile ``[BLOCK_N, BLOCK_D]`` converted to ``DT`` for the decode kernel's PV dot. The select
    changes no value (masked rows were loaded as 0); it pins the conversion to the load's layout, so the
    compiler keeps the converted 16-bit tile in shared memory and reads it transposed with ``ldmatrix``.
    Converted at the dot instead, the sm_90 build re-read the fp8 bytes transposed, one byte per load
    (64 ``ld.shared.b8`` per tile), and the fp8 kernel ran slower than the bf16 one."""
    return tl.where(nmask[:, None], v.to(DT), 0.0)


@triton.jit(do_not_specialize=["window"])
def _decode_kernel(
    q_ptr,
    cache_ptr,
    kv_scale_ptr,
    bt_ptr,
    seq_lens_ptr,
    qsl_ptr,
    out_ptr,
    part_acc_ptr,
    part_m_ptr,
    part_l_ptr,
    cnt_ptr,
    scale_log2,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_c_kv,
    stride_c_blk,
    stride_c_tok,
    stride_c_head,
    stride_bt,
    num_heads,
    head_dim,
    GROUP: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_F32: tl.constexpr,
    PRECISION: tl.constexpr,
    KV_FP8: tl.constexpr,
    F16_DOT: tl.constexpr,
    FUSED_REDUCE: tl.constexpr,
    SPLITS_P2: tl.constexpr,
    PDL: tl.constexpr,
    pos_ptr=None,
    k_new_ptr=None,
    v_new_ptr=None,
    cos_ptr=None,
    sin_ptr=None,
    slot_ptr=None,
    stride_kt=0,
    stride_kh=0,
    stride_vt=0,
    stride_vh=0,
    stride_cos=0,
    ROPE_KV: tl.constexpr = False,
    window=0,
    softcap_log2=0.0,
    SLIDING: tl.constexpr = False,
    SOFTCAP: tl.constexpr = False,
):
    wait_then_release(PDL)  # kv/attention/pdl.py
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    row = tl.load(qsl_ptr + seq).to(tl.int64)

    # Equal ranges of whole key tiles over the keys the query sees (``SLIDING``: the last ``window``);
    # trailing splits of a short sequence are empty.
    first_key = 0
    if SLIDING:
        first_key = tl.maximum(seq_len - window, 0)
    per_split = tl.cdiv(tl.cdiv(seq_len - first_key, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = first_key + split * per_split
    end = tl.minimum(start + per_split, seq_len)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    hmask = offs_h < GROUP
    dmask = offs_d < head_dim
    heads = kvh * GROUP + offs_h
    q_rows = q_ptr + row * stride_qt + heads[:, None] * stride_qh
    qmask = hmask[:, None] & dmask[None, :]
    q = tl.load(q_rows + offs_d[None, :], mask=qmask, other=0.0)
    bt = bt_ptr + seq.to(tl.int64) * stride_bt
    head_base = cache_ptr + kvh.to(tl.int64) * stride_c_head
    if ROPE_KV:  # `_rope_kernel`'s rotation (`rotate_neox`) of q and this head's new key; key and value to the cache
        half = head_dim // 2
        partner = tl.where(offs_d < half, offs_d + half, offs_d - half)  # rotate_half(x) = [-x2 | x1]
        sign = tl.where(offs_d < half, -1.0, 1.0)
        at = tl.load(pos_ptr + row).to(tl.int64)  # the new token's position (`pos` is the key loop's)
        c = tl.load(cos_ptr + at * stride_cos + offs_d, mask=dmask, other=0.0)  # the table is [cos | cos]
        sn = tl.load(sin_ptr + at * stride_cos + offs_d, mask=dmask, other=0.0)
        c = c.to(q.dtype).to(tl.float32)
        sn = sn.to(q.dtype).to(tl.float32)
        q2 = tl.load(q_rows + partner[None, :], mask=qmask, other=0.0)
        q = rotate_neox(q, q2, c[None, :], (sign * sn)[None, :])
        k_row = k_new_ptr + row * stride_kt + kvh.to(tl.int64) * stride_kh
        k_new = rotate_neox(tl.load(k_row + offs_d, mask=dmask), tl.load(k_row + partner, mask=dmask), c, sign * sn)
        v_new = tl.load(v_new_ptr + row * stride_vt + kvh.to(tl.int64) * stride_vh + offs_d, mask=dmask)
        # The program whose keys end with the new one stores it, then reads it back from the cache like any key
        # (one barrier: every thread's store is seen by the tile loads after it), so the result is the two
        # kernels' to the bit. A padding row has no context and slot -1: nothing to store.
        slot = tl.load(slot_ptr + row).to(tl.int64)
        last = seq_len - 1
        if (slot >= 0) & (last >= start) & (last < end):
            dst = head_base + (slot // BLOCK_SIZE) * stride_c_blk + (slot % BLOCK_SIZE) * stride_c_tok + offs_d
            tl.store(dst, k_new.to(cache_ptr.dtype.element_ty), mask=dmask)
            tl.store(dst + stride_c_kv, v_new.to(cache_ptr.dtype.element_ty), mask=dmask)
        tl.debug_barrier()
    if F16_DOT:
        q = q.to(tl.float16)
    if KV_FP8:  # the K scale multiplies every logit: fold it into their scale, once
        scale_log2 = scale_log2 * tl.load(kv_scale_ptr + kvh)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for t0 in range(start, end, BLOCK_N):
        pos = t0 + offs_n
        nmask = pos < end
        k, v = _load_kv_tile(
            head_base, bt, pos, nmask, offs_d, dmask, stride_c_kv, stride_c_blk, stride_c_tok, BLOCK_SIZE
        )
        qk = _dot(q, tl.trans(k.to(q.dtype)), DOT_F32, PRECISION) * scale_log2
        if SOFTCAP:
            qk = _softcap(qk, softcap_log2)
        qk = tl.where(nmask[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if KV_FP8:
            v = _fp8_v_operand(v, nmask, q.dtype)
        acc = acc * alpha[:, None] + _dot(p.to(q.dtype), v.to(q.dtype), DOT_F32, PRECISION)
        m_i = m_new

    if KV_FP8:  # the V scale multiplies the output; before the partials are written, so the reduce needs none
        acc = acc * tl.load(kv_scale_ptr + tl.num_programs(1) + kvh)
    if NUM_SPLITS == 1:
        o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(
            out_ptr + row * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=hmask[:, None] & dmask[None, :],
        )
    else:
        # partials are contiguous [num_seqs, num_heads, NUM_SPLITS] (+ [head_dim] for acc)
        idx = (seq.to(tl.int64) * num_heads + heads) * NUM_SPLITS + split
        tl.store(part_m_ptr + idx, m_i, mask=hmask)
        tl.store(part_l_ptr + idx, l_i, mask=hmask)
        tl.store(
            part_acc_ptr + idx[:, None] * head_dim + offs_d[None, :],
            acc,
            mask=hmask[:, None] & dmask[None, :],
        )
        if FUSED_REDUCE:
            tl.debug_barrier()  # every thread's partials are written before the counter moves
            cnt = cnt_ptr + seq * tl.num_programs(1) + kvh
            if tl.atomic_add(cnt, 1, sem="acq_rel") == NUM_SPLITS - 1:
                _merge_splits(
                    out_ptr + row * stride_ot, part_acc_ptr, part_m_ptr, part_l_ptr,
                    (seq.to(tl.int64) * num_heads + heads) * NUM_SPLITS, hmask, heads, offs_d, dmask, stride_oh,
                    head_dim, NUM_SPLITS, SPLITS_P2,
                )  # fmt: skip
                tl.atomic_xchg(cnt, 0)  # ready for the next launch (or graph replay)


@triton.jit
def _merge_splits(
    out_row_ptr,
    part_acc_ptr,
    part_m_ptr,
    part_l_ptr,
    base,
    hmask,
    heads,
    offs_d,
    dmask,
    stride_oh,
    head_dim,
    NUM_SPLITS: tl.constexpr,
    SPLITS_P2: tl.constexpr,
):
    """Merge the ``NUM_SPLITS`` partials of the heads at ``base`` (``[BLOCK_H]`` offsets of split 0) into the
    output row: by the decode kernel's last split (fused) or by the reduce kernel. Partials are read past L1
    (``.cg``): other programs wrote them."""
    offs_s = tl.arange(0, SPLITS_P2)
    smask = hmask[:, None] & (offs_s < NUM_SPLITS)[None, :]
    m = tl.load(part_m_ptr + base[:, None] + offs_s[None, :], mask=smask, other=float("-inf"), cache_modifier=".cg")
    l_s = tl.load(part_l_ptr + base[:, None] + offs_s[None, :], mask=smask, other=0.0, cache_modifier=".cg")
    m_max = tl.max(m, 1)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)  # empty context: all weights 0, output 0
    w = tl.exp2(m - m_max[:, None])
    denom = tl.sum(w * l_s, 1)
    o = tl.zeros([base.shape[0], offs_d.shape[0]], tl.float32)
    for s in tl.static_range(NUM_SPLITS):
        w_s = tl.sum(tl.where(offs_s[None, :] == s, w, 0.0), 1)
        a = tl.load(
            part_acc_ptr + (base + s)[:, None] * head_dim + offs_d[None, :],
            mask=hmask[:, None] & dmask[None, :],
            other=0.0,
            cache_modifier=".cg",
        )
        o += w_s[:, None] * a
    o = o / tl.where(denom == 0.0, 1.0, denom)[:, None]
    tl.store(
        out_row_ptr + heads[:, None] * stride_oh + offs_d[None, :],
        o.to(out_row_ptr.dtype.element_ty),
        mask=hmask[:, None] & dmask[None, :],
    )


@triton.jit
def _decode_reduce_kernel(
    out_ptr,
    part_acc_ptr,
    part_m_ptr,
    part_l_ptr,
    qsl_ptr,
    stride_ot,
    stride_oh,
    num_heads,
    head_dim,
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_P2: tl.constexpr,
    PDL: tl.constexpr,
):
    """The decode kernel's merge as a kernel of its own (no arrival counters): one program per (sequence, KV
    head), its ``GROUP`` query heads."""
    wait_then_release(PDL)
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    row = tl.load(qsl_ptr + seq).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kvh * GROUP + offs_h
    _merge_splits(
        out_ptr + row * stride_ot, part_acc_ptr, part_m_ptr, part_l_ptr,
        (seq.to(tl.int64) * num_heads + heads) * NUM_SPLITS, offs_h < GROUP, heads, offs_d, offs_d < head_dim,
        stride_oh, head_dim, NUM_SPLITS, SPLITS_P2,
    )  # fmt: skip


@triton.jit
def _attend_range(
    acc,
    m_i,
    l_i,
    q,
    q_pos,
    head_base,
    bt,
    lo,
    hi,
    offs_n,
    offs_d,
    dmask,
    scale_log2,
    stride_c_kv,
    stride_c_blk,
    stride_c_tok,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    DOT_F32: tl.constexpr,
    PRECISION: tl.constexpr,
    window,
    softcap_log2,
    SLIDING: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    """Online-softmax pass over keys ``[lo, hi)``; ``CAUSAL`` masks key > query position and key >= hi,
    ``SLIDING`` (with ``CAUSAL``) also key <= query position - ``window``; a row may then see no key of a tile,
    so its running max stays -inf and is read as 0 (no NaN from ``-inf - -inf``). ``SOFTCAP`` caps the logits
    before the masks. K/V tiles are converted to the query's dtype; an fp8 cache's scales are the caller's (see
    the module doc)."""
    for t0 in range(lo, hi, BLOCK_N):
        pos = t0 + offs_n
        if CAUSAL:
            nmask = pos < hi
        else:
            nmask = offs_n < BLOCK_N  # the whole tile is in range
        k, v = _load_kv_tile(
            head_base, bt, pos, nmask, offs_d, dmask, stride_c_kv, stride_c_blk, stride_c_tok, BLOCK_SIZE
        )
        qk = _dot(q, tl.trans(k.to(q.dtype)), DOT_F32, PRECISION) * scale_log2
        if SOFTCAP:
            qk = _softcap(qk, softcap_log2)
        if CAUSAL:
            seen = nmask[None, :] & (pos[None, :] <= q_pos[:, None])
            if SLIDING:
                seen = seen & (pos[None, :] > q_pos[:, None] - window)
            qk = tl.where(seen, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_ref = m_new
        if SLIDING:
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_ref)
        p = tl.exp2(qk - m_ref[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _dot(p.to(q.dtype), v.to(q.dtype), DOT_F32, PRECISION)
        m_i = m_new
    return acc, m_i, l_i


# ``num_seqs`` only bounds a search: not specialized on (Triton compiles a variant per argument that is 1, a
# multiple of 16, or neither), so a step with a new kind of sequence count compiles nothing while serving.
@triton.jit(do_not_specialize=["num_seqs", "window"])
def _prefill_kernel(
    q_ptr,
    cache_ptr,
    kv_scale_ptr,
    bt_ptr,
    seq_lens_ptr,
    qsl_ptr,
    out_ptr,
    scale_log2,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_c_kv,
    stride_c_blk,
    stride_c_tok,
    stride_c_head,
    stride_bt,
    head_dim,
    num_seqs,
    GROUP: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_F32: tl.constexpr,
    PRECISION: tl.constexpr,
    KV_FP8: tl.constexpr,
    F16_DOT: tl.constexpr,
    window=0,
    softcap_log2=0.0,
    SLIDING: tl.constexpr = False,
    SOFTCAP: tl.constexpr = False,
):
    # Tile t belongs to the last sequence s whose first tile, qsl[s] // BLOCK_Q + s, is <= t (found by
    # binary search); sequence s has at least as many tile numbers as it needs (see `paged_prefill`).
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        go_right = tl.load(qsl_ptr + mid) // BLOCK_Q + mid <= tile
        lo = tl.where(go_right, mid + 1, lo)
        hi = tl.where(go_right, hi, mid)
    seq = lo - 1
    q_start = tl.load(qsl_ptr + seq)
    qtile = tile - (q_start // BLOCK_Q + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    if qtile * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx = seq_len - q_len  # tokens before this step's first query

    # row r of the tile = (query qtile*BLOCK_Q + r // GROUP, query head kvh*GROUP + r % GROUP)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    q_local = qtile * BLOCK_Q + offs_m // GROUP
    heads = kvh * GROUP + offs_m % GROUP
    row_mask = (offs_m < BLOCK_Q * GROUP) & (q_local < q_len)
    dmask = offs_d < head_dim
    q_pos = ctx + q_local
    rows = (q_start + q_local).to(tl.int64)
    q = tl.load(
        q_ptr + rows[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=row_mask[:, None] & dmask[None, :],
        other=0.0,
    )

    if F16_DOT:
        q = q.to(tl.float16)
    if KV_FP8:  # the K scale multiplies every logit: fold it into their scale, once
        scale_log2 = scale_log2 * tl.load(kv_scale_ptr + kvh)
    first_pos = ctx + qtile * BLOCK_Q  # smallest query position of the tile
    last_pos = tl.minimum(first_pos + BLOCK_Q, seq_len) - 1  # largest
    full_end = ((first_pos + 1) // BLOCK_N) * BLOCK_N  # keys [0, full_end) are seen by every row

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    bt = bt_ptr + seq.to(tl.int64) * stride_bt
    head_base = cache_ptr + kvh.to(tl.int64) * stride_c_head
    if SLIDING:  # one masked pass from the first key the tile's first query sees (whole tiles)
        first_key = (tl.maximum(first_pos - window + 1, 0) // BLOCK_N) * BLOCK_N
        acc, m_i, l_i = _attend_range(
            acc, m_i, l_i, q, q_pos, head_base, bt, first_key, last_pos + 1, offs_n, offs_d, dmask, scale_log2,
            stride_c_kv, stride_c_blk, stride_c_tok, BLOCK_SIZE, BLOCK_N, True, DOT_F32, PRECISION,
            window, softcap_log2, True, SOFTCAP,
        )  # fmt: skip
    else:
        acc, m_i, l_i = _attend_range(
            acc, m_i, l_i, q, q_pos, head_base, bt, 0, full_end, offs_n, offs_d, dmask, scale_log2,
            stride_c_kv, stride_c_blk, stride_c_tok, BLOCK_SIZE, BLOCK_N, False, DOT_F32, PRECISION,
            window, softcap_log2, False, SOFTCAP,
        )  # fmt: skip
        acc, m_i, l_i = _attend_range(
            acc, m_i, l_i, q, q_pos, head_base, bt, full_end, last_pos + 1, offs_n, offs_d, dmask, scale_log2,
            stride_c_kv, stride_c_blk, stride_c_tok, BLOCK_SIZE, BLOCK_N, True, DOT_F32, PRECISION,
            window, softcap_log2, False, SOFTCAP,
        )  # fmt: skip

    if KV_FP8:  # the V scale multiplies the output
        acc = acc * tl.load(kv_scale_ptr + tl.num_programs(1) + kvh)
    o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(
        out_ptr + rows[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
        o.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & dmask[None, :],
    )


# ----------------------------------------------------------------------------------------------- launchers


def _dot_args(dtype: torch.dtype, device: torch.device) -> tuple[bool, str]:
    dot_f32 = dtype == torch.bfloat16 and device.type == "cpu"  # interpreter: bf16 dot is broken
    precision = "ieee" if dtype == torch.float32 else "tf32"  # tf32 is ignored for 16-bit operands
    return dot_f32, precision


def _block_d(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))


def _wide_head_tiles(block_n: int, num_stages: int, block_d: int, elem_bytes: int) -> tuple[int, int]:
    """Key tiles and stages for rows wider than 512 bytes (fp32 at head size 256, say: a GPU check's dtype, not
    a serving one): the default tiles, sized for 16-bit heads up to 256, would ask for more shared memory than
    an SM has (Hopper: 227 KiB), so the tile shrinks to 32 keys and the pipeline to at most 2 stages. Narrower
    rows keep the tiles the sweeps chose."""
    if block_d * elem_bytes <= 512:
        return block_n, num_stages
    return min(block_n, 32), min(num_stages, 2)


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _fp8_args(kv_cache: torch.Tensor, kv_scale: torch.Tensor | None) -> tuple[torch.Tensor, bool]:
    """The scale pointer (any tensor when unused) and the ``KV_FP8`` flag of a launch."""
    if not fp8.is_fp8(kv_cache):
        return kv_cache, False
    kv_scale = fp8.require_scale(kv_scale)
    assert kv_scale.is_contiguous() and kv_scale.dtype == torch.float32
    return kv_scale, True


def _variant_args(window: int, softcap: float) -> dict:
    """A layer's sliding window and logit soft-cap as kernel arguments: runtime values (one compiled variant for
    every window) behind compile-time switches (none when unused, so the plain kernel is unchanged)."""
    if not window and not softcap:
        return {}
    return dict(window=int(window), softcap_log2=float(softcap) * LOG2E, SLIDING=window > 0, SOFTCAP=softcap > 0)


def _f16_dot(kv_fp8: bool, query_dtype: torch.dtype) -> bool:
    """``F16_DOT``: an fp8 cache under a 16-bit query computes both dots in fp16 (see the module doc)."""
    return kv_fp8 and query_dtype != torch.float32


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scale: torch.Tensor | None = None,
) -> None:
    """Store ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` at ``slot_mapping`` (-1 = skip); an fp8
    cache divides by ``kv_scale [2, num_kv_heads]``."""
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    key, value = _last_dim_contiguous(key), _last_dim_contiguous(value)
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    assert kv_cache.stride(-1) == 1
    scale_arg, kv_fp8 = _fp8_args(kv_cache, kv_scale)
    _kv_write_kernel[(num_tokens,)](
        key, value, kv_cache, slot_mapping, scale_arg,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        num_kv_heads, head_dim, block_size,
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim), KV_FP8=kv_fp8,
        IEEE_DIV=IEEE_DIV, **pdl_launch(key.device),
    )  # fmt: skip


def paged_decode(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    out: torch.Tensor,
    scale: float,
    num_seqs: int,
    num_splits: int,
    block_n: int = 128,
    num_warps: int = 4,
    num_stages: int = 3,
    kv_scale: torch.Tensor | None = None,
    counters: torch.Tensor | None = None,
    rope: DecodeRope | None = None,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """One query per sequence at row ``query_start_loc[i]``; grid ``(num_seqs, num_kv_heads, num_splits)``.
    The default tile (128 keys, 4 warps, 3 stages) was the fastest on the H200 for both cache dtypes at
    batch 64 and 128 (`scripts/gpu_kernel_sweep.py attn`). ``counters`` (int32 zeros, one per (sequence, KV
    head) at least): the last split of each pair merges the partials (one kernel) and sets its counter back to
    zero; without them (or too few) a reduce kernel runs after the decode kernel. With ``rope`` the query is not yet
    rotated and this step's keys and values not yet in a 16-bit cache: the kernel does what `rope_and_write_kv_`
    (`core/models/fused.py`) would have done first (``query`` itself is left as it was). ``window`` > 0: each query
    sees its last ``window`` keys only (a sliding-window layer); ``softcap`` > 0: logits are ``softcap *
    tanh(logit / softcap)`` (Gemma 2). Both are runtime arguments behind a compile-time switch: a layer without
    them runs the kernel it always did, and every windowed layer shares one variant."""
    query = _last_dim_contiguous(query)
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    num_heads = query.shape[1]
    group = num_heads // num_kv_heads
    block_d = _block_d(head_dim)
    block_n, num_stages = _wide_head_tiles(block_n, num_stages, block_d, query.element_size())
    dot_f32, precision = _dot_args(query.dtype, query.device)
    assert kv_cache.stride(-1) == 1 and out.stride(-1) == 1
    if num_splits > 1:
        part_acc = torch.empty((num_seqs, num_heads, num_splits, head_dim), dtype=torch.float32, device=query.device)
        part_m = torch.empty((num_seqs, num_heads, num_splits), dtype=torch.float32, device=query.device)
        part_l = torch.empty_like(part_m)
    else:
        part_acc = part_m = part_l = out  # unused
    if num_splits == 1 or (counters is not None and counters.numel() < num_seqs * num_kv_heads):
        counters = None
    scale_arg, kv_fp8 = _fp8_args(kv_cache, kv_scale)
    pdl = pdl_launch(query.device)
    rope_args = {}
    if rope is not None:
        assert not kv_fp8 and kv_cache.dtype == rope.key.dtype and rope.key.stride(-1) == rope.value.stride(-1) == 1
        rope_args = dict(
            pos_ptr=rope.positions, k_new_ptr=rope.key, v_new_ptr=rope.value, cos_ptr=rope.cos, sin_ptr=rope.sin,
            slot_ptr=rope.slot_mapping, stride_kt=rope.key.stride(0), stride_kh=rope.key.stride(1),
            stride_vt=rope.value.stride(0), stride_vh=rope.value.stride(1), stride_cos=rope.cos.stride(0),
            ROPE_KV=True,
        )  # fmt: skip
    _decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        query, kv_cache, scale_arg, block_tables, seq_lens, query_start_loc, out, part_acc, part_m, part_l,
        counters if counters is not None else seq_lens, scale * LOG2E,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        block_tables.stride(0), num_heads, head_dim,
        GROUP=group, BLOCK_SIZE=block_size, BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_D=block_d,
        BLOCK_N=block_n, NUM_SPLITS=num_splits, DOT_F32=dot_f32, PRECISION=precision, KV_FP8=kv_fp8,
        F16_DOT=_f16_dot(kv_fp8, query.dtype), FUSED_REDUCE=counters is not None,
        SPLITS_P2=triton.next_power_of_2(num_splits), **pdl, **rope_args, **_variant_args(window, softcap),
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    if num_splits > 1 and counters is None:
        _decode_reduce_kernel[(num_seqs, num_kv_heads)](
            out, part_acc, part_m, part_l, query_start_loc,
            out.stride(0), out.stride(1), num_heads, head_dim,
            GROUP=group, BLOCK_H=triton.next_power_of_2(group), BLOCK_D=block_d, NUM_SPLITS=num_splits,
            SPLITS_P2=triton.next_power_of_2(num_splits), num_warps=4, **pdl,
        )  # fmt: skip
    return out


def paged_prefill(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    out: torch.Tensor,
    scale: float,
    num_seqs: int,
    block_m: int = 64,
    block_n: int | None = None,
    num_warps: int = 4,
    num_stages: int | None = None,
    kv_scale: torch.Tensor | None = None,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Causal attention of each sequence's query rows over its paged context (any query lengths); ``window`` and
    ``softcap`` as in `paged_decode`. Default
    tiles (H200 sweep, `scripts/gpu_kernel_sweep.py attn`): 64 keys and 2 stages over a 16-bit cache, 128 keys
    and 1 stage over fp8 (whose tiles are converted in registers before the dot)."""
    query = _last_dim_contiguous(query)
    scale_arg, kv_fp8 = _fp8_args(kv_cache, kv_scale)
    block_n = block_n or (128 if kv_fp8 else 64)
    num_stages = num_stages or (1 if kv_fp8 else 2)
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    num_heads = query.shape[1]
    group = num_heads // num_kv_heads
    block_n, num_stages = _wide_head_tiles(block_n, num_stages, _block_d(head_dim), query.element_size())
    block_m = max(block_m, 16, triton.next_power_of_2(group))
    block_q = block_m // group
    dot_f32, precision = _dot_args(query.dtype, query.device)
    assert kv_cache.stride(-1) == 1 and out.stride(-1) == 1
    # Tiles of BLOCK_Q queries never span two sequences. Sequence s takes the tile numbers from
    # qsl[s] // BLOCK_Q + s on: that leaves it qsl[s+1] // BLOCK_Q - qsl[s] // BLOCK_Q + 1 of them, at least
    # cdiv(its queries, BLOCK_Q); numbers it does not need end at once. The grid depends only on the tensors'
    # sizes (tokens, sequences), not on how the queries are spread: a CUDA graph of a step with prefill rows
    # serves any step of its size, and a step of one long prompt beside many decodes launches no idle grid.
    grid = (query.shape[0] // block_q + num_seqs, num_kv_heads)
    _prefill_kernel[grid](
        query, kv_cache, scale_arg, block_tables, seq_lens, query_start_loc, out,
        scale * LOG2E,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        block_tables.stride(0), head_dim, num_seqs,
        GROUP=group, BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_Q=block_q, BLOCK_D=_block_d(head_dim),
        BLOCK_N=block_n, DOT_F32=dot_f32, PRECISION=precision, KV_FP8=kv_fp8,
        F16_DOT=_f16_dot(kv_fp8, query.dtype), **_variant_args(window, softcap), num_warps=num_warps,
        num_stages=num_stages,
    )  # fmt: skip
    return out
