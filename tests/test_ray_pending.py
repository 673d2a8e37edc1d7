"""The `kv` router's view of a replica's cache (`app/ray/policy.CacheView`, kept by `kv_index.KVIndex` served and by
`cache-sim --replicas`): blocks routed to a replica count as pending there before any KV event, so a burst of one
prefix follows its first request; pending blocks expire unless an event confirms them; events evict. No Ray."""

from __future__ import annotations

import time

import anyio
from sluice.app.ray.kv_index import KVIndex, apply_batch
from sluice.app.ray.policy import CacheView, kv_choice
from sluice.app.ray.replica import kv_event_endpoints
from sluice.core.ipc.kv_event_publisher import KVEventPublisher, endpoint_for_rank
from sluice.core.ipc.kv_events import to_batch
from sluice.kv.events import BlockRemovedEntry, BlockStoredEntry, KVEventLog
from sluice.kv.prefix_cache import block_hashes

from tests.server_helpers import free_port

BS = 16


def prompt(tenant: int, question: int) -> list:
    """The block hashes of a prompt: 4 blocks of the tenant's system prompt, then 1 of its own question."""
    system = [1000 * tenant + i for i in range(4 * BS)]
    return block_hashes(system + [100_000 + 100 * tenant + question] * BS, BS, None)


def route(views: list[CacheView], queues: list[int], hashes: list, now: float) -> int:
    """What the router does per request: choose, then note the blocks as pending on the chosen replica."""
    chosen = kv_choice([v.match(hashes, now) for v in views], queues)
    views[chosen].routed(hashes, now)
    queues[chosen] += 1
    return chosen


def test_a_burst_of_one_prefix_before_any_event_follows_its_first_request():
    views, queues = [CacheView(), CacheView()], [0, 0]
    chosen: dict[int, list[int]] = {0: [], 1: []}
    # two tenants' bursts, mixed, all routed before either replica has published anything (least-loaded
    # alone would split each tenant over both replicas)
    for k, (t, q) in enumerate([(0, 0), (0, 1), (1, 0), (0, 2), (1, 1), (1, 2), (0, 3)]):
        chosen[t].append(route(views, queues, prompt(t, q), now=0.01 * k))
    assert len(set(chosen[0])) == 1 and len(set(chosen[1])) == 1, chosen
    assert chosen[0][0] != chosen[1][0], "the second tenant's first request: no match anywhere, the shorter queue"


def test_pending_blocks_expire_unless_an_event_confirms_them():
    view = CacheView(ttl=5.0)
    a, b = prompt(0, 0), prompt(1, 0)
    view.routed(a, now=0.0)
    view.routed(b, now=1.0)
    assert view.match(a, now=4.9) == len(a) and view.match(b, now=4.9) == len(b)
    view.stored(b[:4])  # the replica computed b's system prompt; a's request never ran (aborted)
    assert view.match(a, now=5.0) == 0, "expired"
    assert view.match(b, now=100.0) == 4, "confirmed blocks stay; b's unconfirmed question block expired"
    view.expire(now=100.0)
    assert not view.pending


def test_events_evict_confirmed_blocks_but_not_blocks_routed_since():
    view = CacheView()
    a = prompt(0, 0)
    view.stored(a)
    view.removed(a[2:])
    assert view.match(a, now=0.0) == 2
    view.routed(a, now=1.0)  # a request routed after the eviction computes the evicted blocks again...
    view.removed(a[2:])  # ...so an eviction event of the old copies arriving late does not undo that
    assert view.match(a, now=2.0) == len(a)
    view.removed(a[:1])  # an eviction of a block that was cached when the request was routed counts
    assert view.match(a, now=2.0) == 0
    view.cleared()
    assert view.match(a[2:], now=2.0) == 0 and not view.pending


