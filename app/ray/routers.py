"""The request routers of the Ray backend, on Ray Serve's `RequestRouter` API (one per ``--routing``).

Serve calls `choose_replicas` for each request and sends it to the least-loaded replica of the first rank
(list) that has room. So a router that has decided returns ``[[chosen], others]``; one that leaves the choice
to queue lengths returns one rank with every candidate. Every router keeps a session (``x-session-id``) on the
replica that served its first request while that replica lives.

- `KVRouter` (``kv``): the replica whose cache holds the longest prefix of the request's block hashes (the
  prefix cache's own hash, over the token ids), known from the replicas' KV events (`kv_index.py`), so it
  follows evictions; unless that replica's queue is longer than the shortest by more than ``max_imbalance``
  and more than twice as long (`policy.kv_choice`), or nothing matches: then the least loaded.
- `PrefixRouter` (``prefix``): Ray's `PrefixCacheAffinityRouter`, which matches the prompt's text against a
  tree of what it sent where.
- `LeastLoadedRouter` (``least-loaded``), `RoundRobinRouter` (``round-robin``).
"""

from __future__ import annotations

import itertools
import logging
from collections import Counter
from typing import Any

# Ray's prefix-affinity router itself: `ray.serve.llm` would also load the LLM stack's optional dependencies
from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import PrefixCacheAffinityRouter
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica
from sluice.app.ray.kv_index import KVIndex
from sluice.app.ray.policy import MAX_IMBALANCE, kv_choice, least_loaded
from sluice.app.ray.request import ReplicaRequest
from sluice.app.ray.route_trace import RouteDecision, record, tracing
from sluice.kv.prefix_cache import block_hashes

logger = logging.getLogger("sluice")


def _request(pending: PendingRequest | None) -> ReplicaRequest | None:
    if pending is None or not pending.args or not isinstance(pending.args[0], ReplicaRequest):
        return None
    return pending.args[0]


class SessionAffinity:
    """A session's requests go to the replica that took its first one (while it is a candidate)."""

    def sessions(self) -> dict[str, ReplicaID]:
        if not hasattr(self, "_sessions"):
            self._sessions: dict[str, ReplicaID] = {}
        return self._sessions

    def session_replica(self, candidates: list[RunningReplica], pending: PendingRequest | None):
        req = _request(pending)
        if req is None or req.session_id is None:
            return None
        rid = self.sessions().get(req.session_id)
        return next((r for r in candidates if r.replica_id == rid), None)

    def remember_session(self, pending: PendingRequest, replica_id: ReplicaID) -> None:
        req = _request(pending)
        if req is not None and req.session_id is not None:
            self.sessions()[req.session_id] = replica_id


def _first(chosen: RunningReplica, candidates: list[RunningReplica]) -> list[list[RunningReplica]]:
    """The chosen replica alone: no second rank, or Serve would send the request to another replica whenever the
    chosen one answers its queue-length probe late (a busy replica does), and undo the choice. If the chosen one
    cannot take it, Serve asks again after a backoff; a dead replica is no longer a candidate."""
    return [[chosen]]


class Load:
    """The requests each replica holds from this router: counted when it is chosen (a burst routed at once then
    sees its own earlier choices, which Serve's queue lengths do not yet), moved if Serve sends the request
    elsewhere, dropped when it completes."""

    def __init__(self) -> None:
        self.replica_of: dict[str, ReplicaID] = {}
        self.count: Counter[ReplicaID] = Counter()

    def assign(self, request: str, replica: ReplicaID) -> None:
        self.done(request)
        self.replica_of[request] = replica
        self.count[replica] += 1

    def done(self, request: str) -> None:
        old = self.replica_of.pop(request, None)
        if old is not None:
            self.count[old] -= 1


