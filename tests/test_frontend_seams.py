"""The front end's seams: the engine-core client interface (both implementations, same answers), the
`Admitted` message in one process and across the wire, the one request-id scheme, and admission's pieces
(room, retry, the answer to an `AddRequest`)."""

from __future__ import annotations

import anyio
import pytest
from sluice.core import AsyncEngine, EngineArgs, EngineOverloaded, SamplingParams
from sluice.core.engine_core.process import StepCollector
from sluice.core.errors import EngineDeadError, EngineStoppedError
from sluice.core.frontend.admission import Admission, request_admission, request_admission_until_room
from sluice.core.frontend.core_client import CoreClient
from sluice.core.frontend.engine import make_client
from sluice.core.frontend.engine_core_client import EngineCoreClient, SharedCore
from sluice.core.frontend.inproc_client import InprocClient
from sluice.core.frontend.request_actor import RequestLimits, make_requests, run_request
from sluice.core.ipc import wire
from sluice.core.messages import AddRequest, Admitted, TokenEvent, refusal, refuse_queued
from sluice.core.models.loader import resolve_model
from sluice.core.request import Request
from sluice.core.request_ids import front_end_prefix, sequence_id, sequence_prefix
from sluice.core.stats import EngineStats

TINY = dict(model="dummy:tiny", device="cpu", num_kv_blocks=128, max_model_len=256)
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


# -- the engine-core client ------------------------------------------------------------------------------------
def test_make_client_picks_the_implementation_from_the_arguments():
    source = resolve_model("dummy:tiny")
    inproc = make_client(EngineArgs(**TINY, engine_core_process=False), source, 256)
    own = make_client(EngineArgs(**TINY, engine_core_process=True), source, 256)
    inspected = make_client(EngineArgs(**TINY, engine_core_process=True, enable_inspector=True), source, 256)
    shared = make_client(EngineArgs(**TINY, engine_core_process=False), source, 256, SharedCore(1, None, 0))
    assert type(inproc) is InprocClient and type(inspected) is InprocClient
    assert type(own) is CoreClient and type(shared) is CoreClient
    assert all(isinstance(c, EngineCoreClient) for c in (inproc, own, inspected, shared))


async def test_both_clients_serve_the_same_tokens_and_answer_the_same_questions():
    tokens = []
    for own_process in (False, True):
        async with AsyncEngine(EngineArgs(**TINY, engine_core_process=own_process)) as engine:
            assert engine.is_healthy and engine.health_error() is None
            assert (engine.core_pid is not None) == own_process
            assert (engine.local_core is None) == own_process
            outs = [o async for o in engine.generate([5, 6, 7, 8], GREEDY)]
            assert outs[-1].finished and len(outs[-1].token_ids) == 6
            stats = engine.stats()
            assert stats.healthy and stats.generation_tokens >= 6
            assert engine.inspector is None
            assert engine.limits.max_kv_tokens == 128 * engine.args.block_size
            if not own_process:
                assert len(engine.kv_caches) > 0 and engine.host_profile().steps > 0
            tokens.append(outs[-1].token_ids)
    assert tokens[0] == tokens[1]


# -- Admitted ----------------------------------------------------------------------------------------------------
def test_admitted_crosses_the_wire_ahead_of_the_events():
    collector = StepCollector()
    ev = TokenEvent("1:a", [5])
    collector.send_nowait(Admitted("1:a"))
    collector.send_nowait(ev)

    async def take():
        return await collector.take()

    admitted, events = anyio.run(take)
    assert admitted == ["1:a"] and events == [ev]
    step = wire.CoreStep([wire.event_to_wire(e) for e in events], EngineStats(), admitted)
    back = wire.core_decoder.decode(wire.core_encoder.encode(step))
    assert back.admitted == ["1:a"] and wire.event_from_wire(back.events[0]) == ev
    # a step without admissions: the field's default
    plain = wire.core_decoder.decode(wire.core_encoder.encode(wire.CoreStep([], EngineStats())))
    assert plain.admitted == []


async def test_the_scheduler_answers_admission_with_admitted():
    async with AsyncEngine(EngineArgs(**TINY, engine_core_process=False)) as engine:
        (req,) = make_requests("adm", [1, 2, 3], GREEDY, (), engine.limits)
        send, recv = anyio.create_memory_object_stream(16)
        async with recv:
            assert await engine.submit(AddRequest([req], send))
            with anyio.fail_after(20):
                first = await recv.receive()
                assert first == Admitted("adm")
                async for ev in recv:
                    if ev.finish_reason is not None:
                        break
            assert isinstance(ev, TokenEvent) and ev.finish_reason == "length"


