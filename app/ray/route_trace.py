"""Why a served `kv` run hits less than one engine: each request's routing decision beside the hit its replica got.

The `kv` router hands every decision, a `RouteDecision`, to `record` (it runs in the process that holds the Serve
handle); while a `RouteTrace` is open there it collects them, wraps an engine to record each request's cached
tokens, then counts where hits were lost (`python -m sluice.app.ray.bench --trace`). With no trace open, `record`
is one truth test.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import asdict, dataclass, field


@dataclass(slots=True)
class RouteDecision:
    request_id: str
    chosen: int  # index into ``replicas``
    replicas: list[str]  # the candidates' replica ids, in the order Serve gave them
    matches: list[int]  # blocks of the request's prefix each replica holds (confirmed by events)
    pending: list[int]  # ... or is computing for a request routed there (not confirmed yet)
    queues: list[int]  # requests in flight on each replica, from this router
    affinity_overridden: bool  # the longest match lost to the imbalance bound
    t: float = field(default_factory=time.monotonic)


_open: list[RouteTrace] = []


def tracing() -> bool:
    return bool(_open)


def record(decision: RouteDecision) -> None:
    for trace in _open:
        trace.decisions[decision.request_id] = decision


class RouteTrace:
    def __init__(self) -> None:
        self.decisions: dict[str, RouteDecision] = {}
        self.cached: dict[str, int] = {}  # request id -> prompt tokens its replica had cached

    def __enter__(self) -> RouteTrace:
        _open.append(self)
        return self

    def __exit__(self, *exc) -> None:
        _open.remove(self)

    def dump(self, path: str) -> None:
        """One JSON line per traced request: its decision and the tokens its replica had cached."""
        with open(path, "w") as f:
            for rid, d in sorted(self.decisions.items(), key=lambda kv: kv[1].t):
                f.write(json.dumps({**asdict(d), "cached": self.cached.get(rid)}) + "\n")

    def wrap(self, engine):
        return _Recording(engine, self)

    def summary(self, block_size: int, group_of: dict[str, object]) -> dict[str, int]:
        """Counts over the requests both traced and finished: where the router saw a longer prefix than the
        replica then had (``promised_more``), where the imbalance bound overrode the match, where it routed
        away from the longest prefix it saw; and how many groups (``group_of``: a request's shared prefix)
        were spread over more than one replica."""
        c: Counter[str] = Counter()
        where: dict[object, set[str]] = {}
        for rid, d in self.decisions.items():
            if rid not in self.cached:
                continue
            c["requests"] += 1
            seen = max(m + p for m, p in zip(d.matches, d.pending, strict=True))
            on_chosen = d.matches[d.chosen] + d.pending[d.chosen]
            c["hit_tokens"] += self.cached[rid]
            c["promised_tokens"] += on_chosen * block_size
            c["best_seen_tokens"] += seen * block_size
            c["promised_more"] += on_chosen * block_size > self.cached[rid] + block_size
            c["routed_by_pending"] += d.pending[d.chosen] > 0
            c["affinity_overridden"] += d.affinity_overridden
            c["away_from_longest"] += on_chosen < seen
            where.setdefault(group_of.get(rid), set()).add(d.replicas[d.chosen])
        c["groups"] = len(where)
        c["groups_on_several_replicas"] = sum(len(s) > 1 for s in where.values())
        return dict(c)


class _Recording:
    """An engine whose ``generate`` also records each request's cached prompt tokens."""

    def __init__(self, engine, trace: RouteTrace) -> None:
        self.engine, self.trace = engine, trace

    def __getattr__(self, name):
        return getattr(self.engine, name)

    async def generate(self, prompt, params=None, request_id=None, **kw):
        async for out in self.engine.generate(prompt, params, request_id=request_id, **kw):
            if out.finished:
                self.trace.cached[out.request_id] = out.usage.cached_tokens
            yield out
