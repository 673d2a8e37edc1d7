"""A failed step fails its culprits, not everyone batched with them.

A step error that leaves the model usable (not `is_fatal`) is most often caused by one request's own input:
a value that passed validation and still breaks the sampler or the forward. Failing the whole step would
fail every innocent request that happened to share it. Instead the model runner re-runs the step's rows in
halves (bisection, `isolate_culprits`): a group that succeeds keeps its outputs, a group that fails is split
again, and a row that fails alone is a culprit and fails alone. A failure that does not come back
(transient) fails nobody. One culprit among N rows costs about 2 log2 N re-runs.

Re-running rows is safe: each row computes the same tokens into the same KV slots it was given, so a
half-done failed attempt is simply overwritten. The step's changes (new requests, blocks, copy-on-write,
dropped requests) were applied to the persistent batch once, before the first attempt; a re-run carries only
rows (`SchedulerOutput.rows`). A request and its ``n > 1`` forks share a row, so they are re-run (and fail)
together. Seeded sampling draws from a per-request generator; only a failure after the draw (not in setting
it up, where parameter errors happen) could shift a retried row's random stream.

Self-contained on purpose: it needs only the step contract and a way to run some of a step's rows.
"""

from __future__ import annotations

from collections.abc import Callable

from sluice.core.step import ModelOutput, SchedulerOutput

RunRows = Callable[[SchedulerOutput], ModelOutput]  # raises when the rows fail


def is_fatal(exc: BaseException) -> bool:
    """Errors after which the model or its device cannot be trusted (every request must fail)."""
    text = str(exc)
    return isinstance(exc, MemoryError) or "CUDA error" in text or "device-side assert" in text


def isolate_culprits(so: SchedulerOutput, error: Exception, run: RunRows) -> ModelOutput:
    """Re-run the rows of ``so`` (whose step failed with ``error``) until the failure is pinned on single
    rows. Returns the output of the rows that ran, with each culprit (and its forks) in ``failed``. A fatal
    error on the way is raised."""
    outs: list[ModelOutput] = []
    failed: dict[str, Exception] = {}
    todo: list[tuple[list[int], Exception]] = [(list(range(so.num_reqs)), error)]
    while todo:
        rows, err = todo.pop()
        if len(rows) == 1:
            rid = so.req_ids[rows[0]]
            for r in (rid, *so.forks.get(rid, ())):
                failed[r] = err
            continue
        mid = len(rows) // 2
        for part in (rows[:mid], rows[mid:]):
            try:
                outs.append(run(so.rows(part)))
            except Exception as e:
                if is_fatal(e):
                    raise
                todo.append((part, e))
    merged = merge_outputs(so.step_id, outs)
    merged.failed = failed
    return merged


def merge_outputs(step_id: int, outs: list[ModelOutput]) -> ModelOutput:
    """One `ModelOutput` from those of disjoint groups of a step's rows."""
    merged = ModelOutput(step_id)
    any_logprobs = any(o.logprobs is not None for o in outs)
    if any_logprobs:
        merged.logprobs = []
    for o in outs:
        merged.req_ids += o.req_ids
        merged.token_ids += o.token_ids
        if any_logprobs:
            merged.logprobs += o.logprobs if o.logprobs is not None else [None] * len(o.req_ids)
        for name in ("spec_token_ids", "draft_token_ids"):
            part = getattr(o, name)
            if part:
                whole = getattr(merged, name)
                if whole is None:
                    setattr(merged, name, whole := {})
                whole.update(part)
    return merged
