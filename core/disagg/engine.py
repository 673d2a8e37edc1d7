"""Prefill/decode disaggregation: `DisaggEngine`, a prefill engine and a decode engine behind one
`AsyncEngine`-shaped front end, with each prompt's KV shipped from the first to the second.

A long prompt's prefill then never stalls anyone's decode steps (chunked prefill only softens that): the
prefill engine (``kv_role="prefill"``, its own device) runs prompts, the decode engine (``kv_role="decode"``,
another device) runs everyone's decode steps.

One request's path, driven by the pair's router (one task per request, `DisaggEngine._route`):

1. **prefill**: the request runs on the prefill engine with ``max_tokens=1``. Its first token goes to the
   caller at once (time to first token is the prefill's), and the prefill scheduler pins the prompt's full
   KV blocks (`core/sched/disagg.py`). A request that ends with that token (EOS, ``max_tokens=1``) ends
   there; its pins are dropped.
2. **transfer**: the decode engine reserves blocks for the prompt's full blocks (minus any it has cached
   already), the prefill blocks are gathered into a staging copy and released, the copy crosses
   `KVTransport` (torch.distributed: gloo between CPU pools, NCCL between GPUs) in a worker thread and is
   written into the reserved blocks, which are then published in the decode engine's prefix cache under
   the same content hashes. The engines keep stepping meanwhile.
3. **decode**: the request is admitted to the decode engine with its first token already known (as a
   preempted request resumes): its prefix lookup hits every shipped block, so only the prompt's last partial
   block and the first token are computed, and decoding goes on; its tokens stream to the caller.

Failures never cost a wrong token. A transfer that fails or times out (`kv_transfer_timeout`), or a decode
pool with no room for the blocks, leaves the reserved blocks unpublished: the decode engine recomputes the
prompt (counted in `PairStats.num_recomputed`). A cancelled request is aborted on both engines, and every pin
it held on either side is dropped. An engine that dies fails its requests with `EngineDeadError`; the pair
is unhealthy from then on (``/health`` answers 503) and refuses new requests.

Requests the pair does not split: ``n > 1`` (their forks share the prompt's last block on one engine) and
prompts shorter than one block (nothing to ship) go to the decode engine whole.

Both engines live in this process, on one event loop; each runs its steps in its own worker thread, on its
own device. Detokenization, stop strings and streaming are the caller's `run_request`, as for one engine:
the router stands in for an engine's scheduler inbox.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, fields, replace
from typing import Any

import anyio
import torch
from sluice.core.args import EngineArgs
from sluice.core.errors import (
    EngineDeadError,
    EngineOverloaded,
    EngineStoppedError,
    InvalidRequestError,
    SluiceError,
)
from sluice.core.frontend.admission import Admission, request_admission, request_admission_until_room
from sluice.core.frontend.engine import AsyncEngine, Prompt
from sluice.core.frontend.request_actor import run_request
from sluice.core.messages import (
    AbortRequest,
    AddRequest,
    Admitted,
    EndAllRequests,
    TokenEvent,
    refusal,
    refuse_queued,
    reply,
)
from sluice.core.outputs import RequestOutput
from sluice.core.request import Request
from sluice.core.request_ids import LiveRequestIds
from sluice.core.sampling_params import SamplingParams
from sluice.core.sched.disagg import (
    CommitBlocks,
    KVOp,
    ReleaseBlocks,
    ReleaseShipment,
    ReserveBlocks,
    TakeShipment,
)
from sluice.core.stats import EngineStats
from sluice.kv.transfer import (
    KVTransport,
    TransferFailed,
    TransferStats,
    gather_blocks,
    payload_dtype,
    payload_shape,
    scatter_blocks,
)

logger = logging.getLogger("sluice")


@dataclass(slots=True)
class PairStats:
    """What the pair's router did with its requests (cumulative)."""

    num_split: int = 0  # prefill engine, then decode engine
    num_direct: int = 0  # decode engine alone (n > 1, prompts under one block)
    num_ended_at_prefill: int = 0  # their first token ended them
    num_shipped: int = 0  # decode admitted them with shipped blocks
    num_recomputed: int = 0  # the transfer failed or found no room: decode recomputed the prompt
    num_local_blocks: int = 0  # full prompt blocks the decode engine had cached already (not shipped)
    num_cancelled_in_transfer: int = 0  # cancelled between their first token and the decode engine
    prompt_tokens: int = 0


