"""The model runner's speculative part: an EAGLE draft head that verifies last step's drafts inside the
normal mixed batch, then drafts the next ones. It builds no inputs and no sampling batches of its own: the
runner's step-input builder (`InputBatch.build`) writes every forward's inputs, the catch-up's and the draft
chain's included, and the runner's sampling-batch builder gives every row its parameters.

One target forward covers every scheduled request. A request verifying ``d`` drafts computes ``1 + d``
tokens (its last token, then the drafts); its last ``d + 1`` rows are projected through the LM head and
turned into the target's distributions ``p_1..p_{d+1}`` (`sampler.process_logits`), each row with the
request's temperature / top-k / top-p and with penalties and ``min_tokens`` bans as they stand after the
drafts before it. `spec.rejection.rejection_sample` then accepts or rejects (greedy requests: exact
argmax matching) and adds the resampled or bonus token. Rows without drafts (a prefill's last chunk,
logprobs requests, forks) are sampled exactly as in a plain step.

The draft's distribution ``q`` of the pending drafts stays here, on the device, keyed by request (only for
sampled requests; greedy verification needs none), until the next step verifies them.

The steady state of greedy decoding, every request verifying k drafts with no penalties, bans or
logprobs (the scheduler marks such a step `SchedulerOutput.uniform`), has a fixed-shape path
(`uniform_step`): verification, draft catch-up and the draft chain in one function without a host sync,
captured in CUDA graphs per batch size (`capture_graphs`), so that a step costs one replay instead of
hundreds of eager launches. It is launched like a plain step (`prepare_uniform`, `run_uniform`; read back
later) and leaves each request's next inputs on the device, in a state kept per slot: its last emitted
token and next drafts, and how many drafts it accepted. A row of the next step fed from the device
(`SchedulerOutput.device_fed`, scheduled before this step's output was known) takes its tokens from there
and moves its positions, slot mapping and sequence length by the accepted count, inside the step, so
speculative steps overlap the host's work as plain ones do.
"""

from __future__ import annotations

import numpy as np
import torch
from sluice.core.models.layers import ForwardContext, enable_fused_kernels
from sluice.core.models.loader import ModelSource
from sluice.core.step import ModelOutput, SchedulerOutput
from sluice.core.worker.cuda_graphs import DecodeGraphs, graph_batch_sizes
from sluice.core.worker.sampler import SamplingBatch, process_logits, sample, token_logprobs
from sluice.core.worker.step_buffers import StepBuffers
from sluice.kv.attention.base import kv_bytes_per_block
from sluice.spec.eagle import load_draft_head, resolve_draft_head
from sluice.spec.proposer import DraftSampling, EagleProposer, per_token_metadata
from sluice.spec.rejection import RejectionOutput, greedy_verify, rejection_sample

# Graphs of uniform speculative steps are captured for batch sizes up to this (and the load switch).
MAX_UNIFORM_GRAPH_BATCH = 64


