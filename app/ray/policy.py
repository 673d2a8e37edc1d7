"""The routing decisions themselves, without Ray: the Ray routers (`routers.py`) and `sluice cache-sim --replicas`
make them with the same functions. This module imports nothing of Ray."""

from __future__ import annotations

from collections.abc import Sequence

MAX_IMBALANCE = 4  # `kv`: a cache match is worth up to this many more requests queued than the shortest queue
PREFIX_MATCH_RATE = 0.1  # `prefix` (Ray's PrefixCacheAffinityRouter's default): below it, the smallest tree


def least_loaded(queues: Sequence[int]) -> int:
    return min(range(len(queues)), key=queues.__getitem__)


def kv_choice(matches: Sequence[int], queues: Sequence[int], max_imbalance: int = MAX_IMBALANCE) -> int:
    """The replica holding the longest prefix (the shorter queue among equals), unless its queue is longer than
    the shortest by more than ``max_imbalance`` or nothing matches: then the least loaded."""
    least = least_loaded(queues)
    best = max(range(len(matches)), key=lambda i: (matches[i], -queues[i]))
    if matches[best] == 0 or queues[best] - queues[least] > max_imbalance:
        return least
    return best


def prefix_match(blocks: set, hashes: Sequence) -> int:
    """How many of ``hashes`` (a request's, in order) ``blocks`` holds as a prefix."""
    n = 0
    for h in hashes:
        if h not in blocks:
            break
        n += 1
    return n
