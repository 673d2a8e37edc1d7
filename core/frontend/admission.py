"""Admission, in one place: how a caller's request gets into the scheduler's queue.

* **Room** (`Admission.room`): the scheduler refuses a request when its waiting queue is full
  (`EngineOverloaded`), which an HTTP server turns into 503 + Retry-After. A library caller has nobody to retry
  for it, so `AsyncEngine.generate` waits for room instead: at most ``max_num_seqs + max_waiting_requests``
  sequences of waiting callers are in flight at once (a full batch and a full queue), the rest wait in arrival
  order (`AdmissionGate`). The queue can still be found full (the batch is short of KV blocks, or an HTTP server
  shares the engine); the caller then retries as it drains (`Room.retry_after`).
* **The admitting window** (`Admission.window`): a burst's callers reach the scheduler a few at a time; each
  holds a unit from before its validation until the scheduler has answered its admission (`run_request`). The
  event loop runs ready tasks first come first served, and the scheduler is woken by the first request sent to
  it, so without a limit a burst of a thousand callers would all be validated and sent before the scheduler
  could take the first, the device idle all that time. With one, the callers past the limit wait (cheaply) and
  the scheduler's turn comes after the first few: the first step runs while the rest of the burst is admitted.
* **The answer** (`request_admission`): an `AddRequest` is answered `Admitted`, or refused with the reason.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
from sluice.core import envs
from sluice.core.errors import EngineOverloaded, EngineStoppedError
from sluice.core.messages import AddRequest, Admitted

# Requests validated and sent but not yet answered by the scheduler, at most (`Admission.window`).
ADMITTING_AT_ONCE = 64


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


def admitting_window() -> AdmissionGate | None:
    """The window that paces a burst (`run_request`'s ``admitting``): `ADMITTING_AT_ONCE` requests, or what
    SLUICE_ADMITTING says; 0 sends a burst all at once (for comparison), and gives None."""
    at_once = ADMITTING_AT_ONCE if envs.SLUICE_ADMITTING is None else envs.SLUICE_ADMITTING
    return AdmissionGate(at_once) if at_once > 0 else None


class Room:
    """One request's hold on the engine's room (`Admission.room`)."""

    __slots__ = ("_admission", "_num_seqs", "_waits")

    def __init__(self, admission: Admission, num_seqs: int, waits: bool) -> None:
        self._admission = admission
        self._num_seqs = num_seqs
        self._waits = waits

    async def retry_after(self, refused: EngineOverloaded) -> None:
        """The request was refused at admission, so nothing of it was yielded: raise ``refused`` (a caller that
        does not wait for room), or return once the queue may have room for another try."""
        if not self._waits:
            raise refused
        await self._admission.wait_for_room(self._num_seqs)


class Admission:
    """One engine's admission of its callers: the room they wait for, first come first served, the window that
    paces a burst, and what a refused caller waits for before it tries again (``wait_for_room(num_seqs)``).

    A caller's loop (kept in the caller: a generator in between would cost every output a hop)::

        async with admission.room(n, wait_for_room) as room:
            while True:
                try:
                    async for out in run_request(...):
                        yield out
                    return
                except EngineOverloaded as e:
                    await room.retry_after(e)
    """

    def __init__(
        self,
        capacity: int,
        wait_for_room: Callable[[int], Awaitable[None]],
        window: AdmissionGate | None = None,
    ) -> None:
        self.gate = AdmissionGate(capacity)
        self.window = window
        self.wait_for_room = wait_for_room

    @contextlib.asynccontextmanager
    async def room(self, num_seqs: int, wait: bool = True) -> AsyncIterator[Room]:
        """Hold room for ``num_seqs`` sequences while the request runs; without ``wait`` (the HTTP server's 503)
        nothing is held and a refusal is raised at once."""
        if not wait:
            yield Room(self, num_seqs, False)
            return
        async with self.gate.hold(num_seqs):
            yield Room(self, num_seqs, True)


async def request_admission(
    submit: Callable[[AddRequest], Awaitable[bool]], msg: AddRequest, answers: Any, stopped: Exception | None = None
) -> Exception | None:
    """Send ``msg`` (``submit`` is False once the engine has stopped: refused with ``stopped``, by default an
    `EngineStoppedError`) and wait for the scheduler's answer on ``answers``: None once admitted, else why it was
    refused (nothing of it was added: nothing to abort). A caller cancelled in here may have its request held by
    the scheduler: it aborts it."""
    if not await submit(msg):
        return stopped or EngineStoppedError("the engine stopped before the request was admitted")
    answer = await answers.receive()
    return None if answer.__class__ is Admitted else answer.error


async def request_admission_until_room(
    submit: Callable[[AddRequest], Awaitable[bool]],
    msg: AddRequest,
    answers: Any,
    stopped: Exception | None = None,
    gave_up: Callable[[], bool] = lambda: False,
    pause_s: float = 0.01,
) -> Exception | None:
    """`request_admission`, tried again every ``pause_s`` while the engine is overloaded (until ``gave_up()``):
    for a request that has begun already (a prefill/decode pair's, with its first token out), which must not
    fail for want of room."""
    while True:
        refused = await request_admission(submit, msg, answers, stopped)
        if not isinstance(refused, EngineOverloaded) or gave_up():
            return refused
        await anyio.sleep(pause_s)
