"""Where the replicas post their engine counters (a small Ray actor), for /metrics and /health of the front end.

A Serve handle reaches one replica per call, never all: so each replica posts its `EngineStats` every
`POST_INTERVAL_S`, and the front end reads them all at once. A replica silent for `STALE_AFTER_S` is gone
(dead, or being replaced).
"""

from __future__ import annotations

import time
from dataclasses import fields

from sluice.core.stats import EngineStats

POST_INTERVAL_S = 0.5
STALE_AFTER_S = 5.0


class StatsBoard:
    def __init__(self) -> None:
        self.posts: dict[str, tuple[EngineStats, float]] = {}

    def post(self, replica: str, stats: EngineStats) -> None:
        self.posts[replica] = (stats, time.time())

    def read(self) -> dict[str, tuple[EngineStats, float]]:
        return self.posts


def live(posts: dict[str, tuple[EngineStats, float]]) -> dict[str, EngineStats]:
    now = time.time()
    return {r: s for r, (s, t) in sorted(posts.items()) if now - t < STALE_AFTER_S}


def summed(stats: list[EngineStats]) -> EngineStats:
    """The replicas' counters added up (healthy while any replica is)."""
    if not stats:
        return EngineStats(healthy=False)
    out = {}
    for f in fields(EngineStats):
        values = [getattr(s, f.name) for s in stats]
        if f.name == "healthy":
            out[f.name] = any(values)
        elif f.name == "spec_accepted_per_position":
            width = max(map(len, values))
            out[f.name] = tuple(sum(v[i] for v in values if i < len(v)) for i in range(width))
        else:
            out[f.name] = sum(values)
    return EngineStats(**out)
