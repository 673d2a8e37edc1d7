"""The shipped draft head on the real default model (CPU, fp32): greedy outputs with speculation equal
those without it, alone and batched, with and without prefix-cache hits."""

from __future__ import annotations

import pytest
from sluice.core import LLM, SamplingParams
from sluice.spec.eagle import load_draft_head, resolve_draft_head

from tests.helpers import assert_greedy_match, chat_prompt_of_length

pytestmark = pytest.mark.slow

MAX_TOKENS = 32


@pytest.fixture(scope="module")
def spec_llm():
    llm = LLM(
        model="smollm2-135m-instruct",
        device="cpu",
        num_kv_blocks=1024,
        max_model_len=2048,
        speculative_model="default",
        num_speculative_tokens=4,
    )
    yield llm
    llm.close()


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_shipped_head_loads_for_the_default_model(default_source):
    head = load_draft_head(
        resolve_draft_head("default", "smollm2-135m-instruct"), default_source.config, "smollm2-135m-instruct", 64
    )
    assert head.cfg.target == "smollm2-135m-instruct" and head.cfg.vocab_size == default_source.config.vocab_size
    assert head.draft_vocab is None, "it drafts from the whole vocabulary (8,192 ids cost 0.23 of acceptance)"


def test_greedy_with_shipped_head_equals_plain(spec_llm, default_llm, default_tokenizer, hf_default_model):
    system = "You are a concise assistant who answers questions about geography and history."
    prompts = [
        chat_prompt_of_length(default_tokenizer, 40, "rivers"),
        chat_prompt_of_length(default_tokenizer, 70, "mountains", system=system),
        chat_prompt_of_length(default_tokenizer, 90, "deserts", system=system),  # shares a prefix with the last
    ]
    ref = _greedy(default_llm, prompts)
    before = spec_llm.engine.stats()
    runs = {
        "single": (_greedy(spec_llm, prompts[:1]), [0]),
        "batched": (_greedy(spec_llm, prompts), [0, 1, 2]),
        "cached": (_greedy(spec_llm, prompts[::-1]), [2, 1, 0]),  # every prompt's prefix is cached now
    }
    st = spec_llm.engine.stats()
    assert st.prefix_cache_hits > before.prefix_cache_hits
    assert st.spec_num_drafts > before.spec_num_drafts
    for label, (outs, order) in runs.items():
        for out, i in zip(outs, order):
            note = assert_greedy_match(hf_default_model, prompts[i], out, ref[i], f"{label} prompt {i}")
            if note:
                print(note)
