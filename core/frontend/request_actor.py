"""RequestActor: one per caller request. Validates, admits, then turns token events into outputs.

It lives in the caller's task (an async generator), so a caller that stops iterating or is cancelled
runs its ``finally``: the Abort it sends frees the request's blocks in the scheduler's next step.
"""

from __future__ import annotations

import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from functools import partial

import anyio
from anyio.abc import ObjectSendStream
from sluice.core.errors import InvalidRequestError, RequestFailedError, SluiceError
from sluice.core.frontend.admission import AdmissionGate, request_admission
from sluice.core.frontend.tokenizer import IncrementalDetokenizer
from sluice.core.messages import AbortRequest, AddRequest, Admitted, TokenEvent, submit_to
from sluice.core.outputs import RequestMetrics, RequestOutput, TokenLogprob, Usage
from sluice.core.request import Request
from sluice.core.request_ids import sequence_id
from sluice.core.sampling_params import SEED_MAX, SamplingParams


@dataclass(slots=True)
class SequenceState:
    """What the request actor keeps of one sequence: the one copy of its output on the front end. Lists and
    text grow by appending (text as pieces, joined once at the end), so a long output costs linear time."""

    request_id: str
    index: int
    detok: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    pieces: list[str] = field(default_factory=list)  # the text emitted so far
    held: str = ""  # decoded but not emitted yet: it may be the start of a stop string
    finish_reason: str | None = None
    stop_reason: str | int | None = None


@dataclass(slots=True)
class RequestLimits:
    max_model_len: int
    vocab_size: int
    max_kv_tokens: int  # the whole pool: a request longer than this could never run
    max_waiting_requests: int = 1 << 62  # the overload guard counts each of n sequences: more never fit
    max_num_seqs: int = 1 << 62  # a step's buffers hold this many rows: a wider group never runs


def make_requests(
    request_id: str, prompt_ids: list[int], params: SamplingParams, eos: tuple[int, ...], limits: RequestLimits
) -> list[Request]:
    if not prompt_ids:
        raise InvalidRequestError("prompt: must not be empty", param="prompt")
    if len(prompt_ids) >= limits.max_model_len:
        raise InvalidRequestError(
            f"prompt: {len(prompt_ids)} tokens leaves no room to generate within max_model_len={limits.max_model_len}",
            param="prompt",
        )
    # The set/min/max pass runs in C; the per-token check below only runs to name a bad token.
    ok = set(map(type, prompt_ids)) == {int} and 0 <= min(prompt_ids) and max(prompt_ids) < limits.vocab_size
    bad = [] if ok else [t for t in prompt_ids if not isinstance(t, int) or not 0 <= t < limits.vocab_size]
    if bad:
        raise InvalidRequestError(f"prompt: token id {bad[0]!r} outside [0, {limits.vocab_size})", param="prompt")
    room = limits.max_model_len - len(prompt_ids)
    max_tokens = min(params.max_tokens or room, room)
    if len(prompt_ids) + max_tokens > limits.max_kv_tokens:
        raise InvalidRequestError(
            f"max_tokens: prompt + max_tokens = {len(prompt_ids) + max_tokens} tokens exceeds the KV pool "
            f"({limits.max_kv_tokens} tokens)",
            param="max_tokens",
        )
    check_row_params(params, limits)
    if params.n == 1:
        return [Request(request_id, list(prompt_ids), params, max_tokens, eos)]
    out = []
    for i in range(params.n):
        child = params if params.seed is None else _with_seed(params, sibling_seed(params.seed, i))
        out.append(Request(sequence_id(request_id, i), list(prompt_ids), child, max_tokens, eos))
    return out


def check_row_params(params: SamplingParams, limits: RequestLimits) -> None:
    """What `SamplingParams` cannot check alone, against the served model and the engine's limits: each value
    here would otherwise reach the step (and fail it for every request batched with this one) or never run.
    ``params`` is validated again: it is mutable, and may have been changed since it was built."""
    params.validate()
    bad = [t for t in params.stop_token_ids if t >= limits.vocab_size]
    if bad:
        raise InvalidRequestError(
            f"stop_token_ids: token id {bad[0]} outside [0, {limits.vocab_size})", param="stop_token_ids"
        )
    if params.n > limits.max_waiting_requests:
        raise InvalidRequestError(
            f"n: {params.n} sequences can never be admitted: the engine queues at most {limits.max_waiting_requests} "
            "(max_waiting_requests)",
            param="n",
        )
    if params.n > limits.max_num_seqs:
        raise InvalidRequestError(
            f"n: {params.n} sequences can never run together: a step holds at most {limits.max_num_seqs} "
            "(max_num_seqs)",
            param="n",
        )


