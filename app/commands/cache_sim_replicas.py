"""`sluice cache-sim --replicas N --routing ...`: the replay of `cache_sim.py` over N data-parallel replicas, each
its own `Scheduler` + `KVCacheManager` of ``--pool-blocks`` blocks, behind the routing of
`sluice serve --data-parallel-backend ray` (the decisions of `app/ray/policy.py`, the functions the Ray routers
call), so a cluster's hit rate can be sized before it is bought.

Each replica keeps its own virtual clock; the replica furthest behind steps next, and a request is routed when
the earliest clock reaches its arrival. What each policy knows is what its router knows:

- ``kv``: each replica's `CacheView`, as the served router keeps it: the cached blocks from its KV events (its
  pool's event log, applied after every step) and the blocks of the requests routed to it as pending until
  stored (or expired, on the virtual clock); its queue (requests in flight).
- ``prefix``: Ray's prefix-affinity router, modelled on block hashes instead of text (`policy.prefix_choice`): a
  tree of everything sent to each replica, never evicted; under a match rate of 10% the replica with the smallest
  tree; the least loaded where the queues differ by more than the imbalance threshold.
- ``least-loaded``, ``round-robin``.
"""

from __future__ import annotations

import heapq
import itertools
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict

from sluice.app.bench.workloads import Workload
from sluice.app.commands.cache_replay import Replay, SimConfig, SimResult, simulate
from sluice.app.ray.policy import MAX_IMBALANCE, CacheView, kv_choice, least_loaded, prefix_choice, prefix_match
from sluice.kv.events import BlockStoredEntry
from sluice.kv.prefix_cache import block_hashes

ROUTINGS = ("kv", "prefix", "least-loaded", "round-robin")


class ReplicaReplay(Replay):
    """One replica: requests come from the router (not the workload's own schedule); what it finishes is
    reported to the cluster, which starts the conversations' next turns."""

    def __init__(self, workload: Workload, cfg: SimConfig, cluster: ClusterReplay) -> None:
        super().__init__(workload, cfg)
        self.ready, self.dependents = [], {}
        self.cluster = cluster
        self.log = self.kv.record_events()
        self.known = CacheView()  # what a router knows is cached here (KV events + requests routed here)
        self.sent: set = set()  # every block ever routed here (the `prefix` router's tree)

    def settle(self, i: int, ok: bool) -> None:
        super().settle(i, ok)
        self.cluster.settled(i, self.clock)

    def apply_events(self) -> None:
        for e in self.log.drain():
            if isinstance(e, BlockStoredEntry):
                self.known.stored((e.block_hash,))
            else:
                self.known.removed((e.block_hash,))


class ClusterReplay:
    def __init__(
        self, workload: Workload, cfg: SimConfig, num_replicas: int, routing: str, max_imbalance: int = MAX_IMBALANCE
    ) -> None:
        if routing not in ROUTINGS:
            raise ValueError(f"routing: must be one of {', '.join(ROUTINGS)}, got {routing!r}")
        self.workload, self.cfg, self.routing = workload, cfg, routing
        self.max_imbalance = max_imbalance
        self.replicas = [ReplicaReplay(workload, cfg, self) for _ in range(num_replicas)]
        self.ready: list[tuple[float, int]] = []
        self.dependents: dict[int, list[int]] = {}
        for i, r in enumerate(workload.requests):
            if r.after is None:
                self.ready.append((r.arrival_time, i))
            else:
                self.dependents.setdefault(r.after, []).append(i)
        heapq.heapify(self.ready)
        self.turn = itertools.count()
        self.limit = cfg.max_concurrency or math.inf

    def settled(self, i: int, clock: float) -> None:
        for j in self.dependents.pop(i, ()):
            heapq.heappush(self.ready, (max(self.workload.requests[j].arrival_time, clock), j))

    def choose(self, i: int, now: float) -> int:
        reps = self.replicas
        queues = [r.in_flight + len(r.ready) for r in reps]
        if self.routing == "round-robin":
            return next(self.turn) % len(reps)
        if self.routing == "least-loaded":
            return least_loaded(queues)
        req = self.workload.requests[i]
        hashes = block_hashes(req.prompt_token_ids, self.cfg.block_size, req.cache_salt)
        if self.routing == "kv":
            return kv_choice([r.known.match(hashes, now) for r in reps], queues, self.max_imbalance)
        matches, trees = [prefix_match(r.sent, hashes) for r in reps], [len(r.sent) for r in reps]
        return prefix_choice(matches, len(hashes), trees, queues, self.max_imbalance)

    def route(self, now: float) -> None:
        while self.ready and self.ready[0][0] <= now:
            if sum(r.in_flight + len(r.ready) for r in self.replicas) >= self.limit:
                return
            t, i = heapq.heappop(self.ready)
            rep = self.replicas[self.choose(i, now)]
            heapq.heappush(rep.ready, (t, i))
            req = self.workload.requests[i]
            hashes = block_hashes(req.prompt_token_ids, self.cfg.block_size, req.cache_salt)
            rep.known.routed(hashes, now)
            rep.sent.update(hashes)

    def run(self) -> SimResult:
        t0 = time.perf_counter()
        while True:
            busy = [r for r in self.replicas if r.sched.has_work() or r.ready]
            now = min((r.clock for r in busy), default=math.inf)
            room = sum(r.in_flight + len(r.ready) for r in self.replicas) < self.limit
            if self.ready and room and (not busy or self.ready[0][0] <= now):
                now = min(now, self.ready[0][0])
                for r in self.replicas:
                    if not r.sched.has_work() and not r.ready:
                        r.clock = max(r.clock, now)  # idle until now
                self.route(now)
                continue
            if not busy:
                break
            rep = min(busy, key=lambda r: r.clock)
            if not rep.sched.has_work():
                rep.clock = max(rep.clock, rep.ready[0][0])
            rep.admit_ready()
            if rep.sched.has_work():
                rep.step()
                rep.apply_events()
        return self.result(t0)

    def result(self, t0: float) -> SimResult:
        parts = [r.result(t0) for r in self.replicas]
        q = sum(p.prefix_cache_queries for p in parts)
        h = sum(p.prefix_cache_hits for p in parts)
        rejected_tokens = sum(p.rejected_prompt_tokens for p in parts)
        first = parts[0]
        return SimResult(
            block_size=first.block_size,
            num_kv_blocks=first.num_kv_blocks,
            pool_tokens=first.pool_tokens,
            prefix_cache_queries=q,
            prefix_cache_hits=h,
            hit_rate=h / (q + rejected_tokens) if q + rejected_tokens else 0.0,
            num_requests=len(self.workload.requests),
            num_finished=sum(p.num_finished for p in parts),
            num_rejected=sum(p.num_rejected for p in parts),
            rejected_prompt_tokens=rejected_tokens,
            num_preemptions=sum(p.num_preemptions for p in parts),
            num_steps=sum(p.num_steps for p in parts),
            computed_tokens=sum(p.computed_tokens for p in parts),
            virtual_s=max(p.virtual_s for p in parts),
            wall_s=time.perf_counter() - t0,
        )


