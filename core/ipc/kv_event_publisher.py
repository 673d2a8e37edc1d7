"""The KV event publisher: a thread in the engine core's process that sends each step's batch on a ZMQ PUB socket
and answers replay requests on a ROUTER socket, the framing vLLM uses.

PUB frames: ``[topic, seq, payload]``, ``seq`` 8 bytes big-endian, one more per batch from 0, ``payload`` the
msgpack `KVEventBatch` (`kv_events.py`). A subscriber that sees a gap asks the replay socket (REQ or DEALER)
with one frame, the 8-byte sequence to start from; the answer is one ``[seq, payload]`` message per batch still
buffered from there on, then ``[END_SEQ, b""]``.

The engine core hands over the raw log entries (`kv/events.py`) once per step; conversion, encoding and every
socket call happen on this thread, so the step loop pays one queue put per step with events and nothing when
none happened. An endpoint with a wildcard host (``tcp://*:5557``) or an ``ipc://`` path is bound, any other is
connected to (vLLM's rule); data-parallel rank r publishes on the endpoint's port + r.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque

import msgspec
import zmq
from sluice.core.ipc.kv_events import to_batch
from sluice.kv.events import KVEventLog

logger = logging.getLogger("sluice")

TOPIC = b"kv-events"
END_SEQ = (-1).to_bytes(8, "big", signed=True)
BUFFER_STEPS = 10_000  # batches kept for replay


def endpoint_for_rank(endpoint: str, rank: int) -> str:
    """vLLM's convention: rank r of a data-parallel group uses the base port + r."""
    if rank == 0 or not endpoint.startswith("tcp://"):
        return endpoint if rank == 0 else f"{endpoint}_dp{rank}"
    host, _, port = endpoint.rpartition(":")
    return f"{host}:{int(port) + rank}"


def _open(ctx: zmq.Context, kind: int, endpoint: str) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
        sock.bind(endpoint)
    else:
        sock.connect(endpoint)
    return sock


class KVEventPublisher:
    def __init__(
        self, log: KVEventLog, endpoint: str, replay_endpoint: str | None, block_size: int, rank: int = 0
    ) -> None:
        self.log = log
        self.block_size = block_size
        self.rank = rank
        self._queue: queue.SimpleQueue[list | None] = queue.SimpleQueue()
        self._ctx = zmq.Context()
        self._pub = _open(self._ctx, zmq.PUB, endpoint_for_rank(endpoint, rank))
        self._replay = None
        if replay_endpoint:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(endpoint_for_rank(replay_endpoint, rank))
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=BUFFER_STEPS)
        self._seq = 0
        self._thread = threading.Thread(target=self._run, name="sluice-kv-events", daemon=True)
        self._thread.start()

    def flush(self) -> None:
        """Queue what the log holds as one batch (called on the engine core's loop; never blocks)."""
        if self.log.entries:
            self._queue.put(self.log.drain())

    def close(self) -> None:
        """Send what is queued, then stop the thread and close the sockets."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout=5)
        self._ctx.destroy(linger=0)

    @property
    def next_seq(self) -> int:
        return self._seq

    def _run(self) -> None:
        encode = msgspec.msgpack.Encoder().encode
        while True:
            if self._replay is not None:
                while self._replay.poll(0):
                    self._serve_replay()
            try:
                entries = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if entries is None:
                return
            payload = encode(to_batch(entries, self.block_size, self.rank))
            seq = self._seq.to_bytes(8, "big")
            self._pub.send_multipart((TOPIC, seq, payload))
            self._buffer.append((self._seq, payload))
            self._seq += 1

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3:  # [client id, empty delimiter, start seq]
            logger.warning("kv events: malformed replay request (%d frames)", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))
