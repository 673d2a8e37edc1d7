"""CUDA-graph paths on the CPU: the function a graph would capture, run eagerly over the same buffers."""

from __future__ import annotations

import torch
from sluice.core.worker.cuda_graphs import DecodeGraphs, MixedGraphs


class _Eager:
    """Replays run the captured function eagerly, over the same buffers and padded sizes."""

    def capture(self, pool=None):
        self.graphs = dict.fromkeys(self.batch_sizes)
        self.replayed: list[int] = []
        return pool

    def replay(self, size: int) -> torch.Tensor:
        self.replayed.append(size)
        self.num_replays += 1
        return self.forward(*self.step_inputs(size))


class EagerReplay(_Eager, DecodeGraphs):
    @classmethod
    def like(cls, graphs: DecodeGraphs) -> EagerReplay:
        """An eager stand-in for ``graphs`` (same step function, buffers, batch sizes and query length)."""
        return cls(
            graphs.forward, graphs.buffers, graphs.batch_sizes, graphs.max_seq_len, graphs.query_len, graphs.name
        )


class EagerMixedReplay(_Eager, MixedGraphs):
    pass
