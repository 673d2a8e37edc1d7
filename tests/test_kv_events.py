"""KV events: vLLM's wire format (tagged msgpack arrays in vLLM's field order, three-frame PUB messages, the
replay socket), and a subscriber that rebuilds an engine's cached block set from them after a workload that
evicts."""

from __future__ import annotations

import time
from dataclasses import dataclass

import anyio
import msgspec
import zmq
from sluice.core import AsyncEngine, EngineArgs, SamplingParams
from sluice.core.ipc import kv_events as W
from sluice.core.ipc.kv_event_publisher import END_SEQ, TOPIC, endpoint_for_rank
from sluice.kv.events import KVEventLog
from sluice.kv.manager import KVCacheManager

from tests.server_helpers import free_port

BS = 16


@dataclass
class FakeReq:
    request_id: str
    all_token_ids: list[int]
    num_computed_tokens: int = 0
    cache_salt: str | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.all_token_ids)


def test_a_chain_of_stored_blocks_is_one_blockstored_in_vllms_field_order():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    log = kv.record_events()
    a = FakeReq("a", list(range(8)))
    kv.allocate_slots(a, 8)
    kv.cache_blocks(a, 8)
    hashes = list(kv.req_hashes["a"])
    kv.free("a")
    kv.allocate_slots(FakeReq("b", list(range(50, 58))), 8)  # takes both cached blocks: both evicted
    ts, events, rank = msgspec.msgpack.decode(msgspec.msgpack.encode(W.to_batch(log.drain(), 4, rank=3)))
    assert isinstance(ts, float) and rank == 3
    stored, removed = events
    assert stored == ["BlockStored", hashes, None, list(range(8)), 4, None, "GPU"]
    assert removed[0] == "BlockRemoved" and sorted(removed[1]) == sorted(hashes) and removed[2] == "GPU"
    assert kv.cached_hashes() == set()


def test_rank_offsets_the_port_as_vllm_does():
    assert endpoint_for_rank("tcp://*:5557", 0) == "tcp://*:5557"
    assert endpoint_for_rank("tcp://*:5557", 2) == "tcp://*:5559"


def replay(ctx: zmq.Context, address: str, start: int) -> list[tuple[int, W.KVEventBatch]]:
    sock = ctx.socket(zmq.DEALER)
    sock.connect(address)
    sock.send_multipart((b"", start.to_bytes(8, "big")))
    out = []
    while sock.poll(5000):
        _, seq, payload = sock.recv_multipart()
        if seq == END_SEQ:
            break
        out.append((int.from_bytes(seq, "big"), W.decode_batch(payload)))
    sock.close(linger=0)
    return out


async def test_a_subscriber_rebuilds_the_engines_cached_blocks_after_evictions():
    port, replay_port = free_port(), free_port()
    args = EngineArgs(
        model="dummy:tiny", device="cpu", num_kv_blocks=24, max_model_len=256, max_num_batched_tokens=64,
        kv_events_endpoint=f"tcp://*:{port}", kv_events_replay_endpoint=f"tcp://*:{replay_port}",
    )  # fmt: skip
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.connect(f"tcp://127.0.0.1:{port}")
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    params = SamplingParams(max_tokens=3, temperature=0)
    try:
        async with AsyncEngine(args) as engine:
            await anyio.sleep(0.3)  # the subscription reaches the publisher before the first batch
            for tenant in range(6):  # 6 tenants x 5 blocks each > 24 blocks: older prefixes are evicted
                prefix = [1000 + 97 * tenant + i for i in range(5 * BS)]
                async with anyio.create_task_group() as tg:
                    for q in range(2):
                        tg.start_soon(lambda p: _drain(engine.generate(p, params)), prefix + [7, q, 9])
            kv = engine.local_core.scheduler_actor.scheduler.kv
            await anyio.sleep(0.3)
            expected = kv.cached_hashes()
        blocks: set = set()
        seqs, removed = [], 0
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and sub.poll(300):
            topic, seq, payload = sub.recv_multipart()
            assert topic == TOPIC
            batch = W.decode_batch(payload)
            W.apply(batch, blocks)
            seqs.append(int.from_bytes(seq, "big"))
            removed += sum(len(e.block_hashes) for e in batch.events if isinstance(e, W.BlockRemoved))
        assert seqs == list(range(len(seqs))) and seqs, "every batch, numbered from 0 without a gap"
        assert removed > 0, "the workload evicted cached blocks"
        assert blocks == expected and len(expected) > 0
    finally:
        sub.close(linger=0)
        ctx.term()


async def test_the_replay_socket_serves_batches_from_a_sequence_number():
    port, replay_port = free_port(), free_port()
    from sluice.core.ipc.kv_event_publisher import KVEventPublisher

    log = KVEventLog()
    pub = KVEventPublisher(log, f"tcp://*:{port}", f"tcp://*:{replay_port}", block_size=BS)
    ctx = zmq.Context()
    try:
        for i in range(5):
            log.stored(bytes([i]) * 16, None, tuple(range(BS)))
            pub.flush()
        log.removed(bytes([0]) * 16)
        pub.flush()
        deadline = time.monotonic() + 5
        while pub.next_seq < 6 and time.monotonic() < deadline:
            await anyio.sleep(0.02)
        got = replay(ctx, f"tcp://127.0.0.1:{replay_port}", 2)
        assert [s for s, _ in got] == [2, 3, 4, 5]
        blocks = {bytes([0]) * 16, bytes([1]) * 16}
        for _, b in got:
            W.apply(b, blocks)
        assert blocks == {bytes([i]) * 16 for i in (1, 2, 3, 4)}
    finally:
        pub.close()
        ctx.term()


async def _drain(agen):
    async for _ in agen:
        pass


async def test_the_routers_index_follows_stores_and_evictions_and_replays_what_it_missed():
    from sluice.app.ray.kv_index import KVIndex
    from sluice.core.ipc.kv_event_publisher import KVEventPublisher

    port, replay_port = free_port(), free_port()
    log = KVEventLog()
    pub = KVEventPublisher(log, f"tcp://*:{port}", f"tcp://*:{replay_port}", block_size=BS)
    hashes = [bytes([i]) * 16 for i in range(4)]
    for i, h in enumerate(hashes):  # published before anyone listens: only the replay socket has them
        log.stored(h, hashes[i - 1] if i else None, tuple(range(BS)))
    pub.flush()
    index = KVIndex()
    try:
        while pub.next_seq < 1:
            await anyio.sleep(0.02)
        index.watch("r0", f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay_port}")

        async def until(n: int) -> None:
            deadline = time.monotonic() + 5
            while index.match("r0", hashes) != n:
                assert time.monotonic() < deadline, index.match("r0", hashes)
                await anyio.sleep(0.05)

        await anyio.sleep(0.3)  # subscribed
        log.removed(hashes[2])
        pub.flush()
        await until(2)  # the first batch came from the replay socket, the eviction live
        assert index.match("r1", hashes) == 0
    finally:
        index.close()
        pub.close()
