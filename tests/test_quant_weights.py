"""Weight-only int8 / int4 quantization: the quantizers and their formats, the Triton GEMV/GEMM kernels
(interpreter on the CPU) against the torch reference, model quantization, and GGUF Q4_1 loaded as is."""

from __future__ import annotations

import importlib
import os

import pytest
import torch
from torch import nn

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"

from sluice.core.models.quant import (  # noqa: E402
    MIN_GEMV_BLOCK_N,
    QuantizedLinear,
    dequantize_int4,
    dequantize_int8,
    int4_group_size,
    quantize_int4,
    quantize_int8,
    quantize_model,
    weight_bytes,
)

DEV = "cuda" if ON_GPU else "cpu"


def _kernels():
    triton = pytest.importorskip("triton")
    from triton.runtime.interpreter import InterpretedFunction

    if not ON_GPU and not isinstance(triton.language.standard.cdiv, InterpretedFunction):
        pytest.skip("triton was imported without TRITON_INTERPRET=1 (tests/conftest.py sets it)")
    from sluice.core.models import quant_kernels as qk

    if not ON_GPU and not isinstance(qk._int4_gemv_kernel, InterpretedFunction):
        importlib.reload(qk)
    return qk


# ------------------------------------------------------------------------------------------ quantizers


def test_int4_packing_order_is_gguf_q4_1s():
    """Byte i of a group holds weight i (low nibble) and weight i + G/2 (high nibble)."""
    g = 32
    levels = torch.arange(32) % 16  # weight k of the group gets level k % 16, min 0, scale 1
    w = levels.float()[None, :].repeat(2, 1)
    w[1] *= 2  # second row: scale 2
    packed, scales, mins = quantize_int4(w, g)
    assert scales.tolist() == [[1.0], [2.0]] and mins.tolist() == [[0.0], [0.0]]
    assert packed[0].tolist() == [(k % 16) | (((k + 16) % 16) << 4) for k in range(16)]
    assert torch.equal(dequantize_int4(packed, scales, mins, torch.float32), w)


@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_round_to_nearest_within_half_a_step(group):
    w = torch.randn(24, 256, generator=torch.Generator().manual_seed(group)) * 0.05 + 0.01
    packed, scales, mins = quantize_int4(w, group)
    assert packed.dtype == torch.uint8 and packed.shape == (24, 128) and scales.shape == (24, 256 // group)
    err = (dequantize_int4(packed, scales, mins, torch.float32) - w).abs().reshape(24, -1, group)
    step = scales.float()[:, :, None]
    assert (err <= step / 2 + 1e-3 * step).all()
    # each group's extremes are (nearly) representable: the grid spans [min, max]
    assert (err.amax(-1) > 0).any()


def test_int8_round_to_nearest_per_channel():
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 0, 16)[:, None]
    q, s = quantize_int8(w)
    assert q.dtype == torch.int8 and s.shape == (16,) and q.abs().max() == 127
    err = (dequantize_int8(q, s, torch.float32) - w).abs()
    assert (err <= s[:, None] / 2 * (1 + 1e-5)).all()  # per row: small rows get small steps


def test_int4_group_size_prefers_128():
    assert [int4_group_size(k) for k in (4096, 576, 1536, 96)] == [128, 64, 128, 32]
    with pytest.raises(ValueError, match="int4"):
        int4_group_size(100)


# ------------------------------------------------------------------------------------------ kernels


def _ref(x, w, bias):
    y = x.float() @ w.float().t()
    return y + bias.float() if bias is not None else y