def test_a_closing_inbox_refuses_what_is_queued_with_the_engines_failure_or_a_stop():
    """`refuse_queued`: requests still queued when an inbox closes are answered, with the failure that closed it
    (a failed bridge: `EngineDeadError`, code engine_dead) or, on a plain stop, `EngineStoppedError`."""
    limits = RequestLimits(64, 100, 1024)
    for error, expected in ((None, EngineStoppedError), (EngineDeadError("bridge failed"), EngineDeadError)):
        inbox_send, inbox = anyio.create_memory_object_stream(4)
        events_send, events = anyio.create_memory_object_stream(4)
        (req,) = make_requests("queued", [1, 2, 3], GREEDY, (), limits)
        inbox_send.send_nowait(AddRequest([req], events_send))
        refuse_queued(inbox, error)
        ev = events.receive_nowait()
        assert ev.request_id == "queued" and ev.finish_reason == "abort" and type(ev.error) is expected


# -- request ids ---------------------------------------------------------------------------------------------------
def test_one_request_id_scheme():
    assert sequence_id("r", 2) == "r#2" and sequence_id("r", 2).startswith(sequence_prefix("r"))
    assert front_end_prefix(1) + sequence_id("chatcmpl-abc", 2) == "1:chatcmpl-abc#2"
    assert SharedCore(3, None, 0).id_prefix == front_end_prefix(3)


# -- admission -------------------------------------------------------------------------------------------------------
class _Answering:
    """An inbox whose scheduler answers each `AddRequest` with the next of ``answers`` (None: admitted)."""

    def __init__(self, answers: list) -> None:
        self.answers = answers
        self.sent: list = []

    async def submit(self, msg) -> bool:
        self.sent.append(msg)
        if not isinstance(msg, AddRequest):
            return True
        error = self.answers.pop(0)
        rid = msg.requests[0].request_id
        msg.events.send_nowait(Admitted(rid) if error is None else refusal(rid, error))
        if error is None:
            msg.events.send_nowait(TokenEvent(rid, [7], finish_reason="length"))
        return True


async def test_request_admission_answers_admitted_refused_or_stopped():
    inbox = _Answering([None, EngineOverloaded("full")])
    send, recv = anyio.create_memory_object_stream(8)
    msg = AddRequest([Request("a", [1, 2], GREEDY, 4)], send)
    assert await request_admission(inbox.submit, msg, recv) is None
    await recv.receive()  # its token
    assert isinstance(await request_admission(inbox.submit, msg, recv), EngineOverloaded)

    async def stopped(_msg) -> bool:
        return False

    assert isinstance(await request_admission(stopped, msg, recv), EngineStoppedError)
    again = _Answering([EngineOverloaded("full"), EngineOverloaded("full"), None])
    assert await request_admission_until_room(again.submit, msg, recv, pause_s=0) is None
    assert len(again.sent) == 3
    await recv.receive()  # its token
    given_up = _Answering([EngineOverloaded("full")])
    refused = await request_admission_until_room(given_up.submit, msg, recv, gave_up=lambda: True, pause_s=0)
    assert isinstance(refused, EngineOverloaded)


async def test_admission_room_retries_a_waiting_caller_and_refuses_one_that_does_not_wait(default_tokenizer):
    waits: list[int] = []

    async def wait_for_room(n: int) -> None:
        waits.append(n)

    admission = Admission(4, wait_for_room)
    inbox = _Answering([EngineOverloaded("full"), None])
    limits = RequestLimits(256, 49152, 4096)
    send_q, recv_q = anyio.create_memory_object_stream(8)

    async def forward() -> None:  # the request actor's inbox, answered by `inbox`
        async for msg in recv_q:
            await inbox.submit(msg)

    async def attempt(wait: bool) -> list:
        async with admission.room(1, wait) as room:
            while True:
                try:
                    return [o async for o in run_request("r", [1, 2, 3], GREEDY, (), limits, default_tokenizer, send_q)]
                except EngineOverloaded as e:
                    await room.retry_after(e)

    async with anyio.create_task_group() as tg:
        tg.start_soon(forward)
        outs = await attempt(True)
        assert waits == [1] and outs[-1].token_ids == [7] and admission.gate.free == 4
        inbox.answers = [EngineOverloaded("full")]
        with pytest.raises(EngineOverloaded):
            await attempt(False)
        assert waits == [1]
        tg.cancel_scope.cancel()
