"""The CPU decode path: packed int4/int8 linear layers (`core/models/cpu_linear.py`) against the reference
dequantize-per-call path, the kernel chosen per machine, and ``--quantization auto`` on the CPU.

Tolerances: the packed kernels take bf16 activations and bf16 scales and zeros, so a packed layer's output is the
reference's within bf16 rounding (a relative error of a few 2^-8 of the output's scale); the model's logits are
compared the same way.
"""

from __future__ import annotations

import pytest
import torch
from sluice.core.models import cpu_linear, cpu_vnni
from sluice.core.models.cpu_linear import Int4PackedLinear, Int8PackedLinear, pack_for_cpu, select_cpu_kernel
from sluice.core.models.quant import (
    QuantizedLinear,
    dequantize_int4,
    dequantize_int8,
    quantize_int4,
    quantize_int8,
    quantize_model,
)

needs_packed = pytest.mark.skipif(
    not cpu_linear.packed_kernels_available(), reason="torch's packed CPU matmuls need AVX2 or AVX-512"
)
BF16_REL = 2.0**-6  # a few bf16 roundings of the output's scale


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


@pytest.mark.parametrize(
    "bits,dtype,isa,expected",
    [
        (4, torch.bfloat16, "AVX512", "int4pack"),
        (4, torch.bfloat16, "AVX2", "int4pack"),
        (8, torch.bfloat16, "AVX512", "int8pack"),
        (4, torch.float32, "AVX512", "dequantize"),  # fp32 models keep the exact reference path
        (4, torch.bfloat16, "DEFAULT", "dequantize"),  # no vectorized kernel: the reference
        (8, torch.bfloat16, "SVE256", "dequantize"),
    ],
)
def test_kernel_selection_by_cpu_and_dtype(bits, dtype, isa, expected):
    assert select_cpu_kernel(bits, dtype, isa) == expected


def test_packed_kernels_follow_the_cpu_capability(monkeypatch):
    monkeypatch.setattr(cpu_linear, "cpu_capability", lambda: "DEFAULT")
    assert not cpu_linear.packed_kernels_available()
    monkeypatch.setattr(cpu_linear, "cpu_capability", lambda: "AVX2")
    assert cpu_linear.packed_kernels_available()


@needs_packed
@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4pack_is_the_int4_format_with_bf16_scales(group):
    """``(q - 8) * scale + zero`` with ``zero = min + 8 * scale``: the repack computes ``q * scale + min``; the one
    rounding is the scale and zero's to bf16 (pinned: the product equals the dequantized weights with those
    roundings, to fp32 accumulation order), and against the exact weights it stays within bf16 rounding."""
    g = torch.Generator().manual_seed(0)
    n, k = 96, 256
    w = torch.randn(n, k, generator=g) * 0.05 + 0.01
    packed, scales, mins = quantize_int4(w, group)
    bias = torch.randn(n, generator=g).bfloat16()
    lin = Int4PackedLinear.from_int4(packed, scales, mins, bias, group)
    x = torch.randn(5, k, generator=g).bfloat16()
    y = lin(x)
    assert y.dtype == torch.bfloat16 and y.shape == (5, n)
    # the weights the kernel computes with: the file's q, bf16 scale and bf16 zero
    s = scales.float().bfloat16().float()
    z = (mins.float() + 8 * scales.float()).bfloat16().float()
    q = dequantize_int4(packed, torch.ones_like(scales), torch.zeros_like(mins), torch.float32)
    w_kernel = ((q - 8).view(n, -1, group) * s[:, :, None] + z[:, :, None]).view(n, k)
    pinned = x.float() @ w_kernel.t() + bias.float()
    assert _rel_err(y, pinned) < 2.0**-7
    exact = x.float() @ dequantize_int4(packed, scales, mins, torch.float32).t() + bias.float()
    assert _rel_err(y, exact) < BF16_REL


