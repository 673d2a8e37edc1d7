"""The messages between the front end and the engine core when they run in two processes, and their codec.

msgspec Structs encoded as msgpack arrays (``array_like``: no field names on the wire), tagged so one socket
carries several kinds. They mirror the in-process messages of `core/messages.py` (`AddRequest`, `AbortRequest`,
`EndAllRequests`, `Admitted`, `TokenEvent`); the bridges (`core/frontend/core_client.py`,
`core/engine_core/process.py`) convert at the socket, so the actors on either side see the same objects as in
one process.

Front end -> core: one `FrontBatch` per wake-up of the front's bridge (every message queued by then).
Core -> front end: one `CoreStep` per engine step (the requests admitted since the last one, every request's
new tokens, logprobs and finishes of the step, and the engine's counters; to each front end its own requests',
when several share the core), and `CoreReady` / `CoreFailed` once at start.
"""

from __future__ import annotations

import msgspec
from sluice.core import errors as E
from sluice.core.messages import AbortRequest, AddRequest, EndAllRequests, TokenEvent
from sluice.core.outputs import TokenLogprob
from sluice.core.request import Request
from sluice.core.sampling_params import SamplingParams
from sluice.core.stats import EngineStats


class WireError(msgspec.Struct, array_like=True):
    """An exception by its class name and message: sluice's own errors come back as themselves (an overload is
    still `EngineOverloaded`); anything else as a `RuntimeError` (the request actor wraps it, as in one process)."""

    kind: str
    message: str
    param: str | None = None


class WireSequence(msgspec.Struct, array_like=True):
    request_id: str
    params: SamplingParams  # its own: an n > 1 request's sequences differ in seed


class AddMsg(msgspec.Struct, tag="add", array_like=True):
    """An `AddRequest`: the prompt once, however many sequences share it."""

    prompt_token_ids: list[int]
    sequences: list[WireSequence]
    max_tokens: int
    eos_token_ids: tuple[int, ...]
    arrival_time: float  # time.monotonic(): one clock for every process of the host
    final_only: bool


class AbortMsg(msgspec.Struct, tag="abort", array_like=True):
    request_id: str


class EndAllMsg(msgspec.Struct, tag="end_all", array_like=True):
    error: WireError


class ShutdownMsg(msgspec.Struct, tag="shutdown", array_like=True):
    """This front end is done. The core stops (its `async with` ends, then its process) once every front end it
    serves has said so."""


FrontMsg = AddMsg | AbortMsg | EndAllMsg | ShutdownMsg


class FrontBatch(msgspec.Struct, array_like=True):
    messages: list[FrontMsg]


class WireEvent(msgspec.Struct, array_like=True):
    """A `TokenEvent`."""

    request_id: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    stop_reason: int | None = None
    num_cached_tokens: int = 0
    error: WireError | None = None
    first_token_time: float | None = None


class CoreStep(msgspec.Struct, tag="step", array_like=True):
    """One step's messages. ``admitted`` (`Admitted`'s request ids) come first: a request's admission always
    precedes its events, so a receiver that hands these out before ``events`` keeps each request's order."""

    events: list[WireEvent]
    stats: EngineStats
    admitted: list[str] = msgspec.field(default_factory=list)


class CoreReady(msgspec.Struct, tag="ready", array_like=True):
    """The model is loaded: what the front end needs to validate requests."""

    num_kv_blocks: int
    pid: int
    stats: EngineStats


class CoreFailed(msgspec.Struct, tag="failed", array_like=True):
    """Building the engine failed (a bad model, no memory for the KV pool): the front end raises it."""

    error: WireError


CoreMsg = CoreStep | CoreReady | CoreFailed

front_encoder = msgspec.msgpack.Encoder()
front_decoder = msgspec.msgpack.Decoder(FrontBatch)
core_encoder = msgspec.msgpack.Encoder()
core_decoder = msgspec.msgpack.Decoder(CoreMsg)

# The errors that cross as themselves; `InvalidRequestError` keeps its ``param``.
_KNOWN = {
    cls.__name__: cls
    for cls in (
        E.SluiceError,
        E.EngineDeadError,
        E.EngineOverloaded,
        E.EngineStoppedError,
        E.InvalidRequestError,
        E.InvalidStructuredOutput,
        E.ModelLoadError,
        E.RequestFailedError,
        E.WorkerDiedError,
    )
}


def error_to_wire(e: BaseException) -> WireError:
    return WireError(type(e).__name__, str(e), getattr(e, "param", None))


def error_from_wire(w: WireError) -> Exception:
    cls = _KNOWN.get(w.kind)
    if cls is None:
        return RuntimeError(w.message if w.kind == "RuntimeError" else f"{w.kind}: {w.message}")
    if issubclass(cls, E.InvalidRequestError):
        return cls(w.message, param=w.param)
    return cls(w.message)


# -- front end -> core ----------------------------------------------------------------------------------------
def add_to_wire(msg: AddRequest, id_prefix: str = "") -> AddMsg:
    first = msg.requests[0]
    return AddMsg(
        first.prompt_token_ids,
        [WireSequence(id_prefix + r.request_id, r.sampling_params) for r in msg.requests],
        first.max_tokens,
        first.eos_token_ids,
        first.arrival_time,
        msg.final_only,
    )


def add_from_wire(msg: AddMsg, events) -> AddRequest:
    requests = [
        Request(
            s.request_id,
            # each sequence owns its list: the scheduler grows them independently
            msg.prompt_token_ids if i == 0 else list(msg.prompt_token_ids),
            s.params,
            msg.max_tokens,
            msg.eos_token_ids,
            arrival_time=msg.arrival_time,
        )
        for i, s in enumerate(msg.sequences)
    ]
    return AddRequest(requests, events, final_only=msg.final_only)


def front_to_wire(msg: AddRequest | AbortRequest | EndAllRequests, id_prefix: str = "") -> FrontMsg:
    """``id_prefix``: one of several front ends sharing a core marks its request ids with it (`SharedCore`)."""
    if isinstance(msg, AddRequest):
        return add_to_wire(msg, id_prefix)
    if isinstance(msg, AbortRequest):
        return AbortMsg(id_prefix + msg.request_id)
    return EndAllMsg(error_to_wire(msg.error))


# -- core -> front end ----------------------------------------------------------------------------------------
def event_to_wire(ev: TokenEvent) -> WireEvent:
    return WireEvent(
        ev.request_id,
        ev.token_ids,
        ev.logprobs,
        ev.finish_reason,
        ev.stop_reason,
        ev.num_cached_tokens,
        None if ev.error is None else error_to_wire(ev.error),
        ev.first_token_time,
    )


def event_from_wire(w: WireEvent) -> TokenEvent:
    return TokenEvent(
        w.request_id,
        w.token_ids,
        w.logprobs,
        w.finish_reason,
        w.stop_reason,
        w.num_cached_tokens,
        None if w.error is None else error_from_wire(w.error),
        w.first_token_time,
    )
