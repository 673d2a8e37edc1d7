"""`StepBuffers`: the preallocated inputs of a step, host staging and device tensors at fixed addresses. The
input builder (`core/worker/input_batch.py`) writes them, the sampling-batch builder fills their sampling rows,
and CUDA graphs (`core/worker/cuda_graphs.py`) are captured over them."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


class StepBuffers:
    """Preallocated step inputs: pinned host staging (filled with numpy through views) and device tensors.

    Every field is a view into one host arena and one device arena of the same layout, small fields first, so
    that a step's inputs usually go to the device in one copy (each copy is a CUDA call from the step's host
    thread, and a GIL round trip under load). Host -> device copies are asynchronous from pinned memory: the
    next step refills the pinned side only once they have left (`wait_uploaded`; with a step in flight they
    may not have, while the device still works through the step before). On the CPU the "device" tensors are
    the host tensors themselves."""

    # Above this many bytes a step's inputs go field by field (only what the step uses of each).
    MAX_SPAN_BYTES = 256 * 1024

    def __init__(self, max_tokens: int, max_seqs: int, max_blocks: int, device: torch.device) -> None:
        self.on_host = device.type == "cpu"
        self.device = device
        self.max_tokens, self.max_seqs, self.max_blocks = max_tokens, max_seqs, max_blocks
        layout = [  # upload() sends a prefix of this order: the per-step fields, block tables last
            ("query_start_loc", (max_seqs + 1,), torch.int32),
            ("seq_lens", (max_seqs,), torch.int32),
            ("logit_rows", (max_seqs,), torch.int64),
            # decodes whose input token the step in flight sampled: input_ids[gather_dst] = its samples[gather_src]
            ("gather_src", (max_seqs,), torch.int64),
            ("gather_dst", (max_seqs,), torch.int64),
            ("input_ids", (max_tokens,), torch.int64),
            ("positions", (max_tokens,), torch.int64),
            ("slot_mapping", (max_tokens,), torch.int64),
            ("block_tables", (max_seqs, max_blocks), torch.int32),
            # sampling parameters, one row each: temperature, top_p, min_p, presence, frequency, repetition
            ("sampling_f", (6, max_seqs), torch.float32),
            ("top_k", (max_seqs,), torch.int64),
        ]
        self._offset: dict[str, int] = {}
        size = 0
        for name, shape, dtype in layout:
            self._offset[name] = size
            size += -(-math.prod(shape) * dtype.itemsize // 64) * 64
        self._host_arena = torch.zeros(size, dtype=torch.uint8, pin_memory=not self.on_host)
        self._dev_arena = self._host_arena if self.on_host else torch.zeros(size, dtype=torch.uint8, device=device)
        for name, shape, dtype in layout:
            off, n = self._offset[name], math.prod(shape) * dtype.itemsize
            host = self._host_arena[off : off + n].view(dtype).view(shape)
            setattr(self, "h_" + name, host)
            setattr(self, name + "_np", host.numpy())
            setattr(self, name, self._dev_arena[off : off + n].view(dtype).view(shape))
        self._uploaded = None if self.on_host else torch.cuda.Event()
        self._pending = False

    def wait_uploaded(self) -> None:
        """Block until the last `upload` (and `upload_sampling` before it) has been copied to the device."""
        if self._pending:
            self._uploaded.synchronize()
            self._pending = False

    def upload(
        self, num_tokens: int, num_seqs: int, table_width: int, num_logit_rows: int, num_gather: int = 0
    ) -> None:
        """Copy the filled prefixes to the device (asynchronously). Block tables go as whole rows when
        ``table_width`` is ``max_blocks`` (graphs read them with the full row stride)."""
        if self.on_host:
            return
        end = self._offset["block_tables"] + num_seqs * self.max_blocks * 4
        if table_width == self.max_blocks and end <= self.MAX_SPAN_BYTES:
            # one copy: every field up to the step's block-table rows (the unused tails of the token fields too)
            self._dev_arena[:end].copy_(self._host_arena[:end], non_blocking=True)
        else:
            nb = True
            self.input_ids[:num_tokens].copy_(self.h_input_ids[:num_tokens], non_blocking=nb)
            self.positions[:num_tokens].copy_(self.h_positions[:num_tokens], non_blocking=nb)
            self.slot_mapping[:num_tokens].copy_(self.h_slot_mapping[:num_tokens], non_blocking=nb)
            self.query_start_loc[: num_seqs + 1].copy_(self.h_query_start_loc[: num_seqs + 1], non_blocking=nb)
            self.seq_lens[:num_seqs].copy_(self.h_seq_lens[:num_seqs], non_blocking=nb)
            self.block_tables[:num_seqs].copy_(self.h_block_tables[:num_seqs], non_blocking=nb)
            if num_logit_rows:
                self.logit_rows[:num_logit_rows].copy_(self.h_logit_rows[:num_logit_rows], non_blocking=nb)
            if num_gather:
                self.gather_src[:num_gather].copy_(self.h_gather_src[:num_gather], non_blocking=nb)
                self.gather_dst[:num_gather].copy_(self.h_gather_dst[:num_gather], non_blocking=nb)
        self._uploaded.record()
        self._pending = True

    def upload_sampling(self, num_rows: int, with_penalties: bool) -> None:
        if self.on_host:
            return
        nf = 6 if with_penalties else 3
        # whole rows: a column slice is not contiguous, and such a copy goes through pageable memory, which makes
        # the host wait for the stream
        self.sampling_f[:nf].copy_(self.h_sampling_f[:nf], non_blocking=True)
        self.top_k[:num_rows].copy_(self.h_top_k[:num_rows], non_blocking=True)


@dataclass(slots=True)
class StepLimits:
    """The most a step holds (its buffers' sizes) and the persistent batch's slot count."""

    max_tokens: int
    max_seqs: int
    max_blocks_per_seq: int
    max_slots: int