@needs_packed
def test_int4_many_rows_run_dense_on_the_kernels_weight():
    """From `DENSE_MIN_ROWS` rows the weight is dequantized for a bf16 GEMM: the packed kernel's own weight rounded
    to bf16, so the rows agree with the same rows through the packed kernel (a few at a time) within bf16 rounding."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(64, 128, generator=g) * 0.05
    packed, scales, mins = quantize_int4(w, 32)
    lin = Int4PackedLinear.from_int4(packed, scales, mins, torch.randn(64, generator=g).bfloat16(), 32)
    rows = Int4PackedLinear.DENSE_MIN_ROWS + 8
    x = torch.randn(rows, 128, generator=g).bfloat16()
    few = torch.cat([lin(x[i : i + 4]) for i in range(0, rows, 4)])
    assert _rel_err(lin(x), few) < 2.0**-7
    q = dequantize_int4(packed, torch.ones_like(scales), torch.zeros_like(mins), torch.float32).view(64, 4, 32)
    s, z = scales.float().bfloat16().float(), (mins.float() + 8 * scales.float()).bfloat16().float()
    assert torch.equal(lin.dense_weight(), ((q - 8) * s[:, :, None] + z[:, :, None]).view(64, 128).bfloat16())


@needs_packed
def test_int8pack_is_the_int8_format():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(80, 192, generator=g)
    q, scales = quantize_int8(w)
    lin = Int8PackedLinear(q, scales, None)
    x = torch.randn(3, 192, generator=g).bfloat16()
    ref = x.float() @ dequantize_int8(q, scales, torch.float32).t()
    assert _rel_err(lin(x), ref) < BF16_REL


def _tiny_model(dtype: torch.dtype):
    from sluice.core.models.loader import load_model, resolve_model

    return load_model(resolve_model("dummy:tiny"), dtype, torch.device("cpu"), 128, seed=1)


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    """A prefill of ``ids`` and the logits of every position (the torch attention over a small KV pool)."""
    from sluice.core.models.layers import ForwardContext
    from sluice.kv.attention import AttentionMetadata, allocate_kv_cache, get_attention_backend

    n = ids.numel()
    dtype = model.model.embed_tokens.weight.dtype
    caches = allocate_kv_cache(len(model.model.layers), 8, 16, model.num_kv_heads, model.head_dim, dtype, ids.device)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        seq_lens=torch.tensor([n], dtype=torch.int32),
        block_tables=torch.arange(8, dtype=torch.int32)[None],
        max_query_len=n,
        max_seq_len=n,
        query_start_loc_host=[0, n],
        seq_lens_host=[n],
    )
    with torch.inference_mode():
        hidden = model(ids, torch.arange(n), ForwardContext(meta, caches, get_attention_backend("torch")))
        return model.compute_logits(hidden)


@needs_packed
@pytest.mark.parametrize("method", ["int4", "int8"])
@pytest.mark.parametrize(
    "isa",
    ["AVX512", pytest.param("AVX512_VNNI", marks=pytest.mark.skipif(not cpu_vnni.load(), reason="no VNNI kernels"))],
)
def test_packed_model_logits_match_the_reference_path(method, isa):
    """A tiny random model quantized, then packed (every projection and the tied head) for torch's kernels or the
    VNNI ones, against the same quantized model on the reference path (the weights dequantized at each call, bf16
    activations)."""
    ref = _tiny_model(torch.bfloat16)
    quantize_model(ref, method)
    model = _tiny_model(torch.bfloat16)
    quantize_model(model, method)
    counts = pack_for_cpu(model, torch.bfloat16, isa=isa)
    kind = "vnni" if isa == "AVX512_VNNI" else "pack"
    head = "int8" + (kind if model.config.hidden_size % 64 == 0 else "pack")  # int8vnni takes K in steps of 64
    assert counts == {f"{method}{kind}": 8, f"{head} (tied LM head)": 1}
    assert not any(isinstance(m, QuantizedLinear) for m in model.modules())
    ids = torch.randint(0, model.config.vocab_size, (12,), generator=torch.Generator().manual_seed(2))
    got, want = _logits(model, ids), _logits(ref, ids)
    assert _rel_err(got, want) < 0.05  # bf16 through two layers and a requantized (int8) head
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9


def test_fp32_models_keep_the_reference_path():
    model = _tiny_model(torch.float32)
    quantize_model(model, "int4")
    assert pack_for_cpu(model, torch.float32, isa="AVX512") == {"dequantize": 8}
    assert model.lm_head is None  # the tied head stays the embedding


@needs_packed
def test_one_layer_of_the_default_model_packed(default_source):
    """The default model's first layer, its Q4_1 blocks packed, against the file's exact weights in fp32."""
    from sluice.core.models.quant import Q4_1_GROUP, Q4_1Tensors

    gguf = Q4_1Tensors(default_source.gguf_file, default_source.config)
    x = torch.randn(4, default_source.config.hidden_size, generator=torch.Generator().manual_seed(3)).bfloat16()
    for shard in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up"):
        packed, scales, mins = gguf.get(0, shard)
        lin = Int4PackedLinear.from_int4(packed, scales, mins, None, Q4_1_GROUP)
        exact = x.float() @ dequantize_int4(packed, scales, mins, torch.float32).t()
        assert _rel_err(lin(x), exact) < BF16_REL, shard


def test_auto_quantization_resolves_per_device_and_model(monkeypatch):
    from sluice.core.args import EngineArgs

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    auto = EngineArgs(device="cpu", quantization="auto")
    monkeypatch.setattr(cpu_linear, "cpu_capability", lambda: "AVX512")
    assert auto.resolve_quantization(cpu, "model.gguf") == "int4"
    assert auto.resolve_dtype(cpu, "model.gguf") == torch.bfloat16  # the packed kernels' activations
    assert auto.resolve_quantization(cpu, None) is None  # no Q4_1 blocks: the dense model
    assert auto.resolve_dtype(cpu, None) == torch.float32
    assert auto.resolve_quantization(cuda, "model.gguf") is None
    explicit = EngineArgs(device="cpu", quantization="int4")
    assert explicit.resolve_dtype(cpu, "model.gguf") == torch.float32  # int4 in fp32: the file's exact weights
    monkeypatch.setattr(cpu_linear, "cpu_capability", lambda: "DEFAULT")
    assert auto.resolve_quantization(cpu, "model.gguf") is None
    assert auto.resolve_dtype(cpu, "model.gguf") == torch.float32


# ------------------------------------------------------------------------------------- CPU kernels


def _reference_modules(dtype: torch.dtype):
    from sluice.core.models.layers import RMSNorm, RotaryEmbedding, SiluAndMul
    from sluice.core.models.loader import resolve_model

    cfg = resolve_model("dummy:tiny").config
    norm = RMSNorm(64, 1e-5).to(dtype).requires_grad_(False)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    return norm, RotaryEmbedding(cfg, 32, 256), SiluAndMul()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cpu_kernels_do_the_reference_arithmetic(dtype):
    """RMSNorm within one step of the activation dtype (one rounding fewer), RoPE and SiLU-and-mul equal."""
    from sluice.core.models import cpu_kernels

    norm, rotary, act = _reference_modules(dtype)
    g = torch.Generator().manual_seed(4)
    x, res = (torch.randn(7, 64, generator=g).to(dtype) * 3 for _ in range(2))
    want, want_res = norm(x, res)
    got, got_res = cpu_kernels.add_rmsnorm(x, res, norm.weight, norm.eps)
    assert torch.equal(got_res, want_res)
    step = 2.0**-7 if dtype == torch.bfloat16 else 1e-6
    assert float(((got.float() - want.float()).abs() / want.float().abs().clamp_min(1e-3)).max()) <= step
    assert torch.allclose(cpu_kernels.add_rmsnorm(x, None, norm.weight, norm.eps)[0].float(), norm(x).float(), 1e-2)

    gate_up = torch.randn(7, 128, generator=g).to(dtype)
    assert torch.equal(cpu_kernels.silu_and_mul(gate_up.clone()), act(gate_up))

    positions = torch.tensor([0, 3, 9, 100, 101, 5, 255])
    qkv = torch.randn(7, (4 + 2 + 2) * 32, generator=g).to(dtype)  # q: 4 heads, k and v: 2, head_dim 32
    q, k = qkv[:, :128].view(7, 4, 32), qkv[:, 128:192].view(7, 2, 32)
    want_q, want_k = rotary(positions, q.clone(), k.clone())
    rope = cpu_kernels.Rope()
    rope(positions, q, k, rotary.cos, rotary.sin)  # adjacent: rotated as one [T, 6, D] view, in place
    assert torch.equal(q, want_q) and torch.equal(k, want_k)
    q2, k2 = q.clone(), k.clone()  # not adjacent: one at a time
    rope(positions, q2, k2, rotary.cos, rotary.sin)
    want_q2, want_k2 = rotary(positions, q.clone(), k.clone())
    assert torch.equal(q2, want_q2) and torch.equal(k2, want_k2)


def test_cpu_kernels_are_the_auto_choice_of_a_16_bit_cpu_model():
    from sluice.core.args import EngineArgs
    from sluice.core.models import cpu_kernels
    from sluice.core.models.layers import RMSNorm
    from sluice.core.models.loader import resolve_model
    from sluice.core.worker.model_runner import ModelRunner

    src = resolve_model("dummy:tiny")
    runners = {
        dtype: ModelRunner(EngineArgs(model="dummy:tiny", device="cpu", dtype=dtype, num_kv_blocks=8), src, 64)
        for dtype in ("bfloat16", "float32")
    }
    norms = {d: [m for m in r.model.modules() if type(m) is RMSNorm] for d, r in runners.items()}
    assert all(m.fused is cpu_kernels.add_rmsnorm for m in norms["bfloat16"])
    assert all(m.fused is None for m in norms["float32"])  # fp32: the reference modules
    assert isinstance(runners["bfloat16"].model.rotary.fused, cpu_kernels.Rope)


def test_auto_never_rounds_a_layer_to_int4_itself():
    """``auto`` takes a GGUF's Q4_1 blocks as they are; a layer without them stays dense (requantize=False)."""
    from torch import nn

    model = _tiny_model(torch.float32)
    n = sum(isinstance(m, nn.Linear) for m in model.modules())
    assert quantize_model(model, "int4", None, requantize=False) == {"gguf_q4_1": 0, "quantized": 0}
    assert sum(isinstance(m, nn.Linear) for m in model.modules()) == n
    assert quantize_model(model, "int4", None)["quantized"] == n
