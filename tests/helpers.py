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


# --------------------------------------------------------------------------- tiny Hugging Face checkpoints

# llama3 rope scaling with a small original context, so prompts of ~100 tokens run past it.
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
    "rope_theta": 500000.0,
}


def tiny_hf_config(arch: str, vocab_size: int, **overrides):
    """A GQA config in the ``dummy:tiny`` shape of ``arch``: ``llama`` (llama3 rope scaling, untied head) or
    ``qwen2`` (qkv bias, tied head)."""
    from sluice.core.models.registry import DUMMY_SHAPES
    from transformers import LlamaConfig, Qwen2Config

    shape = {k: v for k, v in DUMMY_SHAPES["tiny"].items() if k not in ("rope_theta", "tie_word_embeddings")}
    common = shape | dict(vocab_size=vocab_size, max_position_embeddings=512)
    assert common["num_key_value_heads"] < common["num_attention_heads"]  # GQA
    if arch == "llama":
        cfg = dict(common, rope_parameters=dict(LLAMA3_ROPE), tie_word_embeddings=False)
        return LlamaConfig(**(cfg | overrides))
    if arch == "qwen2":
        cfg = dict(common, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, tie_word_embeddings=True)
        return Qwen2Config(**(cfg | overrides))
    raise ValueError(f"unknown tiny arch {arch!r}")


def save_tiny_hf_model(config, out_dir, tokenizer=None, seed: int = 0, init_std: float = 0.1):
    """Build a transformers model from ``config`` with random weights, save it (safetensors) with
    ``tokenizer`` into ``out_dir``, and return it in eval mode (fp32), the reference.

    transformers initializes biases to 0 and norm weights to 1, which would leave their loading
    untested; here every parameter is random. ``init_std`` above the usual 0.02 spreads the logits, so
    greedy choices have clear margins."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(init_std * torch.randn(p.shape, generator=g))
    model.save_pretrained(out_dir, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)
    return model.eval()


# --------------------------------------------------------------------------- paged attention inputs


def random_paged_batch(
    seq_lens: list[int],
    q_lens: list[int],
    num_kv_heads: int,
    group: int,
    head_dim: int,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    device: torch.device | str = "cpu",
):
    """Random KV cache with SHUFFLED block tables, queries and metadata for one attention step.

    Sequence ``i`` has ``seq_lens[i]`` tokens of context whose last ``q_lens[i]`` are this step's queries.
    Block 0 is never owned (the tables' padding entries point at it) and spare blocks hold garbage, so
    reading past a sequence's blocks shows. Returns ``(query, cache, meta)``."""
    from sluice.kv.attention.base import AttentionMetadata

    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 4
    perm = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()  # block 0 = padding, never owned
    tables = torch.zeros(len(seq_lens), max(blocks_per_seq) + 1, dtype=torch.int32)
    for i, n in enumerate(blocks_per_seq):
        tables[i, :n] = torch.tensor(perm[:n], dtype=torch.int32)
        perm = perm[n:]
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    num_tokens = sum(q_lens)
    query = torch.randn(num_tokens, num_kv_heads * group, head_dim, generator=g).to(dtype)
    qsl = [0]
    for q in q_lens:
        qsl.append(qsl[-1] + q)
    slots = []
    for i, (s, q) in enumerate(zip(seq_lens, q_lens, strict=True)):
        for p in range(s - q, s):
            slots.append(int(tables[i, p // block_size]) * block_size + p % block_size)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=tables.to(device),
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        query_start_loc_host=qsl,
        seq_lens_host=list(seq_lens),
    )
    return query.to(device), cache.to(device), meta


# --------------------------------------------------------------------------- chi-square goodness of fit


def chi2_sf(x: float, df: int) -> float:
    """Survival function of the chi-square distribution: Q(df/2, x/2), the regularized upper gamma."""
    return float(
        torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(x / 2, dtype=torch.float64))
    )


def chi2_test(observed: torch.Tensor, expected_probs: torch.Tensor, min_expected: float = 5.0):
    """Pearson goodness-of-fit test; cells with expected count < min_expected are pooled.

    Returns (statistic, df, p_value).
    """
    obs = observed.flatten().to(torch.float64)
    exp = expected_probs.flatten().to(torch.float64) * obs.sum()
    order = torch.argsort(exp)
    obs, exp = obs[order], exp[order]
    # Pool the smallest cells (in ascending expected order) until the pool reaches min_expected.
    n_small = int((exp < min_expected).sum())
    if n_small:
        n_pool = n_small
        while exp[:n_pool].sum() < min_expected and n_pool < len(exp):
            n_pool += 1
        obs = torch.cat([obs[:n_pool].sum()[None], obs[n_pool:]])
        exp = torch.cat([exp[:n_pool].sum()[None], exp[n_pool:]])
    stat = float(((obs - exp) ** 2 / exp).sum())
    df = len(exp) - 1
    return stat, df, chi2_sf(stat, df)


class InTask:
    """Enters the async context manager ``make()`` returns inside one background task, so a module-scoped async
    fixture (whose setup and teardown pytest-asyncio runs in different tasks) enters and exits its task group
    in the same task."""

    def __init__(self, make) -> None:
        self.make = make

    async def start(self):
        import asyncio

        ready: asyncio.Future = asyncio.get_running_loop().create_future()
        self._stop = asyncio.Event()

        async def hold() -> None:
            try:
                async with self.make() as value:
                    ready.set_result(value)
                    await self._stop.wait()
            except BaseException as e:
                if not ready.done():
                    ready.set_exception(e)
                raise

        self._task = asyncio.get_running_loop().create_task(hold())
        return await ready

    async def stop(self) -> None:
        self._stop.set()
        await self._task


class EngineInTask(InTask):
    """`InTask` of ``AsyncEngine(args)``."""

    def __init__(self, args) -> None:
        from sluice.core import AsyncEngine

        super().__init__(lambda: AsyncEngine(args))
        self.args = args


def fake_output(so, token: int = 7):
    """A `ModelOutput` that samples ``token`` for every sampling row of ``so`` (forks included): a stand-in
    executor for scheduler tests."""
    from sluice.core.step import ModelOutput

    out = ModelOutput(so.step_id)
    for rid, sample in zip(so.req_ids, so.samples):
        if sample:
            for x in (rid, *so.forks.get(rid, ())):
                out.req_ids.append(x)
                out.token_ids.append(token)
    return out
