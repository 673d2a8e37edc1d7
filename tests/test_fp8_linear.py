"""FP8 W8A8 linear layers (`core/models/fp8_linear.py`, `fp8_kernels.py`): the quantizers, the Triton kernels under
the interpreter against the torch emulation, the NaN/inf guards, model quantization and the engine with it."""

from __future__ import annotations

import importlib
import os

import pytest
import torch
from torch import nn

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"

from sluice.core.models.fp8_linear import (  # noqa: E402
    Fp8Linear,
    dequantize_weight,
    fp8_linear_reference,
    quantize_rows,
    quantize_weight,
)
from sluice.kv.attention.fp8 import FP8_DTYPE  # noqa: E402

DEV = "cuda" if ON_GPU else "cpu"


def _kernels():
    triton = pytest.importorskip("triton")
    from triton.runtime.interpreter import InterpretedFunction

    if not ON_GPU and not isinstance(triton.language.standard.cdiv, InterpretedFunction):
        pytest.skip("triton was imported without TRITON_INTERPRET=1 (tests/conftest.py sets it)")
    from sluice.core.models import fp8_kernels as fk

    if not ON_GPU and not isinstance(fk._fp8_gemv_kernel, InterpretedFunction):
        importlib.reload(fk)
    return fk


def _bits(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.uint8)


# ------------------------------------------------------------------------------------------ quantizers


def test_max_rule_scales_are_per_row_amax_over_448_and_codes_round_to_nearest():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(8, 64, generator=g) * torch.logspace(-3, 2, 8)[:, None]
    q, s = quantize_weight(w, "max")
    assert q.dtype == FP8_DTYPE and s.dtype == torch.float32
    assert torch.allclose(s, w.abs().amax(dim=1) / 448)
    assert torch.equal(q.float().abs().amax(dim=1), torch.full((8,), 448.0))  # each row's largest hits the top
    err = (dequantize_weight(q, s) - w).abs() / w.abs().amax(dim=1, keepdim=True)
    assert err.max() <= 2**-4 * 1.0001  # half a step of e4m3's 3 mantissa bits, relative to the row's top binade


def test_zero_and_non_finite_weight_rows_get_finite_scales():
    w = torch.randn(4, 32)
    w[0] = 0.0
    w[1, 3] = float("inf")
    w[2, 5] = float("nan")
    w[3, 7] = -float("inf")
    q, s = quantize_weight(w.to(torch.bfloat16))
    assert torch.isfinite(s).all() and (s > 0).all() and s[0] == 1.0
    assert torch.isfinite(q.float()).all() and (q[0].float() == 0).all()
    assert q[1, 3].float() == 448 and q[3, 7].float() == -448 and q[2, 5].float() == 0


def test_activation_rows_are_quantized_each_with_its_own_scale():
    x = torch.randn(3, 64)
    x[1] *= 1000.0
    x[2] = 0.0
    q, s = quantize_rows(x)
    assert torch.allclose(s[:2], x[:2].abs().amax(dim=1) / 448) and s[2] > 0
    assert (q[2].float() == 0).all()
    assert torch.equal(q[:2].float().abs().amax(dim=1), torch.full((2,), 448.0))


def test_reference_tracks_the_dense_product_within_fp8_error():
    g = torch.Generator().manual_seed(1)
    x, w, b = torch.randn(5, 256, generator=g), torch.randn(64, 256, generator=g) * 0.05, torch.randn(64, generator=g)
    q, s = quantize_weight(w)
    y = fp8_linear_reference(x, q, s, b)
    dense = x @ w.t() + b
    rel = (y - dense).norm() / dense.norm()
    assert 1e-4 < rel < 0.05  # quantized (not the dense product), within e4m3's error


@pytest.mark.parametrize("scale", [1e-30, 1e-6, 1.0, 1e4, 1e30])
def test_extreme_activations_and_weights_never_make_nan_or_inf(scale):
    """Rows of zeros, tiny and huge values, an infinite activation: every output the dense product keeps finite
    stays finite and close, and quantization itself never produces a NaN."""
    g = torch.Generator().manual_seed(2)
    w = torch.randn(16, 64, generator=g)
    w[0] = 0.0
    w[1] *= 1e-20
    w[2] *= 1e3
    x = torch.randn(4, 64, generator=g) * scale
    x[1] = 0.0
    q, s = quantize_weight(w)
    y = fp8_linear_reference(x, q, s, None)
    dense = x.double() @ w.double().t()
    finite = torch.isfinite(dense.float())
    assert torch.isfinite(y[finite]).all()
    assert not torch.isnan(y).any()
    assert (y.double() - dense)[finite].norm() <= 0.05 * dense[finite].norm() + 1e-30
    xi = x.clone()
    xi[2, 0] = float("inf")
    qi, si = quantize_rows(xi)
    assert torch.isfinite(si).all() and not torch.isnan(qi.float()).any()


# ----------------------------------------------------------------------- Triton kernels vs the emulation


