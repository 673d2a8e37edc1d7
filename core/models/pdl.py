"""Programmatic dependent launch (PDL, Hopper and later) for the decode step's weight-streaming GEMVs.

A batch-1 decode step is a chain of ~360 small kernels. Each int4 GEMV streams its weights, and until its
first loads return the memory bus idles, as it does while the norms, RoPE and attention between the GEMVs
run: on the H200 a GEMV of a few megabytes took 2-3x the time its bytes need (docs/benchmarks.md).

With PDL the chain overlaps where it is safe to. A kernel launched with ``launch_pdl=True`` may start once
every program of the kernel before it has called ``gdc_launch_dependents()`` (or ended), and ``gdc_wait()``
in it returns once that kernel has ended and its writes are visible:

* the GEMV calls ``gdc_launch_dependents()`` first, asks L2 for its weights (which no earlier kernel
  writes), and only after ``gdc_wait()`` reads its input and writes anything (output, split-K partials,
  counters). Its weight reads overlap the kernel before it; nothing it reads or writes can race with it;
* the small kernels of the step (fused norms, RoPE, SiLU-and-mul, KV write, decode attention) read the
  previous kernel's output at once, so they start with `wait_then_release`: ``gdc_wait()``, then
  ``gdc_launch_dependents()``. Launched early, they skip the launch gap; releasing their successor as they
  start lets the next GEMV prefetch while they run.

Chains stay correct however far they run ahead: each kernel waits for the one before it, which waited for
the one before it. A kernel whose predecessor does not release early (cuBLAS, torch ops) simply starts when
it ends, as without PDL.

Both calls are no-ops on a GPU without PDL support, but they do not compile for the CPU interpreter and need
sm_90, so every kernel takes them behind a constexpr that `pdl_enabled` sets. ``SLUICE_PDL=0`` turns them off
(for side-by-side timing).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


def pdl_enabled(device: torch.device) -> bool:
    """Whether kernels on ``device`` use programmatic dependent launch (CUDA, compute capability >= 9.0)."""
    if device.type != "cuda" or os.environ.get("SLUICE_PDL", "1") == "0":
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def pdl_launch(device: torch.device) -> dict:
    """Launch keywords for a kernel with a ``PDL`` constexpr: ``PDL=True, launch_pdl=True`` where enabled."""
    return {"PDL": True, "launch_pdl": True} if pdl_enabled(device) else {"PDL": False}


@triton.jit
def wait_then_release(PDL: tl.constexpr):
    """First thing in a PDL-launched kernel that reads its predecessor's output: wait for it, then let the next
    kernel launch (the module doc)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
