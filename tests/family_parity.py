"""Parity with transformers for a model family, shared by `tests/test_family_*.py`: the checks issue 38 asks
of every family on a tiny random checkpoint that transformers' own class writes (fp32, CPU).

* `prefill_logits`: every position's logits of one prompt, prefilled into a paged cache (torch backend).
* `check_greedy`: tokens equal transformers' greedy tokens (a divergence only at a shown near-tie).
* `check_engine_paths`: solo, batched, a prefix-cache hit, and chunked prefill with preemption (a small pool and
  a small token budget) each give transformers' tokens.
"""

from __future__ import annotations

import torch
from sluice.core import LLM, SamplingParams

from tests.helpers import assert_greedy_match

NEW_TOKENS = 32
BLOCK_SIZE = 16
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)


def prefill_logits(model, ids: list[int], backend: str = "torch") -> torch.Tensor:
    """The logits of every position of one prompt, prefilled into a paged cache."""
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
        hidden = model(torch.tensor(ids), torch.arange(n), ForwardContext(meta, kv, get_attention_backend(backend)))
        return model.compute_logits(hidden)


def max_logit_diff(model_dir: str, ref, ids: list[int], max_position: int = 512) -> float:
    """sluice's logits against transformers' for every position of ``ids`` (the largest absolute difference)."""
    from sluice.core.models.loader import load_model, resolve_model

    model = load_model(resolve_model(model_dir), torch.float32, torch.device("cpu"), max_position=max_position)
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0]
    diff = (prefill_logits(model, ids) - want).abs().max().item()
    print(f"{type(model).__name__}: max abs logit diff {diff:.2e} over {len(ids)} positions")
    return diff


def check_greedy(ref, prompts, outs, refs, label: str) -> None:
    for p, o, r in zip(prompts, outs, refs, strict=True):
        (seq,) = o.outputs
        assert len(seq.token_ids) == NEW_TOKENS
        note = assert_greedy_match(ref, p, seq.token_ids, r, f"{label} (prompt len {len(p)})")
        if note:
            print(note)


def check_engine_paths(model_dir: str, ref, prompts, refs, label: str, **engine_kw) -> None:
    """Solo, batched and a prefix hit on one engine; chunked prefill under preemption on another."""
    kw = dict(model=model_dir, device="cpu", block_size=BLOCK_SIZE, max_model_len=256) | engine_kw
    with LLM(**kw, num_kv_blocks=96) as llm:
        solo = [llm.generate([p], GREEDY, use_tqdm=False)[0] for p in prompts]
        batched = llm.generate(prompts, GREEDY, use_tqdm=False)
        (again,) = llm.generate([prompts[-1]], GREEDY, use_tqdm=False)
    check_greedy(ref, prompts, solo, refs, f"{label} solo")
    check_greedy(ref, prompts, batched, refs, f"{label} batched")
    assert again.num_cached_tokens >= BLOCK_SIZE  # the prompt's blocks came from the prefix cache
    check_greedy(ref, prompts[-1:], [again], refs[-1:], f"{label} prefix hit")
    # a pool for about two of the sequences at their end, and a budget that cuts the prompts in chunks
    need = max(-(-(len(p) + NEW_TOKENS) // BLOCK_SIZE) for p in prompts)
    small = dict(num_kv_blocks=2 * need, max_num_batched_tokens=32, enable_prefix_caching=False)
    with LLM(**(kw | small)) as llm:
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert llm.engine.stats().num_preemptions > 0
    check_greedy(ref, prompts, outs, refs, f"{label} chunked + preempted")
