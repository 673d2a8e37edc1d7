"""Every replica's cached blocks, rebuilt from its KV events (`core/ipc/kv_events.py`) on a thread of the router.

One SUB socket per replica; a gap in a replica's sequence numbers (a late subscription, a dropped message) is
filled from its replay socket before the new batch applies, so each set follows its engine's prefix cache,
evictions included. Besides what the events say, the blocks of a request just routed to a replica count as
there (the replica is computing them): a burst of requests with one new prefix then follows the first.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Hashable, Sequence

import zmq
from sluice.app.ray.policy import prefix_match
from sluice.core.ipc.kv_event_publisher import END_SEQ
from sluice.core.ipc.kv_events import apply, decode_batch

logger = logging.getLogger("sluice")


class ReplicaBlocks:
    def __init__(self, ctx: zmq.Context, events: str, replay: str | None) -> None:
        self.blocks: set = set()
        self.next_seq = 0
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(events)
        self.replay_endpoint = replay
        self.ctx = ctx

    def receive(self) -> None:
        _, seq_bytes, payload = self.sub.recv_multipart()
        seq = int.from_bytes(seq_bytes, "big")
        if seq < self.next_seq:
            return
        if seq > self.next_seq:
            self._replay(seq)
        apply(decode_batch(payload), self.blocks)
        self.next_seq = seq + 1

    def _replay(self, upto: int) -> None:
        """Apply the batches from ``next_seq`` to before ``upto`` from the replay socket (what is still there)."""
        if self.replay_endpoint is None:
            return
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.replay_endpoint)
        try:
            sock.send_multipart((b"", self.next_seq.to_bytes(8, "big")))
            while sock.poll(2000):
                _, seq_bytes, payload = sock.recv_multipart()
                if seq_bytes == END_SEQ:
                    break
                seq = int.from_bytes(seq_bytes, "big")
                if self.next_seq <= seq < upto:
                    apply(decode_batch(payload), self.blocks)
                    self.next_seq = seq + 1
        finally:
            sock.close()

    def close(self) -> None:
        self.sub.close()


class KVIndex:
    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.replicas: dict[Hashable, ReplicaBlocks] = {}
        self._changes: list[tuple[Hashable, str | None, str | None]] = []  # (replica, events, replay); None: forget
        self._lock = threading.Lock()
        self._running = True
        self._thread = threading.Thread(target=self._run, name="sluice-kv-index", daemon=True)
        self._thread.start()

    def watch(self, replica: Hashable, events: str, replay: str | None) -> None:
        with self._lock:
            self._changes.append((replica, events, replay))

    def forget(self, replica: Hashable) -> None:
        with self._lock:
            self._changes.append((replica, None, None))

    def watched(self, replica: Hashable) -> bool:
        return replica in self.replicas or any(r == replica for r, _, _ in self._changes)

    def match(self, replica: Hashable, hashes: Sequence) -> int:
        """How many of ``hashes`` (a request's, in order) the replica holds as a prefix."""
        r = self.replicas.get(replica)
        return 0 if r is None else prefix_match(r.blocks, hashes)

    def note_routed(self, replica: Hashable, hashes: Sequence) -> None:
        r = self.replicas.get(replica)
        if r is not None:
            r.blocks.update(hashes)

    def close(self) -> None:
        self._running = False
        self._thread.join(timeout=2)
        self.ctx.destroy(linger=0)

    def _apply_changes(self, poller: zmq.Poller) -> None:
        with self._lock:
            changes, self._changes = self._changes, []
        for replica, events, replay in changes:
            old = self.replicas.pop(replica, None)
            if old is not None:
                poller.unregister(old.sub)
                old.close()
            if events is not None:
                self.replicas[replica] = ReplicaBlocks(self.ctx, events, replay)
                poller.register(self.replicas[replica].sub, zmq.POLLIN)

    def _run(self) -> None:
        poller = zmq.Poller()
        while self._running:
            self._apply_changes(poller)
            by_socket = {r.sub: r for r in self.replicas.values()}
            for sock, _ in poller.poll(50):
                try:
                    by_socket[sock].receive()
                except Exception:  # one bad message must not stop the index
                    logger.exception("kv index: a KV event batch could not be applied")
