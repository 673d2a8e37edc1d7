"""Tensor parallelism inside the model: how heads, columns and the vocabulary are cut over ranks, and the
collectives that join the pieces again.

Every cut is a contiguous range, as even as the size allows (`shard_range`), so nothing has to divide by
the number of ranks:

* attention: rank ``r`` owns a contiguous range of query heads and holds the KV heads those heads read.
  When query heads of one KV group land on two ranks, both hold that KV head (it is replicated); the
  same happens whenever there are fewer KV heads than ranks. See `plan_heads` for how the grouped-query
  layout stays uniform on every rank (padding query slots);
* MLP: gate/up split by output columns, down by input rows;
* o_proj and down_proj produce partial sums that an all-reduce adds up;
* the embedding holds a range of vocabulary rows (tokens outside it look up zeros; an all-reduce
  fills them in) and the LM head (tied or not) the same rows, its logits all-gathered.

Norms and the rotary table are replicated.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from sluice.core.models.errors import ModelLoadError
from torch import nn


def shard_range(n: int, rank: int, world_size: int) -> tuple[int, int]:
    """``[start, end)`` of rank ``rank``'s share of ``n`` items: contiguous, sizes differ by at most one."""
    return n * rank // world_size, n * (rank + 1) // world_size


class TensorParallel:
    """One rank's view of its tensor-parallel group.

    ``group`` carries the activations (NCCL on GPUs, gloo on the CPU); ``cpu_group`` (gloo) carries small
    host values such as the agreed size of the KV pool."""

    def __init__(self, rank: int, world_size: int, group=None, cpu_group=None) -> None:
        self.rank = rank
        self.world_size = world_size
        self.group = group
        self.cpu_group = cpu_group

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        dist.all_reduce(x, group=self.group)
        return x

    def gather_last_dim(self, x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """Concatenate every rank's ``x`` along the last dim; rank ``i`` contributes ``sizes[i]`` columns."""
        import torch.distributed as dist

        width = max(sizes)
        if x.shape[-1] < width:  # all_gather wants equal shapes: pad, then cut the padding off again
            x = F.pad(x, (0, width - x.shape[-1]))
        parts = [torch.empty_like(x) for _ in sizes]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat([p[..., :n] for p, n in zip(parts, sizes)], dim=-1)

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``x`` into every rank's ``x`` (same shape and dtype everywhere)."""
        import torch.distributed as dist

        dist.broadcast(x, src=0, group=self.group)
        return x

    def min_int(self, value: int) -> int:
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t.item())


@dataclass(frozen=True, slots=True)
class HeadShard:
    """One rank's attention heads. ``q_heads[j]`` is the global query head in local slot ``j`` (``-1``: a
    padding slot whose weights are zero); ``kv_heads`` are the global KV heads held, in order. Local slot
    ``j`` reads local KV head ``j // (len(q_heads) // len(kv_heads))``, the uniform grouped-query layout
    the attention backends expect."""

    q_heads: tuple[int, ...]
    kv_heads: tuple[int, ...]

    @property
    def num_padding(self) -> int:
        return sum(h < 0 for h in self.q_heads)


def plan_heads(num_heads: int, num_kv_heads: int, rank: int, world_size: int) -> HeadShard:
    """Rank ``rank``'s query heads (a contiguous range, `shard_range`) and the KV heads they read.

    A range can start or end inside a KV group (9 query heads in 3 groups over 2 ranks: heads 0-3 and
    4-8, so KV head 1 is on both ranks). The backends need every local KV head to serve the same number
    of query slots, so each local group gets as many slots as its fullest one, and slots without a head
    of this rank are padding: zero query weights and zero o_proj columns, so they add nothing. Even
    splits (heads and KV heads divisible by the ranks, or KV heads fewer than ranks with whole groups
    per rank) have no padding."""
    if world_size > num_heads:
        raise ModelLoadError(f"tensor_parallel_size {world_size} exceeds the model's {num_heads} attention heads")
    if num_heads % num_kv_heads:
        raise ModelLoadError(f"{num_heads} attention heads do not form groups over {num_kv_heads} KV heads")
    group = num_heads // num_kv_heads
    q0, q1 = shard_range(num_heads, rank, world_size)
    kv = range(q0 // group, (q1 - 1) // group + 1)
    owned = [[q for q in range(k * group, (k + 1) * group) if q0 <= q < q1] for k in kv]
    per_group = max(len(o) for o in owned)
    slots = [h for o in owned for h in o + [-1] * (per_group - len(o))]
    return HeadShard(tuple(slots), tuple(kv))


def take_heads(t: torch.Tensor, heads: tuple[int, ...], head_dim: int, dim: int) -> torch.Tensor:
    """Heads ``heads`` of ``t`` along ``dim`` (``head_dim`` entries each), in order; ``-1`` gives zeros."""
    shape = list(t.shape)
    grouped = t.unflatten(dim, (shape[dim] // head_dim, head_dim))
    idx = torch.tensor([max(h, 0) for h in heads], device=t.device)
    out = grouped.index_select(dim, idx)
    if any(h < 0 for h in heads):
        keep = torch.tensor([h >= 0 for h in heads], device=t.device, dtype=t.dtype)
        out = out * keep.view([-1 if i == dim else 1 for i in range(out.dim() - 1)] + [1])
    return out.flatten(dim, dim + 1)


class VocabParallelEmbedding(nn.Module):
    """Rows ``[start, end)`` of the embedding table; the full lookup is the all-reduced sum over ranks."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.start, self.end = shard_range(vocab_size, tp.rank, tp.world_size)
        self.weight = nn.Parameter(torch.empty(self.end - self.start, hidden_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        mine = (input_ids >= self.start) & (input_ids < self.end)
        x = F.embedding(torch.where(mine, input_ids - self.start, 0), self.weight)
        return self.tp.all_reduce(x * mine.unsqueeze(-1).to(x.dtype))
