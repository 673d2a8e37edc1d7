"""The executor's persistent batch: every request it holds, in a slot of preallocated host arrays, from the
step that first schedules it until it is dropped.

A step (`SchedulerOutput`) only says what changed; `apply` brings the slots up to date (new requests in
full, blocks appended to tables, requests dropped), and `build` writes the step's inputs, vectorized over
the slots, into a `StepBuffers`. A row's input tokens come from one of three places:

* a prefill (or resume) chunk: the tokens the request arrived with;
* a decode: the token the request sampled last, kept in ``last_token`` once it has been read back, or,
  while the step that sampled it is still in flight (asynchronous scheduling), gathered on the device from
  that step's sampled tokens (``pending``: the token's row there);
* drafts to verify (speculative decoding): after the last token, the drafts the request proposed last step.

A dropped request's slot is reused from the next step on, not in the step that drops it: the step in flight
then (the one before) may still report a token for it. The executor collects that step before it launches
another (at most one step is in flight at a launch), so one step of cooling is enough, and the slots held
never exceed two batches: the requests of this step, and those dropped by it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from sluice.core.sampling_params import SamplingParams
from sluice.core.step import NewRequest, SchedulerOutput
from sluice.core.worker.step_buffers import StepBuffers
from sluice.kv.attention.base import AttentionMetadata


@dataclass(slots=True)
class StepRows:
    """Where one step's rows stand, host side (numpy, in row order)."""

    slots: np.ndarray  # [B] slot of each row
    starts: np.ndarray  # [B] first position computed
    q_lens: np.ndarray  # [B] tokens computed
    query_start_loc: np.ndarray  # [B + 1]
    num_tokens: int
    # device gather of tokens sampled by the step in flight: input_ids[dst] = its sampled[src]
    gather_dst: np.ndarray
    gather_src: np.ndarray


