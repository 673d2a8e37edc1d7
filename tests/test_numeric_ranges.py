"""The range rule (`sluice.core.param_ranges`): every numeric request field is checked at the edge against what
every layer can carry, by the HTTP models and `SamplingParams` alike; a message the bridge to the core cannot
encode fails its own request only; ``n`` over ``max_num_seqs`` is bad input; an engine that fails says so
(``engine_dead``), not that it shuts down."""

from __future__ import annotations

import math

import anyio
import pytest
from sluice.core import EngineArgs, EngineDeadError, InvalidRequestError, SamplingParams
from sluice.core.errors import EngineStoppedError, RequestFailedError

from tests.helpers import EngineInTask

# The values a client can send that a layer behind the edge cannot carry, or that mean nothing.
EXTREMES = [2**63, 2**64, -(2**63) - 1, 1e308, math.nan, math.inf, -math.inf, 0, -1]


def tiny_args(**kw) -> EngineArgs:
    return EngineArgs(**{**dict(model="dummy:tiny", device="cpu", num_kv_blocks=64, max_model_len=128), **kw})


# --------------------------------------------------------------------------- the one table


@pytest.mark.parametrize("field", ["max_tokens", "min_tokens", "n"])
@pytest.mark.parametrize("value", [2**63, 2**64, 2**70])
def test_counts_past_int64_are_refused_naming_the_field(field, value):
    """max_tokens = 2**64 passed validation and then failed the bridge's msgpack encoding: the engine stopped."""
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**{field: value})
    assert e.value.param == field and repr(value) in str(e.value)


def test_every_ranged_field_of_sampling_params_refuses_what_no_layer_carries():
    from sluice.core.param_ranges import PARAM_RANGES
    from sluice.core.sampling_params import _RANGED

    assert set(_RANGED) == set(PARAM_RANGES) - {"token_id"}
    for name in _RANGED:
        rng = PARAM_RANGES[name]
        for value in (rng.hi, rng.lo if not rng.lo_open else None):
            if value is not None and not (name == "top_k" and value == 0):
                SamplingParams(**{name: value, **({"max_tokens": None} if name == "min_tokens" else {})})
        past = rng.hi + 1 if rng.kind is int else 1e308  # float32's largest + 1 rounds back to itself
        for value in (math.nan, math.inf, -math.inf, past, rng.lo - 1, True):
            with pytest.raises(InvalidRequestError) as e:
                SamplingParams(**{name: value})
            assert e.value.param == name


def test_stop_token_ids_past_int64_are_refused():
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(stop_token_ids=[1, 2**64])
    assert e.value.param == "stop_token_ids" and str(2**64) in str(e.value)


def numeric_fields(model) -> dict[str, bool]:
    """Every field of a pydantic request model that holds a number, or a list of numbers (True), from its
    annotation: a new numeric field is found without a list to update."""
    import typing

    def kinds(tp) -> set:
        if tp in (int, float):
            return {"scalar"}
        origin = typing.get_origin(tp)
        if origin is list:
            return {"list"} if kinds(typing.get_args(tp)[0]) else set()
        if origin is typing.Annotated:
            return kinds(typing.get_args(tp)[0])
        return set().union(*(kinds(a) for a in typing.get_args(tp))) if typing.get_args(tp) else set()

    out = {}
    for name, f in model.model_fields.items():
        k = kinds(f.annotation)
        if k:
            out[name] = "list" in k and "scalar" not in k
    return out


def test_every_numeric_field_of_the_http_schema_is_bounded_within_the_wire():
    """The OpenAPI document (generated from the models) bounds every integer and number on both sides, within
    what msgpack carries (int64 / uint64) and float32 for the sampler's floats."""
    from sluice.app.server import schemas as S
    from sluice.app.server.openapi import openapi_schema

    defs = openapi_schema()["components"]["schemas"]
    for model in (S.ChatCompletionRequest, S.CompletionRequest):
        fields = numeric_fields(model)
        assert {"max_tokens", "min_tokens", "n", "seed", "temperature", "stop_token_ids"} <= set(fields)
        for name in fields:
            prop = defs[model.__name__]["properties"][name]
            numeric = [s for s in _leaves(prop) if s.get("type") in ("integer", "number")]
            assert numeric, (model.__name__, name, prop)
            for s in numeric:
                lo = s.get("minimum", s.get("exclusiveMinimum"))
                hi = s.get("maximum")
                assert lo is not None and hi is not None, (model.__name__, name, s)
                assert -(2**63) <= lo and hi <= (2**64 - 1 if s["type"] == "integer" else 3.5e38), (name, s)