@pytest.mark.parametrize("n,k,group", [(40, 256, 128), (24, 96, 32), (33, 192, 64)])
def test_int4_gemv_every_config_matches_the_reference(n, k, group):
    qk = _kernels()
    g = torch.Generator().manual_seed(n)
    w = torch.randn(n, k, generator=g) * 0.05
    packed, scales, mins = (t.to(DEV) for t in quantize_int4(w, group))
    wd = dequantize_int4(packed, scales, mins, torch.float32)
    x = torch.randn(1, k, generator=g).to(DEV)
    bias = torch.randn(n, generator=g).to(DEV)
    ref = _ref(x, wd, bias)
    assert MIN_GEMV_BLOCK_N <= min(c.block_n for c in qk.GEMV_CONFIGS)  # the counters cover every config
    for cfg in qk.GEMV_CONFIGS:
        counters = torch.zeros(-(-n // MIN_GEMV_BLOCK_N), dtype=torch.int32, device=DEV)
        y = qk.int4_matmul(x, packed, scales, mins, group, bias, counters, qk.GemvTuner(configs=(cfg,)))
        assert (y - ref).abs().max() < 1e-4, cfg
        assert not counters.any(), f"{cfg}: split-K counters must be reset for the next launch"
    # the same counters serve the next call (what a CUDA graph replay relies on)
    y2 = qk.int4_matmul(x * 2, packed, scales, mins, group, None, counters, qk.GemvTuner(configs=qk.GEMV_CONFIGS[-2:]))
    assert (y2 - _ref(x * 2, wd, None)).abs().max() < 1e-4


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n,k,group", [(72, 512, 128), (40, 384, 32), (33, 192, 64)])
def test_int4_gemv_tensor_core_variant_matches_the_reference(dtype, n, k, group):
    """`_int4_gemv_tc_kernel`: N not a multiple of BLOCK_N, uneven K steps (192 / 64 = 3 groups), split-K.
    fp32 runs the exact fp32 path; fp16 the magic-number unpack (the inline-PTX one on a GPU, "tcx"); bf16
    too on a GPU (the interpreter computes it in fp32): within the rounding of the output's dtype."""
    qk = _kernels()
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g) * 0.05
    packed, scales, mins = (t.to(DEV) for t in quantize_int4(w, group))
    wd = dequantize_int4(packed, scales, mins, torch.float32)
    x = torch.randn(1, k, generator=g).to(DEV, dtype)
    bias = torch.randn(n, generator=g).to(DEV)
    ref = _ref(x, wd, bias)
    tol = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype] * max(1.0, float(ref.abs().max()))
    configs = [c for c in qk.GEMV_CONFIGS if c.layout in ("tc", "tcx")][:2] + [
        qk.GemvConfig(16, 64, 1, 4, "tc"),
        qk.GemvConfig(32, 128, 2, 4, "tcx"),
        qk.GemvConfig(16, 32, 4, 2, "tcx"),
    ]
    for cfg in configs:
        counters = torch.zeros(-(-n // MIN_GEMV_BLOCK_N), dtype=torch.int32, device=DEV)
        y = qk.int4_matmul(x, packed, scales, mins, group, bias, counters, qk.GemvTuner(configs=(cfg,)))
        assert y.dtype == dtype and (y.float() - ref).abs().max() < tol, cfg
        assert not counters.any(), cfg


@pytest.mark.parametrize("m", [2, 17, 40])
@pytest.mark.parametrize("group", [32, 128])
def test_int4_gemm_matches_the_reference(m, group):
    qk = _kernels()
    g = torch.Generator().manual_seed(m)
    n, k = 72, 256
    packed, scales, mins = (t.to(DEV) for t in quantize_int4(torch.randn(n, k, generator=g) * 0.05, group))
    wd = dequantize_int4(packed, scales, mins, torch.float32)
    x = torch.randn(m, k, generator=g).to(DEV)
    bias = torch.randn(n, generator=g).to(DEV)
    assert (qk.int4_matmul(x, packed, scales, mins, group, bias) - _ref(x, wd, bias)).abs().max() < 1e-4


@pytest.mark.parametrize("m", [1, 5, 33])
def test_int8_kernels_match_the_reference(m):
    qk = _kernels()
    g = torch.Generator().manual_seed(m)
    n, k = 40, 192
    q, s = (t.to(DEV) for t in quantize_int8(torch.randn(n, k, generator=g) * 0.05))
    wd = dequantize_int8(q, s, torch.float32)
    x = torch.randn(m, k, generator=g).to(DEV)
    ref = _ref(x, wd, None)
    configs = [c for c in qk.GEMV_CONFIGS if c.layout == "3d"] if m == 1 else qk.GEMV_CONFIGS[:1]
    for cfg in configs:
        counters = torch.zeros(-(-n // MIN_GEMV_BLOCK_N), dtype=torch.int32, device=DEV)
        y = qk.int8_matmul(x, q, s, None, counters, qk.GemvTuner(configs=(cfg,)))
        assert (y - ref).abs().max() < 1e-4, cfg
        assert not counters.any()


@pytest.mark.parametrize("m", [1, 3])
def test_kernels_take_bf16_activations(m):
    qk = _kernels()
    g = torch.Generator().manual_seed(3)
    w = torch.randn(48, 256, generator=g) * 0.05
    x = torch.randn(m, 256, generator=g).bfloat16().to(DEV)
    packed, scales, mins = (t.to(DEV) for t in quantize_int4(w, 128))
    ref = _ref(x, dequantize_int4(packed, scales, mins, torch.float32), None)
    y = qk.int4_matmul(x, packed, scales, mins, 128)
    assert y.dtype == torch.bfloat16
    # the dequantized weight (GEMM) or the output (both) is rounded to bf16
    assert (y.float() - ref).abs().max() < 0.02 * ref.abs().max()
    q8, s8 = (t.to(DEV) for t in quantize_int8(w))
    ref8 = _ref(x, dequantize_int8(q8, s8, torch.float32), None)
    assert (qk.int8_matmul(x, q8, s8).float() - ref8).abs().max() < 0.02 * ref8.abs().max()


# ------------------------------------------------------------------------------------------ models


def _tiny_model(tie: bool = True):
    from sluice.core.models.loader import load_model, resolve_model
    from sluice.core.models.registry import DUMMY_SHAPES

    src = resolve_model("dummy:tiny")
    if not tie:
        src.config.tie_word_embeddings = False
    assert DUMMY_SHAPES["tiny"]["hidden_size"] % 32 == 0
    return load_model(src, torch.float32, torch.device("cpu"), 128, seed=1)


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantize_model_replaces_every_linear_and_stays_close(method):
    dense = _tiny_model(tie=False)
    model = _tiny_model(tie=False)
    before = weight_bytes(model)
    counts = quantize_model(model, method)
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    quant = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    assert not linears and len(quant) == counts["quantized"] == 4 * 2 + 1  # 4 per layer + the untied head
    assert weight_bytes(model) < before
    x = torch.randn(5, model.config.hidden_size)
    for name, m in model.named_modules():
        if isinstance(m, QuantizedLinear):
            ref = dense.get_submodule(name)(x if m.in_features == x.shape[1] else torch.randn(5, m.in_features))
            assert m(x if m.in_features == x.shape[1] else torch.randn(5, m.in_features)).shape == ref.shape
            w = dense.get_submodule(name).weight
            rel = (m.dequantize(torch.float32) - w).norm() / w.norm()
            assert rel < (0.01 if method == "int8" else 0.12), (name, float(rel))
    # the forward of a QuantizedLinear is F.linear with its dequantized weight (the reference path)
    q = quant[0]
    xi = torch.randn(3, q.in_features)
    assert torch.equal(q(xi), nn.functional.linear(xi, q.dequantize(torch.float32), q.bias))


def test_quantize_model_can_keep_the_head_dense():
    model = _tiny_model(tie=False)
    quantize_model(model, "int4", include_lm_head=False)
    assert isinstance(model.lm_head, nn.Linear)
    with pytest.raises(ValueError, match="quantization"):
        quantize_model(_tiny_model(), "int2")


@pytest.mark.slow
def test_gguf_q4_1_blocks_load_as_is_and_equal_the_dense_weights(default_source):
    """The default model's Q4_1 projections become int4 without passing through 16 bits: dequantized, they
    are bit for bit the weights transformers' GGUF reader produced (q/k row order included)."""
    from sluice.core.models.loader import load_model

    model = load_model(default_source, torch.float32, torch.device("cpu"), 64)
    dense = {n: m.weight.detach().clone() for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    counts = quantize_model(model, "int4", default_source.gguf_file)
    assert counts == {"gguf_q4_1": len(dense), "quantized": 0}
    for name, m in model.named_modules():
        if isinstance(m, QuantizedLinear):
            assert m.group_size == 32 and m.scales.dtype == torch.float16
            assert torch.equal(m.dequantize(torch.float32), dense[name]), name


def test_bench_perplexity_compares_every_option_on_the_same_text(tmp_path):
    import json

    from sluice.app.commands.cli import main

    out = tmp_path / "ppl.json"
    argv = ["bench", "perplexity", "--model", "dummy:tiny", "--device", "cpu", "--num-tokens", "192"]
    rc = main([*argv, "--seq-len", "64", "--variants", "int8,fp8-kv,int4", "--out", str(out)])
    rec = json.loads(out.read_text())
    rows = {r["variant"]: r for r in rec["variants"]}
    assert list(rows) == ["base", "int8", "fp8-kv", "int4"]  # the unquantized base always comes first
    assert rec["dataset"]["split"] == "heldout" and rec["dataset"]["tokens"] >= 192
    assert len({r["scored_tokens"] for r in rows.values()}) == 1  # one text for all
    assert rows["base"]["delta_pct"] == 0.0
    assert rows["fp8-kv"]["kv_bytes_per_token"] * 4 == rows["base"]["kv_bytes_per_token"]  # fp32 -> e4m3
    assert rows["int8"]["weights_gib"] < rows["base"]["weights_gib"]
    for r in rows.values():  # a random model: perplexity near its vocabulary, each option close to the base
        assert abs(r["delta_pct"]) < 5 and r["perplexity"] > 1000
    assert rc == (0 if rec["all_within_bounds"] else 1)


def test_window_logits_in_steps_of_a_few_tokens_are_the_prefills():
    """``rows`` tokens a pass, each over the KV the passes before wrote (how the perplexity bench scores the CPU's
    few-row kernels), gives the one prefill's logits (fp32: equal to summation order)."""
    from sluice.app.bench.perplexity import window_logits
    from sluice.core.args import EngineArgs
    from sluice.core.models.loader import resolve_model
    from sluice.core.worker.model_runner import ModelRunner

    runner = ModelRunner(
        EngineArgs(model="dummy:tiny", device="cpu", num_kv_blocks=8), resolve_model("dummy:tiny"), 128
    )
    ids = torch.randint(0, 200, (37,), generator=torch.Generator().manual_seed(4)).tolist()
    whole = window_logits(runner, ids)
    assert whole.shape[0] == 37
    for rows in (1, 5, 16):
        torch.testing.assert_close(window_logits(runner, ids, rows), whole, rtol=1e-4, atol=1e-4)


def test_gemv_tuner_never_picks_a_config_whose_output_is_wrong(monkeypatch):
    """The tuner times candidates on a GPU; one that computes a different product (a miscompiled unpack, say)
    is dropped however fast it is. Timing is faked here (no GPU): the wrong config is the fastest."""
    import triton.testing

    qk = _kernels()
    configs = (qk.GemvConfig(16, 256, 1, 4), qk.GemvConfig(32, 128, 1, 4, "2d"), qk.GemvConfig(64, 128, 1, 4, "tcx"))
    right = torch.arange(8, dtype=torch.float32)
    outputs = {configs[0]: right, configs[1]: right + 1e-4, configs[2]: right.flip(0)}
    speed = {configs[0]: 3.0, configs[1]: 2.0, configs[2]: 1.0}
    last = []

    def run(c):
        last.append(c)
        return outputs[c]

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kw: (fn(), speed[last[-1]])[1])
    tuner = qk.GemvTuner(configs=configs)
    assert tuner.pick(("int4", 8, 64, 32), run, torch.device("cuda")) == configs[1]
    assert tuner.timings[("int4", 8, 64, 32)] == {configs[0]: 3.0, configs[1]: 2.0}  # the wrong one never timed


def test_gemv_tuner_takes_the_offline_config_only_when_its_output_is_right(monkeypatch):
    """A config chosen offline (`int4_gemv_config`) is taken untimed when it agrees with the first candidate,
    and timed out of the running when it does not (faked timing as above)."""
    import triton.testing

    qk = _kernels()
    configs = (qk.GemvConfig(16, 256, 1, 4), qk.GemvConfig(32, 128, 1, 4, "2d"))
    preferred = qk.GemvConfig(64, 128, 4, 4, "tcx")
    right = torch.arange(8, dtype=torch.float32)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    timed = []
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kw: (fn(), timed.append(1), 1.0)[2])
    good = qk.GemvTuner(configs=configs)
    assert good.pick(("int4", 8, 64, 32), lambda c: right, torch.device("cuda"), preferred=preferred) == preferred
    assert not timed and good.choice[("int4", 8, 64, 32)] == preferred
    bad = qk.GemvTuner(configs=configs)
    outputs = {configs[0]: right, configs[1]: right, preferred: right.flip(0)}
    assert bad.pick(("int4", 8, 64, 32), outputs.get, torch.device("cuda"), preferred=preferred) == configs[0]
    assert len(timed) == 2 and preferred not in bad.timings[("int4", 8, 64, 32)]


def test_int4_gemv_config_splits_k_only_while_the_grid_is_short():
    """The offline rule at Llama-3-8B's shapes on 132 SMs gives what the H200 sweep measured fastest."""
    qk = _kernels()
    splits = {name: qk.int4_gemv_config(n, k, 132).split_k for name, (n, k) in {
        "qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
        "lm_head": (128256, 4096)}.items()}  # fmt: skip
    assert splits == {"qkv": 4, "o": 4, "gate_up": 1, "down": 8, "lm_head": 1}
    assert qk.int4_gemv_config(576, 576, 132).split_k == 1  # SmolLM2: K too short to split


def test_pdl_only_on_a_cuda_gpu_of_compute_capability_9_and_not_when_turned_off(monkeypatch):
    """The PDL constexprs compile only for sm_90+ (and not in the interpreter); `configure` (the engine's
    SLUICE_PDL, tests/test_envs.py) is the A/B switch."""
    from sluice.kv.attention import pdl
    from sluice.kv.attention.pdl import pdl_enabled

    pdl.configure(enabled=True)
    pdl_enabled.cache_clear()  # it answers once per device and process; each case below is a new "process"
    assert not pdl_enabled(torch.device("cpu"))
    for capability, expected in (((9, 0), True), ((10, 0), True), ((8, 9), False)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        pdl_enabled.cache_clear()
        assert pdl_enabled(torch.device("cuda", 0)) is expected
    pdl.configure(enabled=False)
    pdl_enabled.cache_clear()
    assert not pdl_enabled(torch.device("cuda", 0))
    pdl.configure(enabled=True)  # the default
    pdl_enabled.cache_clear()  # leave no answer from a faked GPU behind