class Drafter:
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
        # uniform greedy steps (see the module docstring): captured on CUDA, run eagerly otherwise; only over a
        # graph-safe attention backend, whose metadata the step derives on the device
        self.graphs: DecodeGraphs | None = None
        self.buffers: StepBuffers | None = None  # the catch-up's inputs (the target keeps the runner's)
        self.chain_buffers: StepBuffers | None = None  # the draft chain's

    def kv_bytes_per_block(self) -> int:
        cfg = self.head.cfg
        return kv_bytes_per_block(1, self.runner.block_size, cfg.num_key_value_heads, cfg.head_dim, self.runner.dtype)

    def allocate_kv(self, num_blocks: int) -> None:
        r = self.runner
        self.proposer = EagleProposer(
            self.head, r.model, num_blocks, r.block_size, self.k, r.backend, r.device, r.dtype
        )
        self.buffers = StepBuffers(r.max_num_tokens, r.max_num_seqs, r.max_blocks_per_seq, r.device)
        self.chain_buffers = StepBuffers(r.max_num_seqs, r.max_num_seqs, r.max_blocks_per_seq, r.device)
        if r.tp is None and getattr(r.backend, "graph_safe", False):
            self.graphs = self.uniform_graphs()
            top = self.graphs.batch_sizes[-1]
            slots = r.batch.max_slots + 1  # the last: scratch for padding rows
            # per slot, what the last uniform step left: the next inputs (last token, k drafts), drafts accepted
            self.state_inputs = torch.zeros(slots, self.k + 1, dtype=torch.long, device=r.device)
            self.state_accepted = torch.zeros(slots, dtype=torch.long, device=r.device)
            # per row of a uniform step: its slot, and 1 when it is fed from the device
            pin = r.device.type == "cuda"
            self.h_row_info = torch.zeros(2, top, dtype=torch.long, pin_memory=pin)
            self.row_info = torch.zeros(2, top, dtype=torch.long, device=r.device) if pin else self.h_row_info

    @property
    def max_uniform_batch(self) -> int:
        """The most rows a uniform step may have (0: none, the general path serves every step)."""
        return self.graphs.batch_sizes[-1] if self.graphs is not None else 0

    def uniform_graphs(self, max_batch: int = MAX_UNIFORM_GRAPH_BATCH) -> DecodeGraphs:
        """The (uncaptured) graphs of uniform steps for batch sizes up to the load switch, over their own
        buffers (block tables wide enough for the draft's lookahead positions)."""
        r = self.runner
        top = min(r.args.speculative_disable_batch_size, r.max_num_seqs, max_batch)
        q = self.k + 1
        buffers = StepBuffers(top * q, top, r.max_blocks_per_seq, r.device)
        return DecodeGraphs(self.uniform_step, buffers, graph_batch_sizes(top), r.max_model_len, q, "speculative")

    def capture_graphs(self) -> None:
        if self.graphs is not None:
            with torch.inference_mode():
                self.graphs.capture()

    def forget(self, finished_ids, preempted_ids=()) -> None:
        for rid in (*finished_ids, *preempted_ids):
            self.draft_probs.pop(rid, None)

    # -- one step ----------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self, so: SchedulerOutput) -> ModelOutput:
        r, ib = self.runner, self.runner.batch
        b = r.buffers
        n = len(so.req_ids)
        # the target's forward replays a mixed-step graph when one fits (it keeps the head's features too)
        graph_t = r.mixed_graphs.padded_size(so.num_tokens) if r.mixed_graphs is not None else None
        b.wait_uploaded()
        if graph_t is not None:
            graph_seqs = r.mixed_graphs.num_seqs(graph_t)
            rows = ib.build(so, b, graph_seqs, graph_t)
        else:
            rows = ib.build(so, b)
        qsl = rows.query_start_loc
        sample_idx, req_ids = r._sampling_rows(so)
        verify = [j for j, rid in enumerate(req_ids) if rid in so.num_draft_tokens]
        plain = [j for j, rid in enumerate(req_ids) if rid not in so.num_draft_tokens]
        # logit rows: a plain row's last position, then each verifying row's last d + 1 positions
        logit_rows = [int(qsl[sample_idx[j] + 1]) - 1 for j in plain]
        slots, outputs, extra = [], [], []
        for j in plain:
            i = sample_idx[j]
            slot = int(ib.slot_of[req_ids[j]])
            slots.append(slot)
            outputs.append(int(rows.starts[i] + rows.q_lens[i]) - int(ib.num_prompt[slot]))
            extra.append([])
        drafts_of: list[list[int]] = []
        for j in verify:
            i, rid = sample_idx[j], req_ids[j]
            d = so.num_draft_tokens[rid]
            slot = int(ib.slot_of[rid])
            drafts = ib.drafts[slot, :d].tolist()
            drafts_of.append(drafts)
            end = int(qsl[i + 1])
            logit_rows.extend(range(end - 1 - d, end))
            base = int(rows.starts[i]) + 1 - int(ib.num_prompt[slot])
            for t in range(d + 1):  # row t sees the drafts before it as output tokens (penalties, min_tokens)
                slots.append(slot)
                outputs.append(base + t)
                extra.append(drafts[:t])
        slots_np = np.asarray(slots, np.int64)
        batch = r._sampling_batch(slots_np, np.asarray(outputs, np.int64), b, extra) if slots else None
        if graph_t is not None:
            b.upload(graph_t, graph_seqs, b.max_blocks, 0)
            hidden, features = r.replay_mixed(graph_t)
        else:
            b.upload(rows.num_tokens, n, b.max_blocks, 0)
            meta = r._metadata(rows, b)
            hidden, features = self.target_forward(b.input_ids[: rows.num_tokens], b.positions[: rows.num_tokens], meta)
        parts: list[torch.Tensor] = []
        out_plain = None
        if logit_rows:
            logits = r.model.compute_logits(hidden[torch.tensor(logit_rows, device=r.device)]).float()
            p = len(plain)
            if plain:
                if batch is None:
                    parts.append(logits[:p].argmax(-1))
                else:
                    out_plain = sample(logits[:p], batch.select(0, p))
                    parts.append(out_plain.token_ids)
            if verify:
                vb = batch.select(p, len(slots)) if batch is not None else None
                res = self._verify(logits[p:], vb, [req_ids[j] for j in verify], slots_np[p:], drafts_of)
                parts += [res.output_token_ids.flatten(), res.num_accepted]
        host = torch.cat(parts).tolist() if parts else []  # the target's one host sync

        out = ModelOutput(so.step_id, req_ids, [0] * len(req_ids))
        sampled: dict[str, int] = {}
        for j, t in zip(plain, host):
            out.token_ids[j] = sampled[req_ids[j]] = t
        spec_tokens: dict[str, list[int]] = {}
        if verify:
            width = max(len(d) for d in drafts_of) + 1
            base = len(plain)
            accepted = host[base + width * len(verify) :]
            for v, j in enumerate(verify):
                row = host[base + v * width : base + (v + 1) * width]
                spec_tokens[req_ids[j]] = row[: accepted[v] + 1]
                out.token_ids[j] = row[accepted[v]]
            out.spec_token_ids = spec_tokens
        if out_plain is not None and out_plain.logprobs is not None:
            lps = token_logprobs(ib.num_logprobs[slots_np[: len(plain)]].tolist(), host[: len(plain)], out_plain)
            out.logprobs = [None] * len(req_ids)
            for j, lp in zip(plain, lps):
                out.logprobs[j] = lp
        row_slots = np.fromiter(map(ib.slot_of.__getitem__, req_ids), np.int64, len(req_ids))
        ib.read_back(row_slots, so.step_id, np.asarray(out.token_ids, np.int64))
        self._record_outputs(row_slots, req_ids, sampled, spec_tokens)
        out.draft_token_ids = self._propose(so, rows, features, sampled, spec_tokens)
        return out

    def _record_outputs(self, slots: np.ndarray, req_ids: list[str], sampled, spec_tokens) -> None:
        """Penalized requests keep their output tokens in the persistent batch."""
        ib = self.runner.batch
        for slot, rid in zip(slots.tolist(), req_ids):
            out = ib.output_tokens[slot]
            if out is not None:
                out.extend(spec_tokens[rid] if rid in spec_tokens else [sampled[rid]])

    def _verify(
        self, logits: torch.Tensor, batch: SamplingBatch | None, req_ids: list[str], slots: np.ndarray, drafts_of
    ) -> RejectionOutput:
        """Rejection-sample each request's drafts against the target's rows ``[sum(d + 1), vocab]``."""
        r, ib = self.runner, self.runner.batch
        dev = logits.device
        b, kmax = len(req_ids), max(len(d) for d in drafts_of)
        flat = torch.tensor(
            [i * (kmax + 1) + j for i, d in enumerate(drafts_of) for j in range(len(d) + 1)], device=dev
        )
        draft_ids = torch.tensor([d + [0] * (kmax - len(d)) for d in drafts_of], device=dev)
        num_draft = torch.tensor([len(d) for d in drafts_of], device=dev)
        processed = logits if batch is None else process_logits(logits, batch)
        first_rows = np.cumsum([0] + [len(d) + 1 for d in drafts_of[:-1]])
        req_slots = slots[first_rows]
        greedy = (ib.temperature[req_slots] == 0).tolist()
        if all(greedy):
            argmax = torch.zeros(b * (kmax + 1), dtype=torch.long, device=dev)
            argmax[flat] = processed.argmax(-1)
            return greedy_verify(draft_ids, argmax.view(b, kmax + 1), num_draft)
        p = processed.softmax(-1)
        vocab = p.shape[-1]
        target = p.new_zeros(b, kmax + 1, vocab)
        target.view(-1, vocab)[flat] = p
        q = p.new_zeros(b, kmax, vocab)
        for i, rid in enumerate(req_ids):
            if not greedy[i]:
                q[i, : len(drafts_of[i])] = self.draft_probs[rid][: len(drafts_of[i])]
        gens = [r._generator(int(s)) if ib.seeded[s] else None for s in req_slots]
        return rejection_sample(draft_ids, q, target, torch.tensor(greedy, device=dev), gens, num_draft)

    def _propose(self, so: SchedulerOutput, rows, features, sampled, spec_tokens) -> dict[str, list[int]] | None:
        """Draft KV catch-up over every verified position of the drafting requests, then k drafts for those
        that sampled. Both forwards take their inputs from the runner's step-input builder."""
        r, ib = self.runner, self.runner.batch
        sub = SchedulerOutput(so.step_id)
        feature_rows: list[int] = []
        next_tokens: list[int] = []
        proposing: list[str] = []
        chain_rows: list[int] = []
        qsl = rows.query_start_loc
        for i, rid in enumerate(so.req_ids):
            if rid not in so.drafting:
                continue
            slot = ib.slot_of[rid]
            start, q = int(rows.starts[i]), int(rows.q_lens[i])
            inputs = r.buffers.input_ids_np[int(qsl[i]) : int(qsl[i]) + q].tolist()
            if rid in spec_tokens:
                # x_{N-1}, d_1..d_a stand; the pairs' next tokens are the emitted tokens themselves
                nxt = spec_tokens[rid]
            elif rid in sampled:
                nxt = inputs[1:] + [sampled[rid]]
            else:  # a prefill chunk: the token after it is one the request arrived with
                nxt = inputs[1:] + [ib.tokens[slot][start + q]]
            sub.req_ids.append(rid)
            sub.num_scheduled_tokens.append(len(nxt))
            sub.num_computed_tokens.append(start)
            sub.samples.append(False)
            feature_rows.extend(range(int(qsl[i]), int(qsl[i]) + len(nxt)))
            next_tokens.extend(nxt)
            if rid in sampled or rid in spec_tokens:
                proposing.append(rid)
                chain_rows.append(len(next_tokens) - 1)
        if not sub.req_ids:
            return None
        dev = r.device
        b = self.buffers
        b.wait_uploaded()
        crows = ib.build(sub, b)
        b.upload(crows.num_tokens, len(sub.req_ids), b.max_blocks, 0)
        meta = r._metadata(crows, b)
        positions = b.positions[: crows.num_tokens]
        if not proposing:
            self.proposer.propose(
                features[torch.tensor(feature_rows, device=dev)],
                torch.tensor(next_tokens, device=dev),
                positions,
                meta,
                [],
                None,
                DraftSampling([], []),
            )
            return None
        # the chain: one token per proposing request, the first right after its last verified position
        row = {rid: i for i, rid in enumerate(sub.req_ids)}
        pos0 = [int(crows.starts[row[rid]] + crows.q_lens[row[rid]]) for rid in proposing]
        chain_buffers = self.chain_buffers

        def chain_metadata(step: int):
            chain = SchedulerOutput(so.step_id, list(proposing), [1] * len(proposing), [p + step for p in pos0])
            chain.samples = [False] * len(proposing)
            chain_buffers.wait_uploaded()
            c = ib.build(chain, chain_buffers)
            chain_buffers.upload(c.num_tokens, len(proposing), chain_buffers.max_blocks, 0)
            return chain_buffers.positions[: c.num_tokens], r._metadata(c, chain_buffers)

        slots = np.fromiter(map(ib.slot_of.__getitem__, proposing), np.int64, len(proposing))
        greedy = (ib.temperature[slots] == 0).tolist()
        gens = [r._generator(int(s)) if ib.seeded[s] else None for s in slots]
        ng = [int(s) for s, g in zip(slots, greedy) if not g]
        sampling = DraftSampling(greedy, gens, self._probs_fn(np.asarray(ng, np.int64)) if ng else None)
        out = self.proposer.propose(
            features[torch.tensor(feature_rows, device=dev)],
            torch.tensor(next_tokens, device=dev),
            positions,
            meta,
            chain_rows,
            chain_metadata,
            sampling,
        )
        drafts = out.token_ids.tolist()  # the draft's one host sync
        for rid in proposing:
            self.draft_probs.pop(rid, None)
        for j, row in enumerate(out.probs_rows):
            self.draft_probs[proposing[row]] = out.probs[j]
        ib.drafts[slots, : self.k] = np.asarray(drafts, np.int64)
        return dict(zip(proposing, drafts))

    def _probs_fn(self, slots: np.ndarray):
        """q for sampled drafts: the request's temperature and truncation over the draft's vocabulary.
        Penalties are left out: q may be any distribution, as long as the drafts are drawn from it."""
        ib, dev = self.runner.batch, self.runner.device
        batch = SamplingBatch(
            temperature=torch.from_numpy(ib.temperature[slots]).to(dev),
            top_k=torch.from_numpy(ib.top_k[slots]).to(dev),
            top_p=torch.from_numpy(ib.top_p[slots]).to(dev),
            min_p=torch.from_numpy(ib.min_p[slots]).to(dev),
            generators=[None] * len(slots),
            any_top_k_top_p=bool((ib.top_k[slots] > 0).any() or (ib.top_p[slots] < 1).any()),
            any_min_p=bool((ib.min_p[slots] > 0).any()),
        )
        return lambda logits: process_logits(logits, batch).softmax(-1)

    # -- the uniform greedy step -------------------------------------------------------------------
    def prepare_uniform(self, so: SchedulerOutput) -> tuple[np.ndarray, int]:
        """Write a uniform step's inputs (`SchedulerOutput.uniform`) into the graphs' buffers; its rows' slots
        and the batch size it runs at (`run_uniform`)."""
        k, g, ib = self.k, self.graphs, self.runner.batch
        n = len(so.req_ids)
        bs = g.padded_size(n)
        b = g.buffers
        b.wait_uploaded()
        rows = ib.build(so, b, pad_to=bs)
        info = self.h_row_info.numpy()
        info[0, :bs] = ib.max_slots  # padding rows: the scratch slot
        info[0, :n] = rows.slots
        info[1, :bs] = 0
        if so.device_fed:
            info[1, :n] = [rid in so.device_fed for rid in so.req_ids]
        if self.row_info is not self.h_row_info:  # whole (a column slice would not be one asynchronous copy)
            self.row_info.copy_(self.h_row_info, non_blocking=True)  # before upload's event
        b.upload(bs * (k + 1), bs, b.max_blocks, 0)
        return rows.slots, bs

    def run_uniform(self, bs: int) -> torch.Tensor:
        """Enqueue the prepared uniform step; its output vector (see `uniform_step`), read back later."""
        g = self.graphs
        return g.replay(bs) if g.graphs else self.uniform_step(*g.step_inputs(bs))

    def uniform_output(self, so: SchedulerOutput, slots: np.ndarray, host: np.ndarray) -> ModelOutput:
        """A uniform step's output from its read-back vector (see `uniform_step`)."""
        k, ib = self.k, self.runner.batch
        n = len(so.req_ids)
        bs = host.shape[0] // (2 * k + 2)
        q = k + 1
        tokens = host[: bs * q].reshape(bs, q)[:n]
        accepted = host[bs * q : bs * (q + 1)][:n]
        drafts = host[bs * (q + 1) :].reshape(bs, k)[:n]
        last = tokens[np.arange(n), accepted]
        out = ModelOutput(so.step_id, so.req_ids, last.tolist(), spec_token_ids={}, draft_token_ids={})
        for rid, row, a, d in zip(so.req_ids, tokens.tolist(), accepted.tolist(), drafts.tolist()):
            out.spec_token_ids[rid] = row[: a + 1]
            out.draft_token_ids[rid] = d
        ib.read_back(slots, so.step_id, last)
        ib.drafts[slots, :k] = drafts
        return out

    def uniform_step(self, input_ids: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor:
        """One uniform greedy step without a host sync (the function the graphs capture): the target over
        each request's last token and k drafts, greedy verification, the draft's catch-up and its next k
        drafts. Returns one int64 vector: emitted tokens ``[batch, k + 1]`` (-1 after the first
        non-accepted position), accepted counts ``[batch]``, next drafts ``[batch, k]``, flattened."""
        r = self.runner
        batch, q = meta.block_tables.shape[0], self.k + 1
        slots = self.row_info[0, :batch]
        self._feed_from_device(input_ids, positions, meta, slots, self.row_info[1, :batch])
        token_meta = per_token_metadata(meta, positions)  # the target's and the draft catch-up's attention
        hidden, features = self.target_forward(input_ids, positions, token_meta)
        argmax = r.model.compute_logits(hidden).argmax(-1)
        num_draft = torch.full((batch,), self.k, dtype=torch.long, device=input_ids.device)
        res = greedy_verify(input_ids.view(batch, q)[:, 1:], argmax.view(batch, q), num_draft)
        # the pair after each verified position: its next token is the target's argmax there
        drafts = self.proposer.propose_greedy_uniform(features, argmax, positions, meta, token_meta, res.num_accepted)
        # the next step's inputs, for rows fed from the device
        last = res.output_token_ids.gather(1, res.num_accepted[:, None])
        self.state_inputs[slots] = torch.cat([last, drafts], 1)
        self.state_accepted[slots] = res.num_accepted
        return torch.cat([res.output_token_ids.flatten(), res.num_accepted, drafts.flatten()])

    def _feed_from_device(self, input_ids, positions, meta, slots: torch.Tensor, fed: torch.Tensor) -> None:
        """Rows fed from the device take their tokens from the last uniform step's state, and move by the
        drafts it accepted: positions, sequence lengths and slot mapping (the host built them as if it
        accepted none). In place, in the step's buffers (the host writes them afresh every step)."""
        batch, q, bs = fed.shape[0], self.k + 1, self.runner.block_size
        on = fed.bool()[:, None]
        shift = self.state_accepted[slots] * fed
        ids = input_ids.view(batch, q)
        ids.copy_(torch.where(on, self.state_inputs[slots], ids))
        pos = positions.view(batch, q)
        pos.add_(shift[:, None])
        meta.seq_lens.add_(shift.to(meta.seq_lens.dtype))
        block = meta.block_tables.gather(1, pos // bs).long()
        mapping = meta.slot_mapping.view(batch, q)
        mapping.copy_(torch.where(on, block * bs + pos % bs, mapping))

    def target_forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The target's forward: its final hidden states (for its LM head) and the head's features."""
        r = self.runner
        ctx = ForwardContext(meta, r.kv_caches, r.backend)
        if not self.feature_layers:
            hidden = r.model(input_ids, positions, ctx)
            return hidden, hidden
        return r.model(input_ids, positions, ctx, aux_layers=self.feature_layers)
