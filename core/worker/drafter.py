"""The model runner's speculative collaborator: an EAGLE draft head that verifies last step's drafts inside
the normal mixed batch, then drafts the next ones. It holds no reference to the runner and builds no inputs
and no sampling batches of its own: the runner's step (`ModelRunner._speculative_step`) hands it the persistent
batch, whose step-input builder (`InputBatch.build`) writes every forward's inputs, the catch-up's and the draft
chain's included, the seeded generators, and the target's rows, logits and features; the runner's sampling-batch
builder gives every row its parameters. It returns the step's extra verification rows (`rows_to_verify`), the
accepted drafts (`verify`) and the next drafts (`propose`).

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

from dataclasses import dataclass

import numpy as np
import torch
from sluice.core import envs
from sluice.core.args import EngineArgs
from sluice.core.models.layers import argmax_rows, enable_fused_kernels
from sluice.core.models.loader import ModelSource
from sluice.core.step import ModelOutput, SchedulerOutput
from sluice.core.worker.cuda_graphs import DecodeGraphs, graph_batch_sizes
from sluice.core.worker.input_batch import InputBatch, StepRows, attention_metadata
from sluice.core.worker.sampler import SamplingBatch, process_logits
from sluice.core.worker.sampling_batch import SeededGenerators
from sluice.core.worker.step_buffers import StepBuffers, StepLimits
from sluice.core.worker.target import TargetForward
from sluice.kv.attention.base import kv_bytes_per_block
from sluice.spec.eagle import load_draft_head, resolve_draft_head
from sluice.spec.proposer import DraftSampling, EagleProposer, per_token_metadata
from sluice.spec.rejection import RejectionOutput, greedy_verify, rejection_sample

# Graphs of uniform speculative steps are captured for batch sizes up to this (and the load switch).
MAX_UNIFORM_GRAPH_BATCH = 64


@dataclass(slots=True)
class SpecRows:
    """The sampling rows of a speculative step, plain ones first: a plain row samples at its last position, a
    verifying row contributes its last ``d + 1`` positions. Row ``i`` of the sampling batch belongs to slot
    ``slots[i]``, after ``num_outputs[i]`` output tokens and then (a verification row) ``extra_outputs[i]``."""

    plain: list[int]  # indices (into the step's sampled requests) of rows without drafts
    verify: list[int]  # those verifying drafts
    drafts_of: list[list[int]]  # each verifying row's drafts
    logit_rows: list[int]  # the step's token rows projected through the LM head, in sampling-row order
    slots: np.ndarray
    num_outputs: np.ndarray
    extra_outputs: list[list[int]]


class Drafter:
    """The draft head and its state between steps, a collaborator of the model runner: the runner builds each
    step's inputs and sampling batch and runs the target; the drafter adds the verification rows, verifies and
    proposes, from what it is handed."""

    def __init__(
        self,
        args: EngineArgs,
        source: ModelSource,
        max_model_len: int,
        device,
        dtype,
        fused_kernels: bool,
        quantization: str | None = None,
    ) -> None:
        self.k = args.resolve_num_speculative_tokens(device, quantization)
        self.block_size = args.block_size
        self.max_model_len = max_model_len
        self.disable_batch_size = args.speculative_disable_batch_size
        self.device, self.dtype = device, dtype
        path = resolve_draft_head(args.speculative_model, source.name)
        # Speculative pairs run up to k - 1 positions past the verified ones.
        self.head = load_draft_head(path, source.config, source.name, max_model_len + 2 * self.k + 1, device, dtype)
        self.head.restrict_draft_vocab(args.resolve_speculative_draft_vocab_size(device, quantization))
        if fused_kernels:
            enable_fused_kernels(self.head, **envs.fused_kernel_options())
        # drafts scored through an int4 copy of the LM head (`EagleProposer`), where the head is packed
        self.cpu_packed = device.type == "cpu" and quantization is not None and self._pack_for_cpu()
        self.feature_layers = tuple(self.head.cfg.feature_layers)  # () = the final hidden state (EAGLE-1)
        self.proposer: EagleProposer | None = None
        self.draft_probs: dict[str, torch.Tensor] = {}  # request -> q of its pending drafts [k, vocab]
        # uniform greedy steps (see the module docstring): captured on CUDA, run eagerly otherwise; only over a
        # graph-safe attention backend, whose metadata the step derives on the device
        self.graphs: DecodeGraphs | None = None
        self.buffers: StepBuffers | None = None  # the catch-up's inputs (the target keeps the runner's)
        self.chain_buffers: StepBuffers | None = None  # the draft chain's

    def _pack_for_cpu(self) -> bool:
        """On the CPU the head follows a quantized target onto the packed int4 kernels (`core/models/cpu_linear.py`)
        where they run (bf16 activations, AVX2 / AVX-512); returns whether it did. A draft step reads the head's
        weights cold (the target's forward passes in between), so their bytes are its time; their rounding can
        only change which drafts are proposed, never what the target emits."""
        from sluice.core.models.cpu_linear import packed_kernels_available, round_linears_to_int4

        if self.dtype != torch.bfloat16 or not packed_kernels_available():
            return False
        round_linears_to_int4(self.head)
        return True

    def kv_bytes_per_block(self) -> int:
        cfg = self.head.cfg
        return kv_bytes_per_block(1, self.block_size, cfg.num_key_value_heads, cfg.head_dim, self.dtype)

    def allocate_kv(self, num_blocks: int, target: TargetForward, limits: StepLimits, uniform_steps: bool) -> None:
        """The draft head's KV pool (as many blocks as the target's) and its step buffers; with
        ``uniform_steps`` (one process, a graph-safe attention backend) the uniform steps' graphs and state."""
        self.target = target
        self.proposer = EagleProposer(
            self.head,
            target.model,
            num_blocks,
            self.block_size,
            self.k,
            target.backend,
            self.device,
            self.dtype,
            int4_lm_head=self.cpu_packed,
        )
        self.buffers = StepBuffers(limits.max_tokens, limits.max_seqs, limits.max_blocks_per_seq, self.device)
        self.chain_buffers = StepBuffers(limits.max_seqs, limits.max_seqs, limits.max_blocks_per_seq, self.device)
        if uniform_steps:
            self.graphs = self.uniform_graphs(limits)
            top = self.graphs.batch_sizes[-1]
            slots = limits.max_slots + 1  # the last: scratch for padding rows
            self.scratch_slot = limits.max_slots
            # per slot, what the last uniform step left: the next inputs (last token, k drafts), drafts accepted
            self.state_inputs = torch.zeros(slots, self.k + 1, dtype=torch.long, device=self.device)
            self.state_accepted = torch.zeros(slots, dtype=torch.long, device=self.device)
            # per row of a uniform step: its slot, and 1 when it is fed from the device
            pin = self.device.type == "cuda"
            self.h_row_info = torch.zeros(2, top, dtype=torch.long, pin_memory=pin)
            self.row_info = torch.zeros(2, top, dtype=torch.long, device=self.device) if pin else self.h_row_info

    @property
    def max_uniform_batch(self) -> int:
        """The most rows a uniform step may have (0: none, the general path serves every step)."""
        return self.graphs.batch_sizes[-1] if self.graphs is not None else 0

    def uniform_graphs(self, limits: StepLimits, max_batch: int = MAX_UNIFORM_GRAPH_BATCH) -> DecodeGraphs:
        """The (uncaptured) graphs of uniform steps for batch sizes up to the load switch, over their own
        buffers (block tables wide enough for the draft's lookahead positions)."""
        top = min(self.disable_batch_size, limits.max_seqs, max_batch)
        q = self.k + 1
        buffers = StepBuffers(top * q, top, limits.max_blocks_per_seq, self.device)
        return DecodeGraphs(self.uniform_step, buffers, graph_batch_sizes(top), self.max_model_len, q, "speculative")

    def capture_graphs(self) -> None:
        if self.graphs is not None:
            with torch.inference_mode():
                self.graphs.capture()

    def forget(self, finished_ids, preempted_ids=()) -> None:
        for rid in (*finished_ids, *preempted_ids):
            self.draft_probs.pop(rid, None)

    # -- one step (the runner's `_speculative_step`) --------------------------------------------------
    def rows_to_verify(
        self, so: SchedulerOutput, rows: StepRows, sample_idx: np.ndarray, req_ids: list[str], ib: InputBatch
    ) -> SpecRows:
        """The step's sampling rows: the plain rows', then each verifying row's ``d + 1`` (row ``t`` sees the
        drafts before it as output tokens: penalties, ``min_tokens``)."""
        qsl = rows.query_start_loc
        verify = [j for j, rid in enumerate(req_ids) if rid in so.num_draft_tokens]
        plain = [j for j, rid in enumerate(req_ids) if rid not in so.num_draft_tokens]
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
            for t in range(d + 1):
                slots.append(slot)
                outputs.append(base + t)
                extra.append(drafts[:t])
        return SpecRows(
            plain, verify, drafts_of, logit_rows, np.asarray(slots, np.int64), np.asarray(outputs, np.int64), extra
        )

    def step_output(
        self, so: SchedulerOutput, req_ids: list[str], spec: SpecRows, host: list[int], ib: InputBatch
    ) -> tuple[ModelOutput, dict[str, int], dict[str, list[int]]]:
        """The step's output from its read-back tokens (the plain rows' samples, then each verifying row's
        emitted tokens and the accepted counts); the persistent batch learns them. Also returns the plain rows'
        samples and the verifying rows' emitted tokens, by request (what `propose` continues from)."""
        out = ModelOutput(so.step_id, req_ids, [0] * len(req_ids))
        sampled: dict[str, int] = {}
        for j, t in zip(spec.plain, host):
            out.token_ids[j] = sampled[req_ids[j]] = t
        spec_tokens: dict[str, list[int]] = {}
        if spec.verify:
            width = max(len(d) for d in spec.drafts_of) + 1
            base = len(spec.plain)
            accepted = host[base + width * len(spec.verify) :]
            for v, j in enumerate(spec.verify):
                row = host[base + v * width : base + (v + 1) * width]
                spec_tokens[req_ids[j]] = row[: accepted[v] + 1]
                out.token_ids[j] = row[accepted[v]]
            out.spec_token_ids = spec_tokens
        row_slots = np.fromiter(map(ib.slot_of.__getitem__, req_ids), np.int64, len(req_ids))
        ib.read_back(row_slots, so.step_id, np.asarray(out.token_ids, np.int64))
        for slot, rid in zip(row_slots.tolist(), req_ids):  # penalized requests keep their output tokens
            kept = ib.output_tokens[slot]
            if kept is not None:
                kept.extend(spec_tokens[rid] if rid in spec_tokens else [sampled[rid]])
        return out, sampled, spec_tokens

    def verify(
        self,
        logits: torch.Tensor,
        batch: SamplingBatch | None,
        req_ids: list[str],
        slots: np.ndarray,
        drafts_of: list[list[int]],
        ib: InputBatch,
        generators: SeededGenerators,
    ) -> RejectionOutput:
        """Rejection-sample each request's drafts against the target's rows ``[sum(d + 1), vocab]``: the emitted
        tokens and accepted counts."""
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
            argmax[flat] = argmax_rows(processed)
            return greedy_verify(draft_ids, argmax.view(b, kmax + 1), num_draft)
        p = processed.softmax(-1)
        vocab = p.shape[-1]
        target = p.new_zeros(b, kmax + 1, vocab)
        target.view(-1, vocab)[flat] = p
        q = p.new_zeros(b, kmax, vocab)
        for i, rid in enumerate(req_ids):
            if not greedy[i]:
                q[i, : len(drafts_of[i])] = self.draft_probs[rid][: len(drafts_of[i])]
        gens = [generators.of_slot(int(s)) if ib.seeded[s] else None for s in req_slots]
        return rejection_sample(draft_ids, q, target, torch.tensor(greedy, device=dev), gens, num_draft)

    def propose(
        self,
        so: SchedulerOutput,
        rows: StepRows,
        input_ids: np.ndarray,
        features: torch.Tensor,
        sampled: dict[str, int],
        spec_tokens: dict[str, list[int]],
        ib: InputBatch,
        generators: SeededGenerators,
    ) -> dict[str, list[int]] | None:
        """Draft KV catch-up over every verified position of the drafting requests, then k drafts for those
        that sampled. ``rows``, ``input_ids`` and ``features`` are the target step's; both forwards take their
        inputs from the step-input builder (``ib``)."""
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
            inputs = input_ids[int(qsl[i]) : int(qsl[i]) + q].tolist()
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
        dev = self.device
        b = self.buffers
        b.wait_uploaded()
        crows = ib.build(sub, b)
        b.upload(crows.num_tokens, len(sub.req_ids), b.max_blocks, 0)
        meta = attention_metadata(crows, b)
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
            return chain_buffers.positions[: c.num_tokens], attention_metadata(c, chain_buffers)

        slots = np.fromiter(map(ib.slot_of.__getitem__, proposing), np.int64, len(proposing))
        greedy = (ib.temperature[slots] == 0).tolist()
        gens = [generators.of_slot(int(s)) if ib.seeded[s] else None for s in slots]
        ng = [int(s) for s, g in zip(slots, greedy) if not g]
        sampling = DraftSampling(greedy, gens, self._probs_fn(np.asarray(ng, np.int64), ib) if ng else None)
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

    def _probs_fn(self, slots: np.ndarray, ib: InputBatch):
        """q for sampled drafts: the request's temperature and truncation over the draft's vocabulary.
        Penalties are left out: q may be any distribution, as long as the drafts are drawn from it."""
        dev = self.device
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
    def prepare_uniform(self, so: SchedulerOutput, ib: InputBatch) -> tuple[np.ndarray, int]:
        """Write a uniform step's inputs (`SchedulerOutput.uniform`) into the graphs' buffers; its rows' slots
        and the batch size it runs at (`run_uniform`)."""
        k, g = self.k, self.graphs
        n = len(so.req_ids)
        bs = g.padded_size(n)
        b = g.buffers
        b.wait_uploaded()
        rows = ib.build(so, b, pad_to=bs)
        info = self.h_row_info.numpy()
        info[0, :bs] = self.scratch_slot  # padding rows
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

    def uniform_output(self, so: SchedulerOutput, slots: np.ndarray, host: np.ndarray, ib: InputBatch) -> ModelOutput:
        """A uniform step's output from its read-back vector (see `uniform_step`); the persistent batch learns
        its tokens and drafts."""
        k = self.k
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
        batch, q = meta.block_tables.shape[0], self.k + 1
        slots = self.row_info[0, :batch]
        self._feed_from_device(input_ids, positions, meta, slots, self.row_info[1, :batch])
        token_meta = per_token_metadata(meta, positions)  # the target's and the draft catch-up's attention
        hidden, features = self.target(input_ids, positions, token_meta)
        argmax = argmax_rows(self.target.model.compute_logits(hidden))
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
        batch, q, bs = fed.shape[0], self.k + 1, self.block_size
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
