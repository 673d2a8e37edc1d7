"""A compiled decode step for the CPU: what CUDA graphs are to the GPU (`core/worker/cuda_graphs.py`).

On the CPU a small model's decode step is mostly per-op overhead: 30 layers of a dozen torch calls each, every one
a Python call, a dispatch and an allocation, around a few weight-bound matmuls. `torch.compile` (inductor's C++
backend) turns the step from the embedding to the logits into one call of generated code: the elementwise work
of each layer fused into a few loops, the packed matmuls (`core/models/cpu_linear.py`) called as they are.

The step reads the runner's `StepBuffers` for its batch, as a decode graph does, with the attention of
`kv/attention/cpu_decode.py` (one kernel call a layer, on AVX-512 machines: `decode_attention_backend`) or of
`kv/attention/torch_decode.py` (tensors only, fused by the compiler). The batch size and the block-table width (the
step's longest context, in blocks) are unbacked dynamic dimensions: the compiler neither specializes sizes 0 and 1
nor guards on a range, so one graph serves every batch of 1 to ``max_batch`` sequences and every context length,
compiled at start-up (`capture`, at both ends of both ranges), never in the middle of serving. That one graph is all
there is, so it keeps no guards (``skip_all_guards_unsafe``, as vLLM compiles): checking them would walk every
weight of the model at each call (about a millisecond for the default model), and `padded_size` already keeps each
call within the ranges the graph was compiled for.
Steps with more rows run eagerly: their matmuls outweigh the overhead, and the packed int4 layer switches to a
dense GEMM from `Int4PackedLinear.DENSE_MIN_ROWS` rows, a branch a graph would have to take both ways.
"""

from __future__ import annotations

import logging
import time
import types

import torch
from sluice.core.models import cpu_vnni
from sluice.core.models.cpu_linear import Int4PackedLinear, Int8PackedLinear, cpu_isa
from sluice.core.models.layers import ForwardContext
from sluice.core.worker.step_buffers import StepBuffers
from sluice.kv.attention.base import AttentionBackend, AttentionMetadata
from sluice.kv.attention.cpu_decode import CpuKernelDecodeAttentionBackend
from sluice.kv.attention.torch_decode import TorchDecodeAttentionBackend
from torch import nn

logger = logging.getLogger("sluice")

_MIN_BLOCKS = 2  # a width of 1 would be specialized by the compiler (a recompile in the middle of serving)


