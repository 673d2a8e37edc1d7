"""Programmatic dependent launch (PDL, Hopper and later) for the kernels of a decode step.

A batch-1 decode step is a chain of ~360 small kernels. Each waits for the one before it to end, and is
only then launched and ramped up: on the H200 a GEMV of a few megabytes took 2-3x the time its bytes need,
and the gaps between kernels added ~0.4 ms to a 3.1 ms int4 step (docs/benchmarks.md).

With PDL a kernel launched with ``launch_pdl=True`` may start once every program of the kernel before it
has called ``gdc_launch_dependents()`` (or ended), and ``gdc_wait()`` in it returns once that kernel has
ended and its writes are visible. So:

* the small kernels of the step (fused norms, RoPE, SiLU-and-mul, KV write, decode attention) read the
  previous kernel's output at once: they start with `wait_then_release`, ``gdc_wait()`` then
  ``gdc_launch_dependents()``, so the kernel after them is resident and waiting by the time they end;
* the int4 GEMV calls ``gdc_launch_dependents()`` first and reads its input or writes anything (output,
  split-K partials, counters) only after ``gdc_wait()``. Before the wait it may ask L2 for its first
  weight bytes (`GemvConfig.prefetch`, which no earlier kernel writes); on the H200 that was slower at
  every depth tried, so it is off.

On the H200 this took the int4 step from 3.11 to 2.70 ms (docs/benchmarks.md, fifth quantization pass).

Chains stay correct however far they run ahead: each kernel waits for the one before it, which waited for
the one before it. A kernel whose predecessor does not release early (cuBLAS, torch ops) simply starts when
it ends, as without PDL.

Both calls are no-ops on a GPU without PDL support, but they do not compile for the CPU interpreter and need
sm_90, so every kernel takes them behind a constexpr that `pdl_enabled` sets. ``configure(enabled=False)`` turns
them off (for side-by-side timing; the engine sets it from ``SLUICE_PDL``, `core/envs.py`).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

# PDL where the device has it, unless switched off (`configure`)
_enabled = True


def configure(enabled: bool) -> None:
    """Turn PDL on (where the device has it) or off for this process's later launches."""
    global _enabled
    if enabled != _enabled:
        _enabled = enabled
        pdl_enabled.cache_clear()


@functools.cache  # asked at every kernel launch; the answer is fixed for a device and a configuration
def pdl_enabled(device: torch.device) -> bool:
    """Whether kernels on ``device`` use programmatic dependent launch (CUDA, compute capability >= 9.0)."""
    if device.type != "cuda" or not _enabled:
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