def sibling_seed(seed: int, i: int) -> int:
    """The seed of sequence ``i`` of an ``n > 1`` request: ``seed + i``, wrapped into the generator's 64 bits."""
    s = seed + i
    return s - (SEED_MAX + 1) if s > SEED_MAX else s


def _with_seed(params: SamplingParams, seed: int) -> SamplingParams:
    from dataclasses import replace

    return replace(params, seed=seed)


async def run_request(
    request_id: str,
    prompt_ids: list[int],
    params: SamplingParams,
    eos: tuple[int, ...],
    limits: RequestLimits,
    tokenizer,
    inbox: ObjectSendStream,
    final_only: bool = False,
    arrival_time: float | None = None,
    admitting: AdmissionGate | None = None,
) -> AsyncIterator[RequestOutput]:
    """Run one caller request: yield its outputs as tokens arrive, or with ``final_only`` one final output per
    sequence (stop strings still need the text token by token, so such requests stream internally).

    ``admitting`` paces a burst (`Admission.window`, `core/frontend/admission.py` says why): the request holds
    one of its units from before its validation until the scheduler has answered its admission."""
    if admitting is not None:
        await admitting.acquire(1)
    unfinished: set[str] = set()
    try:
        requests = make_requests(request_id, prompt_ids, params, eos, limits)
        seqs = _sequence_states(requests, prompt_ids, params, tokenizer)
        send, recv = _event_stream(requests)
        unfinished = set(seqs)
        metrics = RequestMetrics(arrival_time if arrival_time is not None else time.time())
        num_cached = num_output_tokens = 0  # of every sequence, for the usage
        stops, stop_hold = params.stop, max((len(s) for s in params.stop), default=1) - 1
        async with recv:
            # From here on the scheduler may hold the requests, even if we are cancelled before it answers
            # (or inside the send): the finally aborts them. An Abort for an id it never added is ignored.
            add = AddRequest(requests, send, final_only=final_only and not stops)
            refused = await request_admission(partial(submit_to, inbox), add, recv)
            if admitting is not None:  # answered: the next caller of a burst may go
                admitting.release(1)
                admitting = None
            if refused is not None:
                unfinished.clear()  # refused: nothing was added
                raise refused
            while unfinished:
                ev = await recv.receive()
                seq = seqs[ev.request_id]
                if ev.error is not None:
                    raise _request_error(request_id, ev.error)
                num_cached = max(num_cached, ev.num_cached_tokens)
                if ev.token_ids and metrics.first_token_time is None:
                    metrics.first_token_time = ev.first_token_time or time.time()
                new_ids, new_logprobs = ev.token_ids, ev.logprobs
                seq.token_ids.extend(new_ids)
                num_output_tokens += len(new_ids)
                if new_logprobs is not None:
                    if seq.logprobs is None:
                        seq.logprobs = []
                    seq.logprobs.extend(new_logprobs)
                delta = seq.detok.add(new_ids)
                finish, stop_reason = ev.finish_reason, ev.stop_reason
                if stops:
                    delta, finish, stop_reason, hit = _cut_stop_strings(
                        seq, delta, finish, stop_reason, params, stop_hold
                    )
                    if hit:
                        await _send_abort(inbox, ev.request_id)  # the scheduler may not know yet
                seq.pieces.append(delta)
                seq.finish_reason, seq.stop_reason = finish, stop_reason
                if finish is not None:
                    unfinished.discard(ev.request_id)
                    metrics.finished_time = time.time()
                    usage = Usage(len(prompt_ids), num_output_tokens, num_cached)
                    yield _final_output(
                        request_id, seq, prompt_ids, (delta, new_ids, new_logprobs), usage, metrics, final_only
                    )
                elif not final_only:
                    # Streams carry deltas (vLLM's DELTA kind): rebuilding the whole text and lists for every
                    # output would cost time quadratic in the output's length.
                    yield RequestOutput(
                        request_id=request_id,
                        index=seq.index,
                        prompt_token_ids=prompt_ids,
                        text=delta,
                        token_ids=new_ids,
                        delta_text=delta,
                        delta_token_ids=new_ids,
                        finished=False,
                        finish_reason=None,
                        usage=Usage(len(prompt_ids), num_output_tokens, num_cached),
                        logprobs=new_logprobs,
                        delta_logprobs=new_logprobs,
                        stop_reason=None,
                        metrics=metrics,
                    )
    finally:
        if admitting is not None:  # never answered: refused by validation, cancelled, or the engine stopped
            admitting.release(1)
        for rid in unfinished:
            await _send_abort(inbox, rid)