@pytest.mark.parametrize(
    "m,n,k,bias,cfg",
    [
        (1, 96, 256, False, (32, 64, 1)),
        (3, 64, 320, True, (32, 64, 2)),
        (20, 40, 128, True, (32, 128, 1)),
        (2, 32, 4500, False, (32, 256, 2)),
    ],
)
def test_gemv_kernel_matches_the_emulation(m, n, k, bias, cfg):
    """Split-K, K not a multiple of the step, N not of the tile, several row tiles (20 rows in tiles of 16); the
    amax prologue over several steps with a ragged last one (2 rows: tiles of 2 x 2048)."""
    fk = _kernels()
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=g) * 3
    x[:, -1] = 20.0  # each row's amax in the prologue's last (ragged) step
    x = x.to(DEV)
    w = (torch.randn(n, k, generator=g) * 0.05).to(DEV)
    b = torch.randn(n, generator=g).to(DEV) if bias else None
    q, s = quantize_weight(w)
    counters = torch.zeros(8, dtype=torch.int32, device=DEV)
    ref = fp8_linear_reference(x, q, s, b)
    for _ in range(2):  # twice: the split-K counters are reset by the kernel
        y = fk.fp8_gemv(x, q, s, b, counters, fk.Fp8GemvConfig(*cfg))
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    assert int(counters.sum()) == 0


def test_row_quant_kernel_is_the_reference_bit_for_bit():
    fk = _kernels()
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 200, generator=g) * torch.logspace(-4, 4, 6)[:, None]
    x[3] = 0.0
    x[4, :5] = torch.tensor([126.04, 125.9, -31.36, 0.0009, 447.9]) * x[4].abs().max() / 448  # binade edges
    q, s = fk.quantize_rows(x.to(DEV))
    rq, rs = quantize_rows(x.to(DEV))
    assert torch.equal(_bits(q), _bits(rq)) and torch.equal(s, rs)


def test_interpreters_own_fp8_cast_is_why_kernels_round_explicitly():
    """The reason for ``EXACT_ROUND``: should Triton's interpreter get its e4m3 cast right, this fails and the
    explicit rounding can go."""
    if ON_GPU:
        pytest.skip("the interpreter's cast")
    import triton
    import triton.language as tl

    @triton.jit
    def cast(x_ptr, o_ptr, N: tl.constexpr):
        offs = tl.arange(0, N)
        tl.store(o_ptr + offs, tl.load(x_ptr + offs).to(tl.float8e4nv))

    x = torch.tensor([126.04, 0.001, 100.0, 3.0])
    out = torch.empty(4, dtype=FP8_DTYPE)
    cast[(1,)](x, out, N=4)
    assert not torch.equal(_bits(out), _bits(x.to(FP8_DTYPE)))


def test_cuda_dispatch_picks_by_rows_without_the_gpu():
    fk = _kernels()
    x = torch.zeros(64, 128, dtype=torch.bfloat16)
    assert not fk.scaled_mm_fits(x, 256)  # not on a GPU
    assert fk.gemv_rows() == fk.GEMV_ROWS
    c1, c64 = fk.gemv_config(4096, 14336, 132, 16), fk.gemv_config(4096, 14336, 132, 64)
    assert c1.split_k > 1 and c64.block_k <= c1.block_k
    assert (c1.dot, c64.dot) == (2, 1) and c1.promote_k > 0  # fp8 operands only at small row tiles


def test_split_k_ranges_follow_their_bound_from_the_environment(monkeypatch):
    from sluice.core import envs

    fk = _kernels()
    # Llama-3-8B's o projection at one row: ranges of 1024 split it in 4, the former bound of 2048 in 2; the
    # gate/up projection (448 tiles) fills the grid without a split under either
    assert fk.gemv_config(4096, 4096, 132, 16).split_k == 4
    assert fk.gemv_config(28672, 4096, 132, 16).split_k == 1
    monkeypatch.setenv("SLUICE_FP8_GEMV_SPLIT_MIN_K", "2048")
    try:
        envs.configure_kernels()
        assert fk.gemv_config(4096, 4096, 132, 16).split_k == 2
        assert fk.gemv_config(4096, 14336, 132, 16).split_k == 4
    finally:
        monkeypatch.delenv("SLUICE_FP8_GEMV_SPLIT_MIN_K")
        envs.configure_kernels()
    assert fk.gemv_config(4096, 4096, 132, 16).split_k == 4


def test_the_fp8_gemv_rows_come_from_the_environment(monkeypatch):
    from sluice.core import envs

    fk = _kernels()
    monkeypatch.setenv("SLUICE_FP8_GEMV_ROWS", "8")
    try:
        envs.configure_kernels()
        assert fk.gemv_rows() == 8
    finally:
        monkeypatch.delenv("SLUICE_FP8_GEMV_ROWS")
        envs.configure_kernels()
    assert fk.gemv_rows() == fk.GEMV_ROWS


# ------------------------------------------------------------------------------------------------ model