@dataclass(slots=True)
class _Route:
    request_id: str
    aborted: bool = False


class DisaggEngine:
    """``async with DisaggEngine(EngineArgs(...), prefill_device="cuda:0", decode_device="cuda:1") as engine:
    async for out in engine.generate(...)``: the same calls as `AsyncEngine`.

    ``args`` configure both engines (``kv_role`` and ``device`` are set per engine); ``prefill_args`` /
    ``decode_args`` override fields of one engine only (for instance a larger token budget for prefill)."""

    def __init__(
        self,
        args: EngineArgs | None = None,
        prefill_device: str | None = None,
        decode_device: str | None = None,
        prefill_args: dict[str, Any] | None = None,
        decode_args: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        self.args = args if args is not None else EngineArgs.from_kwargs(**kwargs)
        known = {f.name for f in fields(EngineArgs)}
        for extra in (prefill_args, decode_args):
            bad = set(extra or ()) - known
            if bad:
                raise InvalidRequestError(f"unknown engine argument(s): {', '.join(sorted(bad))}")
        # Both engine cores run in this process (engine_core_process off): the transfer reads and writes their KV
        # pools, and the router talks to their scheduler actors directly.
        one_process = {"engine_core_process": False}
        self.prefill = AsyncEngine(
            replace(
                self.args,
                kv_role="prefill",
                device=prefill_device or self.args.device,
                **{**one_process, **(prefill_args or {})},
            ),
            paired=True,  # each is half of this pair (AsyncEngine refuses alone)
        )
        self.decode = AsyncEngine(
            replace(
                self.args,
                kv_role="decode",
                device=decode_device or self.args.device,
                **{**one_process, **(decode_args or {})},
            ),
            paired=True,
        )
        self.pair_stats = PairStats()
        self.transport: KVTransport | None = None
        self._routes: dict[str, _Route] = {}
        self._live_ids = LiveRequestIds()
        self._stack: contextlib.AsyncExitStack | None = None
        self._tg: anyio.abc.TaskGroup | None = None

    # -- lifecycle ---------------------------------------------------------------------------------
    async def __aenter__(self) -> DisaggEngine:
        if self._stack is not None:
            raise SluiceError("the engine pair is already running: `async with` may be entered once at a time")
        stack = contextlib.AsyncExitStack()
        try:
            await stack.enter_async_context(self.prefill)
            await stack.enter_async_context(self.decode)
            self._check_layouts()
            p, d = self.prefill.kv_caches, self.decode.kv_caches
            self.transport = KVTransport(p[0].device, d[0].device, self.args.kv_transfer_timeout)
            self._inbox_send, inbox_recv = anyio.create_memory_object_stream(self.args.max_waiting_requests * 4 + 64)
            # no burst window: the router stands between the callers and the schedulers
            self._admission = Admission(self.args.max_num_seqs + self.args.max_waiting_requests, _moment)
            # transfers one at a time (the transport is one ordered lane); the staging copies are made in it too
            self._lane = anyio.CapacityLimiter(1)
            self._tg = await stack.enter_async_context(anyio.create_task_group())
            self._tg.start_soon(self._router, inbox_recv)
        except BaseException:
            await stack.aclose()
            raise
        self._stack = stack
        return self

    async def __aexit__(self, *exc) -> bool | None:
        assert self._stack is not None and self._tg is not None
        if self.transport is not None:
            self.transport.kill()  # a transfer in flight ends now, not at its timeout
        self._tg.cancel_scope.cancel()
        stack, self._stack, self._tg = self._stack, None, None
        await stack.aclose()
        return None

    def _check_layouts(self) -> None:
        # The transfer reads and writes the pools where the executors keep them (both in this process).
        p, d = self.prefill.kv_caches, self.decode.kv_caches
        if len(p) != len(d) or payload_shape(p, 1) != payload_shape(d, 1) or payload_dtype(p) != payload_dtype(d):
            raise InvalidRequestError(
                f"the prefill and decode engines' KV layouts differ ({len(p)} x {tuple(p[0].shape[2:])} {p[0].dtype} "
                f"vs {len(d)} x {tuple(d[0].shape[2:])} {d[0].dtype}): both must serve the same model, dtype and "
                "block size"
            )

    # -- the AsyncEngine surface -----------------------------------------------------------------------
    @property
    def model_name(self) -> str:
        return self.decode.model_name

    @property
    def tokenizer(self):
        return self.decode.tokenizer

    @property
    def max_model_len(self) -> int:
        return min(self.prefill.max_model_len, self.decode.max_model_len)

    @property
    def is_running(self) -> bool:
        return self._tg is not None

    @property
    def is_healthy(self) -> bool:
        return self._tg is not None and self.prefill.is_healthy and self.decode.is_healthy

    @property
    def inspector(self) -> None:
        return None

    @property
    def transfer_stats(self) -> TransferStats:
        return self.transport.stats if self.transport is not None else TransferStats()

    def _dead(self) -> str | None:
        for name, engine in (("prefill", self.prefill), ("decode", self.decode)):
            if engine.is_running and not engine.is_healthy:
                return f"the {name} engine is dead: {engine.health_error()}"
        return None

    def stats(self) -> EngineStats:
        """Both engines' counters, added up (KV blocks of both pools); the prefix cache is the prefill engine's
        (the decode engine's hits are the shipped blocks), prompt tokens are counted once."""
        p, d = self.prefill.stats(), self.decode.stats()
        return EngineStats(
            num_running=p.num_running + d.num_running,
            num_waiting=p.num_waiting + d.num_waiting,
            kv_blocks_total=p.kv_blocks_total + d.kv_blocks_total,
            kv_blocks_free=p.kv_blocks_free + d.kv_blocks_free,
            num_preemptions=p.num_preemptions + d.num_preemptions,
            prefix_cache_queries=p.prefix_cache_queries,
            prefix_cache_hits=p.prefix_cache_hits,
            num_steps=p.num_steps + d.num_steps,
            prompt_tokens=self.pair_stats.prompt_tokens,
            generation_tokens=p.generation_tokens + d.generation_tokens,
            healthy=self.is_healthy,
        )

    async def generate(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        final_only: bool = False,
        wait_for_room: bool = True,
    ) -> AsyncIterator[RequestOutput]:
        """As `AsyncEngine.generate`, through the pair."""
        arrival = time.time()
        if self._tg is None:
            raise SluiceError("engine pair is not running: use `async with DisaggEngine(...) as engine`")
        dead = self._dead()
        if dead is not None:
            raise EngineDeadError(dead)
        params = params or SamplingParams()
        engine = self.decode
        prompt_ids = await engine.tokenize_off_loop(prompt)
        request_id = self._live_ids.claim(request_id)
        # a request must fit both pools
        limits = replace(
            engine.limits, max_kv_tokens=min(self.prefill.limits.max_kv_tokens, engine.limits.max_kv_tokens)
        )
        try:
            async with self._admission.room(params.n, wait_for_room) as room:
                while True:
                    try:
                        async for out in run_request(
                            request_id,
                            prompt_ids,
                            params,
                            engine.eos_token_ids,
                            limits,
                            engine.tokenizer,
                            self._inbox_send,
                            final_only,
                            arrival_time=arrival,
                        ):
                            yield out
                        return
                    except EngineOverloaded as e:
                        await room.retry_after(e)
        finally:
            self._live_ids.release(request_id)

    async def abort(self, request_id: str) -> None:
        if self._tg is not None:
            await self._inbox_send.send(AbortRequest(request_id))

    async def end_all_requests(self, error: Exception) -> None:
        if self._tg is not None:
            await self._inbox_send.send(EndAllRequests(error))

    # -- the router: stands in for a scheduler's inbox -----------------------------------------------------
    async def _router(self, inbox) -> None:
        try:
            async with inbox, anyio.create_task_group() as tg:
                await self._serve_inbox(inbox, tg)
        finally:
            # The pair stops: requests still queued here are refused (routed ones end in `_route`), later ones
            # find the inbox closed.
            refuse_queued(inbox, EngineStoppedError("the engine pair stopped before the request was admitted"))

    async def _serve_inbox(self, inbox, tg) -> None:
        async for msg in inbox:
            if isinstance(msg, AddRequest):
                tg.start_soon(self._route, msg)
            elif isinstance(msg, AbortRequest):
                route = self._routes.get(msg.request_id)
                if route is not None:
                    route.aborted = True  # checked between the stages
                # wherever it is now: an abort for an id an engine does not hold is ignored there
                for engine in (self.prefill, self.decode):
                    await engine.submit(AbortRequest(msg.request_id))
            elif isinstance(msg, EndAllRequests):
                for engine in (self.prefill, self.decode):
                    await engine.submit(msg)

    async def _route(self, msg: AddRequest) -> None:
        req = msg.requests[0]
        rid = req.request_id
        self.pair_stats.prompt_tokens += req.num_prompt_tokens
        if len(msg.requests) > 1 or req.num_prompt_tokens < self.args.block_size:
            self.pair_stats.num_direct += 1
            if not await self.decode.submit(msg):
                reply(msg.events, _refused(rid, "the decode engine has stopped"))
            return
        route = self._routes[rid] = _Route(rid)
        try:
            await self._split(msg, req, route)
        except anyio.get_cancelled_exc_class():
            # the pair stops: the caller's loop ends with an error, as each engine ends its own requests
            stopped = EngineStoppedError("the engine pair stopped before the request finished")
            reply(msg.events, refusal(rid, stopped))
            raise
        finally:
            del self._routes[rid]

    async def _split(self, msg: AddRequest, req: Request, route: _Route) -> None:
        rid = req.request_id
        self.pair_stats.num_split += 1
        # 1. prefill: the prompt and its first token
        first = await self._first_token(req, msg.events, route)
        if first is None:
            return  # refused, failed, or its first token ended it: the caller has its answer
        first_token_time = time.time()
        if not msg.final_only:
            reply(
                msg.events,
                TokenEvent(rid, list(first.token_ids), first.logprobs, num_cached_tokens=first.num_cached_tokens),
            )
        # 2. the prompt's KV to the decode engine
        reserved = await self._ship(rid, req, route)
        if route.aborted:
            self.pair_stats.num_cancelled_in_transfer += 1
            if reserved:
                await _ask(self.decode, ReleaseBlocks(rid))
            return
        # 3. decode, from the known first token on
        await self._decode(msg, req, route, first, first_token_time, reserved)

    async def _first_token(self, req: Request, caller: Any, route: _Route) -> TokenEvent | None:
        """Run the prompt on the prefill engine for its first token, answering the caller's admission on the way.
        None when the request goes no further (the caller then has its last event)."""
        rid = req.request_id
        first_req = Request(rid, list(req.prompt_token_ids), req.sampling_params, 1, req.eos_token_ids)
        send, recv = anyio.create_memory_object_stream[Admitted | TokenEvent](4)
        async with recv:
            stopped = EngineDeadError("the prefill engine has stopped")
            refused = await request_admission(self.prefill.submit, AddRequest([first_req], send), recv, stopped)
            if refused is not None:  # overloaded, dead, shutting down
                reply(caller, refusal(rid, refused))
                return None
            reply(caller, Admitted(rid))
            if route.aborted:  # its abort may have reached the prefill engine before the request did
                await self.prefill.submit(AbortRequest(rid))
            ev = await recv.receive()
        if ev.error is not None or ev.finish_reason == "abort" or not ev.token_ids:
            await _ask(self.prefill, ReleaseShipment(rid))
            reply(caller, ev)
            return None
        if ev.finish_reason == "stop" or req.max_tokens <= 1 or req.num_prompt_tokens + 1 >= self.max_model_len:
            # the first token ends it, as it would on one engine
            self.pair_stats.num_ended_at_prefill += 1
            await _ask(self.prefill, ReleaseShipment(rid))
            ev.finish_reason = ev.finish_reason if ev.finish_reason == "stop" else "length"
            reply(caller, ev)
            return None
        return ev

    async def _decode(
        self, msg: AddRequest, req: Request, route: _Route, first: TokenEvent, first_token_time: float, reserved: bool
    ) -> None:
        """Admit the request to the decode engine with its first token known, and relay its tokens."""
        rid, caller = req.request_id, msg.events
        rest = Request(
            rid,
            list(req.prompt_token_ids),
            req.sampling_params,
            req.max_tokens,
            req.eos_token_ids,
            arrival_time=req.arrival_time,
            output_token_ids=list(first.token_ids),
        )
        if msg.final_only:  # its one final event carries the first token too (it is an output token already)
            rest.first_token_time = first_token_time
            rest.output_logprobs = list(first.logprobs) if first.logprobs else None
        send, recv = anyio.create_memory_object_stream[Admitted | TokenEvent](req.max_tokens + 4)
        async with recv:
            # the caller has its first token: wait for room, do not fail it
            refused = await request_admission_until_room(
                self.decode.submit,
                AddRequest([rest], send, final_only=msg.final_only),
                recv,
                EngineDeadError("the decode engine has stopped"),
                gave_up=lambda: route.aborted,
            )
            if refused is not None:
                if reserved:
                    await _ask(self.decode, ReleaseBlocks(rid))
                if not route.aborted:
                    reply(caller, refusal(rid, refused))
                return
            if route.aborted:  # as above, on the decode engine
                await self.decode.submit(AbortRequest(rid))
            async for ev in recv:
                ev.num_cached_tokens = first.num_cached_tokens  # the prefill's prefix-cache hit, not the shipped blocks
                reply(caller, ev)
                if ev.finish_reason is not None:
                    return

    async def _ship(self, rid: str, req: Request, route: _Route) -> bool:
        """Move the prompt's full blocks into the decode engine's prefix cache. Returns whether blocks are
        reserved there (pinned for the request: `ReleaseBlocks` if it never arrives). Never raises for a
        failed transfer: the request then recomputes what did not arrive."""
        src = await _ask(self.prefill, TakeShipment(rid))
        if not src:
            self.pair_stats.num_recomputed += 1
            return False
        reserved = shipped = False
        try:
            bs = self.args.block_size
            answer = None
            if not route.aborted:
                full = list(req.prompt_token_ids[: len(src) * bs])
                answer = await _ask(self.decode, ReserveBlocks(rid, token_ids=full, cache_salt=req.cache_salt))
            if answer is None:
                return False
            reserved = True
            num_local, dst = answer
            self.pair_stats.num_local_blocks += num_local
            if dst:
                async with self._lane:
                    payload = await anyio.to_thread.run_sync(self._gather, src[num_local:])
                    await _ask(self.prefill, ReleaseShipment(rid))
                    src = None
                    await anyio.to_thread.run_sync(self._receive, payload, dst)
            await _ask(self.decode, CommitBlocks(rid, ok=True))
            shipped = True
            return True
        except TransferFailed as e:
            logger.warning("KV transfer of %s failed (%s): the decode engine recomputes its prompt", rid, e)
            if reserved:
                await _ask(self.decode, CommitBlocks(rid, ok=False))
                reserved = False
            return False
        finally:
            if src is not None:
                await _ask(self.prefill, ReleaseShipment(rid))
            if shipped:
                self.pair_stats.num_shipped += 1
            else:
                self.pair_stats.num_recomputed += 1

    def _gather(self, block_ids: list[int]) -> torch.Tensor:
        """The blocks' staging copy, complete (on a GPU, on a side stream, synchronized) before the blocks are
        released: the prefill engine's steps never write full prompt blocks, so it runs beside them."""
        kv = self.prefill.kv_caches
        if kv[0].device.type != "cuda":
            return gather_blocks(kv, block_ids)
        stream = torch.cuda.Stream(kv[0].device)
        with torch.cuda.stream(stream):
            payload = gather_blocks(kv, block_ids)
        stream.synchronize()
        return payload

    def _receive(self, payload: torch.Tensor, dst: list[int]) -> None:
        """Ship the payload and write it into the reserved blocks (nobody reads them before `CommitBlocks`)."""
        assert self.transport is not None
        received = self.transport.transfer(payload)
        kv = self.decode.kv_caches
        if kv[0].device.type != "cuda":
            scatter_blocks(kv, dst, received)
            return
        stream = torch.cuda.Stream(kv[0].device)
        with torch.cuda.stream(stream):
            scatter_blocks(kv, dst, received)
        stream.synchronize()


# -- talking to an engine's scheduler actor -------------------------------------------------------------------
async def _ask(engine: AsyncEngine, op: KVOp) -> Any:
    """A block hand-over's answer (None when the engine has stopped)."""
    send, recv = anyio.create_memory_object_stream[object](1)
    op.reply = send
    async with recv:
        if not await engine.submit(op):
            return None
        # the inbox answers at once, even mid-step; an engine stopping with the op unread never answers
        with anyio.move_on_after(60):
            return await recv.receive()
    return None


async def _moment(num_seqs: int) -> None:
    """What a caller refused as overloaded waits before it tries again."""
    await anyio.sleep(0.05)


def _refused(rid: str, why: str) -> TokenEvent:
    return refusal(rid, EngineDeadError(why))
