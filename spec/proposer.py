"""Drafts a chain of k tokens per request with an EAGLE head, from the target's hidden states.

The head reads pairs ``(f_t, x_{t+1})``: the target's feature at position ``t`` and the token after it.
Its KV for the pair is stored at position ``t`` in one extra layer of paged KV (``kv_caches``), indexed
by the request's own block table: it needs no allocator of its own, is freed with the request's blocks
and copied with them on copy-on-write.

Each step, after the target has run and the verifier has decided which tokens stand:

1. *Catch-up*: the head runs over the pairs of every position the target verified this step (a
   prefill chunk, or the last token plus the accepted drafts), writing their draft KV. Invariant: a
   request's draft KV is valid below its ``num_computed_tokens``, like the target's.
2. *Proposal* (requests that just sampled): from the last pair's output ``g`` (its guess of the next
   feature) the head drafts ``d_1 = LM(g)``, then feeds ``(g, d_1)`` back in at the next position, and
   so on for k tokens. These pairs are speculative: their draft KV sits at positions
   ``>= num_computed_tokens`` and the next catch-up overwrites it, so it is never read as context once
   the target has spoken.

Greedy requests draft the argmax; the others sample from ``q`` (the caller's ``probs_fn``, i.e. the
request's temperature / top-k / top-p over the draft's vocabulary), which is returned in full-vocabulary
form for the rejection sampler.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from sluice.core.models.layers import ForwardContext, argmax_rows
from sluice.kv.attention import AttentionMetadata, allocate_kv_cache
from sluice.kv.attention.base import AttentionBackend
from sluice.spec.eagle import EagleDraftHead, target_lm_weight
from sluice.spec.rejection import sample_from_probs


@dataclass(slots=True)
class DraftSampling:
    """How the proposing requests (in order) draw their drafts."""

    greedy: list[bool]
    generators: list[torch.Generator | None]
    # draft-vocabulary logits of the non-greedy rows (in order) -> the probabilities they sample from
    probs_fn: Callable[[torch.Tensor], torch.Tensor] | None = None


@dataclass(slots=True)
class DraftOutput:
    token_ids: torch.Tensor  # [R, k] int64, R = proposing requests
    probs: torch.Tensor | None  # [len(probs_rows), k, vocab]: q of the non-greedy rows
    probs_rows: list[int]


def paged_metadata(
    starts: list[int], q_lens: list[int], block_tables: list[list[int]], block_size: int, device: torch.device
) -> tuple[torch.Tensor, AttentionMetadata]:
    """Positions and attention metadata for sequences computing ``q_lens[i]`` tokens from ``starts[i]``."""
    st = np.asarray(starts, dtype=np.int64)
    ql = np.asarray(q_lens, dtype=np.int64)
    qsl = np.zeros(len(starts) + 1, dtype=np.int64)
    np.cumsum(ql, out=qsl[1:])
    seq_lens = st + ql
    positions = np.repeat(st, ql) + (np.arange(qsl[-1]) - np.repeat(qsl[:-1], ql))
    width = max(-(-int(s) // block_size) for s in seq_lens)
    tables = np.zeros((len(starts), width), dtype=np.int64)
    for i, t in enumerate(block_tables):
        n = min(len(t), width)
        tables[i, :n] = t[:n]
    req_idx = np.repeat(np.arange(len(starts)), ql)
    slots = tables[req_idx, positions // block_size] * block_size + positions % block_size
    meta = AttentionMetadata(
        slot_mapping=torch.from_numpy(slots).to(device, non_blocking=True),
        query_start_loc=torch.from_numpy(qsl.astype(np.int32)).to(device, non_blocking=True),
        seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(device, non_blocking=True),
        block_tables=torch.from_numpy(tables.astype(np.int32)).to(device, non_blocking=True),
        max_query_len=int(ql.max()),
        max_seq_len=int(seq_lens.max()),
        query_start_loc_host=qsl.tolist(),
        seq_lens_host=seq_lens.tolist(),
    )
    return torch.from_numpy(positions).to(device, non_blocking=True), meta


def per_token_metadata(meta: AttentionMetadata, positions: torch.Tensor) -> AttentionMetadata:
    """``meta`` of a uniform step (every sequence computes q tokens) recast as one decode row per token:
    token ``j`` of a sequence attends to keys ``0..positions[j]`` through its sequence's block table.

    The same attention as the causal one over q queries (the step's K/V are written before attention in
    each layer), but it takes the split-K decode kernel: a verification of 1 + k tokens per request at
    small batch then spreads a long context over many programs instead of one per KV head. Built on
    the device, with no host sync."""
    batch, width = meta.block_tables.shape
    num_tokens = positions.shape[0]
    q = num_tokens // batch
    return AttentionMetadata(
        slot_mapping=meta.slot_mapping,
        query_start_loc=torch.arange(num_tokens + 1, dtype=torch.int32, device=positions.device),
        seq_lens=(positions + 1).to(torch.int32),
        block_tables=meta.block_tables[:, None, :].expand(batch, q, width).reshape(num_tokens, width),
        max_query_len=1,
        max_seq_len=meta.max_seq_len,
        query_start_loc_host=list(range(num_tokens + 1)),
        seq_lens_host=[1] * num_tokens,  # not read by graph-safe backends
    )


class EagleProposer:
    def __init__(
        self,
        head: EagleDraftHead,
        target,
        num_blocks: int,
        block_size: int,
        num_speculative_tokens: int,
        backend: AttentionBackend,
        device: torch.device,
        dtype: torch.dtype,
        int4_lm_head: bool = False,
    ) -> None:
        self.head = head
        self.k = num_speculative_tokens
        self.block_size = block_size
        self.backend = backend
        self.device = device
        self.embed = target.model.embed_tokens
        self.lm_weight = head.lm_weight(target_lm_weight(target))  # [draft vocab, hidden]
        # A draft step's LM head reads the whole matrix for one row a request: on the CPU (int4 packed kernels) an
        # int4 copy reads a quarter of bf16's bytes. Its rounding can only change which drafts are proposed.
        self.lm_head = None
        if int4_lm_head:
            from sluice.core.models.cpu_linear import Int4PackedLinear  # CPU only: torch's packed CPU kernels

            self.lm_head = Int4PackedLinear.rounded_from(self.lm_weight)
        self.vocab_size = head.cfg.vocab_size
        cfg = head.cfg
        self.kv_caches = allocate_kv_cache(
            1, num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim, dtype, device
        )

    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy-on-write for the draft layer: the same block copies the target's KV gets."""
        for kv in self.kv_caches:
            kv[:, dst] = kv[:, src]

    def _run(self, tokens: torch.Tensor, features: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor:
        ctx = ForwardContext(meta, self.kv_caches, self.backend)
        return self.head(self.embed(tokens), features, positions, ctx)

    def propose(
        self,
        features: torch.Tensor,
        next_tokens: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        chain_rows: list[int],
        chain_metadata: Callable[[int], tuple[torch.Tensor, AttentionMetadata]],
        sampling: DraftSampling,
    ) -> DraftOutput | None:
        """Catch up on this step's verified pairs, then draft k tokens for the proposing requests.

        ``features``, ``next_tokens``, ``positions`` and ``meta``: the catch-up's pairs (the target's feature
        at each verified position, the token after it) and their attention metadata. ``chain_rows``: for
        each proposing request, the pair its chain starts from (its last verified one). ``chain_metadata(j)``:
        positions and metadata of draft step ``j + 1`` of the proposing requests (one token each, at the
        position after step ``j``'s)."""
        g = self._run(next_tokens, features, positions, meta)
        if not chain_rows:
            return None
        g = g[torch.tensor(chain_rows, device=self.device)]
        ng = [j for j, greedy in enumerate(sampling.greedy) if not greedy]
        ng_gens = [sampling.generators[j] for j in ng]
        tokens, probs = [], []
        for step in range(self.k):
            logits = self._draft_logits(g).float()
            tok, q = self._draw(logits, sampling, ng, ng_gens)
            tokens.append(tok)
            if q is not None:
                probs.append(q)
            if step == self.k - 1:
                break
            pos, step_meta = chain_metadata(step)
            g = self._run(tok, g, pos, step_meta)
        return DraftOutput(torch.stack(tokens, 1), torch.stack(probs, 1) if probs else None, ng)

    def propose_greedy_uniform(
        self,
        features: torch.Tensor,
        next_tokens: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        token_meta: AttentionMetadata,
        num_accepted: torch.Tensor,
    ) -> torch.Tensor:
        """`propose` for a batch in which every request verified the same number of tokens q (its last token
        and k drafts) and drafts greedily, without a host sync, so that it can be captured in a CUDA graph:
        ``[batch, k]`` drafts.

        The catch-up runs over all q positions of each request (``next_tokens``: the target's argmax at
        each), not only over the ``num_accepted + 1`` that stand: the pairs past them are computed from
        rejected tokens, but their draft KV sits at positions ``>= num_computed_tokens`` and is overwritten
        before it is read, like a proposal's. The chain then starts from the row of the last standing pair.
        ``token_meta`` is the target's `per_token_metadata` of ``meta``, which the catch-up shares. The draft
        steps' metadata is derived on the device (``meta.seq_lens == 0`` marks a padding sequence, which
        writes no KV); only graph-safe backends run it, as they read no host values."""
        batch = meta.block_tables.shape[0]
        q = positions.shape[0] // batch
        dev, bs = positions.device, self.block_size
        g = self._run(next_tokens, features, positions, token_meta)
        g = g[torch.arange(batch, device=dev) * q + num_accepted]
        # positions, slots and sequence lengths of the k - 1 chain steps at once (a few launches instead of a
        # dozen per step), then a row per step, each contiguous as the kernels read it
        pos = (positions.view(batch, q)[:, 0] + num_accepted + 1)[:, None] + torch.arange(self.k - 1, device=dev)
        width = meta.block_tables.shape[1]
        idx = pos // bs
        valid = (meta.seq_lens > 0)[:, None] & (idx < width)
        block = meta.block_tables.gather(1, idx.clamp(max=width - 1)).long()
        slots = torch.where(valid, block * bs + pos % bs, -1).T.contiguous()
        seq_lens = (pos + 1).to(torch.int32).T.contiguous()
        pos = pos.T.contiguous()
        qsl = torch.arange(batch + 1, dtype=torch.int32, device=dev)
        tokens = []
        for step in range(self.k):
            tokens.append(self._greedy_tokens(self._draft_logits(g)))
            if step == self.k - 1:
                break
            step_meta = AttentionMetadata(
                slot_mapping=slots[step],
                query_start_loc=qsl,
                seq_lens=seq_lens[step],
                block_tables=meta.block_tables,
                max_query_len=1,
                max_seq_len=meta.max_seq_len + self.k,
                query_start_loc_host=list(range(batch + 1)),
                seq_lens_host=[1] * batch,  # not read by graph-safe backends
            )
            g = self._run(tokens[-1], g, pos[step], step_meta)
        return torch.stack(tokens, 1)

    def _draft_logits(self, g: torch.Tensor) -> torch.Tensor:
        """Logits over the draft's vocabulary of predicted features ``g`` ``[rows, hidden]``."""
        return self.lm_head(g) if self.lm_head is not None else g @ self.lm_weight.t()

    def _greedy_tokens(self, logits: torch.Tensor) -> torch.Tensor:
        """Argmax over the draft's vocabulary, as full-vocabulary ids (in the logits' own dtype: upcasting
        keeps the order and the first of equal values, so the argmax is the same)."""
        return self._full_vocab_ids(argmax_rows(logits))

    def _full_vocab_ids(self, tok: torch.Tensor) -> torch.Tensor:
        return tok if self.head.draft_vocab is None else self.head.draft_vocab[tok]

    def _draw(self, logits: torch.Tensor, sampling: DraftSampling, ng: list[int], ng_gens):
        """Draft tokens (full-vocabulary ids) for one step, and q of the non-greedy rows."""
        vocab_ids = self.head.draft_vocab
        tok = argmax_rows(logits)  # mapped to full-vocabulary ids below, after sampled rows replace theirs
        q_full = None
        if ng:
            assert sampling.probs_fn is not None
            idx = torch.tensor(ng, device=logits.device)
            q = sampling.probs_fn(logits[idx])
            tok[idx] = sample_from_probs(q, ng_gens)
            if vocab_ids is None:
                q_full = q
            else:
                q_full = q.new_zeros(len(ng), self.vocab_size)
                q_full[:, vocab_ids] = q
        return self._full_vocab_ids(tok), q_full
