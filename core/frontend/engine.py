"""AsyncEngine (the embeddable async API) and LLM (the sync offline API over the same engine).

`AsyncEngine` is the front end: one RequestActor per `generate()` call (running in the caller's task) puts
its requests on the engine's inbox and reads its events. Behind the inbox runs the engine core (the
SchedulerActor and the ExecutorActor, `core/engine_core/core.py`), reached through one `EngineCoreClient`
(`core/frontend/engine_core_client.py`): in this process's task group, or with ``engine_core_process`` in a
process of its own, bridged so that it presents the same streams. Admission (room, burst pacing, retries) is
`core/frontend/admission.py`'s. The actors share nothing mutable and talk only over bounded anyio memory streams.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import anyio
from sluice.core import envs
from sluice.core.args import MAX_MODEL_LEN_DEFAULT, EngineArgs
from sluice.core.engine_core.inspector import StepRecorder
from sluice.core.engine_core.runtime import freeze_heap, unfreeze_heap
from sluice.core.errors import EngineDeadError, EngineOverloaded, InvalidRequestError, SluiceError
from sluice.core.frontend.admission import Admission, admitting_window
from sluice.core.frontend.engine_core_client import EngineCoreClient, SharedCore
from sluice.core.frontend.inproc_client import InprocClient
from sluice.core.frontend.request_actor import RequestLimits, run_request
from sluice.core.frontend.tokenizer import apply_chat_template, load_tokenizer
from sluice.core.frontend.tokenizer_pool import tokenizer_threads
from sluice.core.host_profile import HostProfile
from sluice.core.messages import AbortRequest, EndAllRequests, submit_to
from sluice.core.models.loader import ModelSource, resolve_model
from sluice.core.outputs import RequestOutput
from sluice.core.request_ids import LiveRequestIds
from sluice.core.sampling_params import SamplingParams, StructuredOutputsParams
from sluice.core.stats import EngineStats
from sluice.core.structured.backend import CompiledGrammar, GrammarBackend
from sluice.core.structured.registry import DEFAULT_BACKEND, make_backend

if TYPE_CHECKING:
    import torch
    from sluice.core.engine_core.core import EngineCore

logger = logging.getLogger("sluice")

Prompt = str | list[int] | list[dict]

# Prompts with more text than this are tokenized in a worker thread (a tokenizer releases the GIL; 1 MB of text
# takes it ~0.5 s), so the event loop keeps serving; shorter ones cost less than the thread hop.
OFF_LOOP_CHARS = 16_384


class AsyncEngine:
    """``async with AsyncEngine(EngineArgs(...)) as engine: async for out in engine.generate(...)``.

    ``shared_core``: attach to an engine core that a supervisor started for several front ends (``sluice serve
    --api-server-count N``) instead of starting one. ``paired``: this engine is half of a prefill/decode pair
    (`DisaggEngine`); a ``kv_role`` other than "both" is refused otherwise."""

    def __init__(
        self,
        args: EngineArgs | None = None,
        *,
        shared_core: SharedCore | None = None,
        paired: bool = False,
        **kwargs: Any,
    ) -> None:
        self.args = args if args is not None else EngineArgs.from_kwargs(**kwargs)
        self.shared_core = shared_core
        self.paired = paired
        self._tg: anyio.abc.TaskGroup | None = None
        self._tokenizers = anyio.CapacityLimiter(tokenizer_threads(self.args))  # large prompts: on the spare cores
        self._live_ids = LiveRequestIds()
        self._entered = False  # inside `async with` (starting, running or stopping)
        self._client: EngineCoreClient | None = None  # the engine core, once started
        # called with each structured output's compile time, in seconds (the server's histogram)
        self.on_grammar_compile: Callable[[float], None] | None = None

    # -- lifecycle ---------------------------------------------------------------------------------
    async def __aenter__(self) -> AsyncEngine:
        """Load the model and start the actors. On exit, requests still in flight end with
        `EngineStoppedError` (their callers' loops end too), and later ones are refused."""
        if self._entered:
            raise SluiceError("the engine is already running: `async with engine` may be entered once at a time")
        self._entered = True
        try:
            await anyio.to_thread.run_sync(self._load)
            await self._start_core()
        except BaseException:
            self._entered = False
            raise
        self._inbox_send, inbox_recv = anyio.create_memory_object_stream(self.args.max_waiting_requests * 4 + 64)
        # Library callers wait for room (back-pressure) instead of being refused: core/frontend/admission.py.
        room = self.args.max_num_seqs + self.args.max_waiting_requests
        self._admission = Admission(room, self._room_in_queue, admitting_window())
        self._request_ended = anyio.Event()
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        self._tg.start_soon(self._client.run, inbox_recv)
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
            with anyio.CancelScope(shield=True):  # also when the caller was cancelled: no orphan process
                await anyio.to_thread.run_sync(self._client.close)

    async def _start_core(self) -> None:
        client = make_client(self.args, self.source, self.max_model_len, self.shared_core)
        try:
            await client.start()
        except BaseException:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(client.close)
            raise
        self._client = client
        self.limits = RequestLimits(
            self.max_model_len,
            self.source.config.vocab_size,
            client.num_kv_blocks * self.args.block_size,
            self.args.max_waiting_requests,
            self.args.max_num_seqs,
        )

    def _load(self) -> None:
        # prefill/decode disaggregation: alone, a prefill engine would pin every prompt's blocks for a peer that
        # never takes them
        if self.args.kv_role != "both" and not self.paired:
            raise InvalidRequestError(
                f"kv_role: a {self.args.kv_role} engine runs only as half of a prefill/decode pair (DisaggEngine, or "
                "sluice serve --prefill-device ... --decode-device ...)",
                param="kv_role",
            )
        source: ModelSource = resolve_model(self.args.model, envs.SLUICE_CACHE_DIR)
        self.source = source
        self.model_name = self.args.served_model_name or source.name
        self.tokenizer = load_tokenizer(source.tokenizer_dir)
        # No token covers more characters of text than the vocabulary's longest entry (byte-level entries have a
        # character per byte; special tokens are entries too): a prompt longer than this many per position
        # cannot fit, whatever it tokenizes to.
        self._max_token_chars = max(map(len, self.tokenizer.get_vocab()), default=1) or 1
        self.max_model_len = max_model_len_for(self.args, source.config)
        self.eos_token_ids = tuple(source.eos_token_ids)
        # structured outputs: requests' grammars are checked here, in the front end, before they are sent
        self.grammars: GrammarBackend = make_backend(
            DEFAULT_BACKEND, self.tokenizer, source.config.vocab_size, list(self.eos_token_ids)
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

    async def tokenize_off_loop(self, prompt: Prompt) -> list[int]:
        """`tokenize_prompt`, in a worker thread for a prompt with much text (the event loop keeps serving)."""
        if _text_chars(prompt) > OFF_LOOP_CHARS:
            return await anyio.to_thread.run_sync(self.tokenize_prompt, prompt, limiter=self._tokenizers)
        return self.tokenize_prompt(prompt)

    async def compile_structured_outputs(self, spec: StructuredOutputsParams) -> CompiledGrammar:
        """Check a structured output (JSON schema, regex, choice, grammar) against the tokenizer, in a worker
        thread (a compile takes milliseconds; the first one also builds the grammar engine's view of the
        tokenizer): `InvalidStructuredOutput` (HTTP 400) if it is invalid or unsupported. `generate` calls it for
        every request that has one."""
        t0 = time.perf_counter()
        grammar = await anyio.to_thread.run_sync(self.grammars.compile, spec, limiter=self._tokenizers)
        if self.on_grammar_compile is not None:
            self.on_grammar_compile(time.perf_counter() - t0)
        return grammar

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
        dead = self._client.dead_error()
        if dead is not None:
            raise dead if isinstance(dead, EngineDeadError) else EngineDeadError(f"engine is dead: {dead}")
        params = params or SamplingParams()
        if params.structured_outputs is not None:
            await self.compile_structured_outputs(params.structured_outputs)
        prompt_ids = await self.tokenize_off_loop(prompt)
        request_id = self._live_ids.claim(request_id)
        try:
            if wait_for_room and params.n > self.args.max_waiting_requests:
                raise InvalidRequestError(
                    f"n: {params.n} sequences can never fit max_waiting_requests={self.args.max_waiting_requests}",
                    param="n",
                )
            async with self._admission.room(params.n, wait_for_room) as room:
                while True:
                    try:
                        async for out in run_request(
                            request_id,
                            prompt_ids,
                            params,
                            self.eos_token_ids,
                            self.limits,
                            self.tokenizer,
                            self._inbox_send,
                            final_only,
                            arrival_time=arrival,
                            admitting=self._admission.window,
                        ):
                            yield out
                        return
                    except EngineOverloaded as e:
                        await room.retry_after(e)
        finally:
            self._live_ids.release(request_id)
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
            if self.stats().num_waiting + num_seqs <= limit or self._client.dead_error() is not None:
                return

    async def submit(self, msg: object) -> bool:
        """Put a message on the engine core's inbox: `AddRequest`, `AbortRequest`, `EndAllRequests`, or a block
        hand-over of a prefill/decode pair (`core/sched/disagg.py`). False once the engine has stopped."""
        if self._tg is None:
            return False
        return await submit_to(self._inbox_send, msg)

    async def abort(self, request_id: str) -> None:
        """Abort a request (all its sequences); unknown or finished ids are ignored."""
        await self.submit(AbortRequest(request_id))

    async def end_all_requests(self, error: Exception) -> None:
        """End every request in flight with ``error`` and refuse every later one with it: for a server whose
        shutdown grace is over (each caller gets an error rather than a silently cut stream)."""
        await self.submit(EndAllRequests(error))

    # -- the core ----------------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        """Counters as of the last step (after a stop: as the engine left them). With the core in its own
        process: as of its last message, which follows every step."""
        return self._started_client().stats

    def host_profile(self) -> HostProfile:
        """Where the steps' host time went so far, by phase (cumulative; `HostProfile.since` for a window).
        Empty with the core in its own process (the profile lives there)."""
        return self._started_client().host_profile()

    def _started_client(self) -> EngineCoreClient:
        if self._client is None:
            raise SluiceError("the engine has not started: this needs `async with AsyncEngine(...)` first")
        return self._client

    @property
    def core_pid(self) -> int | None:
        """The engine core's process id when it runs in a process of its own (``engine_core_process``)."""
        return self._client.pid if self._client is not None else None

    @property
    def inspector(self) -> StepRecorder | None:
        """The step recorder behind the /inspect page; None unless ``enable_inspector`` (or not started)."""
        return self._client.inspector if self._client is not None else None

    @property
    def local_core(self) -> EngineCore | None:
        """The engine core when it runs in this process (None otherwise, or not started): for tools that need
        the model itself (draft training, benchmarks' counters). Requests go through `generate`."""
        return self._client.local_core if self._client is not None else None

    @property
    def kv_caches(self) -> list[torch.Tensor]:
        """The KV pool's tensors, with the core in this process (a prefill/decode pair ships blocks between
        its engines' pools)."""
        return self._started_client().kv_caches

    @property
    def is_running(self) -> bool:
        """Inside ``async with`` (started, not yet stopped)."""
        return self._tg is not None

    @property
    def is_healthy(self) -> bool:
        return self._tg is not None and self._client.health_error() is None

    def health_error(self) -> Exception | None:
        """Why the engine is unhealthy (None while it is healthy, or not started)."""
        return self._client.health_error() if self._client is not None else None


def make_client(
    args: EngineArgs, source: ModelSource, max_model_len: int, shared: SharedCore | None = None
) -> EngineCoreClient:
    """The engine core's client for ``args``: a core in a process of its own (``engine_core_process``), a shared
    one (``shared``), or one in this process (the inspector reads the recorder live: one process)."""
    if shared is not None or (args.engine_core_process and not args.enable_inspector):
        from sluice.core.frontend.core_client import CoreClient

        return CoreClient(args, max_model_len, shared)
    if args.engine_core_process:
        logger.warning("engine_core_process: the inspector needs the engine in one process; running in one")
    return InprocClient(args, source, max_model_len)


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
