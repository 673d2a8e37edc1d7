"""Lossless rejection sampling for speculative decoding (EAGLE / Leviathan et al. style).

A draft model proposes ``x_1..x_n`` (``n = num_draft_tokens[row] <= k``), each sampled from its own
distribution ``q_i`` conditioned on the prefix so far. The target model scores all of them in one
forward pass, giving ``p_1..p_{n+1}`` (``p_i`` conditioned on the same prefix as ``q_i``; ``p_{n+1}``
on the whole draft). We walk the positions: accept ``x_i`` with probability ``min(1, p_i(x_i) /
q_i(x_i))``; at the first rejection, emit one token sampled from the residual ``r_i = norm(max(p_i -
q_i, 0))`` and stop; if all ``n`` are accepted, emit a bonus token sampled from ``p_{n+1}``.

Why this is lossless. Fix a position and its prefix. The token emitted there is ``x`` either because
the draft proposed ``x`` and it was accepted, with probability ``q(x) min(1, p(x)/q(x)) = min(p(x),
q(x))``, or because the proposal was rejected (probability ``Z = 1 - sum_y min(p(y), q(y)) = sum_y
max(p(y) - q(y), 0)``) and the residual produced ``x`` (probability ``max(p(x) - q(x), 0) / Z``).
Summing, ``P(x) = min(p(x), q(x)) + max(p(x) - q(x), 0) = p(x)``: each emitted token has exactly the
target's conditional distribution given the (already target-distributed) prefix, and by induction
over positions so does the whole emitted sequence. The bonus token is a plain sample from ``p_{n+1}``,
which is the target's conditional given a prefix that was entirely accepted, so it too is exact.

Subtle points:

* The resample after a rejection must come from the residual, not from ``p``: sampling ``p`` there
  over-weights tokens the draft already likes. If the residual is all zeros (``p == q``, where a
  rejection can only happen by rounding), we fall back to ``p``.
* Everything after the first rejection is discarded: those draft tokens and target distributions
  were conditioned on the rejected token. At most one token per row is ever *sampled* (the resample
  or the bonus), so one categorical draw per row suffices; the bonus comes from position
  ``num_draft_tokens[row]``, not ``k``, for rows with fewer drafts.
* ``q`` must be the exact distribution the draft sampled from (after the draft's own temperature
  etc.), and the verifier's uniforms must be independent of the draft's sampling noise.
* Categorical sampling uses the exponential race: ``argmax_v p(v) / E_v`` with ``E_v ~ Exp(1)`` iid
  picks ``v`` with probability ``p(v) / sum p`` (the smallest of independent exponentials with rates
  ``p(v)`` is the ``v``-th one with that probability), so it needs no normalisation and no CDF.
* Fixed RNG consumption: a row with its own ``torch.Generator`` draws exactly ``num_draft_tokens[row]``
  uniforms and then ``vocab`` exponentials from it, every call, whatever is accepted (greedy rows draw
  nothing). Its result and the generator's state afterwards thus depend only on that row's inputs
  and the generator's prior state, never on the other rows of the batch or the padded ``k``.
* ``draft_probs=None`` means a deterministic drafter (point mass ``q_i = onehot(x_i)``, e.g. n-gram
  lookup): accept with probability ``p_i(x_i)``, resample from ``p_i`` with ``x_i`` removed. Greedy
  rows ignore ``draft_probs``: they accept while ``x_i == argmax p_i`` and emit ``argmax p`` at the
  first mismatch or as the bonus.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PLACEHOLDER_TOKEN_ID = -1


@dataclass(slots=True)
class RejectionOutput:
    # [batch, k+1] int64: accepted drafts, then the resampled / bonus token, then -1 padding.
    output_token_ids: torch.Tensor
    # [batch] int64: accepted draft tokens (0..num_draft); tokens emitted = num_accepted + 1.
    num_accepted: torch.Tensor


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _exponential_noise(
    shape: tuple[int, int],
    device: torch.device,
    dtype: torch.dtype,
    generators: list[torch.Generator | None] | None,
) -> torch.Tensor:
    """Exp(1) noise [rows, vocab]; row i comes from ``generators[i]`` when set, else the global RNG."""
    noise = torch.empty(shape, device=device, dtype=dtype).exponential_()
    if generators is not None:
        for i, g in enumerate(generators):
            if g is not None:
                noise[i].exponential_(generator=g)
    # exponential_ may return exactly 0 on some backends; p / 0 would be nan (p == 0) or inf.
    return noise.clamp_(min=torch.finfo(dtype).tiny)


def _race(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    return (probs.to(noise.dtype) / noise).argmax(dim=-1)


def sample_from_probs(probs: torch.Tensor, generators: list[torch.Generator | None] | None = None) -> torch.Tensor:
    """One categorical sample per row of ``probs`` [rows, vocab] (need not be normalised) -> [rows] int64.

    Exponential race, so each row with its own generator consumes exactly ``vocab`` exponentials from it.
    """
    noise = _exponential_noise(tuple(probs.shape), probs.device, _compute_dtype(probs.dtype), generators)
    return _race(probs, noise)


def _accept_probs(target_p: torch.Tensor, draft_q: torch.Tensor) -> torch.Tensor:
    """min(1, p(x) / q(x)) for the drafted tokens; q(x) == 0 (never proposable) accepts iff p(x) > 0."""
    ratio = target_p / draft_q.clamp(min=torch.finfo(draft_q.dtype).tiny)
    return torch.where(draft_q > 0, ratio.clamp(max=1.0), (target_p > 0).to(ratio.dtype))


def _residual_probs(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(p - q, 0)) per row of [rows, vocab]; rows where that is all zero (p == q) give p."""
    r = (p - q).clamp_(min=0)
    total = r.sum(dim=-1, keepdim=True)
    return torch.where(total > 0, r / total.clamp(min=torch.finfo(r.dtype).tiny), p)