class InputBatch:
    def __init__(self, max_slots: int, max_blocks: int, block_size: int, num_speculative_tokens: int = 0) -> None:
        self.max_slots = max_slots
        self.max_blocks = max_blocks
        self.block_size = block_size
        self.slot_of: dict[str, int] = {}
        self.req_ids: list[str | None] = [None] * max_slots
        self._free = list(range(max_slots - 1, -1, -1))
        self._cooling: list[int] = []  # slots dropped by the last step: free from this one on
        # tokens and positions
        self.tokens: list[list[int] | None] = [None] * max_slots  # the tokens each request arrived with
        self.num_arrived = np.zeros(max_slots, np.int64)  # len(tokens)
        self.num_prompt = np.zeros(max_slots, np.int64)
        self.last_token = np.zeros(max_slots, np.int64)
        self.pending = np.full(max_slots, -1, np.int64)  # row of the last token in the in-flight step's samples
        self.pending_step = np.full(max_slots, -1, np.int64)
        self.drafts = np.zeros((max_slots, max(num_speculative_tokens, 1)), np.int64)
        self.block_table = np.zeros((max_slots, max_blocks), np.int32)
        self.num_blocks = np.zeros(max_slots, np.int64)
        # sampling parameters, one entry per slot
        self.params: list[SamplingParams | None] = [None] * max_slots
        self.eos: list[tuple[int, ...]] = [()] * max_slots
        self.temperature = np.zeros(max_slots, np.float32)
        self.top_p = np.ones(max_slots, np.float32)
        self.top_k = np.zeros(max_slots, np.int64)
        self.min_p = np.zeros(max_slots, np.float32)
        self.presence = np.zeros(max_slots, np.float32)
        self.frequency = np.zeros(max_slots, np.float32)
        self.repetition = np.ones(max_slots, np.float32)
        self.min_tokens = np.zeros(max_slots, np.int64)
        self.num_logprobs = np.full(max_slots, -1, np.int64)
        self.penalized = np.zeros(max_slots, bool)
        self.seeded = np.zeros(max_slots, bool)
        self.structured = np.zeros(max_slots, bool)  # sampled under a grammar (`GrammarRows`)
        self.output_tokens: list[list[int] | None] = [None] * max_slots  # penalized slots only

    # -- changes -------------------------------------------------------------------------------------
    def apply(self, so: SchedulerOutput) -> list[str]:
        """Bring the slots up to ``so``: drop, then add, then grow tables. Returns the ids dropped for good."""
        self._free.extend(self._cooling)
        dropped: list[int] = []
        for rid in (*so.finished_request_ids, *so.preempted_request_ids):
            slot = self.slot_of.pop(rid, None)
            if slot is not None:
                self.req_ids[slot] = None
                self.tokens[slot] = self.output_tokens[slot] = self.params[slot] = None
                dropped.append(slot)
        self._cooling = dropped
        for nr in so.new_requests:
            self._add(nr)
        for rid, (start, ids) in so.block_updates.items():
            slot = self.slot_of[rid]
            end = start + len(ids)
            self.block_table[slot, start:end] = ids
            self.num_blocks[slot] = end
        return so.finished_request_ids

    def _add(self, nr: NewRequest) -> None:
        if not self._free:
            raise RuntimeError(f"persistent batch full ({self.max_slots} slots)")
        slot = self._free.pop()
        self.slot_of[nr.request_id] = slot
        self.req_ids[slot] = nr.request_id
        self.tokens[slot] = nr.token_ids
        n = len(nr.token_ids)
        self.num_arrived[slot] = n
        self.num_prompt[slot] = nr.num_prompt_tokens
        self.last_token[slot] = nr.token_ids[-1]
        self.pending[slot] = -1
        self.pending_step[slot] = -1
        nb = len(nr.block_ids)
        self.block_table[slot, :nb] = nr.block_ids
        self.num_blocks[slot] = nb
        p = nr.sampling_params
        self.params[slot] = p
        self.eos[slot] = () if p.ignore_eos else nr.eos_token_ids
        self.temperature[slot] = p.temperature
        self.top_p[slot] = p.top_p
        self.top_k[slot] = max(p.top_k, 0)
        self.min_p[slot] = p.min_p
        self.presence[slot] = p.presence_penalty
        self.frequency[slot] = p.frequency_penalty
        self.repetition[slot] = p.repetition_penalty
        self.min_tokens[slot] = p.min_tokens
        self.num_logprobs[slot] = -1 if p.logprobs is None else p.logprobs
        penalized = p.has_penalties
        self.penalized[slot] = penalized
        self.seeded[slot] = p.seed is not None and p.temperature != 0
        self.structured[slot] = p.structured_outputs is not None
        self.output_tokens[slot] = list(nr.token_ids[nr.num_prompt_tokens :]) if penalized else None

    # -- one step's inputs ---------------------------------------------------------------------------
    def build(
        self, so: SchedulerOutput, b: StepBuffers, pad_to: int | None = None, pad_tokens_to: int | None = None
    ) -> StepRows:
        """Write the step's token ids, positions, slot mapping, sequence lengths and block tables into ``b``'s
        host side. With ``pad_to`` (a graph's batch size; every row then computes the same number of tokens q),
        rows ``B..pad_to`` are padding of q tokens each that write and read no KV. With ``pad_tokens_to`` too (a
        mixed-step graph, `MixedGraphs`), tokens ``T..pad_tokens_to`` are padding owned by no row, and rows
        ``B..pad_to`` own no tokens."""
        n = len(so.req_ids)
        slot_of = self.slot_of
        slots = np.fromiter(map(slot_of.__getitem__, so.req_ids), np.int64, n)
        q_lens = np.fromiter(so.num_scheduled_tokens, np.int64, n)
        starts = np.fromiter(so.num_computed_tokens, np.int64, n)
        qsl = b.query_start_loc_np[: n + 1]
        qsl[0] = 0
        np.cumsum(q_lens, out=qsl[1:])
        t = int(qsl[n])
        b.seq_lens_np[:n] = starts + q_lens
        positions = b.positions_np[:t]
        if t == n:
            positions[:] = starts
            req_idx = None
        else:
            req_idx = np.repeat(np.arange(n), q_lens)
            positions[:] = np.arange(t) - np.repeat(qsl[:n].astype(np.int64) - starts, q_lens)
        # block tables: each row up to the widest table of the step (a row is never read past its own table)
        width = min(int(self.num_blocks[slots].max()) if n else 0, b.max_blocks)
        tables = b.block_tables_np
        tables[:n, :width] = self.block_table[slots, :width]
        bs = self.block_size
        row_of_token = np.arange(n) if req_idx is None else req_idx
        b.slot_mapping_np[:t] = tables[row_of_token, positions // bs].astype(np.int64) * bs + positions % bs
        # token ids: decodes (and verifications) start at the last token; chunks come from the arrived tokens
        ids = b.input_ids_np
        first = qsl[:n]
        decoding = starts >= self.num_arrived[slots]
        if decoding.all():
            dec_rows = None
            ids[first] = self.last_token[slots]
            pend = self.pending[slots]
        else:
            dec_rows = np.flatnonzero(decoding)
            ids[first[dec_rows]] = self.last_token[slots[dec_rows]]
            pend = self.pending[slots[dec_rows]]
            for i in np.flatnonzero(~decoding).tolist():
                s, start, q = int(slots[i]), int(starts[i]), int(q_lens[i])
                ids[int(first[i]) : int(first[i]) + q] = self.tokens[s][start : start + q]
        waiting = pend >= 0
        if waiting.any():
            dst = first if dec_rows is None else first[dec_rows]
            gather_dst, gather_src = dst[waiting].astype(np.int64), pend[waiting]
        else:
            gather_dst = gather_src = _EMPTY
        if so.num_draft_tokens:  # only in steps that speculate, which have few rows
            row = {rid: i for i, rid in enumerate(so.req_ids)}
            for rid, d in so.num_draft_tokens.items():
                f = int(first[row[rid]])
                ids[f + 1 : f + 1 + d] = self.drafts[slot_of[rid], :d]
        if pad_tokens_to is not None:
            pad = slice(t, pad_tokens_to)
            ids[pad] = 0
            b.positions_np[pad] = 0
            b.slot_mapping_np[pad] = -1
            if pad_to is not None and pad_to > n:
                b.seq_lens_np[n:pad_to] = 0
                b.query_start_loc_np[n + 1 : pad_to + 1] = t
        elif pad_to is not None and pad_to > n:
            q = t // n
            pad = slice(t, pad_to * q)
            ids[pad] = 0
            b.positions_np[pad] = 0
            b.slot_mapping_np[pad] = -1
            b.seq_lens_np[n:pad_to] = 0
            b.query_start_loc_np[n + 1 : pad_to + 1] = np.arange(n + 1, pad_to + 1) * q
        return StepRows(slots, starts, q_lens, qsl, t, gather_dst, gather_src)

    def sampled(self, slots: np.ndarray, step_id: int, device_rows: np.ndarray) -> None:
        """Rows of a launched step sample: their next input token is row ``device_rows[i]`` of its samples,
        until `read_back` records its value."""
        self.pending[slots] = device_rows
        self.pending_step[slots] = step_id

    def read_back(self, slots: np.ndarray, step_id: int, tokens: np.ndarray) -> None:
        """The sampled tokens of step ``step_id`` are on the host now."""
        self.last_token[slots] = tokens
        done = slots[self.pending_step[slots] == step_id]  # a later step may have sampled the slot again
        self.pending[done] = -1
        self.pending_step[done] = -1

    def num_outputs(self, slots: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Output tokens a row has before the token sampled after ``positions`` (its last computed one)."""
        return positions + 1 - self.num_prompt[slots]


def sampling_rows(so: SchedulerOutput) -> tuple[np.ndarray, list[str]]:
    """The rows that sample (their indices in the step) and the request of each sampled token: a row's own,
    then with n > 1 its forks', which sample from the same row."""
    n = len(so.req_ids)
    if not so.forks:
        if all(so.samples):
            return np.arange(n), so.req_ids
        idx = [i for i, s in enumerate(so.samples) if s]
        return np.asarray(idx, np.int64), [so.req_ids[i] for i in idx]
    idx, req_ids = [], []
    for i, (rid, s) in enumerate(zip(so.req_ids, so.samples)):
        if s:
            for r in (rid, *so.forks.get(rid, ())):
                idx.append(i)
                req_ids.append(r)
    return np.asarray(idx, np.int64), req_ids


def attention_metadata(rows: StepRows, b: StepBuffers) -> AttentionMetadata:
    """The attention metadata of an eager forward over the rows `InputBatch.build` wrote into ``b``."""
    n = len(rows.slots)
    qsl = rows.query_start_loc
    seq_lens = b.seq_lens_np[:n]
    return AttentionMetadata(
        slot_mapping=b.slot_mapping[: rows.num_tokens],
        query_start_loc=b.query_start_loc[: n + 1],
        seq_lens=b.seq_lens[:n],
        block_tables=b.block_tables[:n],
        max_query_len=int(rows.q_lens.max()),
        max_seq_len=int(seq_lens.max()),
        query_start_loc_host=qsl.tolist(),
        seq_lens_host=seq_lens.tolist(),
    )


_EMPTY = np.zeros(0, np.int64)
