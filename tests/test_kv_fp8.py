"""fp8 (e4m3) KV cache: the format, the torch reference path, the Triton kernels (interpreter on the CPU),
calibration of the per-head scales, and the pool doubling its tokens."""

from __future__ import annotations

import importlib
import logging
import os

import pytest
import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"

from sluice.kv.attention import fp8  # noqa: E402
from sluice.kv.attention.torch_ref import TorchAttentionBackend  # noqa: E402

from tests.helpers import random_paged_batch  # noqa: E402

SCALE = torch.tensor([[0.03, 0.05], [0.02, 0.04]])  # [K/V, head]: random N(0, 1) caches fit without saturating


def _fp8_cache(cache: torch.Tensor, kv_scale: torch.Tensor) -> torch.Tensor:
    """A model-dtype cache quantized per (K/V, head), as the writers store it."""
    shape = cache.shape[1:]
    h, d = shape[-2], shape[-1]
    return torch.stack([fp8.quantize(cache[i].reshape(-1, h, d), kv_scale[i]).reshape(shape) for i in range(2)])


def _dequant_cache(c8: torch.Tensor, kv_scale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    return torch.stack([fp8.dequantize(c8[i], kv_scale[i], dtype) for i in range(2)])


def _tricky_values(n_tok: int, heads: int, dim: int, seed: int = 0) -> torch.Tensor:
    """Values over every e4m3 regime once divided by SCALE[0]: normal, subnormal, ties, binade carries, -0,
    and beyond the largest finite value."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n_tok, heads, dim, generator=g) * torch.tensor([0.5, 3.0])[None, :, None]
    special = torch.tensor([1.98, 7.84, -1.9766, 1.8125, 1.0625, 0.001, -0.0001, -0.0, 0.0171, 500.0, -1e4, 0.0039])
    x[0, 0, : len(special)] = special * SCALE[0, 0]
    x[1, 1, : len(special)] = special * SCALE[0, 1]
    return x


def test_quantize_round_trip_error_and_saturation():
    x = torch.linspace(-500, 500, 20001)
    scale = torch.tensor([1.0])
    q = fp8.quantize(x[:, None, None], scale)
    back = fp8.dequantize(q, scale, torch.float32).flatten()
    normal = (x.abs() >= 2**-6) & (x.abs() <= fp8.FP8_MAX)
    # 3 mantissa bits: round to nearest is within half a step, 2^-4 of the value
    assert ((back - x).abs()[normal] <= x.abs()[normal] * 2**-4 + 1e-9).all()
    assert (back[x > fp8.FP8_MAX] == fp8.FP8_MAX).all() and (back[x < -fp8.FP8_MAX] == -fp8.FP8_MAX).all()
    assert fp8.scales_from_amax(torch.tensor([0.0, 44.8])).tolist() == pytest.approx([1.0, 44.8 * 4 / 448])


def test_kv_cache_dtype_names():
    assert fp8.kv_cache_torch_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert fp8.kv_cache_torch_dtype("fp8", torch.bfloat16) == torch.float8_e4m3fn
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        fp8.kv_cache_torch_dtype("int8", torch.bfloat16)


def test_torch_backend_reads_fp8_as_its_dequantized_values():
    """Attention over an fp8 cache is exactly attention over the cache's dequantized values."""
    q, cache, meta = random_paged_batch([40, 17, 70, 3], [40, 1, 5, 1], 2, 2, 32)
    c8 = _fp8_cache(cache, SCALE)
    be = TorchAttentionBackend()
    out = be.forward(q, c8, meta, 0.2, SCALE)
    assert torch.equal(out, be.forward(q, _dequant_cache(c8, SCALE), meta, 0.2))
    # and it is an approximation of the unquantized cache, not something else
    ref = be.forward(q, cache, meta, 0.2)
    assert (out - ref).abs().max() < 0.05 * ref.abs().max()


def test_torch_backend_writes_quantized_bytes_and_skips_padding():
    be = TorchAttentionBackend()
    k, v = _tricky_values(20, 2, 32), _tricky_values(20, 2, 32, seed=1)
    cache = torch.zeros(2, 4, 16, 2, 32, dtype=fp8.FP8_DTYPE)
    slots = torch.randperm(64, generator=torch.Generator().manual_seed(0))[:20]
    slots[3] = -1
    be.write_kv(k, v, cache, slots, SCALE)
    flat = cache.view(2, 64, 2, 32).view(torch.uint8)
    keep = slots >= 0
    assert torch.equal(flat[0, slots[keep]], fp8.quantize(k[keep], SCALE[0]).view(torch.uint8))
    assert torch.equal(flat[1, slots[keep]], fp8.quantize(v[keep], SCALE[1]).view(torch.uint8))
    written = torch.zeros(64, dtype=torch.bool)
    written[slots[keep]] = True
    assert (flat[:, ~written] == 0).all()


def test_fp8_cache_without_scales_is_an_error():
    be = TorchAttentionBackend()
    q, cache, meta = random_paged_batch([8], [8], 2, 1, 16)
    c8 = cache.to(fp8.FP8_DTYPE)
    with pytest.raises(ValueError, match="kv_scale"):
        be.write_kv(q[:, :2], q[:, :2], c8, meta.slot_mapping)
    with pytest.raises(ValueError, match="kv_scale"):
        be.forward(q, c8, meta, 0.25)


# ------------------------------------------------------------------------------------------ Triton kernels


def _triton_backend(**kw):
    triton = pytest.importorskip("triton")
    from triton.runtime.interpreter import InterpretedFunction

    if not ON_GPU and not isinstance(triton.language.standard.cdiv, InterpretedFunction):
        pytest.skip("triton was imported without TRITON_INTERPRET=1 (tests/conftest.py sets it)")
    from sluice.kv.attention import triton_kernels as tk

    if not ON_GPU and not isinstance(tk._decode_kernel, InterpretedFunction):
        importlib.reload(tk)
    from sluice.kv.attention.triton_backend import TritonAttentionBackend

    return TritonAttentionBackend(**kw)


def test_triton_write_kernel_stores_the_same_bytes_as_torch():
    """The kernel's own e4m3 rounding (ties to even, carries into the exponent, subnormals, -0, saturation)
    agrees with torch's cast byte for byte."""
    tr = _triton_backend()
    dev = "cuda" if ON_GPU else "cpu"
    k, v = _tricky_values(50, 2, 32).to(dev), _tricky_values(50, 2, 32, seed=1).to(dev)
    scale = SCALE.to(dev)
    slots = torch.randperm(128, generator=torch.Generator().manual_seed(1))[:50].to(dev)
    slots[7] = -1
    a = torch.zeros(2, 8, 16, 2, 32, dtype=fp8.FP8_DTYPE, device=dev)
    b = torch.zeros_like(a)
    TorchAttentionBackend().write_kv(k, v, a, slots, scale)
    tr.write_kv(k, v, b, slots, scale)
    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    tr.write_kv(k.bfloat16(), v.bfloat16(), b, slots, scale)  # bf16 activations, as on the GPU
    TorchAttentionBackend().write_kv(k.bfloat16(), v.bfloat16(), a, slots, scale)
    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize(
    "seq_lens,q_lens,splits",
    [([40, 17, 70], [1, 1, 1], 1), ([40, 17, 70], [1, 1, 1], 2), ([40, 17, 70, 9], [40, 1, 5, 9], None)],
)
def test_triton_attention_over_fp8_matches_the_torch_reference(seq_lens, q_lens, splits):
    tr = _triton_backend(decode_num_splits=splits)
    dev = "cuda" if ON_GPU else "cpu"
    q, cache, meta = random_paged_batch(seq_lens, q_lens, 2, 2, 32, device=dev)
    c8 = _fp8_cache(cache.cpu(), SCALE).to(dev)
    scale = SCALE.to(dev)
    ref = TorchAttentionBackend().forward(q, c8, meta, 0.2, scale)
    out = tr.forward(q, c8, meta, 0.2, scale)
    assert (out - ref).abs().max().item() < 1e-5


# K and V amplitudes per KV head: ~100x apart between heads, and K's differ from V's, as in real models
WIDE_AMP = torch.tensor([[0.05, 6.0, 0.6, 2.0], [8.0, 0.08, 1.0, 0.3]])


def _wide_fp8_batch(seq_lens, q_lens, dtype, dev):
    """A batch over an fp8 cache whose per-head scales (calibrated from its own amax) differ a lot."""
    q, cache, meta = random_paged_batch(seq_lens, q_lens, 4, 2, 32, dtype=torch.float32, seed=5, device=dev)
    cache = cache * WIDE_AMP[:, None, None, :, None]
    kv_scale = fp8.scales_from_amax(cache.abs().amax(dim=(1, 2, 4)))
    return q.to(dtype).to(dev), _fp8_cache(cache, kv_scale).to(dev), meta, kv_scale.to(dev)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "seq_lens,q_lens,splits",
    [
        ([150, 17, 70, 1], [1, 1, 1, 1], 1),
        ([150, 17, 70, 1], [1, 1, 1, 1], 3),  # split-K partials, the short sequences' trailing splits empty
        ([70, 17, 9], [70, 17, 9], None),  # prefill
        ([150, 40, 33, 5], [20, 1, 33, 2], None),  # chunked prefill (unmasked and causal key tiles) + decode rows
    ],
)
def test_triton_fp8_scales_apply_per_head_and_per_tensor(seq_lens, q_lens, splits, dtype):
    """The kernels fold each head's K scale into its logits and its V scale into its output: a scale of
    another head, of the other tensor, applied twice or not at all is far outside the tolerance. 16-bit
    queries run the GPU's fp16 dots (on the CPU the dot itself then runs in fp32, operands rounded to fp16)."""
    tr = _triton_backend(decode_num_splits=splits)
    dev = "cuda" if ON_GPU else "cpu"
    q, c8, meta, kv_scale = _wide_fp8_batch(seq_lens, q_lens, dtype, dev)
    be, sm = TorchAttentionBackend(), 32**-0.5
    exact = be.forward(q.float(), c8, meta, sm, kv_scale)

    def head_err(out):  # per query head, relative to that head's largest output
        return ((out.float() - exact).abs().amax(dim=(0, 2)) / exact.abs().amax(dim=(0, 2))).max().item()

    # bf16: the interpreter truncates the fp32 output to bf16 (up to 2^-7 of a value), the GPU rounds it
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.2e-2}[dtype]
    assert head_err(tr.forward(q, c8, meta, sm, kv_scale)) < tol
    for wrong in (kv_scale.flip(-1), kv_scale.flip(0), kv_scale * torch.tensor([[1.0], [2.0]], device=dev)):
        assert head_err(be.forward(q.float(), c8, meta, sm, wrong)) > 10 * tol


