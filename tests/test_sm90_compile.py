"""The decode path's Triton kernels compile for the H200 (sm_90) on a machine without a GPU, each variant the engine
launches at Llama-3-8B's shapes, specialized as the engine's launches are (`scripts/sm90_compile_check.py`), and
each fits the H200's shared memory. The CPU tests run the kernels under Triton's interpreter, which checks neither:
a kernel that only the GPU's compiler refuses (a loop-carried variable whose type changes, say) fails here first."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton.backends.nvidia.compiler")

ROOT = Path(__file__).resolve().parents[1]


def test_the_engines_kernels_compile_for_sm90_and_fit_its_shared_memory():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # a real compile, not the interpreter
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "sm90_compile_check.py")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert sum("'ptxas': 'Used" in line for line in lines) >= 30  # every variant compiled and was assembled
    assert lines[-1] == "over the H200's shared memory: none"
