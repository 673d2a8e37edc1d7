"""The model runner's speculative steps: verify last step's drafts inside the normal mixed batch, then
let the EAGLE proposer draft the next ones.

One target forward covers every scheduled request. A request verifying ``d`` drafts computes ``1 + d``
tokens (its last token, then the drafts); its last ``d + 1`` rows are projected through the LM head and
turned into the target's distributions ``p_1..p_{d+1}`` by the sampler's own ``process_logits``, each
row with the request's temperature / top-k / top-p and with penalties and ``min_tokens`` bans as they
stand after the drafts before it. `spec.rejection.rejection_sample` then accepts or rejects (greedy
requests: exact argmax matching) and adds the resampled or bonus token. Requests without drafts (a
prefill's last chunk, logprobs requests) are sampled exactly as in the plain step.

The draft's distribution ``q`` of the pending drafts stays here, on the device, keyed by request (only
for sampled requests; greedy verification needs none), until the next step verifies them.

Of the plain runner it uses the model, the KV tensors, the attention backend and the per-request
generators; step inputs and sampling rows are built here, so the plain step's own buffers and CUDA
graphs can change without touching this path.

The steady state of greedy decoding, every request verifying k drafts with no penalties, bans or
logprobs, has a second, fixed-shape path (`uniform_step`): verification, draft catch-up and the draft
chain in one function without a host sync, captured in CUDA graphs per batch size (`capture_graphs`),
so that a step costs one replay and one read-back instead of hundreds of eager launches.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from sluice.core.cuda_graphs import DecodeGraphs, StepBuffers, graph_batch_sizes
from sluice.core.models.layers import ForwardContext, enable_fused_kernels
from sluice.core.models.loader import ModelSource
from sluice.core.sampler import SamplingBatch, min_tokens_bans, process_logits, sample, token_logprobs
from sluice.core.step import ModelOutput, ScheduledRequest, SchedulerOutput
from sluice.kv.attention.base import kv_bytes_per_block
from sluice.spec.eagle import load_draft_head, resolve_draft_head
from sluice.spec.proposer import DraftInput, DraftSampling, EagleProposer, paged_metadata, per_token_metadata
from sluice.spec.rejection import RejectionOutput, greedy_verify, rejection_sample

# Graphs of uniform speculative steps are captured for batch sizes up to this (and the load switch).
MAX_UNIFORM_GRAPH_BATCH = 64


class SpecDecodeRunner:
    def __init__(self, runner, source: ModelSource) -> None:
        args = runner.args
        self.runner = runner
        self.k = args.num_speculative_tokens
        path = resolve_draft_head(args.speculative_model, source.name)
        # Speculative pairs run up to k - 1 positions past the verified ones.
        self.head = load_draft_head(
            path, source.config, source.name, runner.max_model_len + 2 * self.k + 1, runner.device, runner.dtype
        )
        if runner.fused_kernels:
            enable_fused_kernels(self.head)
        self.feature_layers = tuple(self.head.cfg.feature_layers)  # () = the final hidden state (EAGLE-1)
        self.proposer: EagleProposer | None = None
        self.draft_probs: dict[str, torch.Tensor] = {}  # request -> q of its pending drafts [k, vocab]
        self.graphs: DecodeGraphs | None = None  # uniform greedy steps (see the module docstring)

    def kv_bytes_per_block(self) -> int:
        cfg = self.head.cfg
        return kv_bytes_per_block(1, self.runner.block_size, cfg.num_key_value_heads, cfg.head_dim, self.runner.dtype)

    def allocate_kv(self, num_blocks: int) -> None:
        r = self.runner
        self.proposer = EagleProposer(
            self.head, r.model, num_blocks, r.block_size, self.k, r.backend, r.device, r.dtype
        )

    def uniform_graphs(self, max_batch: int = MAX_UNIFORM_GRAPH_BATCH) -> DecodeGraphs:
        """The (uncaptured) graphs of uniform steps for batch sizes up to the load switch, over their own
        buffers (block tables wide enough for the draft's lookahead positions)."""
        r = self.runner
        top = min(r.args.speculative_disable_batch_size, r.max_num_seqs, max_batch)
        q = self.k + 1
        blocks = -(-(r.max_model_len + 2 * self.k + 1) // r.block_size)
        buffers = StepBuffers(top * q, top, blocks, r.device)
        return DecodeGraphs(self.uniform_step, buffers, graph_batch_sizes(top), r.max_model_len, q, "speculative")

    def capture_graphs(self) -> None:
        graphs = self.uniform_graphs()
        with torch.inference_mode():
            graphs.capture()
        self.graphs = graphs

    def forget(self, request_ids) -> None:
        for rid in request_ids:
            self.draft_probs.pop(rid, None)

    # -- one step ----------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, so: SchedulerOutput) -> ModelOutput:
        r = self.runner
        r.copy_blocks(so.block_copies)
        reqs = so.requests
        if self.graphs is not None and self._uniform(reqs):
            return self._execute_uniform(so)
        positions, meta = paged_metadata(
            [sr.start_pos for sr in reqs],
            [len(sr.token_ids) for sr in reqs],
            [sr.block_table for sr in reqs],
            r.block_size,
            r.device,
        )
        input_ids = torch.tensor([t for sr in reqs for t in sr.token_ids], dtype=torch.long, device=r.device)
        hidden, features = self._target(input_ids, positions, meta)
        qsl = meta.query_start_loc_host
        plain = [i for i, sr in enumerate(reqs) if sr.sample and not sr.num_draft_tokens]
        verify = [i for i, sr in enumerate(reqs) if sr.num_draft_tokens]
        rows = [qsl[i + 1] - 1 for i in plain]
        for i in verify:
            d = reqs[i].num_draft_tokens
            rows.extend(range(qsl[i + 1] - 1 - d, qsl[i + 1]))
        parts: list[torch.Tensor] = []
        out_plain = None
        if rows:
            logits = r.model.compute_logits(hidden[torch.tensor(rows, device=r.device)])
            if plain:
                out_plain = sample(logits[: len(plain)], self._sampling_batch([reqs[i] for i in plain]))
                parts.append(out_plain.token_ids)
            if verify:
                res = self._verify(logits[len(plain) :], [reqs[i] for i in verify])
                parts += [res.output_token_ids.flatten(), res.num_accepted]
        host = torch.cat(parts).tolist() if parts else []  # the target's one host sync

        sampled = {reqs[i].request_id: t for i, t in zip(plain, host)}
        spec_tokens: dict[str, list[int]] = {}
        if verify:
            width = max(reqs[i].num_draft_tokens for i in verify) + 1
            base = len(plain)
            accepted = host[base + width * len(verify) :]
            for b, i in enumerate(verify):
                row = host[base + b * width : base + (b + 1) * width]
                spec_tokens[reqs[i].request_id] = row[: accepted[b] + 1]
        logprobs = None
        if out_plain is not None:
            logprobs = token_logprobs([reqs[i] for i in plain], host[: len(plain)], out_plain)
        drafts = self._propose(reqs, features, qsl, sampled, spec_tokens)
        return ModelOutput(so.step_id, sampled, logprobs, spec_token_ids=spec_tokens or None, draft_token_ids=drafts)

    # -- the uniform greedy step -------------------------------------------------------------------
    def _uniform(self, reqs: list[ScheduledRequest]) -> bool:
        """Every request verifies k drafts greedily and proposes again, with nothing that needs the
        general sampler (penalties, min_tokens bans, logprobs, forks), and a graph fits the batch."""
        if self.graphs.padded_size(len(reqs)) is None:
            return False
        q = self.k + 1
        for sr in reqs:
            sp = sr.sampling_params
            if not (sr.spec and sr.sample and sr.num_draft_tokens == self.k and len(sr.token_ids) == q):
                return False
            if sp.temperature != 0 or sr.output_token_ids is not None or sp.logprobs is not None or sr.forks:
                return False
            if sr.num_output_tokens < sp.min_tokens:
                return False
        return True

    def _execute_uniform(self, so: SchedulerOutput) -> ModelOutput:
        reqs, k, g = so.requests, self.k, self.graphs
        n = len(reqs)
        bs = g.padded_size(n)
        self.runner._prepare(reqs, g.buffers, bs, sampling_idx=[])
        host = g.replay(bs).tolist()  # the step's one host sync
        tokens, accepted, drafts = host[: bs * (k + 1)], host[bs * (k + 1) : bs * (k + 2)], host[bs * (k + 2) :]
        spec_tokens = {}
        draft_ids = {}
        for i, sr in enumerate(reqs):
            spec_tokens[sr.request_id] = tokens[i * (k + 1) : i * (k + 1) + accepted[i] + 1]
            draft_ids[sr.request_id] = drafts[i * k : (i + 1) * k]
        return ModelOutput(so.step_id, {}, None, spec_token_ids=spec_tokens, draft_token_ids=draft_ids)

    def uniform_step(self, input_ids: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor:
        """One uniform greedy step without a host sync (the function the graphs capture): the target over
        each request's last token and k drafts, greedy verification, the draft's catch-up and its next k
        drafts. Returns one int64 vector: emitted tokens ``[batch, k + 1]`` (-1 after the first
        non-accepted position), accepted counts ``[batch]``, next drafts ``[batch, k]``, flattened."""
        r = self.runner
        batch, q = meta.block_tables.shape[0], self.k + 1
        token_meta = per_token_metadata(meta, positions)  # the target's and the draft catch-up's attention
        hidden, features = self._target(input_ids, positions, token_meta)
        argmax = r.model.compute_logits(hidden).argmax(-1)
        num_draft = torch.full((batch,), self.k, dtype=torch.long, device=input_ids.device)
        res = greedy_verify(input_ids.view(batch, q)[:, 1:], argmax.view(batch, q), num_draft)
        # the pair after each verified position: its next token is the target's argmax there
        drafts = self.proposer.propose_greedy_uniform(features, argmax, positions, meta, token_meta, res.num_accepted)
        return torch.cat([res.output_token_ids.flatten(), res.num_accepted, drafts.flatten()])

    def _target(self, input_ids: torch.Tensor, positions: torch.Tensor, meta) -> tuple[torch.Tensor, torch.Tensor]:
        """The target's forward: its final hidden states (for its LM head) and the head's features."""
        r = self.runner
        ctx = ForwardContext(meta, r.kv_caches, r.backend)
        if not self.feature_layers:
            hidden = r.model(input_ids, positions, ctx)
            return hidden, hidden
        return r.model(input_ids, positions, ctx, aux_layers=self.feature_layers)

    def _verify(self, logits: torch.Tensor, vreqs: list[ScheduledRequest]) -> RejectionOutput:
        """Rejection-sample each request's drafts against the target's rows ``[sum(d + 1), vocab]``."""
        r = self.runner
        dev = logits.device
        rows: list[ScheduledRequest] = []
        for sr in vreqs:
            d = sr.num_draft_tokens
            drafts = sr.token_ids[-d:]
            for j in range(d + 1):
                # row j sees the drafts before it as output tokens (penalties, min_tokens)
                outs = None if sr.output_token_ids is None else sr.output_token_ids + drafts[:j]
                rows.append(replace(sr, num_output_tokens=sr.num_output_tokens + j, output_token_ids=outs))
        processed = process_logits(logits.float(), self._sampling_batch(rows))
        b, kmax = len(vreqs), max(sr.num_draft_tokens for sr in vreqs)
        flat = torch.tensor(
            [i * (kmax + 1) + j for i, sr in enumerate(vreqs) for j in range(sr.num_draft_tokens + 1)], device=dev
        )
        draft_ids = torch.tensor(
            [sr.token_ids[-sr.num_draft_tokens :] + [0] * (kmax - sr.num_draft_tokens) for sr in vreqs], device=dev
        )
        num_draft = torch.tensor([sr.num_draft_tokens for sr in vreqs], device=dev)
        greedy = [sr.sampling_params.temperature == 0 for sr in vreqs]
        if all(greedy):
            argmax = torch.zeros(b * (kmax + 1), dtype=torch.long, device=dev)
            argmax[flat] = processed.argmax(-1)
            return greedy_verify(draft_ids, argmax.view(b, kmax + 1), num_draft)
        p = processed.softmax(-1)
        vocab = p.shape[-1]
        target = p.new_zeros(b, kmax + 1, vocab)
        target.view(-1, vocab)[flat] = p
        q = None
        if not all(greedy):
            q = p.new_zeros(b, kmax, vocab)
            for i, sr in enumerate(vreqs):
                if not greedy[i]:
                    q[i, : sr.num_draft_tokens] = self.draft_probs[sr.request_id][: sr.num_draft_tokens]
        gens = [r._generator(sr) for sr in vreqs]
        return rejection_sample(draft_ids, q, target, torch.tensor(greedy, device=dev), gens, num_draft)

    def _propose(
        self,
        reqs: list[ScheduledRequest],
        features: torch.Tensor,
        qsl: list[int],
        sampled: dict[str, int],
        spec_tokens: dict[str, list[int]],
    ) -> dict[str, list[int]] | None:
        """Draft KV catch-up over every verified position, then k drafts for the requests that sampled."""
        inp = DraftInput([], [], [], [], [], [])
        proposing: list[ScheduledRequest] = []
        for i, sr in enumerate(reqs):
            if not sr.spec:
                continue
            rid = sr.request_id
            if sr.num_draft_tokens:
                # x_{N-1}, d_1..d_a stand; the pairs' next tokens are the emitted tokens themselves
                nxt = spec_tokens[rid]
            elif sr.sample:
                nxt = sr.token_ids[1:] + [sampled[rid]]
            else:
                nxt = sr.token_ids[1:] + [sr.next_token_id]
            inp.starts.append(sr.start_pos)
            inp.lens.append(len(nxt))
            inp.block_tables.append(sr.block_table)
            inp.propose.append(sr.sample)
            inp.feature_rows.extend(range(qsl[i], qsl[i] + len(nxt)))
            inp.next_tokens.extend(nxt)
            if sr.sample:
                proposing.append(sr)
        if not inp.starts:
            return None
        r = self.runner
        greedy = [sr.sampling_params.temperature == 0 for sr in proposing]
        ng = [sr for sr, g in zip(proposing, greedy) if not g]
        sampling = DraftSampling(greedy, [r._generator(sr) for sr in proposing], self._probs_fn(ng) if ng else None)
        out = self.proposer.propose(features, inp, sampling)
        if out is None:
            return None
        drafts = out.token_ids.tolist()  # the draft's one host sync
        for sr in proposing:
            self.draft_probs.pop(sr.request_id, None)
        for j, row in enumerate(out.probs_rows):
            self.draft_probs[proposing[row].request_id] = out.probs[j]
        return {sr.request_id: d for sr, d in zip(proposing, drafts)}

    def _sampling_batch(self, reqs: list[ScheduledRequest]) -> SamplingBatch:
        """The sampler's per-row parameters (penalties and min_tokens bans as each row stands)."""
        dev = self.runner.device
        sps = [r.sampling_params for r in reqs]
        f = lambda xs: torch.tensor(xs, dtype=torch.float32, device=dev)
        any_pen = any(r.output_token_ids is not None for r in reqs)
        banned = min_tokens_bans(reqs)
        nlp = [p.logprobs for p in sps if p.logprobs is not None]
        return SamplingBatch(
            temperature=f([p.temperature for p in sps]),
            top_k=torch.tensor([max(p.top_k, 0) for p in sps], dtype=torch.long, device=dev),
            top_p=f([p.top_p for p in sps]),
            min_p=f([p.min_p for p in sps]),
            generators=[self.runner._generator(r) for r in reqs],
            presence_penalty=f([p.presence_penalty for p in sps]) if any_pen else None,
            frequency_penalty=f([p.frequency_penalty for p in sps]) if any_pen else None,
            repetition_penalty=f([p.repetition_penalty for p in sps]) if any_pen else None,
            output_token_ids=[r.output_token_ids or [] for r in reqs] if any_pen else None,
            prompt_token_ids=[r.prompt_token_ids or [] for r in reqs] if any_pen else None,
            banned_token_ids=banned if any(banned) else None,
            num_logprobs=max(nlp) if nlp else -1,
            all_greedy=all(p.temperature == 0 for p in sps),
            any_top_k_top_p=any(p.top_k > 0 or p.top_p < 1 for p in sps),
            any_min_p=any(p.min_p > 0 for p in sps),
        )

    def _probs_fn(self, reqs: list[ScheduledRequest]):
        """q for sampled drafts: the request's temperature and truncation over the draft's vocabulary.
        Penalties are left out: q may be any distribution, as long as the drafts are drawn from it."""
        dev = self.runner.device
        sps = [sr.sampling_params for sr in reqs]
        f = lambda xs: torch.tensor(xs, dtype=torch.float32, device=dev)
        batch = SamplingBatch(
            temperature=f([p.temperature for p in sps]),
            top_k=torch.tensor([max(p.top_k, 0) for p in sps], dtype=torch.long, device=dev),
            top_p=f([p.top_p for p in sps]),
            min_p=f([p.min_p for p in sps]),
            generators=[None] * len(sps),
            any_top_k_top_p=any(p.top_k > 0 or p.top_p < 1 for p in sps),
            any_min_p=any(p.min_p > 0 for p in sps),
        )
        return lambda logits: process_logits(logits, batch).softmax(-1)
