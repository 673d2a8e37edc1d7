"""A failed step fails its culprits, not everyone batched with them.

A step error that leaves the model usable (not `executor.is_fatal`) is most often caused by one request's own
input: a value that passed validation and still breaks the sampler or the forward. Failing the whole step
would fail every innocent request that happened to share it. Instead, `isolate_culprits` re-runs the step's
requests in halves (bisection): a group that succeeds keeps its outputs, a group that fails is split again,
and a request that fails alone is a culprit and fails alone. A failure that does not come back (transient)
fails nobody. One culprit among N requests costs about 2 log2 N re-runs.

Re-running a step is safe: each request computes the same tokens into the same KV slots it was given, so a
half-done failed attempt is simply overwritten. The copy-on-write orders go with the first re-run only,
before any request writes into a copied block again; so do the ids of finished requests, whose state (a
seeded generator) the failed attempt may not have dropped before a new request reuses the id. A request and
its ``n > 1`` forks share a logits row, so they are re-run (and fail) together. Seeded sampling draws from a
per-request generator; only a failure after the draw (not in setting it up, where parameter errors happen)
could shift a retried row's random stream.

Self-contained on purpose: it needs only the step contract and a way to run one step.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from sluice.core.step import ModelOutput, ScheduledRequest, SchedulerOutput

RunStep = Callable[[SchedulerOutput], Awaitable[ModelOutput]]


async def isolate_culprits(
    so: SchedulerOutput, out: ModelOutput, run: RunStep
) -> tuple[SchedulerOutput, ModelOutput, list[tuple[ScheduledRequest, Exception]]]:
    """Re-run the requests of ``so`` (whose step failed with ``out``) until the failure is pinned on single
    requests. Returns the step cut to the requests that ran (``so`` itself on a fatal failure), their merged
    output (or the fatal one), and the culprits with their errors."""
    copies, finished = list(so.block_copies), list(so.finished_request_ids)
    good: list[ScheduledRequest] = []
    outs: list[ModelOutput] = []
    culprits: list[tuple[ScheduledRequest, Exception]] = []
    failed: list[tuple[list[ScheduledRequest], Exception]] = [(list(so.requests), out.error)]
    while failed:
        group, error = failed.pop()
        if len(group) == 1:
            culprits.append((group[0], error))
            continue
        mid = len(group) // 2
        for part in (group[:mid], group[mid:]):
            sub = SchedulerOutput(so.step_id, part, copies, finished)
            copies, finished = [], []
            got = await run(sub)
            if got.fatal:
                return so, got, []
            if got.error is None:
                good.extend(part)
                outs.append(got)
            else:
                failed.append((part, got.error))
    return SchedulerOutput(so.step_id, good), merge_outputs(so.step_id, outs), culprits


def merge_outputs(step_id: int, outs: list[ModelOutput]) -> ModelOutput:
    """One `ModelOutput` from those of disjoint groups of a step's requests."""
    merged = ModelOutput(step_id, {})
    for o in outs:
        merged.sampled.update(o.sampled)
        for name in ("logprobs", "spec_token_ids", "draft_token_ids"):
            part = getattr(o, name)
            if part:
                whole = getattr(merged, name)
                if whole is None:
                    setattr(merged, name, whole := {})
                whole.update(part)
    return merged
