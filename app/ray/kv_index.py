"""Every replica's cached blocks, rebuilt from its KV events (`core/ipc/kv_events.py`) on a thread of the router.

One SUB socket per replica; a gap in a replica's sequence numbers (a late subscription, a dropped message) is
filled from its replay socket before the new batch applies, so each view follows its engine's prefix cache,
evictions included. Besides what the events say, the blocks of a request just routed to a replica count as
pending there until its events confirm them or they expire (`policy.CacheView`): a burst of requests with one
new prefix then follows the first. A replica's view exists from the first time the router names it, before
its sockets are connected (the first requests are routed before any replica has said where it publishes).
The views are read and noted on the router's thread and written on this one: one lock keeps them apart.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Hashable, Sequence

import zmq
from sluice.app.ray.policy import CacheView, prefix_match
from sluice.core.ipc.kv_event_publisher import END_SEQ
from sluice.core.ipc.kv_events import BlockRemoved, BlockStored, KVEventBatch, decode_batch

logger = logging.getLogger("sluice")


def apply_batch(batch: KVEventBatch, view: CacheView) -> None:
    for ev in batch.events:
        if isinstance(ev, BlockStored):
            view.stored(ev.block_hashes)
        elif isinstance(ev, BlockRemoved):
            view.removed(ev.block_hashes)
        else:
            view.cleared()


class ReplicaEvents:
    """One replica's event stream, in sequence order, handed to ``apply``."""

    def __init__(
        self, ctx: zmq.Context, events: str, replay: str | None, apply: Callable[[KVEventBatch], None]
    ) -> None:
        self.apply = apply
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
        self.apply(decode_batch(payload))
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
                    self.apply(decode_batch(payload))
                    self.next_seq = seq + 1
        finally:
            sock.close()

    def close(self) -> None:
        self.sub.close()


class KVIndex:
    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.views: dict[Hashable, CacheView] = {}
        self.watching: set[Hashable] = set()
        self._views_lock = threading.Lock()
        self._events: dict[Hashable, ReplicaEvents] = {}  # the thread's own
        self._changes: list[tuple[Hashable, str | None, str | None]] = []  # (replica, events, replay); None: forget
        self._lock = threading.Lock()
        self._running = True
        self._thread = threading.Thread(target=self._run, name="sluice-kv-index", daemon=True)
        self._thread.start()

    def watch(self, replica: Hashable, events: str, replay: str | None) -> None:
        self._view(replica)
        self.watching.add(replica)
        with self._lock:
            self._changes.append((replica, events, replay))

    def forget(self, replica: Hashable) -> None:
        self.watching.discard(replica)
        with self._views_lock:
            self.views.pop(replica, None)
        with self._lock:
            self._changes.append((replica, None, None))

    def watched(self, replica: Hashable) -> bool:
        return replica in self.watching

    def match(self, replica: Hashable, hashes: Sequence) -> int:
        """How many of ``hashes`` (a request's, in order) the replica holds or is computing, as a prefix."""
        return self.match_split(replica, hashes)[1]

    def match_split(self, replica: Hashable, hashes: Sequence) -> tuple[int, int]:
        """The prefix of ``hashes`` the replica's events confirm, and the one with its pending blocks too."""
        view = self.views.get(replica)
        if view is None:
            return 0, 0
        with self._views_lock:
            return prefix_match(view.blocks, hashes), view.match(hashes, time.monotonic())

    def note_routed(self, replica: Hashable, hashes: Sequence) -> None:
        """A request with these blocks was just routed to the replica: they are pending there."""
        view = self._view(replica)
        with self._views_lock:
            view.routed(hashes, time.monotonic())

    def close(self) -> None:
        self._running = False
        self._thread.join(timeout=2)
        self.ctx.destroy(linger=0)

    def _view(self, replica: Hashable) -> CacheView:
        view = self.views.get(replica)
        if view is None:
            with self._views_lock:
                view = self.views.setdefault(replica, CacheView())
        return view

    def _applier(self, replica: Hashable) -> Callable[[KVEventBatch], None]:
        def apply(batch: KVEventBatch) -> None:
            with self._views_lock:
                view = self.views.get(replica)  # None: forgotten since
                if view is not None:
                    apply_batch(batch, view)

        return apply

    def _apply_changes(self, poller: zmq.Poller) -> None:
        with self._lock:
            changes, self._changes = self._changes, []
        for replica, events, replay in changes:
            old = self._events.pop(replica, None)
            if old is not None:
                poller.unregister(old.sub)
                old.close()
            if events is not None:
                self._events[replica] = ReplicaEvents(self.ctx, events, replay, self._applier(replica))
                poller.register(self._events[replica].sub, zmq.POLLIN)

    def _run(self) -> None:
        poller = zmq.Poller()
        while self._running:
            self._apply_changes(poller)
            by_socket = {r.sub: r for r in self._events.values()}
            for sock, _ in poller.poll(50):
                try:
                    by_socket[sock].receive()
                except Exception:  # one bad message must not stop the index
                    logger.exception("kv index: a KV event batch could not be applied")
