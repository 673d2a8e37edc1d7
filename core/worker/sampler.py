"""Sampling on the device, vectorized over the rows of a step that need a next token.

Order per row: penalties -> min_tokens mask -> temperature -> min_p -> top_k / top_p -> draw.
Draws use the exponential race (``argmax(p / E)`` with ``E ~ Exp(1)``), which samples exactly from
``p`` and lets a seeded row draw its noise from its own generator: a fixed amount per step, so the
same seed and prompt give the same tokens alone or inside any batch.
Logprobs are of the model's raw distribution (before temperature and truncation), as in vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from sluice.core.models.layers import argmax_rows
from sluice.core.outputs import TokenLogprob


@dataclass(slots=True)
class SamplingBatch:
    temperature: torch.Tensor  # [B] float32; 0 = greedy
    top_k: torch.Tensor  # [B] int64; 0 = off
    top_p: torch.Tensor  # [B] float32
    min_p: torch.Tensor  # [B] float32
    generators: list[torch.Generator | None]
    presence_penalty: torch.Tensor | None = None  # [B] (None when no row uses penalties)
    frequency_penalty: torch.Tensor | None = None
    repetition_penalty: torch.Tensor | None = None
    output_token_ids: list[list[int]] | None = None  # per row, for the penalties
    prompt_token_ids: list[list[int]] | None = None  # per row, for the repetition penalty
    banned_token_ids: list[list[int]] | None = None  # per row: EOS / stop ids masked by min_tokens
    num_logprobs: int = -1  # max top-n over rows; -1 = none
    all_greedy: bool = False
    any_top_k_top_p: bool = True
    any_min_p: bool = True

    def select(self, start: int, end: int) -> SamplingBatch:
        """Rows ``start..end`` (the flags stay those of the whole batch: still right, at worst slower)."""

        def cut(x):
            return None if x is None else x[start:end]

        return SamplingBatch(
            self.temperature[start:end],
            self.top_k[start:end],
            self.top_p[start:end],
            self.min_p[start:end],
            self.generators[start:end],
            cut(self.presence_penalty),
            cut(self.frequency_penalty),
            cut(self.repetition_penalty),
            cut(self.output_token_ids),
            cut(self.prompt_token_ids),
            cut(self.banned_token_ids),
            self.num_logprobs,
            self.all_greedy,
            self.any_top_k_top_p,
            self.any_min_p,
        )


@dataclass(slots=True)
class SamplerOutput:
    token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor | None = None  # [B] logprob of the sampled token
    top_logprobs: torch.Tensor | None = None  # [B, n]
    top_token_ids: torch.Tensor | None = None  # [B, n]


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    if batch.output_token_ids is None:
        return logits
    b, v = logits.shape
    dev = logits.device
    out_counts = torch.zeros(b, v, device=dev, dtype=logits.dtype)
    rows = [i for i, ids in enumerate(batch.output_token_ids) for _ in ids]
    if rows:
        cols = [t for ids in batch.output_token_ids for t in ids]
        out_counts.index_put_(
            (torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)),
            torch.ones(len(rows), device=dev, dtype=logits.dtype),
            accumulate=True,
        )
    seen = out_counts > 0
    if batch.repetition_penalty is not None and batch.prompt_token_ids is not None:
        prompt_seen = torch.zeros(b, v, device=dev, dtype=torch.bool)
        prow = [i for i, ids in enumerate(batch.prompt_token_ids) for _ in ids]
        if prow:
            pcol = [t for ids in batch.prompt_token_ids for t in ids]
            prompt_seen[torch.tensor(prow, device=dev), torch.tensor(pcol, device=dev)] = True
        rep = batch.repetition_penalty[:, None]
        any_seen = seen | prompt_seen
        penalized = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(any_seen, penalized, logits)
    if batch.frequency_penalty is not None:
        logits = logits - batch.frequency_penalty[:, None] * out_counts
    if batch.presence_penalty is not None:
        logits = logits - batch.presence_penalty[:, None] * seen.to(logits.dtype)
    return logits


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask everything outside each row's top-k and its top-p nucleus (ties at the cut are kept)."""
    v = logits.shape[-1]
    sorted_logits, _ = logits.sort(dim=-1, descending=True)
    k = torch.where(top_k > 0, top_k.clamp(max=v), torch.full_like(top_k, v))
    kth = sorted_logits.gather(-1, (k - 1)[:, None])
    # nucleus: keep the smallest prefix whose mass reaches top_p (the token that crosses is kept)
    probs = sorted_logits.masked_fill(sorted_logits < kth, float("-inf")).softmax(-1)
    mass_before = probs.cumsum(-1) - probs
    # top_p = 1 is off: float32 cumsum can reach 1.0 before a tiny tail, which `< 1` would cut
    keep_sorted = (mass_before < top_p[:, None]) | (top_p[:, None] >= 1)
    keep_sorted[:, 0] = True
    num_keep = keep_sorted.sum(-1, keepdim=True).clamp(max=k[:, None])
    cutoff = sorted_logits.gather(-1, num_keep - 1)
    return logits.masked_fill(logits < cutoff, float("-inf"))


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    probs = logits.softmax(-1)
    threshold = probs.max(-1, keepdim=True).values * min_p[:, None]
    return logits.masked_fill(probs < threshold, float("-inf"))


