"""CUDA graphs for uniform steps (pure decode, or speculative verification of k drafts per request), one per
batch size of a ladder, and for steps with prefill rows (`MixedGraphs`), one per token count of a ladder,
all over the same static input buffers.

A decode step of an 8B model launches ~350 kernels (fused) to ~1300 (unfused); launched one by one from
Python that is several milliseconds of host time, more than the GPU needs. A captured graph replays them
with one call. What makes a step replayable:

* every input lives at a fixed address: the runner writes each step's ids, positions, slot mapping,
  sequence lengths and block tables into the first rows of the `StepBuffers` the graph was captured
  over, padded to the graph's batch size (padding rows write no KV: slot -1; read no KV: length 0);
* the attention backend plans its grid from host values fixed at capture (the batch size, the token count
  and the longest context, ``max_model_len``): see `kv/attention/triton_backend.py`; so only the Triton
  backend is graph-safe (the torch reference loops over host lists);
* the plain decode graph ends with the LM head, so its output is the logits of every row; sampling runs
  eagerly after it (per-request generators and penalties do not fit a fixed graph). The speculative graph
  (`core/worker/drafter.py`) goes on through greedy verification and the draft chain.

Graphs share one memory pool, captured largest first so the smaller ones reuse its blocks.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import torch
from sluice.core.worker.step_buffers import StepBuffers
from sluice.kv.attention.base import AttentionMetadata

logger = logging.getLogger("sluice")


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to 64, every 16 up to 256, every 32 beyond: padding a batch to the next
    size wastes at most ~12% of a step, and capture stays a few seconds."""
    sizes = [1, 2, 4] + list(range(8, 65, 8)) + list(range(80, 257, 16)) + list(range(288, 1025, 32))
    out = [s for s in sizes if s < max_num_seqs]
    return out + [max_num_seqs]


