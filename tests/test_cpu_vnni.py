"""The AVX-512 VNNI int4/int8 kernels (`core/models/cpu_vnni.py`) against the arithmetic they claim: the stored
weights times the activations rounded per block of 32 (to int8; to 15 bits for int8 weights), summed in fp32; and
their selection per machine (a packed model's logits through them: `tests/test_cpu_decode.py`)."""

from __future__ import annotations

import pytest
import torch
from sluice.core.models import cpu_linear, cpu_vnni
from sluice.core.models.cpu_linear import Int4PackedLinear, Int8PackedLinear, select_cpu_kernel
from sluice.core.models.quant import quantize_int4, quantize_int8, unpack_int4

needs_vnni = pytest.mark.skipif(not cpu_vnni.load(), reason="the kernels need AVX-512 VNNI and a C++ compiler")


def _rounded(x: torch.Tensor) -> torch.Tensor:
    """x rounded as the kernels round it, fp32: per block of 32, ``round(x / max|x| * 127)`` (half to even) times
    ``d = max|x| / 127``."""
    xb = x.float().view(x.shape[0], -1, 32)
    amax = xb.abs().amax(-1, keepdim=True)
    q = torch.where(amax > 0, torch.round(xb / amax * 127), torch.zeros_like(xb))
    return (q * (amax / 127)).view(x.shape)


def _rounded_fine(x: torch.Tensor) -> torch.Tensor:
    """x as the int8 kernel rounds it: `_rounded`, plus the residual of ``x / max|x| * 127`` rounded to int8 at 254
    steps per unit (``d * (q + round(r * 254) / 254)``)."""
    xb = x.float().view(x.shape[0], -1, 32)
    amax = xb.abs().amax(-1, keepdim=True)
    t = torch.where(amax > 0, xb / amax * 127, torch.zeros_like(xb))
    q = torch.round(t)
    return ((q + torch.round((t - q) * 254) / 254) * (amax / 127)).view(x.shape)


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal up to fp32 summation order and the output's bf16 rounding."""
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    err = (got.float() - want).abs().max() / want.abs().max().clamp_min(1e-30)
    assert err < 2.0**-7, float(err)


@needs_vnni
@pytest.mark.parametrize("n,k,group", [(96, 576, 32), (37, 160, 32), (64, 256, 64), (20, 384, 128), (5, 32, 32)])
@pytest.mark.parametrize("rows", [1, 3, 4, 6, 15])
def test_int4_is_the_stored_weight_times_the_rounded_activation(n, k, group, rows):
    """K of 1 to 18 blocks, N not a multiple of the kernel's 16-row weight groups (a partial last group), row counts
    on both sides of the 4-row activation tile, groups of 64 and 128 split into blocks of 32 sharing their scale and
    min."""
    g = torch.Generator().manual_seed(n * k + rows)
    w = torch.randn(n, k, generator=g) * 0.05 + 0.01
    qweight, scales, mins = quantize_int4(w, group)
    lin = Int4PackedLinear.from_int4(qweight, scales, mins, None, group, kernel="int4vnni")
    assert lin.kernel == "int4vnni"
    x = (torch.randn(rows, k, generator=g) * 3).bfloat16()
    q = unpack_int4(qweight, scales.shape[1]).view(n, -1, group).float()
    stored = (q * scales.float()[..., None] + mins.float()[..., None]).view(n, k)  # the file's fp16 scale and min
    _close(lin(x), _rounded(x) @ stored.t())
    # the many-row path's weight is the same weight rounded to bf16
    assert torch.equal(lin.dense_weight(), stored.bfloat16())


@needs_vnni
@pytest.mark.parametrize("n,k", [(96, 576), (41, 64), (7, 1536)])
@pytest.mark.parametrize("rows", [1, 2, 5])
def test_int8_is_the_stored_weight_times_the_rounded_activation(n, k, rows):
    """The int8 kernel takes x to 15 bits (`_rounded_fine`): its outputs sit several times closer to the stored
    weight times the exact x than 8-bit rounding alone puts them (an LM head's near-ties)."""
    g = torch.Generator().manual_seed(n + k + rows)
    q, scales = quantize_int8(torch.randn(n, k, generator=g))
    lin = Int8PackedLinear(q, scales, None, kernel="int8vnni")
    assert lin.kernel == "int8vnni"
    x = torch.randn(rows, k, generator=g).bfloat16()
    stored = q.float() * scales.bfloat16().float()[:, None]
    y = lin(x)
    _close(y, _rounded_fine(x) @ stored.t())
    exact = x.float() @ stored.t()
    coarse = (_rounded(x) @ stored.t() - exact).abs().max()
    beyond_bf16 = (y.float() - exact).abs() - exact.abs() * 2.0**-8  # past the output's own bf16 rounding
    assert beyond_bf16.max() < coarse / 4