def _sequence_states(
    requests: list[Request], prompt_ids: list[int], params: SamplingParams, tokenizer
) -> dict[str, SequenceState]:
    return {
        r.request_id: SequenceState(
            r.request_id, i, IncrementalDetokenizer(tokenizer, prompt_ids, params.skip_special_tokens)
        )
        for i, r in enumerate(requests)
    }


def _event_stream(requests: list[Request]):
    """The request's own event stream. Each sequence emits at most max_tokens + 2 events, so its buffer never
    fills: the scheduler never waits on a slow caller."""
    max_tokens = requests[0].max_tokens
    size = len(requests) * (max_tokens + 4) if max_tokens < 1 << 20 else math.inf
    return anyio.create_memory_object_stream[Admitted | TokenEvent](size)


def _request_error(request_id: str, error: Exception) -> Exception:
    """What the caller raises for a failed step: sluice's own errors as they are, anything else wrapped."""
    if isinstance(error, SluiceError):
        return error
    wrapped = RequestFailedError(f"request {request_id} failed: {error}")
    wrapped.__cause__ = error
    return wrapped


def _cut_stop_strings(
    seq: SequenceState, piece: str, finish: str | None, stop_reason, params: SamplingParams, stop_hold: int
) -> tuple[str, str | None, str | int | None, bool]:
    """A new ``piece`` of text where stop strings apply: what may be emitted now (held back: what may still
    become a stop string), and whether a stop string was hit (the sequence then finishes with it as its reason).
    Returns ``(delta, finish, stop_reason, hit)``."""
    held = seq.held + piece
    cut = _find_stop(held, params.stop, 0) if finish != "abort" else None
    hit = cut is not None
    if hit:
        pos, stop = cut
        delta, held = held[: pos + (len(stop) if params.include_stop_str_in_output else 0)], ""
        finish, stop_reason = "stop", stop
    elif finish is not None:
        delta, held = held, ""
    else:
        split = max(0, len(held) - stop_hold)
        delta, held = held[:split], held[split:]
    seq.held = held
    return delta, finish, stop_reason, hit


def _final_output(
    request_id: str,
    seq: SequenceState,
    prompt_ids: list[int],
    last: tuple[str, list[int], list[TokenLogprob] | None],
    usage: Usage,
    metrics: RequestMetrics,
    final_only: bool,
) -> RequestOutput:
    """A sequence's final output: it carries the whole sequence (and, final-only, that is its delta too);
    ``last`` is the last event's delta (text, token ids, logprobs)."""
    text = "".join(seq.pieces)
    seq.pieces = [text]
    delta, new_ids, new_logprobs = last
    return RequestOutput(
        request_id=request_id,
        index=seq.index,
        prompt_token_ids=prompt_ids,
        text=text,
        token_ids=seq.token_ids,
        delta_text=text if final_only else delta,
        delta_token_ids=seq.token_ids if final_only else new_ids,
        finished=True,
        finish_reason=seq.finish_reason,
        usage=usage,
        logprobs=seq.logprobs,
        delta_logprobs=seq.logprobs if final_only else new_logprobs,
        stop_reason=seq.stop_reason,
        metrics=metrics,
    )


def _find_stop(text: str, stops: list[str], start: int) -> tuple[int, str] | None:
    best: tuple[int, str] | None = None
    for s in stops:
        pos = text.find(s, max(0, start))
        if pos >= 0 and (best is None or pos < best[0]):
            best = (pos, s)
    return best


async def _send_abort(inbox: ObjectSendStream, request_id: str) -> None:
    try:
        inbox.send_nowait(AbortRequest(request_id))
    except anyio.WouldBlock:
        with anyio.CancelScope(shield=True):
            await inbox.send(AbortRequest(request_id))
    except (anyio.BrokenResourceError, anyio.ClosedResourceError):
        pass  # the engine is shutting down
