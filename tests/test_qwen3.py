"""Qwen3 (dense) against transformers on a tiny random checkpoint that transformers' own `Qwen3ForCausalLM`
writes (fp32, CPU), and the message for an architecture sluice does not serve.

The checkpoint has GQA, an untied head and ``head_dim`` 32 where hidden / heads is 16, so a model that derived the
head size, skipped the per-head q/k norms or put them after RoPE would not match. Every parameter is random (the
q/k norm weights included), so a weight loaded into the wrong place shows.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from sluice.core import LLM, SamplingParams
from sluice.core.models.errors import ModelLoadError

from tests.helpers import assert_greedy_match, hf_greedy, prompt_of_length, save_tiny_hf_model

NEW_TOKENS = 32
BLOCK_SIZE = 16
PROMPT_LENS = [1, 16, 17, 33, 70]
# fp32 on both sides; the sums run in another order (a paged attention, merged projections)
LOGITS_ATOL = 1e-4
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)


def _qwen3_config(vocab_size: int, **overrides):
    from transformers import Qwen3Config

    cfg = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )
    return Qwen3Config(**(cfg | overrides))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, default_tokenizer):
    """(model directory, transformers reference model)."""
    d = tmp_path_factory.mktemp("tiny-qwen3")
    ref = save_tiny_hf_model(_qwen3_config(len(default_tokenizer)), d, default_tokenizer, seed=3)
    return str(d), ref


@pytest.fixture(scope="module")
def prompts(default_tokenizer):
    return [prompt_of_length(default_tokenizer, n, f"Story {n}:") for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def references(checkpoint, prompts):
    return [hf_greedy(checkpoint[1], p, NEW_TOKENS) for p in prompts]


@pytest.fixture(scope="module")
def llm(checkpoint):
    engine = LLM(model=checkpoint[0], device="cpu", num_kv_blocks=128, block_size=BLOCK_SIZE, max_model_len=512)
    yield engine
    engine.close()


def _prefill_logits(model, ids: list[int]) -> torch.Tensor:
    """The logits of every position of one prompt, prefilled into a paged cache through the torch backend."""
    from sluice.core.models.layers import ForwardContext
    from sluice.kv.attention import AttentionMetadata, allocate_kv_cache, get_attention_backend

    n = len(ids)
    blocks = -(-n // BLOCK_SIZE)
    kv = allocate_kv_cache(
        len(model.model.layers), blocks, BLOCK_SIZE, model.num_kv_heads, model.head_dim, torch.float32, "cpu"
    )
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        seq_lens=torch.tensor([n], dtype=torch.int32),
        block_tables=torch.arange(blocks, dtype=torch.int32)[None],
        max_query_len=n,
        max_seq_len=n,
        query_start_loc_host=[0, n],
        seq_lens_host=[n],
    )
    with torch.inference_mode():
        hidden = model(torch.tensor(ids), torch.arange(n), ForwardContext(meta, kv, get_attention_backend("torch")))
        return model.compute_logits(hidden)


def _check(ref_model, prompts, outs, refs, label):
    for p, o, r in zip(prompts, outs, refs):
        (seq,) = o.outputs
        assert len(seq.token_ids) == NEW_TOKENS
        note = assert_greedy_match(ref_model, p, seq.token_ids, r, f"{label} (prompt len {len(p)})")
        if note:
            print(note)


def test_checkpoint_has_the_features_under_test(checkpoint):
    d, ref = checkpoint
    cfg = json.loads((Path(d) / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3ForCausalLM"]
    assert cfg["head_dim"] != cfg["hidden_size"] // cfg["num_attention_heads"]
    assert cfg["num_key_value_heads"] < cfg["num_attention_heads"] and cfg["tie_word_embeddings"] is False
    attn = ref.model.layers[0].self_attn
    assert attn.q_proj.bias is None and not torch.allclose(attn.k_norm.weight, torch.ones(32))


def test_logits_match_transformers(checkpoint, prompts):
    from sluice.core.models.loader import load_model, resolve_model
    from sluice.core.models.qwen3 import Qwen3ForCausalLM

    d, ref = checkpoint
    model = load_model(resolve_model(d), torch.float32, torch.device("cpu"), max_position=512)
    assert type(model) is Qwen3ForCausalLM and model.head_dim == 32
    ids = prompts[-1]
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0]
    got = _prefill_logits(model, ids)
    assert (got - want).abs().max().item() < LOGITS_ATOL


def test_greedy_matches_transformers_one_at_a_time(llm, checkpoint, prompts, references):
    outs = [llm.generate([p], GREEDY, use_tqdm=False)[0] for p in prompts]
    _check(checkpoint[1], prompts, outs, references, "qwen3 solo")
    attn = llm.engine.local_core.executor.runner.model.model.layers[0].self_attn
    assert attn.fused_qk_norm is None  # no Triton kernels on the CPU: the two norm modules


def test_greedy_matches_transformers_in_one_batch(llm, checkpoint, prompts, references):
    steps_before = llm.engine.stats().num_steps
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert llm.engine.stats().num_steps - steps_before <= NEW_TOKENS + 2  # together, not one after another
    _check(checkpoint[1], prompts, outs, references, "qwen3 batched")


def test_references_are_not_trivial(references):
    assert len({tuple(r) for r in references}) == len(references)
    assert all(len(set(r)) > 2 for r in references)


def test_fused_kernels_norm_q_and_k_on_every_rope_path(checkpoint, prompts, references):
    """The Triton backend with the fused kernels (the interpreter on the CPU): the q/k norms run as the fused
    RMSNorm, then the fused RoPE/KV-write kernel (prompt steps) or the decode kernel's own RoPE (decode steps,
    `DecodeRope`) rotate and store the normed keys; tokens equal transformers', solo and batched."""
    pytest.importorskip("triton")
    d, ref = checkpoint
    kw = dict(model=d, device="cpu", attention_backend="triton", fused_kernels="on", block_size=BLOCK_SIZE)
    with LLM(**kw, num_kv_blocks=64, max_model_len=256) as llm:
        runner = llm.engine.local_core.executor.runner
        attn = runner.model.model.layers[0].self_attn
        assert attn.fused_qk_norm is not None and runner.model.rotary.fused_write is not None
        assert runner.backend.rope_in_decode
        few = [prompts[1], prompts[3]]
        solo = [llm.generate([p], GREEDY, use_tqdm=False)[0] for p in few]
        batched = llm.generate(few, GREEDY, use_tqdm=False)
    refs = [references[1], references[3]]
    _check(ref, few, solo, refs, "qwen3 triton solo")
    _check(ref, few, batched, refs, "qwen3 triton batched")


