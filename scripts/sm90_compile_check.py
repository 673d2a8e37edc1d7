"""Compile the decode path's Triton kernels for the H200 (sm_90) on a machine without a GPU: Triton's bundled
ptxas does the work, so a kernel change can be checked against the GPU machine's Triton before device time is
spent on it. Prints, per variant, its registers and spills (ptxas -v over the kernel's PTX), shared memory,
global loads, MMA instructions and exponentials in the PTX; last, the variants that would not fit the H200's
shared memory (a launch of one fails). `tests/test_sm90_compile.py` runs it in CI.

    python scripts/sm90_compile_check.py [gemv] [decode] [prefill] [folds32]   # default: the first three
    PYTHONPATH=/tmp/t36:$(scripts/namespace_path.sh) python scripts/sm90_compile_check.py   # another Triton
                                            # (e.g. `pip install --no-deps --target /tmp/t36 triton==3.6.0`)
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)  # a real compile, not the interpreter

import triton  # noqa: E402
from sluice.core.models import fused, gemv  # noqa: E402
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
PTR_F32, PTR_I32, PTR_I64 = "ptr_f32", "ptr_i32", "ptr_i64"
SMEM_LIMIT = 232448  # bytes of shared memory a program may use on the H200 (227 KiB): more fails at launch


def _gemv_args(rows: int, n: int, norm: bool) -> dict:
    return dict(
        x_ptr=PTR, w_ptr=PTR, b_ptr=PTR, out_ptr=PTR, ws_ptr=PTR_F32, cnt_ptr=PTR_I32, res_ptr=PTR, nw_ptr=PTR,
        res_out_ptr=PTR, eps=1e-5, M=rows, N=n, K=HIDDEN, stride_xm=HIDDEN, stride_wn=HIDDEN, stride_om=n,
        stride_rm=HIDDEN, stride_rom=HIDDEN if norm else n,  # without a norm: x's and out's (`gemv._run`)
    )  # fmt: skip


# the cache's strides: [2, blocks, 16 tokens, 8 KV heads, 128]
_CACHE_STRIDES = dict(stride_c_kv=NUM_BLOCKS * 16 * 1024, stride_c_blk=16 * 1024, stride_c_tok=1024, stride_c_head=128)
_ATTN_ARGS = dict(
    q_ptr=PTR, cache_ptr=PTR, kv_scale_ptr=PTR_F32, bt_ptr=PTR_I32, seq_lens_ptr=PTR_I32, qsl_ptr=PTR_I32,
    out_ptr=PTR, scale_log2=0.1275, stride_qt=QKV, stride_qh=128, stride_ot=HIDDEN, stride_oh=128,
    stride_bt=MAX_BLOCKS, head_dim=128, **_CACHE_STRIDES,
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


def _decode(block_n: int, splits: int, warps: int, stages: int, what: str, rope: bool = False) -> tuple:
    const = dict(
        GROUP=4, BLOCK_SIZE=16, BLOCK_H=16, BLOCK_D=128, BLOCK_N=block_n, NUM_SPLITS=splits, DOT_F32=False,
        PRECISION="tf32", KV_FP8=False, F16_DOT=False, FUSED_REDUCE=splits > 1, SPLITS_P2=splits, PDL=True,
        ROPE_KV=rope,
    )  # fmt: skip
    args = dict(_ATTN_ARGS, part_acc_ptr=PTR_F32, part_m_ptr=PTR_F32, part_l_ptr=PTR_F32, cnt_ptr=PTR_I32, num_heads=32)
    if rope:  # RoPE in the decode kernel: the keys and values are views of the qkv block, the tables fp32
        args |= dict(
            pos_ptr=PTR_I64, k_new_ptr=PTR, v_new_ptr=PTR, cos_ptr=PTR_F32, sin_ptr=PTR_F32, slot_ptr=PTR_I64,
            stride_kt=QKV, stride_kh=128, stride_vt=QKV, stride_vh=128, stride_cos=128,
        )  # fmt: skip
    return what, tk._decode_kernel, const, args, dict(num_warps=warps, num_stages=stages, launch_pdl=True)


def _prefill(block_m: int, block_n: int, warps: int, stages: int, what: str) -> tuple:
    const = dict(
        GROUP=4, BLOCK_SIZE=16, BLOCK_M=block_m, BLOCK_Q=block_m // 4, BLOCK_D=128, BLOCK_N=block_n, DOT_F32=False,
        PRECISION="tf32", KV_FP8=False, F16_DOT=False,
    )  # fmt: skip
    args = dict(_ATTN_ARGS, num_seqs=37)  # not specialized (do_not_specialize)
    return what, tk._prefill_kernel, const, args, dict(num_warps=warps, num_stages=stages)


FOLDS = (
    (QKV, "q/k/v, the norm folded in", True, False),
    (GATE_UP, "gate/up, the norm folded in", True, False),
    (GATE_UP, "gate/up, SiLU-and-mul in its epilogue", False, True),
    (GATE_UP, "gate/up, the norm and SiLU-and-mul folded in", True, True),
)


def _rope_kv() -> tuple:
    """`fused.rope_and_write_kv_` as a decode step of Llama-3-8B launches it (steps past the decode kernel's RoPE)."""
    const = dict(HALF=64, BLOCK_HQ=32, BLOCK_HK=8, PDL=True, WRITE_KV=True)
    args = dict(
        pos_ptr=PTR_I64, q_ptr=PTR, k_ptr=PTR, cos_ptr=PTR_F32, sin_ptr=PTR_F32, stride_qt=QKV, stride_qh=128,
        stride_kt=QKV, stride_kh=128, stride_cos=128, num_q_heads=32, num_k_heads=8, v_ptr=PTR, cache_ptr=PTR,
        slot_ptr=PTR_I64, stride_vt=QKV, stride_vh=128, block_size=16, **_CACHE_STRIDES,
    )  # fmt: skip
    options = dict(num_warps=4, num_stages=3, launch_pdl=True)  # the launch's warps, Triton's default stages
    return "RoPE and the KV write (their own kernel)", fused._rope_kernel, const, args, options


# The GEMV at one row (the steps of a run's long tail; at 1 row M is a constant), 16 and 64; the folds at 1 and 16
# rows (the engine folds to 16; `folds32` past it); decode attention, also with RoPE and the KV write in it, at each
# split count a graph plans (`TritonAttentionBackend.decode_splits`, contexts to 8,192): 32 at 1-2 running,
# 16 at 3-4, 8 at 5-8, 4 at 9-16, 2 at 17-64, 1 from 65; SLUICE_DECODE_BLOCK_N=64 the 64-key tile
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
    ],
    "prefill": [  # and the RoPE/KV-write kernel of steps with prompt rows
        _rope_kv(),
        _prefill(64, 64, 4, 2, "prefill attention, the engine's tile"),
        _prefill(128, 64, 8, 2, "prefill attention, 128 x 64, 8 warps"),
    ],
}