def rejection_sample(
    draft_token_ids: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    is_greedy: torch.Tensor,
    generators: list[torch.Generator | None] | None = None,
    num_draft_tokens: torch.Tensor | None = None,
) -> RejectionOutput:
    """Verify ``draft_token_ids`` [batch, k] against ``target_probs`` [batch, k+1, vocab].

    ``draft_probs`` [batch, k, vocab] is the draft's distribution ``q`` (None: deterministic drafter,
    see the module docstring). ``target_probs`` is ``p`` after each request's temperature / top-k /
    top-p. ``is_greedy`` [batch] bool selects exact argmax matching. ``generators[i]`` (optional)
    makes row ``i`` reproducible. ``num_draft_tokens`` [batch] (default ``k``) allows shorter rows;
    their draft ids / probs past that count are ignored (any value, including -1).
    """
    batch, k = draft_token_ids.shape
    if target_probs.dim() != 3 or target_probs.shape[:2] != (batch, k + 1):
        raise ValueError(f"target_probs must be [{batch}, {k + 1}, vocab], got {tuple(target_probs.shape)}")
    if draft_probs is not None and draft_probs.shape != (batch, k, target_probs.shape[2]):
        raise ValueError(f"draft_probs must be [{batch}, {k}, vocab], got {tuple(draft_probs.shape)}")
    if generators is not None and len(generators) != batch:
        raise ValueError(f"generators must have {batch} entries, got {len(generators)}")
    device = target_probs.device
    vocab = target_probs.shape[2]
    cdtype = _compute_dtype(target_probs.dtype)
    is_greedy = is_greedy.to(device=device, dtype=torch.bool)
    if num_draft_tokens is None:
        num_draft = torch.full((batch,), k, dtype=torch.long, device=device)
    else:
        num_draft = num_draft_tokens.to(device=device, dtype=torch.long)

    positions = torch.arange(k, device=device)
    valid = positions[None, :] < num_draft[:, None]  # [batch, k]
    drafts = torch.where(valid, draft_token_ids.to(device=device, dtype=torch.long), 0)
    rows = torch.arange(batch, device=device)

    # Greedy rows: accept while the draft equals the target argmax.
    target_argmax = target_probs.argmax(dim=-1)  # [batch, k+1]
    accepted = drafts == target_argmax[:, :k]

    seeded = [] if generators is None else [i for i, g in enumerate(generators) if g is not None]
    all_greedy = bool(is_greedy.all()) if batch else True
    if not all_greedy:
        # Stochastic rows: accept x_i with probability min(1, p_i(x_i) / q_i(x_i)).
        p_x = target_probs[:, :k].gather(-1, drafts[..., None]).squeeze(-1).to(cdtype)
        if draft_probs is None:
            q_x = torch.ones_like(p_x)
        else:
            q_x = draft_probs.gather(-1, drafts[..., None]).squeeze(-1).to(cdtype)
        uniforms = torch.rand((batch, k), device=device, dtype=cdtype)
        row_gens: list[torch.Generator | None] | None = None
        if seeded:
            greedy_host = is_greedy.tolist()
            n_host = num_draft.tolist()
            row_gens = [None] * batch
            for i in seeded:
                if greedy_host[i]:
                    continue  # greedy rows use no randomness and leave their generator untouched
                g = generators[i]
                row_gens[i] = g
                uniforms[i, : n_host[i]] = torch.rand(n_host[i], generator=g, device=device, dtype=cdtype)
        stochastic_accept = uniforms < _accept_probs(p_x, q_x)
        accepted = torch.where(is_greedy[:, None], accepted, stochastic_accept)
    accepted &= valid
    # Leading run of accepted positions; stops at the first rejection or at num_draft.
    num_accepted = accepted.long().cumprod(dim=-1).sum(dim=-1)

    # One token per row, at position j = num_accepted: argmax (greedy), the residual resample
    # (j < num_draft: x_j was rejected) or the bonus (j == num_draft).
    final = target_argmax[rows, num_accepted]
    if not all_greedy:
        p_final = target_probs[rows, num_accepted].to(cdtype)  # [batch, vocab]
        rejected = num_accepted < num_draft
        j = num_accepted.clamp(max=max(k - 1, 0))
        if k > 0:
            if draft_probs is None:
                q_final = torch.zeros_like(p_final)
                q_final[rows, drafts[rows, j]] = 1.0
            else:
                q_final = draft_probs[rows, j].to(cdtype)
            p_final = torch.where(rejected[:, None], _residual_probs(p_final, q_final), p_final)
        noise = _exponential_noise((batch, vocab), device, cdtype, row_gens)
        final = torch.where(is_greedy, final, _race(p_final, noise))

    return _assemble(drafts, num_accepted, final)