def simulate_replicas(
    workload: Workload, cfg: SimConfig, num_replicas: int, routing: str, max_imbalance: int = MAX_IMBALANCE
) -> SimResult:
    """Replay ``workload`` over ``num_replicas`` replicas of ``cfg`` each, routed by ``routing``."""
    return ClusterReplay(workload, cfg, num_replicas, routing, max_imbalance).run()


def compare_routings(
    workload: Workload,
    base: SimConfig,
    pool_blocks: list[int],
    num_replicas: int,
    routings: list[str],
    max_imbalance: int = MAX_IMBALANCE,
) -> list[dict]:
    """Per pool size (each replica's): one engine with ``num_replicas`` times the blocks, then each routing over
    ``num_replicas`` replicas; the hit rate relative to the one engine's beside each."""
    rows = []
    for n in pool_blocks:
        one = simulate_from(workload, base, n * num_replicas)
        rows.append(_row("one engine", 1, n * num_replicas, one, one))
        for routing in routings:
            cfg = SimConfig(**{**_fields(base), "num_kv_blocks": n})
            res = simulate_replicas(workload, cfg, num_replicas, routing, max_imbalance)
            rows.append(_row(routing, num_replicas, n, res, one))
    return rows


# `seed_sweep`'s step timings (step_s, token_s): the replicas' relative speed decides which tenant's prefix the
# LRU keeps, so each workload seed is replayed at a few of them (the one engine's hit rate does not depend on them)
SWEEP_TIMINGS = ((0.02, 0.0005), (0.005, 0.0005), (0.02, 0.0001))


def seed_sweep(
    make_workload: Callable[[int], Workload],
    base: SimConfig,
    num_replicas: int,
    routings: list[str],
    seeds: int,
    timings: Sequence[tuple[float, float]] = SWEEP_TIMINGS,
    max_imbalance: int = MAX_IMBALANCE,
) -> list[dict]:
    """Each routing's hit rate relative to one engine with all the blocks, over ``seeds`` workloads
    (``make_workload(seed)``) x ``timings``: its mean, 10th percentile, lowest and highest. A served run is one
    draw of this spread (its timing is the machine's), so a bound must hold at the lowest, not on average."""
    ratios: dict[str, list[float]] = {r: [] for r in routings}
    for seed in range(seeds):
        workload = make_workload(seed)
        for step_s, token_s in timings:
            cfg = SimConfig(**{**_fields(base), "step_s": step_s, "token_s": token_s})
            one = simulate_from(workload, cfg, cfg.num_kv_blocks * num_replicas).hit_rate
            for routing in routings:
                res = simulate_replicas(workload, cfg, num_replicas, routing, max_imbalance)
                ratios[routing].append(res.hit_rate / one if one else 0.0)
    return [_spread(routing, sorted(xs)) for routing, xs in ratios.items()]


def _spread(routing: str, xs: list[float]) -> dict:
    return {
        "routing": routing,
        "runs": len(xs),
        "mean_vs_one": f"{statistics.fmean(xs):.3f}x",
        "p10_vs_one": f"{xs[len(xs) // 10]:.3f}x",
        "lowest_vs_one": f"{xs[0]:.3f}x",
        "highest_vs_one": f"{xs[-1]:.3f}x",
    }


def simulate_from(workload: Workload, base: SimConfig, num_blocks: int) -> SimResult:
    return simulate(workload, SimConfig(**{**_fields(base), "num_kv_blocks": num_blocks}))


def _fields(cfg: SimConfig) -> dict:
    return asdict(cfg)


def _row(routing: str, replicas: int, blocks: int, r: SimResult, one: SimResult) -> dict:
    return {
        "routing": routing,
        "replicas": replicas,
        "blocks_each": blocks,
        "hit_rate": f"{100 * r.hit_rate:.1f}%",
        "vs_one_engine": f"{r.hit_rate / one.hit_rate:.2f}x" if one.hit_rate else "-",
        "prefix_cache_hits": r.prefix_cache_hits,
        "num_rejected": r.num_rejected,
        "virtual_s": round(r.virtual_s, 2),
    }