def _leaves(schema: dict) -> list[dict]:
    out = [schema]
    for key in ("anyOf", "oneOf"):
        for s in schema.get(key, []):
            out += _leaves(s)
    if "items" in schema:
        out += _leaves(schema["items"])
    return out


# --------------------------------------------------------------------------- one unsendable request


async def test_a_request_the_bridge_cannot_encode_fails_alone(monkeypatch):
    """Inject an encoding failure for one request (whatever the range rule may miss some day): it ends with
    `RequestFailedError`, an innocent request sent with it completes, and the engine stays healthy."""
    from sluice.core.ipc import wire

    real = wire.front_encoder

    class PoisonEncoder:
        def encode(self, msg):
            items = msg.messages if isinstance(msg, wire.FrontBatch) else [msg]
            for m in items:
                if isinstance(m, wire.AddMsg) and any(s.request_id.startswith("poison") for s in m.sequences):
                    raise OverflowError("can't serialize (injected)")
            return real.encode(msg)

    monkeypatch.setattr(wire, "front_encoder", PoisonEncoder())
    holder = EngineInTask(tiny_args(engine_core_process=True))
    engine = await holder.start()
    try:
        results: dict[str, object] = {}

        async def run(rid: str, max_tokens: int) -> None:
            params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
            try:
                outs = [o async for o in engine.generate([5, 6, 7], params, request_id=rid) if o.finished]
                results[rid] = len(outs[0].token_ids)
            except Exception as e:  # noqa: BLE001 - the test looks at what each request got
                results[rid] = e

        async with anyio.create_task_group() as tg:  # queued together: one batch to the core
            tg.start_soon(run, "innocent", 12)
            tg.start_soon(run, "poison", 4)
        assert results["innocent"] == 12, results
        assert isinstance(results["poison"], RequestFailedError), results
        assert engine.is_healthy
        outs = [o async for o in engine.generate([1, 2], SamplingParams(max_tokens=3, ignore_eos=True)) if o.finished]
        assert len(outs[0].token_ids) == 3
    finally:
        await holder.stop()


# --------------------------------------------------------------------------- n over max_num_seqs


async def test_n_over_max_num_seqs_is_invalid_naming_the_limit():
    """A step's buffers hold max_num_seqs rows: a wider group was admitted alone and then failed (a 500)."""
    holder = EngineInTask(tiny_args(max_num_seqs=2, max_waiting_requests=16))
    engine = await holder.start()
    try:
        for wait in (True, False):
            with pytest.raises(InvalidRequestError) as e:
                async for _ in engine.generate([1, 2, 3], SamplingParams(n=3, max_tokens=2), wait_for_room=wait):
                    pass
            assert e.value.param == "n" and "max_num_seqs" in str(e.value)
        outs = [o async for o in engine.generate([1, 2, 3], SamplingParams(n=2, max_tokens=2)) if o.finished]
        assert len(outs) == 2 and engine.is_healthy
    finally:
        await holder.stop()


# --------------------------------------------------------------------------- error codes


@pytest.mark.parametrize("split", [False, True], ids=["one-process", "core-process"])
async def test_an_engine_that_fails_ends_its_requests_as_dead_not_stopped(monkeypatch, split):
    """A failure inside the engine (here: an exception in its bridge, or in its scheduler's loop) ends the
    requests in flight with `EngineDeadError` (HTTP code engine_dead), not `EngineStoppedError`
    (server_shutting_down, which a client reads as a planned restart)."""
    from sluice.app.server.errors import engine_error
    from sluice.core.frontend import core_client
    from sluice.core.sched.scheduler import Scheduler

    real_send = core_client.zmq_io.send
    holder = EngineInTask(tiny_args(engine_core_process=split))
    engine = await holder.start()
    failed = {"armed": False}

    def fail_send(sock, data):
        if failed["armed"]:
            raise RuntimeError("the bridge broke (injected)")
        return real_send(sock, data)

    def fail_update(self, so, out):
        raise RuntimeError("the scheduler broke (injected)")

    if split:
        monkeypatch.setattr(core_client.zmq_io, "send", fail_send)
    else:
        monkeypatch.setattr(Scheduler, "update_from_output", fail_update)
    raised: BaseException | None = None
    try:
        failed["armed"] = True
        with pytest.raises(EngineDeadError) as e:
            async for _ in engine.generate([1, 2, 3], SamplingParams(max_tokens=8, ignore_eos=True)):
                pass
        assert not isinstance(e.value, EngineStoppedError), e.value
        assert engine_error(e.value).code == "engine_dead"
    finally:
        try:
            await holder.stop()
        except BaseException as exc:  # noqa: BLE001 - the engine's task group re-raises the injected failure
            raised = exc
    assert raised is not None and "injected" in repr(raised)
