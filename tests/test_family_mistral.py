"""Mistral with a sliding window against transformers' `MistralForCausalLM` on a tiny random checkpoint (fp32,
CPU): the window (24 keys) is shorter than the prompts, so a model that ignored it, or cut it one key off,
would not match. Also: two tensor-parallel gloo ranks, and a GGUF round trip (the ``gguf`` package writes a
llama-architecture file, transformers reads it back as the Mistral-shaped model it is)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from sluice.core import LLM

from tests.family_parity import GREEDY, NEW_TOKENS, check_engine_paths, check_greedy, max_logit_diff
from tests.helpers import hf_greedy, prompt_of_length, save_tiny_hf_model

WINDOW = 24
PROMPT_LENS = [17, 40, 70]


def _mistral_config(vocab_size: int, **overrides):
    from transformers import MistralConfig

    cfg = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        rms_norm_eps=1e-6,
        sliding_window=WINDOW,
        tie_word_embeddings=False,
    )
    return MistralConfig(**(cfg | overrides))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, default_tokenizer):
    d = tmp_path_factory.mktemp("tiny-mistral")
    ref = save_tiny_hf_model(_mistral_config(len(default_tokenizer)), d, default_tokenizer, seed=5)
    return str(d), ref


@pytest.fixture(scope="module")
def prompts(default_tokenizer):
    return [prompt_of_length(default_tokenizer, n, f"Tale {n}:") for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def references(checkpoint, prompts):
    return [hf_greedy(checkpoint[1], p, NEW_TOKENS) for p in prompts]


def test_checkpoint_has_a_window_shorter_than_the_prompts(checkpoint, prompts):
    cfg = json.loads((Path(checkpoint[0]) / "config.json").read_text())
    assert cfg["architectures"] == ["MistralForCausalLM"] and cfg["sliding_window"] == WINDOW
    assert all(len(p) + NEW_TOKENS > WINDOW for p in prompts)


def test_logits_match_transformers(checkpoint, prompts):
    assert max_logit_diff(*checkpoint, prompts[-1]) < 1e-4


def test_the_window_changes_the_reference(checkpoint, tmp_path, default_tokenizer, prompts):
    """The same weights without a window give other logits past the window: the test above can fail."""
    d, ref = checkpoint
    ids = prompts[-1]
    wide = type(ref)(_mistral_config(len(default_tokenizer), sliding_window=None)).eval()
    wide.load_state_dict(ref.state_dict())
    with torch.no_grad():
        diff = (wide(torch.tensor([ids])).logits[0] - ref(torch.tensor([ids])).logits[0]).abs()
    assert diff[:WINDOW].max() < 1e-5 and diff[WINDOW:].max() > 1e-2


def test_engine_paths_give_transformers_tokens(checkpoint, prompts, references):
    check_engine_paths(*checkpoint, prompts, references, "mistral")


def test_two_tensor_parallel_ranks(checkpoint, prompts, references):
    d, ref = checkpoint
    with LLM(model=d, tensor_parallel_size=2, device="cpu", num_kv_blocks=64, block_size=16) as two:
        outs = two.generate(prompts[1:], GREEDY, use_tqdm=False)
    check_greedy(ref, prompts[1:], outs, references[1:], "mistral two ranks")
