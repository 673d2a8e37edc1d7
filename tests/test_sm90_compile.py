"""The engine's Triton kernels compile for the H200 (sm_90) on a machine without a GPU, each variant the engine
launches, specialized as the engine's launches are (`scripts/sm90_compile_check.py`): the GEMV and its folds,
paged attention (plain, and with the sliding windows and soft-caps of Mistral and Gemma 2/3 at head size 128 and
256), the fp8 linear layer's kernels, the fused MoE's, the structured-output bitmask; and each fits the H200's
shared memory. The CPU tests run the kernels under Triton's interpreter, which checks neither: a kernel that only
the GPU's compiler refuses (a loop-carried variable whose type changes, say) fails here first."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton.backends.nvidia.compiler")

ROOT = Path(__file__).resolve().parents[1]
GROUPS = ("gemv", "decode", "prefill", "fp8", "moe", "structured")  # the script's default


def test_the_engines_kernels_compile_for_sm90_and_fit_its_shared_memory():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # a real compile, not the interpreter
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "sm90_compile_check.py")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert [line[:-1] for line in lines if not line.startswith(" ") and line.endswith(":")] == list(GROUPS)
    assert sum("'ptxas': 'Used" in line for line in lines) >= 60  # every variant compiled and was assembled
    for kernel in ("window 4096, soft-cap 50", "head 256", "fp8 GEMV", "fp8 row quantizer", "MoE routing",
                   "MoE grouped GEMM", "MoE decode router", "MoE decode gate/up", "MoE decode down",
                   "structured-output bitmask"):  # fmt: skip
        assert any(kernel in line for line in lines), kernel
    assert lines[-1] == "over the H200's shared memory: none"
