"""Shared test helpers: exact-length prompts and greedy comparison against transformers."""

from __future__ import annotations

import torch

NEAR_TIE = 1e-4


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt_ids) :].tolist()


def top2_gap(model, ids: list[int]) -> float:
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, -1].float()
    top = logits.topk(2).values
    return float(top[0] - top[1])


def assert_greedy_match(model, prompt_ids: list[int], ours: list[int], ref: list[int], label: str) -> str:
    """Token-for-token equality; a divergence is accepted only at a shown near-tie of the reference
    logits (gap < 1e-4), and comparison stops there. Returns a note for the report."""
    n = min(len(ours), len(ref))
    for i in range(n):
        if ours[i] != ref[i]:
            gap = top2_gap(model, prompt_ids + ref[:i])
            assert gap < NEAR_TIE, f"{label}: token {i} differs ({ours[i]} vs {ref[i]}), logit gap {gap:.3g}"
            return f"{label}: near-tie at token {i} (gap {gap:.2e})"
    assert len(ours) == len(ref), f"{label}: lengths differ {len(ours)} vs {len(ref)}"
    return ""


def prompt_of_length(tokenizer, n: int, seed_text: str = "Tell me a story about") -> list[int]:
    """A natural-text prompt of exactly ``n`` tokens."""
    words = (
        seed_text + " a curious fox who lived near the old mill by the river and liked apples, "
        "books, maps and long walks in the autumn rain while the town slept quietly "
    )
    ids = tokenizer.encode(words, add_special_tokens=False)
    ids = ids * (n // len(ids) + 1)
    return ids[:n]


def chat_prompt_of_length(tokenizer, n: int, topic: str = "rivers", system: str | None = None) -> list[int]:
    """A ChatML prompt (the default model's template) of exactly ``n`` tokens: the user turn's text is
    cut to fit between the template's fixed parts."""
    head = (f"<|im_start|>system\n{system}<|im_end|>\n" if system else "") + "<|im_start|>user\n"
    tail = "<|im_end|>\n<|im_start|>assistant\n"
    head_ids = tokenizer.encode(head, add_special_tokens=False)
    tail_ids = tokenizer.encode(tail, add_special_tokens=False)
    body = prompt_of_length(tokenizer, n - len(head_ids) - len(tail_ids), f"Explain {topic}:")
    return head_ids + body + tail_ids
