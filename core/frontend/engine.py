"""AsyncEngine (the embeddable async API) and LLM (the sync offline API over the same engine).

`AsyncEngine` is the front end: one RequestActor per `generate()` call (running in the caller's task) puts
its requests on the engine's inbox and reads its events. Behind the inbox runs the engine core (the
SchedulerActor and the ExecutorActor, `core/engine_core/core.py`): in this process's task group, or with
``engine_core_process`` in a process of its own, reached through a bridge (`core/frontend/core_client.py`) that
presents the same streams. The actors share nothing mutable and talk only over bounded anyio memory streams.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import anyio
from sluice.core.args import MAX_MODEL_LEN_DEFAULT, EngineArgs
from sluice.core.engine_core.core import EngineCore
from sluice.core.engine_core.inspector import StepRecorder
from sluice.core.engine_core.runtime import freeze_heap, restore_switch_interval, shorten_switch_interval, unfreeze_heap
from sluice.core.errors import EngineDeadError, EngineOverloaded, InvalidRequestError, SluiceError
from sluice.core.frontend.admission import AdmissionGate
from sluice.core.frontend.request_actor import RequestLimits, run_request
from sluice.core.frontend.tokenizer import apply_chat_template, load_tokenizer
from sluice.core.frontend.tokenizer_pool import tokenizer_threads
from sluice.core.host_profile import HostProfile
from sluice.core.models.loader import ModelSource, resolve_model
from sluice.core.outputs import RequestOutput
from sluice.core.sampling_params import SamplingParams
from sluice.core.stats import EngineStats

logger = logging.getLogger("sluice")

Prompt = str | list[int] | list[dict]

# Prompts with more text than this are tokenized in a worker thread (a tokenizer releases the GIL; 1 MB of text
# takes it ~0.5 s), so the event loop keeps serving; shorter ones cost less than the thread hop.
OFF_LOOP_CHARS = 16_384
# Requests validated and sent but not yet answered by the scheduler, at most: `run_request`'s ``admitting``.
ADMITTING_AT_ONCE = 64


class AsyncEngine:
    """``async with AsyncEngine(EngineArgs(...)) as engine: async for out in engine.generate(...)``."""

    def __init__(self, args: EngineArgs | None = None, **kwargs: Any) -> None:
        self.args = args if args is not None else EngineArgs.from_kwargs(**kwargs)
        self._tg: anyio.abc.TaskGroup | None = None
        self._tokenizers = anyio.CapacityLimiter(tokenizer_threads(self.args))  # large prompts: on the spare cores
        # Ids of requests whose stream is open: the scheduler keys requests by id, so a second live request
        # under the same id would receive (and abort) the first one's tokens.
        self._live_ids: set[str] = set()
        self._entered = False  # inside `async with` (starting, running or stopping)
        self._client = None  # the bridge to the core's own process (engine_core_process), while it runs

    # -- lifecycle ---------------------------------------------------------------------------------
    async def __aenter__(self) -> AsyncEngine:
        """Load the model and start the actors. On exit, requests still in flight end with
        `EngineStoppedError` (their callers' loops end too), and later ones are refused."""
        if self._entered:
            raise SluiceError("the engine is already running: `async with engine` may be entered once at a time")
        self._entered = True
        try:
            await anyio.to_thread.run_sync(self._load)
            if self._split:
                await self._start_core()
        except BaseException:
            self._entered = False
            raise
        self._inbox_send, inbox_recv = anyio.create_memory_object_stream(self.args.max_waiting_requests * 4 + 64)
        # Library callers wait here for room (back-pressure) instead of being refused; see core/frontend/admission.py.
        self._gate = AdmissionGate(self.args.max_num_seqs + self.args.max_waiting_requests)
        # A burst's callers reach the scheduler this many at a time (`run_request`'s ``admitting``);
        # SLUICE_ADMITTING=0 sends them all at once (for comparison).
        at_once = int(os.environ.get("SLUICE_ADMITTING", ADMITTING_AT_ONCE))
        self._admitting = AdmissionGate(at_once) if at_once > 0 else None
        self._request_ended = anyio.Event()
        # the executor's launch thread beside the event loop's (in the core's process when it has its own)
        self._switch_held = not self._split and shorten_switch_interval(self.args.gil_switch_interval_ms)
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        if self._client is not None:
            self._tg.start_soon(self._client.run, inbox_recv)
        else:
            self._tg.start_soon(self._core.run, inbox_recv)
        if self.args.gc_freeze:
            freeze_heap()
        return self

    async def __aexit__(self, *exc) -> bool | None:
        assert self._tg is not None
        self._tg.cancel_scope.cancel()
        try:
            return await self._tg.__aexit__(*exc)
        finally:
            self._tg = None
            self._entered = False
            if self.args.gc_freeze:
                unfreeze_heap()
            if self._switch_held:
                restore_switch_interval()
            if self._client is not None:
                with anyio.CancelScope(shield=True):  # also when the caller was cancelled: no orphan process
                    await anyio.to_thread.run_sync(self._client.close)

    @property
    def _split(self) -> bool:
        """The core runs in a process of its own (the inspector reads the recorder live: one process)."""
        return self.args.engine_core_process and not self.args.enable_inspector

    def _core_client(self):
        """The bridge to this engine's core process (a front end of several attaches to a shared core instead:
        `sluice.app.server.api_servers`)."""
        from sluice.core.frontend.core_client import CoreClient

        return CoreClient(self.args, self.max_model_len)

    async def _start_core(self) -> None:
        client = self._core_client()
        try:
            await client.start()
        except BaseException:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(client.close)
            raise
        self._client = client
        self._set_limits(client.num_kv_blocks)

    def _load(self) -> None:
        # prefill/decode disaggregation: alone, a prefill engine would pin every prompt's blocks for a peer that
        # never takes them
        if self.args.kv_role != "both" and not getattr(self, "paired", False):
            raise InvalidRequestError(
                f"kv_role: a {self.args.kv_role} engine runs only as half of a prefill/decode pair (DisaggEngine, or "
                "sluice serve --prefill-device ... --decode-device ...)",
                param="kv_role",
            )
        source: ModelSource = resolve_model(self.args.model)
        self.source = source
        self.model_name = self.args.served_model_name or source.name
        self.tokenizer = load_tokenizer(source.tokenizer_dir)
        # No token covers more characters of text than the vocabulary's longest entry (byte-level entries have a
        # character per byte; special tokens are entries too): a prompt longer than this many per position
        # cannot fit, whatever it tokenizes to.
        self._max_token_chars = max(map(len, self.tokenizer.get_vocab()), default=1) or 1
        cfg = source.config
        self.max_model_len = max_model_len_for(self.args, cfg)
        self._eos = tuple(source.eos_token_ids)
        self._client = None
        if self._split:
            return  # the core loads the model in its own process (`_start_core`)
        if self.args.engine_core_process:
            logger.warning("engine_core_process: the inspector needs the engine in one process; running in one")
        self._core = EngineCore.build(self.args, source, self.max_model_len)
        self._executor = self._core.executor
        self._scheduler_actor = self._core.scheduler_actor
        self._set_limits(self._core.num_kv_blocks)

    def _set_limits(self, num_kv_blocks: int) -> None:
        self._limits = RequestLimits(
            self.max_model_len,
            self.source.config.vocab_size,
            num_kv_blocks * self.args.block_size,
            self.args.max_waiting_requests,
        )

    # -- requests ----------------------------------------------------------------------------------
    def tokenize_prompt(self, prompt: Prompt) -> list[int]:
        chars = _text_chars(prompt)
        if chars > self.max_model_len * self._max_token_chars:
            raise InvalidRequestError(
                f"prompt: {chars} characters are more than max_model_len={self.max_model_len} tokens can hold",
                param="prompt",
            )
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt: must not be empty", param="prompt")
            return list(self.tokenizer.encode(prompt, add_special_tokens=True))
        if isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
            return apply_chat_template(self.tokenizer, prompt, self.args.split_special_tokens)
        if isinstance(prompt, (list, tuple)) and _all_ints(prompt):
            return list(prompt)
        raise InvalidRequestError(
            "prompt: must be a string, a list of token ids, or a list of messages", param="prompt"
        )

    async def generate(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        final_only: bool = False,
        wait_for_room: bool = True,
    ) -> AsyncIterator[RequestOutput]:
        """Stream outputs of one request: a string, token ids, or chat messages (chat template applied). With
        ``final_only``, only each sequence's final output (vLLM's ``FINAL_ONLY``): for batch work that does not
        stream, it saves a wake-up of the request per token.

        While the engine is full (``max_waiting_requests``), the call waits for room, first come first served;
        with ``wait_for_room=False`` it raises `EngineOverloaded` at once instead (the HTTP server's 503)."""
        arrival = time.time()
        if self._tg is None:
            raise SluiceError("engine is not running: use `async with AsyncEngine(...) as engine`")
        dead = self._dead
        if dead is not None:
            raise dead if isinstance(dead, EngineDeadError) else EngineDeadError(f"engine is dead: {dead}")
        params = params or SamplingParams()
        if _text_chars(prompt) > OFF_LOOP_CHARS:
            prompt_ids = await anyio.to_thread.run_sync(self.tokenize_prompt, prompt, limiter=self._tokenizers)
        else:
            prompt_ids = self.tokenize_prompt(prompt)
        request_id = request_id or f"req-{uuid.uuid4().hex[:16]}"
        if request_id in self._live_ids:
            raise InvalidRequestError(
                f"request_id: {request_id!r} is already in use by a running request", param="request_id"
            )
        self._live_ids.add(request_id)

        def run() -> AsyncIterator[RequestOutput]:
            return run_request(
                request_id,
                prompt_ids,
                params,
                self._eos,
                self._limits,
                self.tokenizer,
                self._inbox_send,
                final_only,
                arrival_time=arrival,
                admitting=self._admitting,
            )

        try:
            if wait_for_room and params.n > self.args.max_waiting_requests:
                raise InvalidRequestError(
                    f"n: {params.n} sequences can never fit max_waiting_requests={self.args.max_waiting_requests}",
                    param="n",
                )
            if not wait_for_room:
                async for out in run():
                    yield out
                return
            async with self._gate.hold(params.n):
                while True:
                    try:
                        async for out in run():
                            yield out
                        return
                    except EngineOverloaded:
                        # Refused at admission, so nothing was yielded: try again once the queue has room.
                        await self._room_in_queue(params.n)
        finally:
            self._live_ids.discard(request_id)
            self._request_ended.set()
            self._request_ended = anyio.Event()

    async def _room_in_queue(self, num_seqs: int) -> None:
        """Return once the published stats show room for ``num_seqs`` more waiting sequences. The queue shrinks
        when a step admits from it, which needs a request to end (or, at worst, a moment); checked at every end
        and every half second."""
        limit = self.args.max_waiting_requests
        while True:
            with anyio.move_on_after(0.5):
                await self._request_ended.wait()
            if self.stats().num_waiting + num_seqs <= limit or self._dead is not None:
                return

    async def abort(self, request_id: str) -> None:
        """Abort a request (all its sequences); unknown or finished ids are ignored."""
        from sluice.core.messages import AbortRequest

        if self._tg is None:
            return  # not running: nothing to abort
        await self._inbox_send.send(AbortRequest(request_id))

    async def end_all_requests(self, error: Exception) -> None:
        """End every request in flight with ``error`` and refuse every later one with it: for a server whose
        shutdown grace is over (each caller gets an error rather than a silently cut stream)."""
        from sluice.core.messages import EndAllRequests

        if self._tg is not None:
            await self._inbox_send.send(EndAllRequests(error))

    def stats(self) -> EngineStats:
        """Counters as of the last step (after a stop: as the engine left them). With the core in its own
        process: as of its last message, which follows every step."""
        client = getattr(self, "_client", None)
        if client is not None:
            return client.stats
        actor = getattr(self, "_scheduler_actor", None)
        if actor is None:
            raise SluiceError("the engine has not started: stats() needs `async with AsyncEngine(...)` first")
        return actor.stats

    def host_profile(self) -> HostProfile:
        """Where the steps' host time went so far, by phase (cumulative; `HostProfile.since` for a window).
        Empty with the core in its own process (the profile lives there)."""
        if getattr(self, "_client", None) is not None:
            return HostProfile()
        return self._scheduler_actor.profile.merged(self._executor.profile)

    @property
    def core_pid(self) -> int | None:
        """The engine core's process id when it runs in a process of its own (``engine_core_process``)."""
        client = getattr(self, "_client", None)
        return client.pid if client is not None else None

    @property
    def inspector(self) -> StepRecorder | None:
        """The step recorder behind the /inspect page; None unless ``enable_inspector`` (or not started)."""
        actor = getattr(self, "_scheduler_actor", None) if getattr(self, "_client", None) is None else None
        return actor.recorder if actor is not None else None

    @property
    def is_running(self) -> bool:
        """Inside ``async with`` (started, not yet stopped)."""
        return self._tg is not None

    @property
    def _dead(self) -> Exception | None:
        if self._client is not None:
            return self._client.dead or (None if self._client.stats.healthy else EngineDeadError("engine failed"))
        return self._scheduler_actor.dead

    @property
    def is_healthy(self) -> bool:
        if self._tg is None:
            return False
        if self._client is not None:
            return self._client.dead is None and self._client.stats.healthy
        return self._scheduler_actor.dead is None and self._executor.failure is None


def _all_ints(tokens: list | tuple) -> bool:
    """Every item an int, not a bool. The types first, in C (a prompt may hold a million ids); int subclasses
    other than bool take the item-by-item check."""
    types = set(map(type, tokens))
    if types <= {int}:
        return True
    return bool not in types and all(isinstance(t, int) for t in tokens)


def _text_chars(prompt: Prompt) -> int:
    """Characters of text in a prompt or in its messages' contents (0 for token ids)."""
    if isinstance(prompt, str):
        return len(prompt)
    if not isinstance(prompt, list) or not prompt or not isinstance(prompt[0], dict):
        return 0  # token ids: not walked one by one on the event loop
    n = 0
    for m in prompt:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, str):
            n += len(content)
        elif isinstance(content, list):
            n += sum(len(p["text"]) for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return n


def max_model_len_for(args: EngineArgs, config) -> int:
    """The engine's context limit: ``args.max_model_len`` (refused past the model's own), else the model's, at
    most `MAX_MODEL_LEN_DEFAULT`."""
    limit = int(getattr(config, "max_position_embeddings", MAX_MODEL_LEN_DEFAULT) or MAX_MODEL_LEN_DEFAULT)
    if args.max_model_len is not None and args.max_model_len > limit:
        raise InvalidRequestError(
            f"max_model_len: {args.max_model_len} exceeds the model's limit of {limit}", param="max_model_len"
        )
    return args.max_model_len or min(limit, MAX_MODEL_LEN_DEFAULT)
