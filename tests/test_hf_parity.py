"""Greedy outputs equal Hugging Face transformers token for token (fp32, CPU)."""

from __future__ import annotations

import pytest
import torch
from sluice.core import LLM, SamplingParams

from tests.helpers import assert_greedy_match, chat_prompt_of_length, hf_greedy

pytestmark = pytest.mark.slow

NEW_TOKENS = 32  # every prompt (15-64 tokens) decodes across one or more 16-token block boundaries


@pytest.fixture(scope="module")
def parity_prompts(default_tokenizer):
    tok = default_tokenizer
    prompts = [
        chat_prompt_of_length(tok, 15, "primes"),
        chat_prompt_of_length(tok, 16, "the moon"),
        chat_prompt_of_length(tok, 17, "bread"),
        chat_prompt_of_length(tok, 31, "volcanoes", system="You are concise."),
        chat_prompt_of_length(tok, 32, "chess", system="You are concise."),
        chat_prompt_of_length(tok, 33, "the ocean", system="You are concise."),
        chat_prompt_of_length(tok, 48, "trains", system="You are a helpful assistant."),
        chat_prompt_of_length(tok, 64, "music", system="You are a helpful assistant."),
    ]
    prompts.append(
        tok.apply_chat_template(
            [
                {
                    "role": "user",
                    "content": "Write a short paragraph about the history of the printing press, "
                    "then list three inventions it made possible. " * 6,
                }
            ],
            add_generation_prompt=True,
            tokenize=True,
        )
    )
    if isinstance(prompts[-1], dict) or hasattr(prompts[-1], "input_ids"):
        prompts[-1] = list(prompts[-1]["input_ids"])
    assert [len(p) for p in prompts[:8]] == [15, 16, 17, 31, 32, 33, 48, 64]
    assert len(prompts[-1]) > 150
    return prompts


@pytest.fixture(scope="module")
def hf_reference(hf_default_model, parity_prompts):
    return [hf_greedy(hf_default_model, p, NEW_TOKENS) for p in parity_prompts]


def _check(hf_default_model, prompts, outs, refs, mode):
    notes = []
    for i, (p, o, r) in enumerate(zip(prompts, outs, refs)):
        assert o.prompt_token_ids == p
        note = assert_greedy_match(hf_default_model, p, o.outputs[0].token_ids, r, f"{mode} prompt {i} (len {len(p)})")
        if note:
            notes.append(note)
    if notes:
        print("\n".join(notes))


SOLO = (0, 1, 2, 8)  # the prompts that end a token before, at and after a block boundary, and the long one


def test_greedy_matches_transformers_one_at_a_time(default_llm: LLM, hf_default_model, parity_prompts, hf_reference):
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    prompts, refs = [parity_prompts[i] for i in SOLO], [hf_reference[i] for i in SOLO]
    outs = [default_llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
    _check(hf_default_model, prompts, outs, refs, "solo")


def test_greedy_matches_transformers_in_one_flattened_batch(
    default_llm: LLM, hf_default_model, parity_prompts, hf_reference
):
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    stats_before = default_llm.engine.stats().num_steps
    outs = default_llm.generate(parity_prompts, params, use_tqdm=False)
    steps = default_llm.engine.stats().num_steps - stats_before
    # they ran together: one at a time would take len(prompts) * NEW_TOKENS steps (the first step may
    # hold only the earliest arrivals, so allow one or two extra)
    assert steps <= NEW_TOKENS + 2
    _check(hf_default_model, parity_prompts, outs, hf_reference, "batched")


def test_hf_reference_is_not_trivial(hf_reference):
    # guards the comparison itself: the reference produced varied, non-constant text
    assert all(len(set(r)) > 5 for r in hf_reference)
    assert len({tuple(r) for r in hf_reference}) == len(hf_reference)


def test_dtype_of_reference_is_fp32(hf_default_model):
    assert next(hf_default_model.parameters()).dtype == torch.float32