# ------------------------------------------------------------------------------------------ the runner


def _runner(**kw):
    from sluice.core.args import EngineArgs
    from sluice.core.models.loader import resolve_model
    from sluice.core.worker.model_runner import ModelRunner

    args = EngineArgs(model="dummy:tiny", device="cpu", max_model_len=256, **kw)
    return ModelRunner(args, resolve_model(args.model), 256)


def test_fp8_pool_holds_twice_the_tokens_of_bf16_in_the_same_memory(caplog):
    with caplog.at_level(logging.INFO, logger="sluice"):
        bf16 = _runner(dtype="bfloat16", cpu_kv_cache_gib=2**-7)
        fp8_bf16 = _runner(dtype="bfloat16", cpu_kv_cache_gib=2**-7, kv_cache_dtype="fp8")
        fp32 = _runner(dtype="float32", cpu_kv_cache_gib=2**-7)
    assert fp8_bf16.num_kv_blocks == 2 * bf16.num_kv_blocks
    assert fp32.num_kv_blocks * 2 == bf16.num_kv_blocks
    assert fp8_bf16.kv_caches[0].dtype == torch.float8_e4m3fn
    # the pool really is that size: bytes of the allocated tensors
    nbytes = [sum(t.numel() * t.element_size() for t in r.kv_caches) for r in (bf16, fp8_bf16)]
    assert abs(nbytes[0] - nbytes[1]) <= nbytes[0] * 0.01
    # startup logs the weights' bytes and the pool's bytes and tokens
    line = next(r.getMessage() for r in caplog.records if "KV pool" in r.getMessage() and "float8" in r.getMessage())
    assert "weights:" in line and f"{fp8_bf16.num_kv_blocks * 16} tokens" in line and "GiB" in line