class _SluiceRouter(SessionAffinity, RequestRouter):
    """No `FIFOMixin`: it would hand the replica chosen for one request to the oldest one waiting, while the
    choice is made for this request's blocks (Serve's base class matches the request by its id)."""

    @property
    def load(self) -> Load:
        if not hasattr(self, "_load"):
            self._load = Load()
        return self._load

    def queue_len(self, replica: RunningReplica) -> int:
        return self.load.count[replica.replica_id]

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        kept = self.session_replica(candidate_replicas, pending_request)
        ranks = _first(kept, candidate_replicas) if kept else self.choose(candidate_replicas, pending_request)
        if pending_request is not None and len(ranks[0]) == 1:
            # counted and remembered now: requests routed in the same instant see this choice
            self.load.assign(pending_request.metadata.internal_request_id, ranks[0][0].replica_id)
            self.remember_session(pending_request, ranks[0][0].replica_id)
        return ranks

    def choose(self, candidates: list[RunningReplica], pending: PendingRequest | None) -> list[list[RunningReplica]]:
        raise NotImplementedError

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        self.remember_session(pending_request, replica_id)
        self.load.assign(pending_request.metadata.internal_request_id, replica_id)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self.load.done(internal_request_id)


class LeastLoadedRouter(_SluiceRouter):
    def choose(self, candidates, pending):
        return _first(min(candidates, key=self.queue_len), candidates)


class RoundRobinRouter(_SluiceRouter):
    def choose(self, candidates, pending):
        if not hasattr(self, "_turn"):
            self._turn = itertools.count()
        ordered = sorted(candidates, key=lambda r: r.replica_id.unique_id)
        return _first(ordered[next(self._turn) % len(ordered)], ordered)


class KVRouter(_SluiceRouter):
    def initialize_state(self, block_size: int = 16, max_imbalance: int = MAX_IMBALANCE, **_: Any) -> None:
        self.block_size = block_size
        self.max_imbalance = max_imbalance
        self.index = KVIndex()

    def _follow(self, candidates: list[RunningReplica]) -> None:
        """Subscribe to the KV events of replicas not followed yet; forget those gone."""
        for r in candidates:
            stats = r.routing_stats or {}
            if "kv_events" in stats and not self.index.watched(r.replica_id):
                self.index.watch(r.replica_id, stats["kv_events"], stats.get("kv_replay"))
        live = set(self.curr_replicas)
        for rid in [rid for rid in self.index.watching if rid not in live]:
            self.index.forget(rid)

    def hashes(self, req: ReplicaRequest) -> list:
        return block_hashes(req.token_ids, self.block_size, req.params.cache_salt)

    def choose(self, candidates, pending):
        self._follow(candidates)
        req = _request(pending)
        queues = [self.queue_len(r) for r in candidates]
        if req is None:
            return _first(candidates[least_loaded(queues)], candidates)
        hashes = self.hashes(req)
        split = [self.index.match_split(r.replica_id, hashes) for r in candidates]
        matches = [total for _, total in split]
        chosen = kv_choice(matches, queues, self.max_imbalance)
        # the replica is about to compute these blocks: the next request with this prefix follows this one
        self.index.note_routed(candidates[chosen].replica_id, hashes)
        if tracing():
            record(
                RouteDecision(
                    req.request_id,
                    chosen,
                    [r.replica_id.unique_id for r in candidates],
                    [confirmed for confirmed, _ in split],
                    [total - confirmed for confirmed, total in split],
                    queues,
                    max(matches) > matches[chosen],
                )
            )
        return _first(candidates[chosen], candidates)


class PrefixRouter(SessionAffinity, PrefixCacheAffinityRouter):
    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        kept = self.session_replica(candidate_replicas, pending_request)
        if kept is not None:
            return _first(kept, candidate_replicas)
        return await super().choose_replicas(candidate_replicas, pending_request)

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        self.remember_session(pending_request, replica_id)
        super().on_request_routed(pending_request, replica_id, result)


ROUTERS = {"kv": KVRouter, "prefix": PrefixRouter, "least-loaded": LeastLoadedRouter, "round-robin": RoundRobinRouter}
