"""LLM: the sync offline API, an `AsyncEngine` on a private event loop in a background thread."""

from __future__ import annotations

import atexit
import functools
import itertools
import logging
import sys
import weakref
from collections.abc import Sequence
from typing import Any

import anyio
from sluice.core.args import EngineArgs
from sluice.core.errors import EngineStoppedError, InvalidRequestError
from sluice.core.frontend.engine import AsyncEngine
from sluice.core.frontend.request_actor import make_requests
from sluice.core.outputs import PromptOutput, RequestOutput
from sluice.core.sampling_params import SamplingParams

logger = logging.getLogger("sluice")


class LLM:
    """Sync offline API: ``LLM(model=...).generate(prompts, params)``. Runs an `AsyncEngine` on a
    private event loop in a background thread; takes the same keyword arguments as `EngineArgs`."""

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        self._engine_cm = None
        if model is not None:
            kwargs["model"] = model
        self.engine = AsyncEngine(EngineArgs.from_kwargs(**kwargs))
        self._request_ids = itertools.count()
        self._portal_cm = anyio.from_thread.start_blocking_portal()
        self._portal = self._portal_cm.__enter__()
        try:
            engine_cm = self._portal.wrap_async_context_manager(self.engine)
            engine_cm.__enter__()
        except BaseException:
            self._portal_cm.__exit__(None, None, None)
            raise
        self._engine_cm = engine_cm
        _open_llms.add(self)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def close(self) -> None:
        """Stop the engine and its thread. Optional: whatever is still open is closed at interpreter exit."""
        if self._engine_cm is not None:
            _open_llms.discard(self)
            cm, self._engine_cm = self._engine_cm, None
            try:
                cm.__exit__(None, None, None)
            finally:
                self._portal_cm.__exit__(None, None, None)

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        if sys.is_finalizing():
            return  # the engine's thread is frozen by now: closing would wait on it forever
        try:
            self.close()
        except Exception:
            pass

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[list[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[PromptOutput]:
        """One `PromptOutput` per prompt, in prompt order; its ``outputs`` hold the ``n`` sequences."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        return self._run(list(prompts), params, use_tqdm)

    def chat(
        self,
        conversations: Sequence[list[dict]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[PromptOutput]:
        """`generate` over conversations (the chat template applied); ``prompt`` is the templated text."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        return self._run(list(conversations), params, use_tqdm)

    def _run(self, prompts: list, params, use_tqdm: bool) -> list[PromptOutput]:
        if self._engine_cm is None:
            raise EngineStoppedError("LLM is closed: its engine has stopped; make a new LLM to generate again")
        if params is None or isinstance(params, SamplingParams):
            params_list = [params or SamplingParams()] * len(prompts)
        else:
            params_list = list(params)
            if len(params_list) != len(prompts):
                raise InvalidRequestError("params: one SamplingParams per prompt, or a single one", param="params")
        return self._portal.call(self._generate_all, prompts, params_list, use_tqdm)

    async def _generate_all(self, prompts: list, params_list: list[SamplingParams], use_tqdm: bool):
        from tqdm.auto import tqdm

        # Validate everything first, so bad input raises before any request runs.
        ids = [self.engine.tokenize_prompt(p) for p in prompts]
        for p_ids, params in zip(ids, params_list):
            make_requests("validate", p_ids, params, self.engine.eos_token_ids, self.engine.limits)
        # Ids unique across calls: two threads may share this LLM, and the engine keys requests by id.
        request_ids = [f"llm-{next(self._request_ids)}" for _ in prompts]
        finals: list[list[RequestOutput]] = [[] for _ in prompts]
        results: list[PromptOutput | None] = [None] * len(prompts)
        bar = tqdm(total=len(prompts), desc="Processed prompts", disable=not use_tqdm or len(prompts) < 2)
        in_tokens = out_tokens = 0
        errors: list[Exception] = []
        tokenizer = self.engine.tokenizer

        @functools.lru_cache(maxsize=4096)
        def decode_token(token_id: int) -> str:  # Logprob.decoded_token
            return tokenizer.decode([token_id])

        async def one(i: int) -> None:
            nonlocal in_tokens, out_tokens
            try:
                # The engine queues them (back-pressure): any number of prompts, never an overload error.
                async for out in self.engine.generate(
                    ids[i], params_list[i], request_id=request_ids[i], final_only=True
                ):
                    if out.finished:
                        finals[i].append(out)
            except Exception as e:
                # The first failure cancels the rest (they abort) and is raised as itself, typed, rather
                # than wrapped in the task group's exception group.
                errors.append(e)
                tg.cancel_scope.cancel()
                return
            prompt = prompts[i] if isinstance(prompts[i], str) else None
            if isinstance(prompts[i], list) and prompts[i] and isinstance(prompts[i][0], dict):
                prompt = self.engine.tokenizer.decode(ids[i])
            results[i] = PromptOutput.from_final(prompt, finals[i], decode_token)
            if not bar.disable:  # vLLM's progress bar: prompts, and input and output tokens per second
                in_tokens += len(ids[i])
                out_tokens += sum(len(o.token_ids) for o in finals[i])
                elapsed = max(bar.format_dict["elapsed"], 1e-9)
                bar.set_postfix_str(
                    f"est. speed input: {in_tokens / elapsed:.2f} toks/s, output: {out_tokens / elapsed:.2f} toks/s",
                    refresh=False,
                )
                bar.update(1)

        async with anyio.create_task_group() as tg:
            for i in range(len(prompts)):
                tg.start_soon(one, i)
        bar.close()
        if errors:
            raise errors[0]
        return results


# Every LLM not yet closed. A script that never calls close() (vLLM's LLM needs none), or that dies of an
# exception, must still exit: atexit runs while the engine's thread still runs, so the engine stops cleanly
# there. Left to garbage collection at interpreter finalization, close() would wait on a frozen thread forever.
_open_llms: weakref.WeakSet[LLM] = weakref.WeakSet()


@atexit.register
def _close_open_llms() -> None:
    for llm in list(_open_llms):
        try:
            llm.close()
        except Exception:
            logger.exception("closing an LLM at exit failed")
