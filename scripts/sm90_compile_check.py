"""Compile the engine's Triton kernels for the H200 (sm_90) on a machine without a GPU: Triton's bundled
ptxas does the work, so a kernel change can be checked against the GPU machine's Triton before device time is
spent on it. Prints, per variant, its registers and spills (ptxas -v over the kernel's PTX), shared memory,
global loads, MMA instructions and exponentials in the PTX; last, the variants that would not fit the H200's
shared memory (a launch of one fails). `tests/test_sm90_compile.py` runs it in CI.

Groups: ``gemv`` (the bf16 GEMV and its folds), ``decode`` and ``prefill`` (paged attention, plain and with the
sliding windows and soft-caps of Mistral and Gemma 2/3, at head size 128 and 256), ``fp8`` (the W8A8 linear
layer's GEMV and row quantizer), ``moe`` (the fused MoE routing and grouped GEMMs, the few-token path's three
kernels), ``structured`` (the
structured-output bitmask); not in the default, ``folds32`` (not launched: the folds past the engine's row limit)
and ``fp32`` (Gemma 2's prefill attention in fp32, the GPU parity checks' dtype).

    python scripts/sm90_compile_check.py [GROUP ...]   # default: every group but folds32 and fp32
    PYTHONPATH=/tmp/t36:$(scripts/namespace_path.sh) python scripts/sm90_compile_check.py   # another Triton
                                            # (e.g. `pip install --no-deps --target /tmp/t36 triton==3.6.0`)
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass

os.environ.pop("TRITON_INTERPRET", None)  # a real compile, not the interpreter

import torch  # noqa: E402
import triton  # noqa: E402
from sluice.core.models import fp8_kernels, fused, fused_moe, gemv, moe_decode  # noqa: E402
from sluice.core.structured import bitmask, bitmask_kernel  # noqa: E402
from sluice.kv.attention import triton_kernels as tk  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

# Llama-3-8B's shapes in a bf16 engine (bf16 cache of 16-token blocks, 8 KV heads of 128, contexts to 8,192):
# the value of every argument that is not a constexpr, as the engine's launches pass them. The runtime
# specializes on these (`specialize`): an integer equal to 1 becomes a constant, one divisible by 16 and a
# 16-byte-aligned pointer carry that divisibility, which is what lets the compiler vectorize loads; compiled
# without it, a kernel's loads are scalar and its registers are not those of the engine's build.
HIDDEN, QKV, GATE_UP, NUM_BLOCKS, MAX_BLOCKS = 4096, 6144, 28672, 55216, 512
PTR = "ptr"  # a 16-byte-aligned bf16 tensor (every tensor these launches pass is, at these shapes)
PTR_F32, PTR_I32, PTR_I64, PTR_FP8 = "ptr_f32", "ptr_i32", "ptr_i64", "ptr_fp8"
TENSORS = {  # the dtype of each kind of pointer
    PTR: torch.bfloat16, PTR_F32: torch.float32, PTR_I32: torch.int32, PTR_I64: torch.int64,
    PTR_FP8: torch.float8_e4m3fn,
}  # fmt: skip
SMEM_LIMIT = 232448  # bytes of shared memory a program may use on the H200 (227 KiB): more fails at launch


def _gemv_args(rows: int, n: int, norm: bool) -> dict:
    return dict(
        x_ptr=PTR, w_ptr=PTR, b_ptr=PTR, out_ptr=PTR, ws_ptr=PTR_F32, cnt_ptr=PTR_I32, res_ptr=PTR, nw_ptr=PTR,
        res_out_ptr=PTR, eps=1e-5, M=rows, N=n, K=HIDDEN, stride_xm=HIDDEN, stride_wn=HIDDEN, stride_om=n,
        stride_rm=HIDDEN, stride_rom=HIDDEN if norm else n,  # without a norm: x's and out's (`gemv._run`)
    )  # fmt: skip


def _gemv(rows: int, n: int, what: str, norm: bool = False, gated: bool = False) -> tuple:
    """The GEMV as the engine launches it for ``rows`` rows of an ``n x HIDDEN`` weight: its config from
    `gemv.gemv_config` (H200: 132 SMs), halved in height when gated, unsplit with a fold (as `gemv._run` does)."""
    c = gemv.gemv_config(n, HIDDEN, 132, rows)
    block_n = max(gemv.MIN_BLOCK_N, c.block_n // 2) if gated else c.block_n
    split = 1 if norm or gated else c.split_k
    const = dict(
        BLOCK_N=block_n, BLOCK_K=c.block_k, BLOCK_M=gemv.block_m(rows), SPLIT_K=split, HAS_BIAS=False,
        EVEN_K=True, DOT_F32=False, PDL=True, NORM=norm, HAS_RES=norm, GATED=gated,
    )  # fmt: skip
    options = dict(num_warps=c.num_warps, num_stages=c.num_stages, launch_pdl=True)
    what = f"{what}, {rows} row{'s' if rows > 1 else ''} ({block_n} x {c.block_k}, split {split})"
    return what, gemv._gemv_kernel, const, _gemv_args(rows, n, norm), options


@dataclass(frozen=True)
class Attention:
    """A model's attention as the engine lays it out: the cache ``[2, NUM_BLOCKS, 16 tokens, kv_heads,
    head_dim]``, queries (and this step's keys and values) views of the qkv projection's output, the output
    ``[tokens, heads, head_dim]``; ``dtype`` that of all of them (fp32: the GPU checks' parity runs)."""

    heads: int
    kv_heads: int
    head_dim: int
    dtype: str = PTR

    @property
    def qkv(self) -> int:
        return (self.heads + 2 * self.kv_heads) * self.head_dim

    def cache_strides(self) -> dict:
        tok = self.kv_heads * self.head_dim
        return dict(
            stride_c_kv=NUM_BLOCKS * 16 * tok, stride_c_blk=16 * tok, stride_c_tok=tok, stride_c_head=self.head_dim
        )

    def args(self) -> dict:
        d, p = self.head_dim, self.dtype
        return dict(
            q_ptr=p, cache_ptr=p, kv_scale_ptr=PTR_F32, bt_ptr=PTR_I32, seq_lens_ptr=PTR_I32, qsl_ptr=PTR_I32,
            out_ptr=p, scale_log2=0.1275, stride_qt=self.qkv, stride_qh=d, stride_ot=self.heads * d, stride_oh=d,
            stride_bt=MAX_BLOCKS, head_dim=d, **self.cache_strides(),
        )  # fmt: skip

    def dot_args(self) -> dict:
        """``DOT_F32`` and ``PRECISION`` as a GPU launch sets them (`triton_kernels._dot_args`)."""
        dot_f32, precision = tk._dot_args(TENSORS[self.dtype], torch.device("cuda"))
        return dict(DOT_F32=dot_f32, PRECISION=precision)

    def tiles(self, block_n: int, stages: int) -> tuple[int, int]:
        """The key tile and stages the launchers take for these rows (`triton_kernels._wide_head_tiles`)."""
        return tk._wide_head_tiles(block_n, stages, tk._block_d(self.head_dim), TENSORS[self.dtype].itemsize)


LLAMA3 = Attention(heads=32, kv_heads=8, head_dim=128)  # Llama-3-8B; Mistral-7B's and Qwen3-8B's are the same
GEMMA2 = Attention(heads=16, kv_heads=8, head_dim=256)  # Gemma-2-9B: window 4,096 on every other layer, soft-cap 50
GEMMA2_F32 = Attention(heads=16, kv_heads=8, head_dim=256, dtype=PTR_F32)  # gpu_families_check's parity runs


def _split_constexprs(fn, values: dict) -> tuple[dict, dict]:
    """``(constexprs, runtime arguments)`` of launch keywords: `triton_kernels._variant_args` returns both."""
    const = {p.name for p in fn.params if p.is_constexpr}
    return {k: v for k, v in values.items() if k in const}, {k: v for k, v in values.items() if k not in const}


def _variant(fn, window: int, softcap: float) -> tuple[dict, dict, str]:
    """A layer's sliding window and soft-cap as the launchers pass them, and their words for the variant's name."""
    const, args = _split_constexprs(fn, tk._variant_args(window, softcap))
    words = [f"window {window}"] * (window > 0) + [f"soft-cap {softcap:g}"] * (softcap > 0)
    return const, args, f" ({', '.join(words)})" if words else ""


def _decode(
    block_n: int, splits: int, warps: int, stages: int, what: str, rope: bool = False,
    attn: Attention = LLAMA3, window: int = 0, softcap: float = 0.0,
) -> tuple:  # fmt: skip
    block_n, stages = attn.tiles(block_n, stages)
    group = attn.heads // attn.kv_heads
    variant, variant_args, words = _variant(tk._decode_kernel, window, softcap)
    const = dict(
        GROUP=group, BLOCK_SIZE=16, BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_D=tk._block_d(attn.head_dim),
        BLOCK_N=block_n, NUM_SPLITS=splits, KV_FP8=False, F16_DOT=False, FUSED_REDUCE=splits > 1, SPLITS_P2=splits,
        PDL=True, ROPE_KV=rope, **attn.dot_args(), **variant,
    )  # fmt: skip
    args = dict(
        attn.args(), part_acc_ptr=PTR_F32, part_m_ptr=PTR_F32, part_l_ptr=PTR_F32, cnt_ptr=PTR_I32,
        num_heads=attn.heads, **variant_args,
    )  # fmt: skip
    if rope:  # RoPE in the decode kernel: the keys and values are views of the qkv block, the tables fp32
        d = attn.head_dim
        args |= dict(
            pos_ptr=PTR_I64, k_new_ptr=attn.dtype, v_new_ptr=attn.dtype, cos_ptr=PTR_F32, sin_ptr=PTR_F32,
            slot_ptr=PTR_I64, stride_kt=attn.qkv, stride_kh=d, stride_vt=attn.qkv, stride_vh=d, stride_cos=d,
        )  # fmt: skip
    options = dict(num_warps=warps, num_stages=stages, launch_pdl=True)
    return what + words, tk._decode_kernel, const, args, options


def _prefill(
    block_m: int, block_n: int, warps: int, stages: int, what: str,
    attn: Attention = LLAMA3, window: int = 0, softcap: float = 0.0,
) -> tuple:  # fmt: skip
    block_n, stages = attn.tiles(block_n, stages)
    group = attn.heads // attn.kv_heads
    variant, variant_args, words = _variant(tk._prefill_kernel, window, softcap)
    const = dict(
        GROUP=group, BLOCK_SIZE=16, BLOCK_M=block_m, BLOCK_Q=block_m // group, BLOCK_D=tk._block_d(attn.head_dim),
        BLOCK_N=block_n, KV_FP8=False, F16_DOT=False, **attn.dot_args(), **variant,
    )  # fmt: skip
    args = dict(attn.args(), num_seqs=37, **variant_args)  # num_seqs, window: not specialized (do_not_specialize)
    return what + words, tk._prefill_kernel, const, args, dict(num_warps=warps, num_stages=stages)


FOLDS = (
    (QKV, "q/k/v, the norm folded in", True, False),
    (GATE_UP, "gate/up, the norm folded in", True, False),
    (GATE_UP, "gate/up, SiLU-and-mul in its epilogue", False, True),
    (GATE_UP, "gate/up, the norm and SiLU-and-mul folded in", True, True),
)


def _rope_kv(attn: Attention = LLAMA3, what: str = "") -> tuple:
    """`fused.rope_and_write_kv_` as a decode step launches it (steps past the decode kernel's RoPE)."""
    d = attn.head_dim
    const = dict(
        HALF=d // 2, BLOCK_HQ=triton.next_power_of_2(attn.heads), BLOCK_HK=triton.next_power_of_2(attn.kv_heads),
        PDL=True, WRITE_KV=True,
    )  # fmt: skip
    args = dict(
        pos_ptr=PTR_I64, q_ptr=PTR, k_ptr=PTR, cos_ptr=PTR_F32, sin_ptr=PTR_F32, stride_qt=attn.qkv, stride_qh=d,
        stride_kt=attn.qkv, stride_kh=d, stride_cos=d, num_q_heads=attn.heads, num_k_heads=attn.kv_heads, v_ptr=PTR,
        cache_ptr=PTR, slot_ptr=PTR_I64, stride_vt=attn.qkv, stride_vh=d, block_size=16, **attn.cache_strides(),
    )  # fmt: skip
    options = dict(num_warps=4, num_stages=3, launch_pdl=True)  # the launch's warps, Triton's default stages
    return f"RoPE and the KV write (their own kernel){what}", fused._rope_kernel, const, args, options


# fp8 W8A8 linear layers (`fp8_kernels.fp8_linear`) at Llama-3-8B's projections: (N, K, name)
FP8_LAYERS = ((QKV, HIDDEN, "q/k/v"), (GATE_UP, HIDDEN, "gate/up"), (HIDDEN, 14336, "down"))


def _fp8_gemv(rows: int, n: int, k: int, what: str) -> tuple:
    """`fp8_kernels.fp8_gemv` for ``rows`` rows: its config from `gemv_config` (132 SMs), split-K only over one
    row tile (the layer always passes its counters)."""
    bm = fp8_kernels.block_m(rows)
    c = fp8_kernels.gemv_config(n, k, 132, bm)
    split = c.split_k if rows <= bm else 1
    const = dict(
        BLOCK_N=c.block_n, BLOCK_K=c.block_k, BLOCK_M=bm, SPLIT_K=split, HAS_BIAS=False,
        EVEN_K=k % (c.block_k * split) == 0, DOT=c.dot, PROMOTE_K=c.promote, EXACT_ROUND=False,
        PDL=True,
    )  # fmt: skip
    const["AMAX_M"], const["AMAX_K"] = fp8_kernels.amax_tile(rows, bm, c.block_k)
    args = dict(
        x_ptr=PTR, w_ptr=PTR_FP8, sw_ptr=PTR_F32, b_ptr=PTR_F32, out_ptr=PTR, ws_ptr=PTR_F32, cnt_ptr=PTR_I32,
        M=rows, N=n, K=k, stride_xm=k, stride_wn=k, stride_om=n,
    )  # fmt: skip
    options = dict(num_warps=c.num_warps, num_stages=c.num_stages, launch_pdl=True)
    rows_words = f"{rows} row{'s' if rows > 1 else ''}"
    what = f"fp8 GEMV, {what}, {rows_words} ({c.block_n} x {c.block_k} x {bm}, split {split})"
    return what, fp8_kernels._fp8_gemv_kernel, const, args, options


def _fp8_quant_rows(k: int) -> tuple:
    """`fp8_kernels.quantize_rows`, the rows of x ahead of ``_scaled_mm`` (steps past `GEMV_ROWS` rows)."""
    block = min(4096, triton.next_power_of_2(k))
    const = dict(BLOCK_K=block, EXACT_ROUND=False, PDL=True)
    args = dict(x_ptr=PTR, q_ptr=PTR_FP8, s_ptr=PTR_F32, K=k, stride_xm=k, stride_qm=k)
    options = dict(num_warps=4 if block <= 2048 else 8, num_stages=3, launch_pdl=True)
    return f"fp8 row quantizer, K {k}", fp8_kernels._quant_rows_kernel, const, args, options


# Mixture-of-experts layers: (experts, top_k, hidden, intermediate). The grouped GEMM's compile depends on the
# tiles only (every size here is a multiple of 16), so Qwen3-30B-A3B's stands for both; the fused routing's on
# the experts and top_k, so each model's largest fused step (`fused_moe.MAX_FUSED_PAIRS` pairs) is compiled.
QWEN3_MOE, MIXTRAL = (128, 8, 2048, 768), (8, 2, 4096, 14336)


def _moe_route(model: tuple, what: str) -> tuple:
    """`fused_moe.route_and_align` at the most tokens it routes in its one program (bf16 router logits), at the
    row block the layer's grouped GEMM takes for them."""
    e, top_k, _, _ = model
    tokens = fused_moe.MAX_FUSED_PAIRS // top_k
    block_m = fused_moe.gemm_config(tokens, top_k, e)["BLOCK_M"]
    n = tokens * top_k
    assert n <= fused_moe.MAX_FUSED_PAIRS and e <= fused_moe.MAX_FUSED_EXPERTS
    cap = -(-(n + min(n, e) * (block_m - 1)) // block_m) * block_m
    const = dict(
        TOP_K=top_k, RENORMALIZE=True, BLOCK_M=block_m, BLOCK_T=triton.next_power_of_2(tokens),
        BLOCK_E=triton.next_power_of_2(e), K_P2=triton.next_power_of_2(top_k),
        BLOCKS_P2=triton.next_power_of_2(cap // block_m), FILL=256,
    )  # fmt: skip
    args = dict(
        logits_ptr=PTR, weights_ptr=PTR_F32, ids_ptr=PTR_I32, sorted_pairs_ptr=PTR_I32, block_experts_ptr=PTR_I32,
        padded_total_ptr=PTR_I32, T=tokens, E=e, stride_l=e, cap=cap, num_blocks=cap // block_m,
    )  # fmt: skip
    what = f"MoE routing and sort, {what}, {tokens} tokens x {top_k} of {e} experts"
    return what, fused_moe._route_align_kernel, const, args, dict(num_warps=8, num_stages=3)


def _moe_gemm(tokens: int, gated: bool, what: str, model: tuple = QWEN3_MOE) -> tuple:
    """`fused_moe._grouped_gemm` for ``tokens`` tokens at `gemm_config`'s tiles: gate/up (``GATED``) or down (the
    routing weights applied). Past the fused routing's pairs the sort is torch's (an int64 padded total)."""
    e, top_k, h, i = model
    cfg = dict(fused_moe.gemm_config(tokens, top_k, e))
    options = dict(num_warps=cfg.pop("num_warps"), num_stages=cfg.pop("num_stages"))
    n, k = (i, h) if gated else (h, i)
    pairs = tokens * top_k
    fused_route = pairs <= fused_moe.MAX_FUSED_PAIRS
    args = dict(
        a_ptr=PTR, w_ptr=PTR, out_ptr=PTR, pair_weights_ptr=PTR_F32, sorted_pairs_ptr=PTR_I32,
        block_experts_ptr=PTR_I32, padded_total_ptr=PTR_I32 if fused_route else PTR_I64, num_pairs=pairs, N=n, K=k,
        pairs_per_row=top_k if gated else 1, stride_am=k, stride_we=(2 if gated else 1) * n * k, stride_wn=k,
        stride_om=n,
    )  # fmt: skip
    const = dict(cfg, GATED=gated, WEIGHTED=not gated, DOT_F32=False)
    tiles = f"{cfg['BLOCK_M']} x {cfg['BLOCK_N']} x {cfg['BLOCK_K']}"
    return f"MoE grouped GEMM, {what}, {tokens} tokens ({tiles})", fused_moe._grouped_gemm_kernel, const, args, options


def _moe_decode(model: tuple, what: str) -> list[tuple]:
    """`moe_decode.decode_moe`'s three kernels for one token at its default tiles (`DecodeMoEConfig`, the down
    kernel's split for 132 SMs)."""
    e, top_k, h, i = model
    c = moe_decode.DecodeMoEConfig()
    stages = moe_decode.stages_for(c.num_stages, torch.bfloat16.itemsize)  # the launch's rule, bf16 activations
    options = dict(num_warps=c.num_warps, num_stages=stages, launch_pdl=True)
    k_p2 = triton.next_power_of_2(top_k)
    router = dict(
        x_ptr=PTR, w_ptr=PTR, logits_ptr=PTR_F32, weights_ptr=PTR_F32, ids_ptr=PTR_I32, cnt_ptr=PTR_I32, T=1, E=e,
        H=h, stride_xm=h, stride_we=h,
    )  # fmt: skip
    router_const = dict(
        TOP_K=top_k, RENORMALIZE=True, BLOCK_E=c.router_block_e, BLOCK_K=c.router_block_k,
        ALL_E=triton.next_power_of_2(e), K_P2=k_p2, DOT_F32=False, PDL=True,
    )  # fmt: skip
    gate_up = dict(
        x_ptr=PTR, w_ptr=PTR, ids_ptr=PTR_I32, act_ptr=PTR, INTER=i, H=h, stride_xm=h, stride_we=2 * i * h,
        stride_wn=h, stride_am=i,
    )  # fmt: skip
    gate_up_const = dict(TOP_K=top_k, BLOCK_N=c.gate_up_block_n, BLOCK_K=c.gate_up_block_k, DOT_F32=False, PDL=True)
    split, per_split = moe_decode.down_programs(
        moe_decode.down_split(triton.cdiv(h, c.down_block_n), 1, top_k, 132), top_k
    )
    down = dict(
        act_ptr=PTR, w_ptr=PTR, ids_ptr=PTR_I32, weights_ptr=PTR_F32, out_ptr=PTR, ws_ptr=PTR_F32, cnt_ptr=PTR_I32,
        T=1, H=h, INTER=i, stride_am=i, stride_we=h * i, stride_wn=i, stride_om=h,
    )  # fmt: skip
    down_const = dict(
        TOP_K=top_k, K_P2=k_p2, PER_SPLIT=per_split, SPLIT=split, BLOCK_N=c.down_block_n,
        BLOCK_K=moe_decode.down_block_k(i), DOT_F32=False, PDL=True,
    )  # fmt: skip
    return [
        (f"MoE decode router and top-k, {what}", moe_decode._router_top_k_kernel, router_const, router, options),
        (f"MoE decode gate/up, {what}", moe_decode._gate_up_kernel, gate_up_const, gate_up, options),
        (f"MoE decode down and sum, {what} (split {down_const['SPLIT']})", moe_decode._down_sum_kernel, down_const,
         down, options),
    ]  # fmt: skip


def _bitmask(logits: str, what: str, vocab: int = 128256) -> tuple:
    """`bitmask.apply_token_bitmask_` over Llama-3's vocabulary: the step's logits (a graph's, the model's dtype)
    or a speculative step's (fp32)."""
    words = -(-vocab // 32)
    const = dict(BLOCK=bitmask._BLOCK)
    args = dict(
        logits_ptr=logits, bitmask_ptr=PTR_I32, rows_ptr=PTR_I64, vocab=vocab, logits_stride=vocab,
        bitmask_stride=words,
    )  # fmt: skip
    options = dict(num_warps=4, num_stages=3)  # the launch's warps, Triton's default stages
    return f"structured-output bitmask, {what}", bitmask_kernel.apply_bitmask_kernel, const, args, options


def _head256(splits: int, rope: bool, window: int, softcap: float, attn: Attention = GEMMA2) -> tuple:
    """Decode attention at head size 256 (Gemma 2/3) as `paged_decode` launches it there."""
    words = " with RoPE and the KV write" if rope else ""
    what = f"decode attention{words}, head 256{' in fp32' if attn.dtype == PTR_F32 else ''}, {splits} splits"
    return _decode(128, splits, 4, 3, what, rope=rope, attn=attn, window=window, softcap=softcap)


# The GEMV at one row (the steps of a run's long tail; at 1 row M is a constant), 16 and 64; the folds at 1 and 16
# rows (the engine folds to 16; `folds32` past it); decode attention, also with RoPE and the KV write in it, at each
# split count a graph plans (`TritonAttentionBackend.decode_splits`, contexts to 8,192): 32 at 1-2 running,
# 16 at 3-4, 8 at 5-8, 4 at 9-16, 2 at 17-64, 1 from 65; SLUICE_DECODE_BLOCK_N=64 the 64-key tile. Windows and
# soft-caps (shared memory is the same at every split count; 32 splits with RoPE is the most code): Mistral's window
# at Llama's shapes, Gemma 2's window and soft-cap (its local layers) and soft-cap alone (its global ones) at head
# size 256, Gemma 3's window alone there. The fp8 GEMV at 1 row and `GEMV_ROWS` (one row tile each) and at 64 rows (the
# shapes `_scaled_mm` refuses take it there); the fused MoE's routing at its largest fused steps and its grouped
# GEMMs at each tier of `gemm_config` (a decode step's, a few hundred tokens', a long prompt's).
W, CAP = 4096, 50.0  # Gemma 2's window and soft-cap (Mistral-7B-v0.1's window is 4,096 too)
VARIANTS = {
    "gemv": [
        *(_gemv(rows, n, what) for rows in (1, 16, 64) for n, what in ((QKV, "q/k/v"), (GATE_UP, "gate/up"))),
        *(
            _gemv(rows, n, what, norm=norm, gated=gated)
            for rows in (1, gemv.FOLD_NORM_ROWS)
            for n, what, norm, gated in FOLDS
        ),
    ],
    # not launched: the folds at 32 rows, past the engine's limit (why 16 is the limit: shared memory)
    "folds32": [_gemv(2 * gemv.FOLD_NORM_ROWS, n, what, norm=norm, gated=gated) for n, what, norm, gated in FOLDS],
    "decode": [
        *(
            _decode(bn, splits, 4, 3, f"decode attention, {bn}-key tile, {splits} splits")
            for bn in (128, 64)
            for splits in (32, 16, 8, 4, 2, 1)
        ),
        *(
            _decode(128, splits, 4, 3, f"decode attention with RoPE and the KV write, {splits} splits", rope=True)
            for splits in (32, 2, 1)
        ),
        _decode(128, 32, 4, 3, "decode attention with RoPE and the KV write, 32 splits", rope=True, window=W),
        _decode(128, 1, 4, 3, "decode attention, 1 splits", window=W),
        _head256(32, True, W, CAP),
        _head256(1, False, W, CAP),
        _head256(1, False, 0, CAP),
        _head256(1, False, 1024, 0.0),  # Gemma 3's local layers
        # not served, but launched by gpu_families_check's parity runs: fp32 rows of 1 KiB, whose swept tiles
        # (128 keys, 3 stages) asked for 281 KiB; the launchers shrink them (`_wide_head_tiles`)
        _head256(1, False, W, CAP, GEMMA2_F32),
    ],
    "prefill": [  # and the RoPE/KV-write kernel of steps with prompt rows
        _rope_kv(),
        _rope_kv(GEMMA2, ", head 256"),
        _prefill(64, 64, 4, 2, "prefill attention, the engine's tile"),
        _prefill(128, 64, 8, 2, "prefill attention, 128 x 64, 8 warps"),
        _prefill(64, 64, 4, 2, "prefill attention, the engine's tile", window=W),
        *(
            _prefill(64, 64, 4, 2, "prefill attention, head 256", attn=GEMMA2, window=window, softcap=CAP)
            for window in (W, 0)
        ),
        _prefill(64, 64, 4, 2, "prefill attention, head 256", attn=GEMMA2, window=1024),
    ],
    # not served: Gemma 2's prefill in fp32, as gpu_families_check's parity runs launch it (fits even with the
    # swept tiles; the slowest compile here)
    "fp32": [
        _prefill(64, 64, 4, 2, "prefill attention, head 256 in fp32", attn=GEMMA2_F32, window=W, softcap=CAP),
    ],
    "fp8": [
        *(_fp8_gemv(rows, n, k, what) for rows in (1, fp8_kernels.GEMV_ROWS) for n, k, what in FP8_LAYERS),
        _fp8_gemv(64, GATE_UP, HIDDEN, "gate/up"),
        _fp8_quant_rows(HIDDEN),
    ],
    "moe": [
        _moe_route(QWEN3_MOE, "Qwen3-30B-A3B"),
        _moe_route(MIXTRAL, "Mixtral-8x7B"),
        *(
            _moe_gemm(tokens, gated, what)
            for tokens in (16, 512, 4096)
            for gated, what in ((True, "gate/up and SiLU-and-mul"), (False, "down, routing-weighted"))
        ),
        *_moe_decode(QWEN3_MOE, "Qwen3-30B-A3B"),
        *_moe_decode(MIXTRAL, "Mixtral-8x7B"),
    ],
    "structured": [_bitmask(PTR, "bf16 logits"), _bitmask(PTR_F32, "fp32 logits (speculative steps)")],
}
DEFAULT_GROUPS = ["gemv", "decode", "prefill", "fp8", "moe", "structured"]


def specialize(fn, args: dict) -> tuple[dict, dict, dict]:
    """The signature, the divisibility attributes and the constants (integers equal to 1, pointers left None) the
    runtime gives a launch with these argument values: Triton's own rule (``native_specialize_impl``, as
    `JITFunction` calls it), honouring the kernel's ``do_not_specialize``."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    sig, attrs, ones = {}, {}, {}
    for i, param in enumerate(fn.params):
        name = param.name
        if param.is_constexpr or (name not in args and not param.has_default):
            continue
        value = args[name] if name in args else param.default  # an optional argument the launch leaves out
        if isinstance(value, str):
            value = torch.empty(16, dtype=TENSORS[value])  # CPU allocations are 64-byte aligned
        ty, key = native_specialize_impl(
            BaseBackend, value, False, not param.do_not_specialize, not param.do_not_specialize_on_alignment
        )[:2]
        if ty == "constexpr":
            ones[(i,)] = key
        else:
            sig[name] = ty
            if key == "D":
                attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, attrs, ones


def ptxas_usage(ptx: str) -> str:
    """Registers and spills of the kernel, from ptxas -v (of the ptxas Triton ships for sm_90)."""
    from triton.backends.nvidia.compiler import get_ptxas

    ptxas = get_ptxas(90).path  # the one this Triton compiles sm_90 with (its PTX version may need a newer one)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        out = subprocess.run(
            [ptxas, "--gpu-name", "sm_90a", "-v", path, "-o", os.devnull], capture_output=True, text=True
        )
    text = (out.stderr + out.stdout).splitlines()
    used = [line.split("info    : ")[-1] for line in text if "info    : Used" in line]
    if not used:
        return " ".join(text[-2:])  # ptxas refused the PTX: say why
    spills = [line.strip() for line in text if "spill stores" in line]
    return "; ".join(used + spills)


def compile_variant(fn, const: dict, args: dict, options: dict) -> dict:
    sig, attrs, ones = specialize(fn, args)
    # a constexpr the launch leaves out takes its default, as the runtime binds it (SLIDING=False, say)
    const = {p.name: p.default for p in fn.params if p.is_constexpr and p.has_default} | const
    constexprs = {(fn.arg_names.index(k),): v for k, v in const.items()} | ones
    for name in const:
        sig[name] = "constexpr"
    for (i,) in ones:
        sig[fn.arg_names[i]] = "constexpr"
    sig = {name: sig[name] for name in fn.arg_names}
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    ptx = kernel.asm["ptx"]
    return {
        "ptxas": ptxas_usage(ptx),
        "smem": kernel.metadata.shared,
        **({"over the H200's shared memory": SMEM_LIMIT} if kernel.metadata.shared > SMEM_LIMIT else {}),
        "ld.global": ptx.count("ld.global"),
        "ld.global.v4": ptx.count("ld.global.v4"),
        "cp.async": ptx.count("cp.async.cg") + ptx.count("cp.async.ca"),
        "wgmma": ptx.count("wgmma.mma_async"),
        "mma.sync": ptx.count("mma.sync"),
        "ex2": ptx.count("ex2"),
    }


def main() -> None:
    groups = sys.argv[1:] or DEFAULT_GROUPS
    print(f"triton {triton.__version__}, target sm_90")
    over = []
    for group in groups:
        print(f"{group}:")
        for what, fn, const, args, options in VARIANTS[group]:
            print(f"  {what} ({options['num_warps']} warps, {options['num_stages']} stages):")
            result = compile_variant(fn, const, args, options)
            print(f"    {result}")
            if result["smem"] > SMEM_LIMIT:
                over.append(what)
    print(f"over the H200's shared memory: {over or 'none'}")


if __name__ == "__main__":
    main()
