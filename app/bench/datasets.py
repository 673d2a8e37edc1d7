"""Benchmark datasets: ShareGPT (single- and multi-turn views, held-out split) and fixed-length random
prompts.

The ShareGPT reader itself lives in `sharegpt.py` beside this module and is re-exported here.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sluice.app.bench.sharegpt import (  # noqa: F401  (re-exported)
    HOLDOUT_FRACTION,
    SHAREGPT_DISTRIBUTION,
    SHAREGPT_FILENAME,
    Split,
    conversation_turns,
    iter_json_array_items,
    load_sharegpt_conversations,
    load_truncated_json_array,
    sharegpt_conversations,
    sharegpt_path,
    split_indices,
)


@dataclass(slots=True)
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int
    prompt_text: str | None = None


def sample_sharegpt(
    tokenizer,
    num_prompts: int,
    seed: int = 0,
    *,
    split: Split = "all",
    min_len: int = 4,
    max_prompt_len: int = 1024,
    max_total_len: int = 2048,
    fixed_output_len: int | None = None,
    conversations: Sequence[list[str]] | None = None,
) -> list[BenchRequest]:
    """ShareGPT requests with vLLM's benchmark sampling rule: conversations with >= 2 turns, shuffled with
    `random.Random(seed)`; prompt = first turn, output length = token count of the second turn (or
    `fixed_output_len`); pairs with prompt or output under `min_len` tokens, prompt over `max_prompt_len`, or
    prompt + output over `max_total_len` are skipped. Tokenization is lazy: only as many conversations as
    needed to fill `num_prompts` are tokenized. Raises ValueError if the dataset cannot fill `num_prompts`.

    `tokenizer` is a Hugging Face tokenizer (called as `tokenizer(text).input_ids`), or any callable
    `str -> list[int]`. `conversations` overrides the data (multi-turn view), mainly for tests."""
    if num_prompts < 0:
        raise ValueError("num_prompts must be >= 0")
    encode = _encoder(tokenizer)
    pairs = conversations if conversations is not None else sharegpt_conversations(split=split)
    order = [i for i, turns in enumerate(pairs) if len(turns) >= 2]
    random.Random(seed).shuffle(order)
    out: list[BenchRequest] = []
    for i in order:
        if len(out) == num_prompts:
            break
        prompt, completion = pairs[i][0], pairs[i][1]
        prompt_ids = encode(prompt)
        prompt_len = len(prompt_ids)
        if prompt_len < min_len or prompt_len > max_prompt_len:
            continue  # skip before tokenizing the completion
        output_len = len(encode(completion)) if fixed_output_len is None else fixed_output_len
        if output_len < min_len or prompt_len + output_len > max_total_len:
            continue
        out.append(BenchRequest(prompt_token_ids=prompt_ids, output_len=output_len, prompt_text=prompt))
    if len(out) < num_prompts:
        raise ValueError(f"ShareGPT ({split}) has only {len(out)} pairs passing the filters; asked {num_prompts}")
    return out


def _encoder(tokenizer):
    if hasattr(tokenizer, "encode") and callable(tokenizer):
        return lambda text: list(tokenizer(text).input_ids)
    if callable(tokenizer):
        return lambda text: list(tokenizer(text))
    raise TypeError("tokenizer must be a Hugging Face tokenizer or a callable str -> list[int]")


# ------------------------------------------------------------------------------------------------ random


def sample_random(
    num_prompts: int, input_len: int, output_len: int, vocab_size: int, seed: int = 0
) -> list[BenchRequest]:
    """`num_prompts` requests of exactly `input_len` random token ids in [0, vocab_size) and a forced
    `output_len`, reproducible from `seed`."""
    if input_len < 1 or output_len < 1 or vocab_size < 1:
        raise ValueError("input_len, output_len and vocab_size must be >= 1")
    rng = random.Random(seed)
    return [
        BenchRequest(prompt_token_ids=[rng.randrange(vocab_size) for _ in range(input_len)], output_len=output_len)
        for _ in range(num_prompts)
    ]


# ------------------------------------------------------------------------------------------------ summary


def summarize(requests: Sequence[BenchRequest]) -> dict[str, float]:
    """Counts and mean prompt/output lengths of a request list (for logs and result files)."""
    n = len(requests)
    p = sum(len(r.prompt_token_ids) for r in requests)
    o = sum(r.output_len for r in requests)
    return {
        "num_requests": n,
        "prompt_tokens": p,
        "output_tokens": o,
        "mean_prompt_len": p / n if n else 0.0,
        "mean_output_len": o / n if n else 0.0,
    }


# ------------------------------------------------------------------------------------------------ files


def save_requests(path: str | Path, requests: Sequence[BenchRequest], meta: dict[str, Any] | None = None) -> None:
    """Write sampled requests (token ids and forced output lengths) as one JSON file, so the very same
    requests can be replayed where the dataset itself is not installed (the GPU machine)."""
    record = {
        "meta": meta or {},
        "requests": [{"prompt_token_ids": r.prompt_token_ids, "output_len": r.output_len} for r in requests],
    }
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(record, separators=(",", ":")), encoding="utf-8")


def load_requests(path: str | Path) -> tuple[list[BenchRequest], dict[str, Any]]:
    """The requests and metadata written by `save_requests`."""
    record = json.loads(Path(path).read_text(encoding="utf-8"))
    reqs = [BenchRequest(list(r["prompt_token_ids"]), int(r["output_len"])) for r in record["requests"]]
    return reqs, dict(record.get("meta", {}))