class DecodeGraphs:
    """Captured steps for a ladder of batch sizes; `replay(bs)` runs the one of batch size ``bs``.

    Every sequence of a step computes ``query_len`` tokens (1: decode; 1 + k: verification of k drafts).
    ``forward(input_ids, positions, meta)`` is the step to capture (embed ... LM head, or more); its
    output (a tensor) is what `replay` returns.
    """

    def __init__(
        self,
        forward: Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor],
        buffers: StepBuffers,
        batch_sizes: Sequence[int],
        max_seq_len: int,
        query_len: int = 1,
        name: str = "decode",
    ) -> None:
        self.forward = forward
        self.buffers = buffers
        self.batch_sizes = sorted(batch_sizes)
        self.max_seq_len = max_seq_len
        self.query_len = query_len
        self.name = name
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.num_replays = 0
        self.routes: dict[int, int] = {}  # a size to the larger one that runs it faster (`route_to_fastest`)

    def metadata(self, bs: int) -> AttentionMetadata:
        """The captured step's metadata: views of the buffers for ``bs`` sequences of ``query_len`` tokens."""
        b, q = self.buffers, self.query_len
        return AttentionMetadata(
            slot_mapping=b.slot_mapping[: bs * q],
            query_start_loc=b.query_start_loc[: bs + 1],
            seq_lens=b.seq_lens[:bs],
            block_tables=b.block_tables[:bs],
            max_query_len=q,
            max_seq_len=self.max_seq_len,  # plans the split count for the longest context served
            query_start_loc_host=list(range(0, (bs + 1) * q, q)),
            seq_lens_host=[q] * bs,  # not read by graph-safe backends
        )

    def step_inputs(self, bs: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """What `forward` is called with for batch size ``bs``: views of the buffers."""
        b, t = self.buffers, bs * self.query_len
        return b.input_ids[:t], b.positions[:t], self.metadata(bs)

    def _idle_inputs(self) -> None:
        """Inputs for warm-up and capture: no KV writes, empty contexts."""
        b = self.buffers
        largest = self.batch_sizes[-1]
        t, s = self.num_tokens(largest), self.num_seqs(largest)
        b.input_ids[:t].zero_()
        b.positions[:t].zero_()
        b.slot_mapping[:t].fill_(-1)
        b.seq_lens[:s].zero_()
        b.query_start_loc[: s + 1].copy_(torch.arange(s + 1, dtype=torch.int32) * self.query_len)
        b.block_tables[:s].zero_()

    def num_tokens(self, size: int) -> int:
        return size * self.query_len

    def num_seqs(self, size: int) -> int:
        return size

    def capture(self, pool=None):
        """Capture every size, largest first, into ``pool`` (a graph memory pool; a new one if None);
        returns the pool, for graphs to be captured after these into the same memory."""
        self._idle_inputs()
        b = self.buffers
        largest = self.batch_sizes[-1]
        t0 = time.perf_counter()
        stream = torch.cuda.Stream(device=b.device)
        stream.wait_stream(torch.cuda.current_stream(b.device))
        with torch.cuda.stream(stream):
            for bs in reversed(self.batch_sizes):
                inputs = self.step_inputs(bs)
                for _ in range(2):  # compile Triton variants and let cuBLAS pick its kernels first
                    self.forward(*inputs)
                stream.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    out = self.forward(*inputs)
                if pool is None:
                    pool = graph.pool()
                self.graphs[bs] = (graph, out)
        torch.cuda.current_stream(b.device).wait_stream(stream)
        torch.cuda.synchronize(b.device)
        logger.info(
            "captured %d %s CUDA graphs (sizes %s..%s) in %.1fs",
            len(self.graphs),
            self.name,
            self.batch_sizes[0],
            largest,
            time.perf_counter() - t0,
        )
        return pool

    def padded_size(self, n: int) -> int | None:
        """The graph a step of ``n`` (sequences; tokens for mixed steps) replays: the smallest size that holds it,
        or the larger one it is routed to; None if none holds it."""
        for bs in self.batch_sizes:
            if bs >= n:
                return self.routes.get(bs, bs)
        return None

    def route_to_fastest(self, repeats: int = 3) -> dict[int, float]:
        """Time each captured graph on idle inputs and route each size to the fastest graph at least as large
        (`fastest_routes`); returns the times (seconds per replay).

        A size is not always faster than the next one up: cuBLAS picks its kernel by the matrix shape, and at
        some row counts its pick is slower than at a larger one (on the H200 the 448-row decode step took
        longer than the 480-row one). Padding a step to the larger size then costs nothing and saves that. Idle
        inputs (no KV writes, empty contexts) leave out attention, which grows with the real rows only."""
        self._idle_inputs()
        t0 = time.perf_counter()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = {}
        for bs in self.batch_sizes:
            graph, _ = self.graphs[bs]
            graph.replay()  # the first replay after capture uploads the graph
            start.record()
            for _ in range(repeats):
                graph.replay()
            end.record()
            end.synchronize()
            times[bs] = start.elapsed_time(end) / 1e3 / repeats
        self.routes = fastest_routes(times)
        logger.info("timed %d %s graphs in %.1fs", len(times), self.name, time.perf_counter() - t0)
        for bs, to in self.routes.items():
            logger.info(
                "%s graph of size %d routed to size %d (%.2f vs %.2f ms)",
                self.name,
                bs,
                to,
                1e3 * times[bs],
                1e3 * times[to],
            )
        return times

    def replay(self, bs: int) -> torch.Tensor:
        """Replay the graph of batch size ``bs`` (inputs already in the buffers); its output (decode: the
        logits ``[bs, V]``)."""
        graph, out = self.graphs[bs]
        graph.replay()
        self.num_replays += 1
        return out


def fastest_routes(times: dict[int, float], margin: float = 0.03) -> dict[int, int]:
    """For each size, the larger size whose time is the least of all sizes at least as large, where it is faster
    than the size's own by more than ``margin`` (timing noise must not move a step to a larger graph)."""
    sizes = sorted(times)
    routes = {}
    for i, bs in enumerate(sizes):
        best = min(sizes[i:], key=lambda s: (times[s], s))
        if best != bs and times[best] < times[bs] * (1 - margin):
            routes[bs] = best
    return routes


def mixed_graph_sizes(max_tokens: int) -> list[int]:
    """Token counts of the mixed-step graphs, up to ``max_tokens``: every 16 up to 256, then sizes 1/8 apart
    (32 up to 512, 64 up to 1024, ...). Large steps are compute-bound, so padding costs device time in
    proportion there: at most 1/8 of a step from 128 tokens up."""
    sizes = list(range(16, 257, 16)) + list(range(288, 513, 32)) + list(range(576, 1025, 64))
    sizes += list(range(1152, 2049, 128)) + list(range(2304, 4097, 256)) + list(range(4608, 16385, 512))
    return [s for s in sizes if s < max_tokens] + [max_tokens]


class MixedGraphs(DecodeGraphs):
    """Captured steps with prefill rows (prefill chunks, mixed with decodes), one per token count of a ladder.

    Launched eagerly, such a step is a few hundred kernel launches from Python, tens of milliseconds of host
    time for a step the device may finish in a few; a prompt's first token waits for it, and so does every
    running request's next one. Replayed, it is one call. A step of ``t`` tokens and ``n`` sequences runs in
    the graph of the smallest size ``T >= t``, over ``min(T, max_seqs)`` sequences: the real ones, then
    padding sequences that own no tokens (their query range is empty) and no context; tokens ``t..T`` belong
    to no sequence (no KV write, no attention row; their rows are computed and ignored). The prefill kernel's
    grid depends only on those two sizes (`kv/attention/triton_kernels.py`), so one graph serves any mix.
    The graph ends at the final hidden states: the rows that sample are picked and projected eagerly.
    """

    def __init__(
        self,
        forward: Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor],
        buffers: StepBuffers,
        token_counts: Sequence[int],
        max_seq_len: int,
    ) -> None:
        super().__init__(forward, buffers, token_counts, max_seq_len, 0, "mixed-step")

    def num_tokens(self, size: int) -> int:
        return size

    def num_seqs(self, size: int) -> int:
        return min(size, self.buffers.max_seqs)

    def metadata(self, size: int) -> AttentionMetadata:
        b, s = self.buffers, self.num_seqs(size)
        return AttentionMetadata(
            slot_mapping=b.slot_mapping[:size],
            query_start_loc=b.query_start_loc[: s + 1],
            seq_lens=b.seq_lens[:s],
            block_tables=b.block_tables[:s],
            max_query_len=size,  # > 1: the prefill kernel, whatever the step's longest query
            max_seq_len=self.max_seq_len,
            query_start_loc_host=[0] * (s + 1),  # not read by graph-safe backends
            seq_lens_host=[0] * s,
        )

    def step_inputs(self, size: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        b = self.buffers
        return b.input_ids[:size], b.positions[:size], self.metadata(size)
