"""The CPU's batched path (many sequences a step): which kernel a packed layer runs at how many rows, and the
tied head's dense table for many rows (`core/models/cpu_linear.py`).

Tolerances: bf16 paths against fp32 references are compared relative to the output's scale, within a few bf16
roundings (2^-8 each).
"""

from __future__ import annotations

import pytest
import torch
from sluice.core.models import cpu_linear
from sluice.core.models.cpu_linear import Int4PackedLinear, Int8PackedLinear, quantize_tied_head
from sluice.core.models.quant import dequantize_int4, dequantize_int8, quantize_int4, quantize_int8

needs_packed = pytest.mark.skipif(
    not cpu_linear.packed_kernels_available(), reason="torch's packed CPU matmuls need AVX2 or AVX-512"
)


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def _spy(monkeypatch, name: str) -> list[int]:
    """Record the rows of each call to ``cpu_linear.<name>`` (still calling it)."""
    calls: list[int] = []
    real = getattr(cpu_linear, name)

    def spy(x, *args):
        calls.append(x.shape[0])
        return real(x, *args)

    monkeypatch.setattr(cpu_linear, name, spy)
    return calls


@needs_packed
def test_int4_rows_pick_packed_below_the_threshold_and_the_load_time_dense_copy_from_it(monkeypatch):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 128, generator=g) * 0.05
    packed, scales, mins = quantize_int4(w, 32)
    lin = Int4PackedLinear.from_int4(packed, scales, mins, None, 32)
    assert lin.dense.dtype == torch.bfloat16 and "qweight" not in dict(lin.named_buffers())  # no unpacked nibbles
    calls = _spy(monkeypatch, "int4pack_mm")
    few, many = Int4PackedLinear.DENSE_MIN_ROWS - 1, Int4PackedLinear.DENSE_MIN_ROWS
    x = torch.randn(many, 128, generator=g).bfloat16()
    y_few, y_many = lin(x[:few]), lin(x)
    assert calls == [few]  # the many-row call did not reach the packed kernel
    exact = x.float() @ dequantize_int4(packed, scales, mins, torch.float32).t()
    assert _rel_err(y_many, exact) < 2.0**-6 and _rel_err(y_few, exact[:few]) < 2.0**-6
    assert _rel_err(y_many[:few], y_few) < 2.0**-7  # the two paths: the same weights within bf16 rounding


@needs_packed
def test_tied_head_multiplies_its_embedding_table_from_many_rows(monkeypatch):
    """The int8 head for a few rows, the shared bf16 table (not a copy) from `DENSE_MIN_ROWS` rows: exactly the
    dense head there, and within int8 rounding of it below."""

    class Tiny(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = torch.nn.Module()
            self.model.embed_tokens = torch.nn.Embedding(300, 64).to(torch.bfloat16)
            self.lm_head = None

    model = Tiny()
    assert quantize_tied_head(model, torch.bfloat16, isa="AVX512")
    head, table = model.lm_head, model.model.embed_tokens.weight
    assert head.dense.data_ptr() == table.data_ptr()
    calls = _spy(monkeypatch, "int8pack_mm")
    n = Int8PackedLinear.DENSE_MIN_ROWS
    x = torch.randn(n, 64, generator=torch.Generator().manual_seed(1)).bfloat16()
    many, few = head(x), head(x[: n - 1])
    assert calls == [n - 1]
    assert torch.equal(many, x @ table.t())
    q, scales = quantize_int8(table.detach())
    assert _rel_err(few, x[: n - 1].float() @ dequantize_int8(q, scales, torch.float32).t()) < 2.0**-6
    assert _rel_err(few, many[: n - 1]) < 2.0**-5  # int8 rows against the bf16 table


def test_fp32_tables_keep_the_int8_head_only():
    table = torch.randn(40, 32)
    q, scales = quantize_int8(table)
    assert Int8PackedLinear(q, scales, None).dense is None