def test_the_cpu_kernels_keep_two_norm_modules_and_the_fused_kernels_take_one_launch():
    from sluice.core.models.layers import enable_cpu_kernels, enable_fused_kernels
    from sluice.core.models.qwen3 import Qwen3ForCausalLM

    model = Qwen3ForCausalLM(_qwen3_config(256), max_position=128)
    attn = model.model.layers[0].self_attn
    enable_cpu_kernels(model)
    assert attn.fused_qk_norm is None and attn.q_norm.fused is not None  # torch calls, never a Triton launch
    pytest.importorskip("triton")
    enable_fused_kernels(model)
    assert attn.fused_qk_norm is not None


def test_tied_head_loads_and_matches(tmp_path, default_tokenizer):
    from sluice.core.models.loader import load_model, resolve_model

    ref = save_tiny_hf_model(_qwen3_config(len(default_tokenizer), tie_word_embeddings=True), tmp_path, seed=4)
    model = load_model(resolve_model(str(tmp_path)), torch.float32, torch.device("cpu"), max_position=512)
    assert model.lm_head is None
    ids = list(range(100, 140))
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0]
    assert (_prefill_logits(model, ids) - want).abs().max().item() < LOGITS_ATOL


def test_sliding_window_layers_are_refused():
    from sluice.core.models.qwen3 import Qwen3ForCausalLM

    cfg = _qwen3_config(256, use_sliding_window=True, sliding_window=64, max_window_layers=0)
    with pytest.raises(ModelLoadError, match="sliding-window"):
        Qwen3ForCausalLM(cfg, max_position=128)


def test_unknown_architecture_is_one_line_naming_the_supported_ones(tmp_path):
    from sluice.core.models.loader import resolve_model
    from sluice.core.models.registry import MODEL_REGISTRY
    from transformers import LlamaConfig

    assert {"LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"} <= set(MODEL_REGISTRY)
    LlamaConfig(architectures=["FalconForCausalLM"]).save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError) as e:
        resolve_model(str(tmp_path))
    msg = str(e.value)
    assert "\n" not in msg and "FalconForCausalLM" in msg and str(tmp_path) in msg
    assert all(arch in msg for arch in MODEL_REGISTRY)


def test_two_tensor_parallel_ranks_give_transformers_tokens(checkpoint, prompts, references):
    """Two gloo ranks on the CPU, each with its heads and the whole (shared) q/k norm weights."""
    d, ref = checkpoint
    few = [prompts[2], prompts[4]]
    with LLM(model=d, tensor_parallel_size=2, device="cpu", num_kv_blocks=64, block_size=BLOCK_SIZE) as two:
        outs = two.generate(few, GREEDY, use_tqdm=False)
    _check(ref, few, outs, [references[2], references[4]], "qwen3 two ranks")
