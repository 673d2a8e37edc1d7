"""`Runner`: what the executor actor and the engine core ask of a model runner, in this process (`ModelRunner`) or
across tensor-parallel worker processes (`TPRunner`); and `LaunchedStep`, a step between its launch and its
collection.

A runner that overlaps steps (``overlaps_steps``) returns from `Runner.launch` once the step's device work is
enqueued, so the executor can launch the next step before collecting this one (asynchronous scheduling). One
that does not computes each step whole: its `launch` returns the step complete, and the executor calls
`Runner.execute` for it off the event loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch
from sluice.core.step import ModelOutput, SchedulerOutput
from sluice.core.worker.sampler import SamplerOutput


@dataclass(slots=True)
class LaunchedStep:
    """A step whose device work is enqueued; `Runner.collect` turns it into a `ModelOutput`."""

    so: SchedulerOutput
    output: ModelOutput | None = None  # already complete (no sampling rows, speculative steps)
    req_ids: list[str] = field(default_factory=list)  # sampling rows, forks included
    slots: np.ndarray | None = None
    tokens: torch.Tensor | None = None  # [R] on the device
    host_tokens: torch.Tensor | None = None  # pinned, filled asynchronously
    ready: torch.cuda.Event | None = None
    sampler_out: SamplerOutput | None = None  # logprobs
    read: bool = False  # the host has the tokens (`ModelRunner._read_back`)
    uniform: bool = False  # a uniform speculative step: ``tokens`` is its output vector (`Drafter.uniform_step`)
    token_list: list[int] = field(default_factory=list)
    grammar_rows: np.ndarray | None = None  # its sampling rows under a grammar (their matchers read its tokens)
    # for the host profile: when the inputs were ready, how long the host waited for the tokens, and events
    # around the step's device work
    prepared_at: float = 0.0
    waited_s: float = 0.0
    started: torch.cuda.Event | None = None
    eager: bool = False  # its forward ran op by op (no graph replayed): the host's launches may idle the device
    after: torch.cuda.Event | None = None  # the end event of the step launched before it (set by the executor)
    launched_at: float = 0.0  # host clock when its launch began, and how long the launch took (the executor's)
    launch_s: float = 0.0
    enqueued_at: float = 0.0  # host clock when its forward, logits and sampling were enqueued (the trace's)

    def gpu_seconds(self) -> float | None:
        """The device's time on this step (once collected)."""
        if self.started is None or self.ready is None:
            return None
        return self.started.elapsed_time(self.ready) / 1e3


class Runner(Protocol):
    """The model behind the executor: the KV pool it sized, what the scheduler may plan for it, and its steps."""

    num_kv_blocks: int  # the KV pool's size in blocks, the scheduler's KV manager's too
    overlaps_steps: bool  # a launched step may stay in flight while the next one is launched
    out_of_process: bool  # its steps run in worker processes: one may be abandoned at shutdown, `close` stops them

    @property
    def num_speculative_tokens(self) -> int:
        """Drafts a request may verify per step (0: no draft head)."""
        ...

    @property
    def max_uniform_batch(self) -> int:
        """The most rows a uniform speculative step may have (0: none, `SchedulerOutput.uniform`)."""
        ...

    @property
    def failure(self) -> Exception | None:
        """Set once the runner can serve no more steps, even between steps (its worker processes died)."""
        ...

    def launch(self, so: SchedulerOutput) -> LaunchedStep: ...

    def collect(self, step: LaunchedStep) -> ModelOutput: ...

    def execute(self, so: SchedulerOutput) -> ModelOutput:
        """Launch and collect one step."""
        ...

    def close(self) -> None:
        """Release what the runner holds outside this process (nothing for an in-process runner)."""
        ...