@needs_vnni
def test_int8_keeps_torchs_kernel_where_k_is_not_a_multiple_of_64():
    q, scales = quantize_int8(torch.randn(8, 96))
    assert Int8PackedLinear(q, scales, None, kernel="int8vnni").kernel == "int8pack"


@needs_vnni
def test_extreme_activations_stay_in_their_row():
    """A zero row (d = 0), bf16's largest finite values and its smallest normals give the stored weight times the
    rounded activation, finite; a row with a NaN or an inf gives NaN outputs; no row changes another's."""
    g = torch.Generator().manual_seed(9)
    qweight, scales, mins = quantize_int4(torch.randn(16, 128, generator=g) * 0.05, 32)
    lin4 = Int4PackedLinear.from_int4(qweight, scales, mins, None, 32, kernel="int4vnni")
    q8, s8 = quantize_int8(torch.randn(16, 128, generator=g))
    lin8 = Int8PackedLinear(q8, s8, None, kernel="int8vnni")
    big = torch.finfo(torch.bfloat16).max / 2**12  # the products and their fp32 sums stay finite
    x = torch.zeros(6, 128, dtype=torch.bfloat16)
    x[1] = big
    x[2, ::3] = -big
    x[3] = torch.finfo(torch.bfloat16).tiny
    x[4] = torch.randn(128, generator=g).bfloat16()
    x[4, 7] = float("nan")
    x[5] = torch.randn(128, generator=g).bfloat16()
    x[5, 100] = float("inf")
    q = unpack_int4(qweight, scales.shape[1]).view(16, -1, 32).float()
    stored4 = (q * scales.float()[..., None] + mins.float()[..., None]).view(16, 128)
    stored8 = q8.float() * s8.bfloat16().float()[:, None]
    for lin, stored, rounded in ((lin4, stored4, _rounded), (lin8, stored8, _rounded_fine)):
        y = lin(x)
        assert torch.equal(y[0], torch.zeros_like(y[0]))
        assert torch.isfinite(y[:4]).all()
        for i in (1, 2, 3):
            _close(y[i : i + 1], rounded(x[i : i + 1]) @ stored.t())
            assert torch.equal(y[i], lin(x[i : i + 1])[0])  # the same alone
        assert y[4:].isnan().all()


def test_selection_names_the_vnni_kernels_only_on_their_isa(monkeypatch):
    assert select_cpu_kernel(4, torch.bfloat16, "AVX512_VNNI") == "int4vnni"
    assert select_cpu_kernel(8, torch.bfloat16, "AVX512_VNNI") == "int8vnni"
    assert select_cpu_kernel(4, torch.float32, "AVX512_VNNI") == "dequantize"
    assert not cpu_vnni.vnni_supported(frozenset({"avx512f", "avx512bw", "avx512vl", "f16c", "fma"}))
    assert cpu_vnni.vnni_supported(frozenset(cpu_vnni.REQUIRED_FLAGS) | {"sse2"})
    monkeypatch.setattr(cpu_linear, "cpu_capability", lambda: "AVX512")
    monkeypatch.setattr(cpu_vnni, "load", lambda: True)
    assert cpu_linear.cpu_isa() == "AVX512_VNNI"
    cpu_linear.configure(vnni=False)
    try:
        assert cpu_linear.cpu_isa() == "AVX512"  # SLUICE_CPU_VNNI=0
    finally:
        cpu_linear.configure(vnni=True)
    monkeypatch.setattr(cpu_vnni, "load", lambda: False)  # no compiler, or no VNNI
    assert cpu_linear.cpu_isa() == "AVX512"
    monkeypatch.setattr(cpu_linear, "cpu_capability", lambda: "AVX2")
    monkeypatch.setattr(cpu_vnni, "load", lambda: True)
    assert cpu_linear.cpu_isa() == "AVX2"


@needs_vnni
def test_a_non_contiguous_activation_is_taken():
    """A strided view (columns of a wider tensor, as a fused projection's output slices are) gives the copy's."""
    qweight, scales, mins = quantize_int4(torch.randn(8, 64, generator=torch.Generator().manual_seed(3)), 32)
    lin = Int4PackedLinear.from_int4(qweight, scales, mins, None, 32, kernel="int4vnni")
    wide = torch.randn(3, 128).bfloat16()
    x = wide[:, 32:96]
    assert not x.is_contiguous()
    assert torch.equal(lin(x), lin(x.contiguous()))


def test_a_stale_build_lock_is_removed_and_a_fresh_one_kept(tmp_path):
    """A build killed mid-way leaves torch's lock file, on which every later build would wait without end."""
    import os
    import time

    lock = tmp_path / "lock"
    lock.touch()
    cpu_vnni._remove_stale_lock(lock)  # noqa: SLF001
    assert lock.exists()  # a build in progress elsewhere
    old = time.time() - 3600
    os.utime(lock, (old, old))
    cpu_vnni._remove_stale_lock(lock)  # noqa: SLF001
    assert not lock.exists()
    cpu_vnni._remove_stale_lock(lock)  # noqa: SLF001 (none: nothing to do)