class CompiledDecode:
    """Compiled decode steps of up to ``max_batch`` sequences; the interface of `DecodeGraphs` the runner uses
    (`padded_size`, `replay`, `num_replays`)."""

    # below `Int4PackedLinear.DENSE_MIN_ROWS`: the packed layers take one branch for every batch compiled
    MAX_BATCH = min(16, Int4PackedLinear.DENSE_MIN_ROWS - 1)

    def __init__(
        self, model: nn.Module, kv_caches: list[torch.Tensor], buffers: StepBuffers, block_size: int, max_batch: int
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.buffers = buffers
        self.block_size = block_size
        self.max_batch = max_batch
        self.backend = decode_attention_backend(kv_caches[0])
        self.batch_sizes = list(range(1, max_batch + 1))
        self.num_replays = 0
        # No guards: `capture` compiles the one graph there is, and `padded_size` keeps every call within its ranges.
        # Dynamo keeps compiled graphs on the function's code object, shared by every instance: without guards an
        # engine would run the graph another engine of this process compiled for its own model. Each instance
        # compiles a code object of its own.
        forward = CompiledDecode._forward
        own = types.FunctionType(forward.__code__.replace(), forward.__globals__, forward.__name__)
        self._step = torch.compile(
            types.MethodType(own, self),
            fullgraph=True,
            # the graph's own calls from C++ (its Python wrapper costs a few microseconds a call, ~300 calls a step);
            # no size or alignment asserts on its inputs: every call passes the same tensors (the model's weights,
            # hundreds of them, and the buffers' rows), which `capture` compiled for; checking each is host time
            # in every step
            options={
                "guard_filter_fn": torch.compiler.skip_all_guards_unsafe,
                "cpp_wrapper": True,
                "size_asserts": False,
                "alignment_asserts": False,
            },
        )
        self._head_one_row = None  # the LM head of batches of one, when `_choose_head` finds a faster one

    def _forward(self, input_ids, positions, slot_mapping, seq_lens, block_tables) -> torch.Tensor:
        # the unbacked sizes' ranges, for the compiler's branches (below the packed layers' dense switch: one way)
        torch._check(input_ids.shape[0] >= 1)  # noqa: SLF001 (torch's public shape hints have no other name)
        torch._check(input_ids.shape[0] <= self.max_batch)  # noqa: SLF001
        torch._check(block_tables.shape[1] >= _MIN_BLOCKS)  # noqa: SLF001
        # (decode rows: no query starts to read; the host lists are for backends that loop, not this one)
        meta = AttentionMetadata(slot_mapping, seq_lens, seq_lens, block_tables, 1, 0, [], [])
        return self.model(input_ids, positions, ForwardContext(meta, self.kv_caches, self.backend))

    def padded_size(self, n: int) -> int | None:
        return n if n <= self.max_batch else None

    def replay(self, bs: int) -> torch.Tensor:
        """The logits ``[bs, V]`` of the decode step whose inputs are in the buffers' first ``bs`` rows."""
        b = self.buffers
        longest = int(b.seq_lens_np[:bs].max())
        width = max(_MIN_BLOCKS, -(-longest // self.block_size))
        self.num_replays += 1
        hidden = self._run(bs, width)
        if bs == 1 and self._head_one_row is not None:
            return self._head_one_row(hidden)
        return self.model.compute_logits(hidden)

    def _run(self, bs: int, width: int) -> torch.Tensor:
        b = self.buffers
        # the table's first ``width`` columns in a tensor of their own: one layout (row stride = width) at every step
        tables = b.block_tables[:bs, :width].clone(memory_format=torch.contiguous_format)
        inputs = (b.input_ids[:bs], b.positions[:bs], b.slot_mapping[:bs], b.seq_lens[:bs], tables)
        # The batch's hint for the compiler's heuristics: one row, the latency case. Without it an unbacked size
        # counts as 8192, and inductor split each row-wise loop (a norm, RoPE, SiLU over a few hundred elements a
        # row) over the threads: an OpenMP fork and barriers, several per layer, for microseconds of work.
        for t in inputs:
            torch._dynamo.decorators.mark_unbacked(t, 0, hint_override=1)  # noqa: SLF001
        torch._dynamo.decorators.mark_unbacked(inputs[-1], 1)  # noqa: SLF001
        return self._step(*inputs)

    def capture(self) -> None:
        """Compile the graph over idle inputs (each row writes its K/V into block 0's first slot, which no request
        holds yet, and sees that one key), at both ends of its batch and width ranges; then choose the head."""
        b = self.buffers
        b.input_ids[: self.max_batch].zero_()
        b.positions[: self.max_batch].zero_()
        b.slot_mapping[: self.max_batch].zero_()
        b.seq_lens[: self.max_batch].fill_(1)
        b.block_tables[: self.max_batch].zero_()
        t0 = time.perf_counter()
        with torch.inference_mode():
            self._run(self.max_batch, b.max_blocks)
            self._choose_head(self._run(1, _MIN_BLOCKS))
        logger.info(
            "compiled the CPU decode step (batches of 1..%d) in %.1fs", self.max_batch, time.perf_counter() - t0
        )

    def _choose_head(self, hidden: torch.Tensor) -> None:
        """The LM head of a batch of one: an int8 head's packed kernel (the model's own `compute_logits`) or its
        row as a compiled reduction (`Int8PackedLinear.forward_one_row`), whichever is faster on this machine at
        these threads (the packed kernel's time at one row varies several-fold with the thread count)."""
        head = getattr(self.model, "lm_head", None)
        if not isinstance(head, Int8PackedLinear) or getattr(self.model, "tp", None) is not None:
            return
        if head.kernel != "int8pack":  # only torch's int8 kernel has the reduction beside it
            return
        one_row = torch.compile(head.forward_one_row, fullgraph=True, dynamic=False)
        packed_s, one_row_s = (_seconds(f, hidden) for f in (self.model.compute_logits, one_row))
        faster = one_row_s < 0.95 * packed_s
        self._head_one_row = one_row if faster else None
        logger.info(
            "CPU LM head of one row: %s (packed kernel %.2f ms, compiled reduction %.2f ms)",
            "compiled reduction" if faster else "packed kernel",
            1e3 * packed_s,
            1e3 * one_row_s,
        )


def decode_attention_backend(kv_cache: torch.Tensor) -> AttentionBackend:
    """The attention kernel's backend where this CPU runs the AVX-512 library (`cpu_linear.cpu_isa`) and the kernel
    fits the cache (`cpu_vnni.attention_fits`); else the attention in torch ops, which the compiler fuses."""
    if cpu_isa() == "AVX512_VNNI" and cpu_vnni.attention_fits(kv_cache.shape[-1], kv_cache.dtype):
        return CpuKernelDecodeAttentionBackend()
    return TorchDecodeAttentionBackend()


def _seconds(fn, x: torch.Tensor, repeats: int = 5) -> float:
    """The least time of ``repeats`` calls of ``fn(x)`` after a first (the least: the call noise touched least)."""
    fn(x)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(x)
        times.append(time.perf_counter() - t0)
    return min(times)
