"""Phi-3 against transformers' `Phi3ForCausalLM` on a tiny random checkpoint (fp32, CPU) with LongRoPE scaling
(short and long factors) and a sliding window shorter than the prompts: the checkpoint stores ``qkv_proj`` and
``gate_up_proj`` fused, which sluice splits on load (also across two tensor-parallel ranks).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from sluice.core.models.errors import ModelLoadError

from tests.family_parity import NEW_TOKENS, check_engine_paths, max_logit_diff
from tests.helpers import hf_greedy, prompt_of_length, save_tiny_hf_model

HEAD_DIM = 16
ORIGINAL = 256  # the pretrained length: the engine's sequences stay within it, as transformers' short factors
PROMPT_LENS = [17, 40, 70]


def _phi3_config(vocab_size: int, original: int = ORIGINAL, **overrides):
    from transformers import Phi3Config

    g = torch.Generator().manual_seed(0)
    short = (1.0 + 3.0 * torch.rand(HEAD_DIM // 2, generator=g)).tolist()
    long = (4.0 + 8.0 * torch.rand(HEAD_DIM // 2, generator=g)).tolist()
    cfg = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4 * original,
        original_max_position_embeddings=original,
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "short_factor": short,
            "long_factor": long,
            "original_max_position_embeddings": original,
        },
        rms_norm_eps=1e-6,
        sliding_window=48,
        tie_word_embeddings=False,
        pad_token_id=0,
    )
    return Phi3Config(**(cfg | overrides))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, default_tokenizer):
    d = tmp_path_factory.mktemp("tiny-phi3")
    ref = save_tiny_hf_model(_phi3_config(len(default_tokenizer)), d, default_tokenizer, seed=8)
    return str(d), ref


@pytest.fixture(scope="module")
def prompts(default_tokenizer):
    return [prompt_of_length(default_tokenizer, n, f"Myth {n}:") for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def references(checkpoint, prompts):
    return [hf_greedy(checkpoint[1], p, NEW_TOKENS) for p in prompts]


def test_checkpoint_stores_fused_projections_and_longrope(checkpoint):
    from safetensors import safe_open

    d, _ = checkpoint
    cfg = json.loads((Path(d) / "config.json").read_text())
    assert cfg["architectures"] == ["Phi3ForCausalLM"]
    assert (cfg.get("rope_parameters") or cfg.get("rope_scaling"))["rope_type"] == "longrope"
    with safe_open(str(Path(d) / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert "model.layers.0.self_attn.qkv_proj.weight" in names and "model.layers.0.mlp.gate_up_proj.weight" in names
    assert not any(".q_proj." in n or ".gate_proj." in n for n in names)


def test_logits_match_transformers(checkpoint, prompts):
    assert max_logit_diff(*checkpoint, prompts[-1], max_position=ORIGINAL) < 1e-4


def test_longrope_table_short_within_the_pretrained_length_long_beyond(default_tokenizer):
    """Positions within ``original_max_position_embeddings`` rotate as transformers does for a sequence within
    it (short factors), positions past it as transformers does for a longer one (long factors); both scaled."""
    from sluice.core.models.layers import RotaryEmbedding
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    original, total = 32, 96
    cfg = _phi3_config(256, original=original)
    ours = RotaryEmbedding(cfg, HEAD_DIM, total)
    theirs = Phi3RotaryEmbedding(cfg)
    x = torch.zeros(1, 1, HEAD_DIM)
    short_cos, short_sin = theirs(x, torch.arange(original)[None])
    long_cos, long_sin = theirs(x, torch.arange(total)[None])
    torch.testing.assert_close(ours.cos[:original], short_cos[0], atol=1e-6, rtol=0)
    torch.testing.assert_close(ours.sin[:original], short_sin[0], atol=1e-6, rtol=0)
    torch.testing.assert_close(ours.cos[original:], long_cos[0, original:], atol=1e-6, rtol=0)
    torch.testing.assert_close(ours.sin[original:], long_sin[0, original:], atol=1e-6, rtol=0)
    assert (short_cos[0] - long_cos[0, :original]).abs().max() > 1e-2  # the factors differ: the test can tell


def test_engine_paths_give_transformers_tokens(checkpoint, prompts, references):
    check_engine_paths(*checkpoint, prompts, references, "phi3", max_model_len=ORIGINAL)


def test_partial_rotary_is_refused():
    from sluice.core.models.phi3 import Phi3ForCausalLM

    cfg = _phi3_config(256)
    cfg.rope_parameters["partial_rotary_factor"] = 0.75
    with pytest.raises(ModelLoadError, match="partial_rotary_factor"):
        Phi3ForCausalLM(cfg, max_position=64)