def exponential_race(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """Sample one token per row from ``probs``; seeded rows draw their noise from their generator."""
    q = torch.empty_like(probs)
    seeded = [i for i, g in enumerate(generators) if g is not None]
    if len(seeded) < len(generators):
        q.exponential_()
    for i in seeded:
        q[i].exponential_(generator=generators[i])
    return (probs / q).argmax(-1)


def process_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Penalties, bans, temperature and truncation; returns logits whose softmax is the sampling distribution
    (greedy rows are left unscaled)."""
    logits = apply_penalties(logits, batch)
    if batch.banned_token_ids is not None:
        rows = [i for i, ids in enumerate(batch.banned_token_ids) for _ in ids]
        if rows:
            cols = [t for ids in batch.banned_token_ids for t in ids]
            logits = logits.clone()
            logits[torch.tensor(rows, device=logits.device), torch.tensor(cols, device=logits.device)] = float("-inf")
    if batch.all_greedy:
        return logits
    temp = batch.temperature.clamp(min=1e-5)[:, None]
    greedy = (batch.temperature == 0)[:, None]
    scaled = torch.where(greedy, logits, logits / temp)
    if batch.any_min_p:
        scaled = apply_min_p(scaled, batch.min_p)
    if batch.any_top_k_top_p:
        scaled = apply_top_k_top_p(scaled, batch.top_k, batch.top_p)
    return scaled


def sample(logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
    logits = logits.float()
    raw_logprobs = logits.log_softmax(-1) if batch.num_logprobs >= 0 else None
    processed = process_logits(logits, batch)
    greedy_tokens = argmax_rows(processed)
    if batch.all_greedy:
        tokens = greedy_tokens
    else:
        random_tokens = exponential_race(processed.softmax(-1), batch.generators)
        tokens = torch.where(batch.temperature == 0, greedy_tokens, random_tokens)
    out = SamplerOutput(tokens)
    if raw_logprobs is not None:
        out.logprobs = raw_logprobs.gather(-1, tokens[:, None]).squeeze(-1)
        if batch.num_logprobs > 0:
            out.top_logprobs, out.top_token_ids = raw_logprobs.topk(batch.num_logprobs, dim=-1)
    return out


def token_logprobs(num_logprobs: list[int], tokens: list[int], out: SamplerOutput) -> list[TokenLogprob | None]:
    """Per row: the sampled token's logprob and its top ``num_logprobs[i]`` alternatives, or None (not asked)."""
    lp = out.logprobs.tolist()
    top_lp = out.top_logprobs.tolist() if out.top_logprobs is not None else None
    top_id = out.top_token_ids.tolist() if out.top_token_ids is not None else None
    res: list[TokenLogprob | None] = []
    for i, n in enumerate(num_logprobs):
        if n < 0:
            res.append(None)
            continue
        top = list(zip(top_id[i][:n], top_lp[i][:n])) if top_id is not None and n > 0 else []
        res.append(TokenLogprob(tokens[i], lp[i], top))
    return res
