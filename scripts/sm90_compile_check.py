"""Compile the few-row GEMV's kernel variants for the H200 (sm_90) on a machine without a GPU: Triton's bundled
ptxas does the work, so a kernel change can be checked against the GPU machine's Triton before device time is
spent on it. Prints, per variant, its registers and spills (ptxas -v), shared memory, global loads, MMA
instructions and exponentials in the PTX.

    python scripts/sm90_compile_check.py
    PYTHONPATH=/tmp/t36:$(scripts/namespace_path.sh) python scripts/sm90_compile_check.py   # another Triton
                                            # (e.g. `pip install --no-deps --target /tmp/t36 triton==3.6.0`)
"""

from __future__ import annotations

import os
import subprocess
import tempfile

os.environ.pop("TRITON_INTERPRET", None)  # a real compile, not the interpreter

import triton  # noqa: E402
from sluice.core.models import gemv  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

POINTERS = {
    "x_ptr": "*bf16",
    "w_ptr": "*bf16",
    "b_ptr": "*bf16",
    "out_ptr": "*bf16",
    "ws_ptr": "*fp32",
    "cnt_ptr": "*i32",
    "res_ptr": "*bf16",
    "nw_ptr": "*bf16",
    "res_out_ptr": "*bf16",
}
# (BLOCK_N, BLOCK_K, BLOCK_M, NORM, GATED, num_warps): the engine's configs at 1-16 rows, plain and folded
VARIANTS = [
    (64, 256, 16, False, False, 4),  # q/k/v, o, down
    (64, 128, 16, False, False, 4),  # gate/up, LM head
    (64, 256, 16, True, False, 8),  # q/k/v with the norm folded in
    (64, 256, 16, True, False, 4),  # ... with 4 warps (spills)
    (64, 128, 16, True, False, 8),  # gate/up with the norm folded in
    (32, 128, 16, False, True, 4),  # gate/up with SiLU-and-mul in its epilogue (half-height tiles)
    (32, 128, 16, True, True, 8),  # ... and the norm folded in
]


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
    lines = [
        line.split("info    : ")[-1] for line in (out.stderr + out.stdout).splitlines() if "info    : Used" in line
    ]
    spills = [line.split("info    : ")[-1] for line in (out.stderr + out.stdout).splitlines() if "spill stores" in line]
    return "; ".join(lines + spills)


def compile_variant(block_n: int, block_k: int, block_m: int, norm: bool, gated: bool, warps: int) -> dict:
    fn = gemv._gemv_kernel
    const = dict(
        BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_M=block_m, SPLIT_K=1, HAS_BIAS=False, EVEN_K=True, DOT_F32=False,
        PDL=True, NORM=norm, HAS_RES=norm, GATED=gated,
    )  # fmt: skip
    sig = {}
    for name in fn.arg_names:
        sig[name] = POINTERS.get(name) or ("fp32" if name == "eps" else "constexpr" if name in const else "i32")
    src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in const.items()})
    options = dict(num_warps=warps, num_stages=4, launch_pdl=True)
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
    print(f"triton {triton.__version__}, target sm_90")
    for v in VARIANTS:
        print(
            f"  BLOCK_N {v[0]:3d} BLOCK_K {v[1]:3d} BLOCK_M {v[2]:2d} norm {v[3]!s:5} gated {v[4]!s:5}",
            compile_variant(*v),
        )


if __name__ == "__main__":
    main()
