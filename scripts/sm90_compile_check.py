"""Compile the decode path's Triton kernels for the H200 (sm_90) on a machine without a GPU: Triton's bundled
ptxas does the work, so a kernel change can be checked against the GPU machine's Triton before device time is
spent on it. Prints, per variant, its registers and spills (ptxas -v over the kernel's PTX), shared memory,
global loads, MMA instructions and exponentials in the PTX.

    python scripts/sm90_compile_check.py [gemv] [decode] [prefill]
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
from sluice.core.models import gemv  # noqa: E402
from sluice.kv.attention import triton_kernels as tk  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

# Pointer arguments by name (bf16 model, bf16 cache); other arguments are i32, or fp32 where named here.
POINTERS = {
    "x_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16", "out_ptr": "*bf16", "ws_ptr": "*fp32", "cnt_ptr": "*i32",
    "res_ptr": "*bf16", "nw_ptr": "*bf16", "res_out_ptr": "*bf16", "q_ptr": "*bf16", "cache_ptr": "*bf16",
    "kv_scale_ptr": "*bf16", "bt_ptr": "*i32", "seq_lens_ptr": "*i32", "qsl_ptr": "*i32", "part_acc_ptr": "*fp32",
    "part_m_ptr": "*fp32", "part_l_ptr": "*fp32",
}  # fmt: skip
FLOATS = {"eps", "scale_log2"}


def _gemv(block_n: int, block_k: int, norm: bool, gated: bool, warps: int, what: str) -> tuple:
    const = dict(
        BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_M=16, SPLIT_K=1, HAS_BIAS=False, EVEN_K=True, DOT_F32=False,
        PDL=True, NORM=norm, HAS_RES=norm, GATED=gated,
    )  # fmt: skip
    return what, gemv._gemv_kernel, const, dict(num_warps=warps, num_stages=4, launch_pdl=True)


def _decode(block_n: int, splits: int, warps: int, stages: int, what: str) -> tuple:
    const = dict(
        GROUP=4, BLOCK_SIZE=16, BLOCK_H=16, BLOCK_D=128, BLOCK_N=block_n, NUM_SPLITS=splits, DOT_F32=False,
        PRECISION="tf32", KV_FP8=False, F16_DOT=False, FUSED_REDUCE=splits > 1, SPLITS_P2=splits, PDL=True,
    )  # fmt: skip
    return what, tk._decode_kernel, const, dict(num_warps=warps, num_stages=stages, launch_pdl=True)


def _prefill(block_m: int, block_n: int, warps: int, stages: int, what: str) -> tuple:
    const = dict(
        GROUP=4, BLOCK_SIZE=16, BLOCK_M=block_m, BLOCK_Q=block_m // 4, BLOCK_D=128, BLOCK_N=block_n, DOT_F32=False,
        PRECISION="tf32", KV_FP8=False, F16_DOT=False,
    )  # fmt: skip
    return what, tk._prefill_kernel, const, dict(num_warps=warps, num_stages=stages)


# Llama-3-8B's shapes: GQA group 4, head dim 128, 16-token blocks; the GEMV at 1-16 rows
VARIANTS = {
    "gemv": [
        _gemv(64, 256, False, False, 4, "q/k/v, o, down"),
        _gemv(64, 128, False, False, 4, "gate/up, LM head"),
        _gemv(64, 256, True, False, 8, "q/k/v, the norm folded in (8 warps: the engine's)"),
        _gemv(64, 256, True, False, 4, "q/k/v, the norm folded in, 4 warps"),
        _gemv(64, 128, True, False, 8, "gate/up, the norm folded in"),
        _gemv(32, 128, False, True, 4, "gate/up, SiLU-and-mul in its epilogue"),
        _gemv(32, 128, True, True, 8, "gate/up, the norm and SiLU-and-mul folded in"),
    ],
    # the split count a graph plans (`TritonAttentionBackend.decode_splits`, contexts to 8,192): 32 at 1-2 running,
    # 16 at 3-4, 8 at 5-8, 4 at 9-16, 2 at 17-64, 1 from 65; SLUICE_DECODE_BLOCK_N=64 the 64-key tile
    "decode": [
        _decode(bn, splits, 4, 3, f"decode attention, {bn}-key tile, {splits} splits")
        for bn in (128, 64)
        for splits in (32, 16, 8, 4, 2, 1)
    ],
    "prefill": [
        _prefill(64, 64, 4, 2, "prefill attention, the engine's tile"),
        _prefill(128, 64, 8, 2, "prefill attention, 128 x 64, 8 warps"),
    ],
}


def ptxas_usage(ptx: str) -> str:
    """Registers and spills of the kernel, from ptxas -v (the ptxas Triton ships)."""
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        out = subprocess.run(
            [ptxas, "--gpu-name", "sm_90a", "-v", path, "-o", os.devnull], capture_output=True, text=True
        )
    text = (out.stderr + out.stdout).splitlines()
    used = [line.split("info    : ")[-1] for line in text if "info    : Used" in line]
    spills = [line.strip() for line in text if "spill stores" in line]
    return "; ".join(used + spills)


def compile_variant(fn, const: dict, options: dict) -> dict:
    sig = {}
    for name in fn.arg_names:
        sig[name] = POINTERS.get(name) or ("fp32" if name in FLOATS else "constexpr" if name in const else "i32")
    src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in const.items()})
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    ptx = kernel.asm["ptx"]
    return {
        "ptxas": ptxas_usage(ptx),
        "smem": kernel.metadata.shared,
        "ld.global": ptx.count("ld.global"),
        "wgmma": ptx.count("wgmma.mma_async"),
        "mma.sync": ptx.count("mma.sync"),
        "ex2": ptx.count("ex2"),
    }


def main() -> None:
    groups = sys.argv[1:] or list(VARIANTS)
    print(f"triton {triton.__version__}, target sm_90")
    for group in groups:
        for what, fn, const, options in VARIANTS[group]:
            print(f"  {what} ({options['num_warps']} warps, {options['num_stages']} stages):")
            print(f"    {compile_variant(fn, const, options)}")


if __name__ == "__main__":
    main()
