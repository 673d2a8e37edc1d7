"""CPU implementations of the fused-kernel seam of `core/models/layers.py` (``RMSNorm.fused``, ``SiluAndMul.fused``,
``RotaryEmbedding.fused``), set by `enable_cpu_kernels`.

On the CPU a decode step of a small model is made of per-op overhead: each torch call costs a few microseconds
of dispatch and an allocation whatever its size, and the reference modules spend ~9 calls on an RMSNorm with its
residual, ~16 on RoPE and 3 on SiLU-and-mul, 30 layers over. These do the same arithmetic in 2, 8 and 2 calls:

* RMSNorm: the residual sum, then torch's fused ``rms_norm`` (fp32 inside). The reference rounds the normed value
  to the activation dtype before the weight multiply; this rounds once after it, so outputs agree within one
  step of the activation dtype (as the Triton kernels do, `core/models/fused.py`).
* RoPE: q and k rotated in one pass when they are adjacent in the qkv projection's output (they are, unless a
  family transforms them first), from cos/sin tables cast to the activation dtype once; the rounding steps are
  the reference's (``q * cos`` and ``rotate_half(q) * sin`` each rounded, then added), so results are equal.
* SiLU-and-mul: the product written into the SiLU's output (one allocation, equal results).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(norm(x + residual) * weight, x + residual)``; without ``residual``: ``(norm(x) * weight, None)``."""
    if residual is not None:
        x = x + residual
    return F.rms_norm(x, (x.shape[-1],), weight, eps), (x if residual is not None else None)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)


class Rope:
    """Neox RoPE of q ``[T, Hq, D]`` and k ``[T, Hk, D]`` in place, for one model's rotary tables (the tables cast
    to the activation dtype once, on first use)."""

    def __init__(self) -> None:
        self._tables: tuple[torch.dtype, torch.Tensor, torch.Tensor] | None = None

    def _cast(self, cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if self._tables is None or self._tables[0] != dtype:
            self._tables = (dtype, cos.to(dtype), sin.to(dtype))
        return self._tables[1], self._tables[2]

    def __call__(self, positions, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        cos, sin = self._cast(cos, sin, q.dtype)
        c = cos.index_select(0, positions)[:, None, :]
        s = sin.index_select(0, positions)[:, None, :]
        qk = _adjacent(q, k)
        for x in (q, k) if qk is None else (qk,):
            x1, x2 = x.chunk(2, dim=-1)
            rot = torch.cat((-x2, x1), dim=-1).mul_(s)
            x.copy_(torch.mul(x, c).add_(rot))


def _adjacent(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
    """q and k as one ``[T, Hq + Hk, D]`` view when k's heads follow q's in memory row by row (both views of the
    qkv projection's output), else None. None in a compiled step (`core/worker/cpu_compiled.py`): a compiler
    has no pointers to compare, and fuses the two rotations itself."""
    if torch.compiler.is_compiling():
        return None
    d = q.shape[-1]
    same_rows = q.stride() == k.stride() and q.stride()[1:] == (d, 1) and q.shape[0] == k.shape[0]
    if not same_rows or k.data_ptr() != q.data_ptr() + q.shape[1] * d * q.element_size():
        return None
    return q.as_strided((q.shape[0], q.shape[1] + k.shape[1], d), q.stride())
