"""Gemma 2 and Gemma 3 (text) against transformers' own classes on tiny random checkpoints (fp32, CPU).

Gemma 2: sliding layers (window 24, shorter than the prompts) alternate with global ones, attention and final
logits are soft-capped with caps small enough to bend these logits, ``query_pre_attn_scalar`` is not the head
size, and every ``(1 + w)`` norm weight is random. Gemma 3: local/global layers in a 2:1 pattern with two RoPE
bases, q/k norms. Each: logits, the engine's paths (solo, batched, prefix hit, chunked prefill under
preemption); Gemma 2 also through the Triton kernels (interpreter). (Two gloo ranks: `test_family_mistral.py`.)
"""

from __future__ import annotations

import pytest
import torch
from sluice.core import LLM

from tests.family_parity import GREEDY, NEW_TOKENS, check_engine_paths, check_greedy, max_logit_diff
from tests.helpers import hf_greedy, prompt_of_length, save_tiny_hf_model

WINDOW = 24
PROMPT_LENS = [17, 40, 70]
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    sliding_window=WINDOW,
    query_pre_attn_scalar=24,
)


def _gemma2_config(vocab_size: int, **overrides):
    from transformers import Gemma2Config

    cfg = TINY | dict(
        vocab_size=vocab_size,
        num_hidden_layers=2,
        layer_types=["sliding_attention", "full_attention"],
        attn_logit_softcapping=2.0,
        final_logit_softcapping=3.0,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    return Gemma2Config(**(cfg | overrides))


def _gemma3_config(vocab_size: int):
    from transformers import Gemma3TextConfig

    cfg = TINY | dict(
        vocab_size=vocab_size,
        num_hidden_layers=3,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 8.0},
        },
    )
    c = Gemma3TextConfig(**cfg)
    c.architectures = ["Gemma3ForCausalLM"]
    return c


@pytest.fixture(scope="module")
def prompts(default_tokenizer):
    return [prompt_of_length(default_tokenizer, n, f"Fable {n}:") for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory, default_tokenizer, prompts):
    d = tmp_path_factory.mktemp("tiny-gemma2")
    ref = save_tiny_hf_model(_gemma2_config(len(default_tokenizer)), d, default_tokenizer, seed=6)
    return str(d), ref, [hf_greedy(ref, p, NEW_TOKENS) for p in prompts]


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory, default_tokenizer, prompts):
    d = tmp_path_factory.mktemp("tiny-gemma3")
    ref = save_tiny_hf_model(_gemma3_config(len(default_tokenizer)), d, default_tokenizer, seed=7)
    return str(d), ref, [hf_greedy(ref, p, NEW_TOKENS) for p in prompts]


def test_gemma2_logits_match_transformers(gemma2, prompts):
    assert max_logit_diff(gemma2[0], gemma2[1], prompts[-1]) < 1e-4


def test_gemma2_caps_and_window_change_the_reference(gemma2, default_tokenizer, prompts):
    """Each feature under test moves transformers' logits: a model without it could not match them."""
    _, ref, _ = gemma2
    ids = torch.tensor([prompts[-1]])
    with torch.no_grad():
        want = ref(ids).logits[0]
    for change in (
        dict(attn_logit_softcapping=None),
        dict(final_logit_softcapping=None),
        dict(layer_types=["full_attention", "full_attention"]),
    ):
        other = type(ref)(_gemma2_config(len(default_tokenizer), **change)).eval()
        other.load_state_dict(ref.state_dict())
        with torch.no_grad():
            assert (other(ids).logits[0] - want).abs().max() > 1e-2, change


def test_gemma2_engine_paths(gemma2, prompts):
    check_engine_paths(gemma2[0], gemma2[1], prompts, gemma2[2], "gemma2")


def test_gemma2_triton_kernels_window_and_softcap(gemma2, prompts):
    """The Triton backend with the fused kernels (the interpreter on the CPU): windowed and global layers,
    soft-capped, in prefill steps and in decode steps whose RoPE and KV write the decode kernel does itself
    (`DecodeRope`), for a batch."""
    pytest.importorskip("triton")
    d, ref, refs = gemma2
    kw = dict(model=d, device="cpu", attention_backend="triton", fused_kernels="on", block_size=16)
    with LLM(**kw, num_kv_blocks=48, max_model_len=256) as llm:
        runner = llm.engine.local_core.executor.runner
        assert runner.model.rotary.fused_write is not None and runner.backend.rope_in_decode
        batched = llm.generate(prompts[1:], GREEDY, use_tqdm=False)
    check_greedy(ref, prompts[1:], batched, refs[1:], "gemma2 triton batched")


def test_gemma3_logits_match_transformers(gemma3, prompts):
    from sluice.core.models.gemma3 import Gemma3ForCausalLM
    from sluice.core.models.loader import load_model, resolve_model

    model = load_model(resolve_model(gemma3[0]), torch.float32, torch.device("cpu"), max_position=512)
    assert type(model) is Gemma3ForCausalLM
    # two tables: the local layers' base differs from the global one's (and its linear scaling)
    assert [r is model.rotary_local for r in model.layer_rotary] == [True, True, False]
    assert not torch.allclose(model.rotary_local.cos, model.rotary.cos)
    assert max_logit_diff(gemma3[0], gemma3[1], prompts[-1]) < 1e-4


def test_gemma3_engine_paths(gemma3, prompts):
    check_engine_paths(gemma3[0], gemma3[1], prompts, gemma3[2], "gemma3")


def test_gemma2_fp8_kv_cache(gemma2, prompts):
    """An fp8 KV cache (scales calibrated per head) under the windowed, soft-capped layers: every token the engine
    picks is transformers' best or within a small logit margin of it there (fp8 rounding may flip a near tie, and
    the soft-caps pack these logits close), teacher-forced along the engine's own tokens."""
    d, ref, refs = gemma2
    kw = dict(model=d, device="cpu", kv_cache_dtype="fp8", block_size=16, num_kv_blocks=48, max_model_len=256)
    with LLM(**kw) as llm:
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert llm.engine.local_core.executor.runner.model.model.layers[0].self_attn.kv_scale is not None
    worst = 0.0
    for p, o in zip(prompts, outs, strict=True):
        ids = o.outputs[0].token_ids
        with torch.no_grad():
            logits = ref(torch.tensor([p + ids])).logits[0, len(p) - 1 : -1]
        picked = logits.gather(1, torch.tensor(ids)[:, None])[:, 0]
        worst = max(worst, (logits.max(dim=1).values - picked).max().item())
    print(f"fp8 KV: largest logit shortfall of a picked token {worst:.3f}")
    assert worst < 0.05
