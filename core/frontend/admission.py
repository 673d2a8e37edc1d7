"""Back-pressure for library callers: `AdmissionGate`, a first-come first-served count of sequences in flight.

The scheduler refuses a request when its waiting queue is full (`EngineOverloaded`), which an HTTP server turns
into 503 + Retry-After. A library caller has nobody to retry for it, so `AsyncEngine.generate` waits for room
instead: at most ``max_num_seqs + max_waiting_requests`` sequences of waiting callers are in flight at once (a
full batch and a full queue), the rest wait here in arrival order. The queue can still be found full (the batch
is short of KV blocks, or an HTTP server shares the engine); the engine then retries as it drains.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import AsyncIterator

import anyio


class AdmissionGate:
    """A weighted semaphore that serves waiters strictly in arrival order: a request of n sequences takes n units
    at once (taking them one by one could deadlock two half-served requests), and a large request at the head
    is not overtaken by small ones behind it."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.free = capacity
        self._waiters: deque[tuple[int, anyio.Event]] = deque()

    @property
    def num_waiting(self) -> int:
        return len(self._waiters)

    @contextlib.asynccontextmanager
    async def hold(self, units: int) -> AsyncIterator[None]:
        units = min(units, self.capacity)  # a request wider than the gate runs alone
        await self.acquire(units)
        try:
            yield
        finally:
            self.release(units)

    async def acquire(self, units: int) -> None:
        if not self._waiters and self.free >= units:
            self.free -= units
            return
        entry = (units, anyio.Event())
        self._waiters.append(entry)
        try:
            await entry[1].wait()
        except BaseException:  # cancelled while waiting, or just after being granted
            if entry[1].is_set():
                self.release(units)
            else:
                self._waiters.remove(entry)
                self._grant()  # it may have been the head that blocked smaller ones
            raise

    def release(self, units: int) -> None:
        self.free += units
        self._grant()

    def _grant(self) -> None:
        while self._waiters and self._waiters[0][0] <= self.free:
            units, event = self._waiters.popleft()
            self.free -= units
            event.set()
