"""The routing decisions themselves, without Ray: the Ray routers (`routers.py`) and `sluice cache-sim --replicas`
make them with the same functions and keep each replica's cache in the same `CacheView`. This module imports
nothing of Ray."""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence

# `kv`: a cache match is worth this many more requests queued than the shortest queue, or up to BALANCE_RATIO
# times as many (SGLang's cache-aware router's two thresholds, which must both be passed to give up a match).
# The bound is for a hot prefix piling up on one replica: with a handful of requests in flight, a queue a few
# requests longer is ordinary churn, and leaving the cache recomputes the whole prefix there (cache-sim on
# docs/benchmarks/cpu_ray_dp2_dummy_tiny.md's workload: a bound of 4 at 8 in flight lost hits and time).
MAX_IMBALANCE = 8
BALANCE_RATIO = 2.0
PREFIX_MATCH_RATE = 0.1  # `prefix` (Ray's PrefixCacheAffinityRouter's default): below it, the smallest tree
# `kv`: how long a routed request's blocks count as on its replica before its events confirm them. It covers the
# wait in the replica's queue and the prefill; a request that never computes them (aborted, failed) stops
# attracting its prefix after it.
PENDING_TTL_S = 10.0


def least_loaded(queues: Sequence[int]) -> int:
    return min(range(len(queues)), key=queues.__getitem__)


def kv_choice(matches: Sequence[int], queues: Sequence[int], max_imbalance: int = MAX_IMBALANCE) -> int:
    """The replica holding the longest prefix (the shorter queue among equals), unless nothing matches or its
    queue is both longer than the shortest by more than ``max_imbalance`` and more than `BALANCE_RATIO` times
    it: then the least loaded."""
    least = least_loaded(queues)
    best = max(range(len(matches)), key=lambda i: (matches[i], -queues[i]))
    if matches[best] == 0 or imbalanced(queues[best], queues[least], max_imbalance):
        return least
    return best


def prefix_choice(
    matches: Sequence[int],
    length: int,
    tree_sizes: Sequence[int],
    queues: Sequence[int],
    threshold: int = MAX_IMBALANCE,
) -> int:
    """Ray's `PrefixCacheAffinityRouter` (``prefix``), for `cache-sim`: the least loaded where the queues differ by
    more than ``threshold`` (its ``imbalanced_threshold``, which `deployment.py` sets to ``max_imbalance``); else
    the longest match (of ``length``) if it is at least `PREFIX_MATCH_RATE` of the prompt, else the replica
    with the smallest tree (``tree_sizes``: what was sent to each)."""
    least = least_loaded(queues)
    if max(queues) - queues[least] > threshold:
        return least
    best = max(range(len(matches)), key=lambda i: (matches[i], -queues[i]))
    if length and matches[best] / length >= PREFIX_MATCH_RATE:
        return best
    return min(range(len(queues)), key=lambda i: (tree_sizes[i], queues[i]))


def imbalanced(queue: int, shortest: int, max_imbalance: int = MAX_IMBALANCE) -> bool:
    return queue - shortest > max_imbalance and queue > BALANCE_RATIO * shortest


def prefix_match(blocks: set, hashes: Sequence) -> int:
    """How many of ``hashes`` (a request's, in order) ``blocks`` holds as a prefix."""
    n = 0
    for h in hashes:
        if h not in blocks:
            break
        n += 1
    return n


class CacheView:
    """What a router knows of one replica's prefix cache: the blocks its KV events say are cached (``blocks``)
    and the blocks of requests routed to it that no event has confirmed yet (``pending``, hash -> expiry).

    Events arrive after the replica has computed a prefill, so a burst of requests with a new prefix would
    spread over the replicas before the first one's blocks are known; counted as pending at routing time, they
    follow the first. An event that stores a block confirms it; pending blocks never confirmed expire after
    ``ttl``. An eviction event drops a confirmed block but not a pending one: a request routed since will
    compute it again. ``now`` is the caller's clock (the wall clock served, the virtual one in `cache-sim`).
    """

    __slots__ = ("blocks", "pending", "ttl")

    def __init__(self, ttl: float = PENDING_TTL_S) -> None:
        self.blocks: set[Hashable] = set()
        self.pending: dict[Hashable, float] = {}  # insertion order is expiry order: the ttl is one constant
        self.ttl = ttl

    def stored(self, hashes: Iterable[Hashable]) -> None:
        for h in hashes:
            self.blocks.add(h)
            self.pending.pop(h, None)

    def removed(self, hashes: Iterable[Hashable]) -> None:
        self.blocks.difference_update(hashes)

    def cleared(self) -> None:
        self.blocks.clear()
        self.pending.clear()

    def routed(self, hashes: Iterable[Hashable], now: float) -> None:
        """A request with these blocks was just sent to this replica."""
        self.expire(now)
        expiry = now + self.ttl
        for h in hashes:
            if h not in self.blocks:
                self.pending.pop(h, None)  # re-inserted at the end: the order stays the expiry order
                self.pending[h] = expiry

    def expire(self, now: float) -> None:
        pending = self.pending
        while pending:
            h = next(iter(pending))
            if pending[h] > now:
                return
            del pending[h]

    def match(self, hashes: Sequence[Hashable], now: float) -> int:
        """How many of ``hashes`` (a request's, in order) are cached or pending here, as a prefix."""
        n = 0
        for h in hashes:
            if h not in self.blocks and self.pending.get(h, now) <= now:
                break
            n += 1
        return n