def _assemble(drafts: torch.Tensor, num_accepted: torch.Tensor, final: torch.Tensor) -> RejectionOutput:
    """[batch, k+1]: the accepted drafts, then ``final``, then -1 padding."""
    batch, k = drafts.shape
    out_pos = torch.arange(k + 1, device=drafts.device)
    drafts_padded = torch.cat([drafts, drafts.new_zeros(batch, 1)], dim=1)
    output = torch.where(out_pos[None, :] < num_accepted[:, None], drafts_padded, PLACEHOLDER_TOKEN_ID)
    output.scatter_(1, num_accepted[:, None], final[:, None])
    return RejectionOutput(output_token_ids=output, num_accepted=num_accepted)


def greedy_verify(
    draft_token_ids: torch.Tensor, target_argmax: torch.Tensor, num_draft_tokens: torch.Tensor
) -> RejectionOutput:
    """`rejection_sample` for a batch of greedy rows, from the target's argmax ``[batch, k+1]`` alone
    (no vocabulary-sized tensors): accept while the draft equals the argmax, then emit the argmax."""
    batch, k = draft_token_ids.shape
    device = target_argmax.device
    valid = torch.arange(k, device=device)[None, :] < num_draft_tokens.to(device)[:, None]
    drafts = torch.where(valid, draft_token_ids.to(device=device, dtype=torch.long), 0)
    accepted = (drafts == target_argmax[:, :k]) & valid
    num_accepted = accepted.long().cumprod(dim=-1).sum(dim=-1)
    final = target_argmax[torch.arange(batch, device=device), num_accepted]
    return _assemble(drafts, num_accepted, final)