def test_the_imbalance_bound_keeps_affinity_at_a_few_requests_in_flight():
    assert kv_choice([4, 0], [6, 1]) == 0, "8 in flight over 2 replicas: a 5-request gap is churn, not a hot spot"
    assert kv_choice([4, 0], [30, 2]) == 1, "far longer and many times as long: the least loaded"
    assert kv_choice([4, 0], [30, 20]) == 0, "10 more but not twice as many: still the cache"


def test_a_batch_of_events_applies_to_the_view():
    view = CacheView()
    a = prompt(0, 0)
    view.routed(a, now=0.0)
    entries = [BlockStoredEntry(h, a[i - 1] if i else None, tuple(range(BS))) for i, h in enumerate(a)]
    apply_batch(to_batch(entries + [BlockRemovedEntry(a[-1])], BS, rank=0), view)
    assert view.blocks == set(a[:-1]) and not view.pending


def test_a_replica_of_any_rank_advertises_the_ports_its_publisher_binds():
    for rank in (0, 1, 3):
        engine, routers = kv_event_endpoints("10.0.0.7", rank, 40123, 40200)
        assert endpoint_for_rank(engine["kv_events_endpoint"], rank).rsplit(":", 1)[1] == "40123"
        assert endpoint_for_rank(engine["kv_events_replay_endpoint"], rank).rsplit(":", 1)[1] == "40200"
        assert routers == {"kv_events": "tcp://10.0.0.7:40123", "kv_replay": "tcp://10.0.0.7:40200"}


async def test_the_index_counts_routed_blocks_as_pending_until_its_events_confirm_them():
    port = free_port()
    log = KVEventLog()
    pub = KVEventPublisher(log, f"tcp://*:{port}", None, block_size=BS)
    index = KVIndex()
    a = prompt(0, 0)
    try:
        index.note_routed("r1", a)  # routed before the replica said where it publishes: noted all the same
        assert index.match_split("r1", a) == (0, len(a))
        index.watch("r0", f"tcp://127.0.0.1:{port}", None)
        index.views["r0"].ttl = 0.3
        index.note_routed("r0", a)
        assert index.match_split("r0", a) == (0, len(a))
        await anyio.sleep(0.3)  # subscribed
        for i, h in enumerate(a[:4]):
            log.stored(h, a[i - 1] if i else None, tuple(range(BS)))
        pub.flush()
        deadline = time.monotonic() + 5
        while index.match_split("r0", a)[0] != 4:
            assert time.monotonic() < deadline, index.match_split("r0", a)
            await anyio.sleep(0.05)
        await anyio.sleep(0.3)  # past the ttl: the confirmed blocks stay, the question block expired
        assert index.match_split("r0", a) == (4, 4)
    finally:
        index.close()
        pub.close()


def test_the_route_trace_counts_where_the_router_promised_more_than_the_replica_had():
    from sluice.app.ray.route_trace import RouteDecision, RouteTrace, record

    record(RouteDecision("x", 0, ["a", "b"], [0, 0], [0, 0], [0, 0], False))  # no trace open: dropped
    with RouteTrace() as trace:
        record(RouteDecision("r1", 0, ["a", "b"], [0, 0], [0, 0], [0, 0], False))
        record(RouteDecision("r2", 0, ["a", "b"], [4, 0], [0, 0], [1, 0], False))  # promised 4 blocks, got 1
        record(RouteDecision("r3", 1, ["a", "b"], [4, 0], [0, 0], [12, 1], True))  # sent away from its match
        record(RouteDecision("r4", 0, ["a", "b"], [0, 0], [5, 0], [1, 1], False))  # pending, got them all
    trace.cached = {"r1": 0, "r2": BS, "r3": 0, "r4": 5 * BS}
    got = trace.summary(BS, {"r1": "t0", "r2": "t0", "r3": "t0", "r4": "t1"})
    assert "x" not in trace.decisions
    assert got["requests"] == 4 and got["hit_tokens"] == 6 * BS
    assert got["promised_more"] == 1 and got["routed_by_pending"] == 1
    assert got["affinity_overridden"] == 1 and got["away_from_longest"] == 1
    assert got["groups"] == 2 and got["groups_on_several_replicas"] == 1