def _tiny_model():
    from sluice.core.models.loader import load_model, resolve_model

    source = resolve_model("dummy:tiny")
    return source, load_model(source, torch.float32, torch.device("cpu"), 64)


def test_quantize_model_makes_the_projections_fp8_and_keeps_the_head_and_the_recipes_layers_dense():
    from sluice.core.models.fp8_recipe import Fp8Recipe
    from sluice.core.models.quant import quantize_model, weight_bytes

    _, model = _tiny_model()
    dense = {n: m.weight.detach().clone() for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    before = weight_bytes(model)
    counts = quantize_model(model, "fp8")
    fp8 = {n: m for n, m in model.named_modules() if isinstance(m, Fp8Linear)}
    layers, dense_last = len(model.model.layers), Fp8Recipe().dense_last_layers
    assert counts == {"fp8": len(fp8), "dense": 4 * dense_last} and len(fp8) == 4 * (layers - dense_last)
    for layer in model.model.layers[layers - dense_last :]:  # the recipe's dense layers stay as they were
        assert not any(isinstance(m, Fp8Linear) for m in layer.modules())
    assert not isinstance(model.lm_head, Fp8Linear) if model.lm_head is not None else True
    for n, m in fp8.items():
        assert torch.equal(_bits(m.qweight), _bits(quantize_weight(dense[n])[0]))
    assert weight_bytes(model) < before


def test_engine_serves_fp8_and_fp8_with_the_fp8_kv_cache():
    """`--quantization fp8` through the engine (CPU emulation), alone and over the fp8 KV cache (its scales
    calibrated on the fp8 model): requests complete, and greedy tokens mostly agree with the unquantized model's."""
    from sluice.core.frontend.llm import LLM
    from sluice.core.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=8, temperature=0.0)
    prompts = ["The river runs", "Once upon a time", "1, 2, 3,"]
    outs = {}
    for q, kv in ((None, "auto"), ("fp8", "auto"), ("fp8", "fp8")):
        with LLM(model="dummy:tiny", quantization=q, kv_cache_dtype=kv, num_kv_blocks=64, dtype="float32") as llm:
            outs[q, kv] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    for variant in (("fp8", "auto"), ("fp8", "fp8")):
        assert all(len(t) == 8 for t in outs[variant])
        assert sum(a == b for a, b in zip(outs[None, "auto"], outs[variant])) >= 1, outs


def test_gpu_fp8_check_agreement_runs_on_the_cpu(tmp_path, monkeypatch):
    """`scripts/gpu_fp8_check.py agree` (the GPU run's greedy agreement), end to end on a tiny model: every prompt
    gets a verdict and the summary adds up."""
    import importlib.util
    import json
    import sys
    from pathlib import Path

    data = tmp_path / "conversations.json"
    data.write_text(json.dumps([[f"Tell me about topic {i}.", "Sure."] for i in range(4)]))
    out = tmp_path / "agree.json"
    path = Path(__file__).resolve().parents[1] / "scripts" / "gpu_fp8_check.py"
    spec = importlib.util.spec_from_file_location("gpu_fp8_check", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    argv = ["gpu_fp8_check.py", "agree", "--model", "dummy:tiny", "--device", "cpu", "--data", str(data)]
    monkeypatch.setattr(sys, "argv", argv + ["--num-prompts", "3", "--tokens", "4", "--out", str(out)])
    assert script.main() == 0
    res = json.loads(out.read_text())
    assert res["prompts"] == 3 and res["equal"] + res["near-tie"] + res["diverged"] == 3
    assert all(0 <= r["same_tokens"] <= 4 for r in res["rows"])


def test_speculation_over_an_fp8_target_keeps_the_draft_head_dense_and_greedy_tokens(tmp_path):
    """EAGLE over an fp8 target: the draft head (and the LM head it shares) stay dense, drafts get accepted, and
    greedy speculative tokens are the fp8 target's own greedy tokens."""
    from sluice.core.models.loader import ModelSource
    from sluice.core.request import Request
    from sluice.core.sampling_params import SamplingParams

    from tests.spec_helpers import StepLoop, copy_head_dir, tiny_config

    config = tiny_config(64)
    source = ModelSource("tiny64", config, None, "", [])
    head = copy_head_dir(tmp_path, "tiny64", config)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = []
    for spec in ({}, {"speculative_model": head, "num_speculative_tokens": 3}):
        loop = StepLoop(source, 64, 64, 4, block_size=8, quantization="fp8", **spec)
        reqs = loop.run([Request(f"r{i}", [3 + i, 7, 11 + i], params, max_tokens=12) for i in range(4)])
        outs.append([r.output_token_ids for r in reqs])
    runner = loop.runner
    assert any(isinstance(m, Fp8Linear) for m in runner.model.modules())
    assert not any(isinstance(m, Fp8Linear) for m in runner.drafter.head.modules())
    assert loop.scheduler.spec_stats.num_accepted_tokens > 0
    assert outs[0] == outs[1]