def test_calibration_sets_per_head_scales_that_cover_the_calibration_activations():
    from sluice.core.models.quant import calibrate_kv_scales

    r = _runner(kv_cache_dtype="fp8", num_kv_blocks=32)
    layers = [layer.self_attn for layer in r.model.model.layers]
    assert all(a.kv_scale is not None and a.kv_scale.shape == (2, r.model.num_kv_heads) for a in layers)
    # no headroom: the scales map the calibration batch's largest |K|, |V| of each head to exactly 448
    scales = calibrate_kv_scales(r.model, r.backend, r.dtype, r.device, headroom=1.0)
    assert torch.equal(torch.stack([a.kv_scale for a in layers]), scales)
    assert (scales > 0).all() and len(set(scales.flatten().tolist())) > 1  # per head, not one number
    again = calibrate_kv_scales(r.model, r.backend, r.dtype, r.device)
    assert torch.allclose(again, scales * fp8.KV_SCALE_HEADROOM)


def test_engine_args_reject_unknown_kv_cache_dtype_and_quantization():
    from sluice.core.args import EngineArgs
    from sluice.core.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="kv_cache_dtype"):
        EngineArgs(kv_cache_dtype="fp16")
    with pytest.raises(InvalidRequestError, match="quantization"):
        EngineArgs(quantization="int3")
