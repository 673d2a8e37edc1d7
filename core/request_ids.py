"""Request ids: the one scheme by which the engine names requests and derives ids from a caller's.

A caller may name its request (the server's ``chatcmpl-...``, the offline `LLM`'s ``llm-N``); a request it does
not name gets `new_request_id`'s ``req-<16 hex>``.

The scheduler keys every request by its id, so every id it holds must be unique. Two derived forms exist, and
compose (``"1:chatcmpl-abc#2"`` is sequence 2 of front end 1's ``chatcmpl-abc``):

* **sequences**: the ``n`` sequences of one caller request run as ``"{request_id}#{i}"`` (`sequence_id`); an
  abort of the caller's id reaches them through `sequence_prefix`. With ``n == 1`` the one sequence keeps the
  caller's id.
* **front ends**: several front ends sharing one engine core (``sluice serve --api-server-count N``) put their
  ids on the wire behind their own number, ``"{index}:{request_id}"`` (`front_end_prefix`), so two front ends
  can never put the same id into the one scheduler; the core's events come back prefixed and are cut back on
  arrival. Only the bridge (`core/frontend/core_client.py`) ever sees a prefixed id.
"""

from __future__ import annotations

import uuid

from sluice.core.errors import InvalidRequestError

SEQUENCE_SEP = "#"
FRONT_END_SEP = ":"


def new_request_id() -> str:
    """An id for a request whose caller gave none."""
    return f"req-{uuid.uuid4().hex[:16]}"


def sequence_id(request_id: str, index: int) -> str:
    """The id of sequence ``index`` of an ``n > 1`` request."""
    return f"{request_id}{SEQUENCE_SEP}{index}"


def sequence_prefix(request_id: str) -> str:
    """What every sequence id of ``request_id`` starts with."""
    return request_id + SEQUENCE_SEP


def front_end_prefix(index: int) -> str:
    """What front end ``index`` of a shared core puts before each of its request ids on the wire."""
    return f"{index}{FRONT_END_SEP}"


class LiveRequestIds:
    """The ids of an engine's requests whose stream is open. The scheduler keys requests by id, so a second live
    request under the same id would receive (and abort) the first one's tokens: `claim` refuses it."""

    __slots__ = ("_ids",)

    def __init__(self) -> None:
        self._ids: set[str] = set()

    def claim(self, request_id: str | None) -> str:
        """The request's id (a new one if none is given), held until `release`."""
        request_id = request_id or new_request_id()
        if request_id in self._ids:
            raise InvalidRequestError(
                f"request_id: {request_id!r} is already in use by a running request", param="request_id"
            )
        self._ids.add(request_id)
        return request_id

    def release(self, request_id: str) -> None:
        self._ids.discard(request_id)
