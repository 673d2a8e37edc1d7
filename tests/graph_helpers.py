"""CUDA-graph paths on the CPU: the function a graph would capture, run eagerly over the same buffers."""

from __future__ import annotations

import torch
from sluice.core.cuda_graphs import DecodeGraphs


class EagerReplay(DecodeGraphs):
    """Runs the function a graph would capture, eagerly, over the same buffers and padded sizes."""

    def capture(self) -> None:
        self.graphs = dict.fromkeys(self.batch_sizes)
        self.replayed: list[int] = []

    def replay(self, bs: int) -> torch.Tensor:
        self.replayed.append(bs)
        self.num_replays += 1
        return self.forward(*self.step_inputs(bs))

    @classmethod
    def like(cls, graphs: DecodeGraphs) -> EagerReplay:
        """An eager stand-in for ``graphs`` (same step function, buffers, batch sizes and query length)."""
        return cls(
            graphs.forward, graphs.buffers, graphs.batch_sizes, graphs.max_seq_len, graphs.query_len, graphs.name
        )