def specialize(fn, args: dict) -> tuple[dict, dict, dict]:
    """The signature, the divisibility attributes and the constants (integers equal to 1, pointers left None) the
    runtime gives a launch with these argument values: Triton's own rule (``native_specialize_impl``, as
    `JITFunction` calls it), honouring the kernel's ``do_not_specialize``."""
    import torch
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    tensors = {PTR: torch.bfloat16, PTR_F32: torch.float32, PTR_I32: torch.int32, PTR_I64: torch.int64}
    sig, attrs, ones = {}, {}, {}
    for i, param in enumerate(fn.params):
        name = param.name
        if param.is_constexpr or (name not in args and not param.has_default):
            continue
        value = args[name] if name in args else param.default  # an optional argument the launch leaves out
        if isinstance(value, str):
            value = torch.empty(16, dtype=tensors[value])  # CPU allocations are 64-byte aligned
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
    groups = sys.argv[1:] or ["gemv", "decode", "prefill"]
    print(f"triton {triton.__version__}, target sm_90")
    over = []
    for group in groups:
        for what, fn, const, args, options in VARIANTS[group]:
            print(f"  {what} ({options['num_warps']} warps, {options['num_stages']} stages):")
            result = compile_variant(fn, const, args, options)
            print(f"    {result}")
            if result["smem"] > SMEM_LIMIT:
                over.append(what)
    print(f"over the H200's shared memory: {over or 'none'}")


if __name__ == "__main__":
    main()
