"""`GrammarRows`: the grammar matchers of the requests in the executor's persistent batch, and the bitmask their
rows are sampled under.

The matchers live beside the persistent batch because that is where every token a request accepts passes, in
order: the plain steps' samples when they are read back, the speculative steps' accepted drafts. A matcher is
made when its request arrives in the batch (`NewRequest`), from its compiled grammar, and is caught up with the
output tokens it arrived with (a request resumed after a preemption, or a decode engine's hand-over); it is
dropped when the request finishes or is aborted (`SchedulerOutput.finished_request_ids`). Compiling takes
milliseconds, so it runs in a thread of its own (llguidance releases the GIL meanwhile): the step that brought
the request goes on, and only its first mask waits for it, after that step's forward is enqueued.

The mask of a step's constrained rows is filled on the host into one pinned buffer, only after the step before
it is read back (its tokens advance the matchers). The runner has enqueued the step's forward by then, so the
fill overlaps the forward on the device; the mask kernel then reads the pinned buffer itself (no copy) and
masks the logits in place before sampling (`bitmask.apply_token_bitmask_`). Rows without a grammar cost nothing: a step
without a constrained row touches none of this.

A row whose grammar can go nowhere (an error, or no token allowed) fails its request alone (`failures`, which
the runner reports in its `ModelOutput.failed`); its row is sampled unmasked and its token dropped.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from operator import itemgetter

import numpy as np
import torch
from sluice.core.errors import RequestFailedError
from sluice.core.sampling_params import StructuredOutputsParams
from sluice.core.structured.backend import CompiledGrammar, GrammarBackend, GrammarMatcher, bitmask_words
from sluice.core.structured.bitmask import apply_token_bitmask_
from sluice.core.structured.starts import GrammarStarts


class GrammarRows:
    def __init__(self, make_backend: Callable[[], GrammarBackend], vocab_size: int, max_rows: int, device) -> None:
        self._make_backend = make_backend
        self._backend: GrammarBackend | None = None  # built at the first constrained request (reads the tokenizer)
        self.device = device
        self.words = bitmask_words(vocab_size)
        # request -> its matcher and the matcher's family (`starts.py`), or the compile that will give them
        # (`_made` waits for it)
        self.matchers: dict[str, tuple[GrammarMatcher, int] | Future] = {}
        self._compiler: ThreadPoolExecutor | None = None
        self._starts: GrammarStarts | None = None  # with the backend: how many starts per grammar is its to say
        self.failures: dict[str, Exception] = {}  # requests whose grammar failed, for the step's output
        self.max_rows = max_rows
        self._buffers: tuple[torch.Tensor, torch.Tensor] | None = None  # the mask's (`_allocate`), at first use
        # the host's time filling and applying masks since the runner last reported it, and the rows filled
        self.fill_seconds = 0.0
        self.rows_filled = 0

    @property
    def backend(self) -> GrammarBackend:
        if self._backend is None:
            self._backend = self._make_backend()
        return self._backend

    # -- requests ------------------------------------------------------------------------------------
    def add(self, request_id: str, spec: StructuredOutputsParams, output_tokens: list[int]) -> None:
        """A request arrives in the batch: its matcher, forked from a grammar compiled before (microseconds) or
        compiled in the background, then caught up with the output tokens it already has (`starts.py`)."""
        grammar = self.backend.grammar_of(spec)
        fork = self.starts.fork(grammar.source)
        if fork is not None and not output_tokens:
            self.matchers[request_id] = fork
            return
        if self._compiler is None:
            self._compiler = ThreadPoolExecutor(1, thread_name_prefix="sluice-grammar")
        self.matchers[request_id] = self._compiler.submit(self._build, grammar, output_tokens)

    @property
    def starts(self) -> GrammarStarts:
        if self._starts is None:
            self._starts = GrammarStarts(self.backend.independent_starts)
        return self._starts

    def _build(self, grammar: CompiledGrammar, output_tokens: list[int]) -> tuple[GrammarMatcher, int]:
        """In the compile thread: a matcher at the grammar's start, from a start of its own while the grammar has
        fewer than the backend's independent starts (kept, to fork for later requests), then caught up; with its
        family."""
        fork = self.starts.fork(grammar.source)
        if fork is None:
            m = self.backend.matcher(grammar)
            fork = m, self.starts.add(grammar.source, m.fork())
        if output_tokens and not fork[0].accept_tokens(output_tokens):
            raise RequestFailedError(f"the grammar rejects the output so far: {_first_line(fork[0].error)}")
        return fork

    def _made(self, request_id: str) -> tuple[GrammarMatcher, int] | None:
        """The request's matcher and its family (once its compile is done), or None: not constrained, or failed."""
        made = self.matchers.get(request_id)
        if isinstance(made, Future):
            try:
                made = made.result()
            except Exception as e:  # checked by the front end already: only a broken backend gets here
                self._fail(request_id, str(e))
                return None
            if request_id in self.matchers:  # not dropped meanwhile
                self.matchers[request_id] = made
        return made

    def _matcher(self, request_id: str) -> GrammarMatcher | None:
        made = self._made(request_id)
        return made[0] if made is not None else None

    @property
    def families(self) -> dict[str, int]:
        """request -> the family of its matcher, for the matchers made (for inspection: `fill` reads them itself)."""
        return {rid: made[1] for rid, made in self.matchers.items() if not isinstance(made, Future)}

    def drop(self, request_id: str) -> None:
        self.matchers.pop(request_id, None)

    def accept(self, request_id: str, tokens: list[int]) -> None:
        """The request's next tokens."""
        m = self._advancing(request_id)
        if m is not None and not m.accept_tokens(tokens):
            self._rejected(request_id, m, tokens)

    def accept_rows(self, req_ids: list[str], tokens: list[int], rows: np.ndarray) -> None:
        """A read-back step's tokens, for its constrained ``rows`` only: the matchers advance together (in
        parallel where the backend can), and one that rejects its token fails its request."""
        steps: list[tuple[GrammarMatcher, int]] = []
        owners: list[str] = []
        for j in rows.tolist():
            m = self._advancing(req_ids[j])
            if m is not None:
                steps.append((m, tokens[j]))
                owners.append(req_ids[j])
        if steps:
            for ok, (m, t), rid in zip(self.backend.accept_each(steps), steps, owners):
                if not ok:
                    self._rejected(rid, m, [t])

    def _advancing(self, request_id: str) -> GrammarMatcher | None:
        """The request's matcher while it takes tokens: None once it failed, or after the grammar's end (its EOS,
        when ``ignore_eos`` goes on: those tokens are not the grammar's)."""
        m = self._matcher(request_id)
        return None if m is None or m.is_terminated else m

    def _rejected(self, request_id: str, m: GrammarMatcher, tokens: list[int]) -> None:
        self._fail(request_id, f"the grammar rejected token(s) {tokens}: {_first_line(m.error)}")

    def accept_step(self, sampled: dict[str, int], emitted: dict[str, list[int]]) -> None:
        """A speculative step's tokens: the plain rows' samples, the verifying rows' accepted drafts and the token
        after them (the rejected drafts never reached the matchers: nothing to roll back)."""
        for rid, t in sampled.items():
            if rid in self.matchers:
                self.accept(rid, [t])
        for rid, tokens in emitted.items():
            if rid in self.matchers:
                self.accept(rid, tokens)

    def take_failures(self) -> dict[str, Exception] | None:
        if not self.failures:
            return None
        out, self.failures = self.failures, {}
        return out

    def _fail(self, request_id: str, why: str) -> None:
        self.failures[request_id] = RequestFailedError(f"structured output: {why}")
        self.drop(request_id)

    # -- one step's mask -----------------------------------------------------------------------------
    def mask_logits(
        self, logits: torch.Tensor, req_ids: list[str], rows: np.ndarray, drafts: list[list[int]] | None = None
    ) -> None:
        """Mask ``logits`` rows ``rows`` (of requests ``req_ids``, after ``drafts``: see `fill`) in place; the
        host's time on it counts in ``fill_seconds``."""
        bitmask, row_idx = self.fill(req_ids, rows, drafts)
        t0 = time.perf_counter()
        apply_token_bitmask_(logits, bitmask, row_idx)
        self.fill_seconds += time.perf_counter() - t0

    def fill(
        self, req_ids: list[str], rows: np.ndarray, drafts: list[list[int]] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Fill the mask of a step's constrained ``rows`` (row ``rows[i]`` of the step's logits belongs to request
        ``req_ids[i]``): ``(bitmask [C, words], rows [C])`` in the mask's host buffers (`_allocate`), ready for
        `apply_token_bitmask_`. A verification row samples after ``drafts[i]`` (the drafts before it): its mask
        is the grammar's after them; one behind a draft the grammar rejects is never reached (its draft is
        rejected first, masked out of the row before it) and is left unmasked."""
        t0 = time.perf_counter()
        c = len(rows)
        if c > self.max_rows:
            raise RuntimeError(f"{c} constrained rows, more than the {self.max_rows} the mask holds")
        host_t, rows_t = self._buffers or self._allocate()
        host = host_t.numpy()
        plain: list[tuple[int, GrammarMatcher, int]] = []  # filled together (in parallel, where the backend can)
        for i, rid in enumerate(req_ids):
            made = self._made(rid)
            m = made[0] if made is not None else None
            before = drafts[i] if drafts is not None else None
            if m is None or (before and m.validate_tokens(before) < len(before)):
                host[i] = -1  # failed earlier (its token is dropped), or a row past a rejected draft
            elif before:
                m.accept_tokens(before)
                m.fill_bitmask(host, i)
                m.rollback(len(before))
            else:
                plain.append((made[1], m, i))
        if plain:
            plain.sort(key=itemgetter(0))  # each family's rows together (`starts.py`)
            self.backend.fill_bitmasks([(m, i) for _, m, i in plain], host)
        # rows that allow no token (an unsigned max: a reduction numpy vectorizes, unlike ``any`` along rows)
        for i in np.flatnonzero(host[:c].view(np.uint32).max(axis=1) == 0).tolist():
            m = self._matcher(req_ids[i])
            self._fail(req_ids[i], f"no token can continue the output ({_first_line(m.error) if m else 'failed'})")
            host[i] = -1
        rows_t.numpy()[:c] = rows
        self.fill_seconds += time.perf_counter() - t0
        self.rows_filled += c
        return host_t[:c], rows_t[:c]

    def warm_up(self, logits: torch.Tensor) -> None:
        """Mask ``logits``' first row with a one-row mask that allows every token, held where the step's masks are
        (pinned host memory on a GPU): the kernel is compiled at start-up, not in the first constrained step (a
        Triton compile holds that step for a fraction of a second), and an engine that never sees a grammar
        allocates no mask buffers (`_allocate` waits for the first fill)."""
        pin = self.device.type == "cuda"
        # freed on return, maybe before the kernel reads it: only these warm-up logits could then see other bytes
        mask = torch.full((1, self.words), -1, dtype=torch.int32, pin_memory=pin)
        apply_token_bitmask_(logits, mask, torch.zeros(1, dtype=torch.int64, pin_memory=pin))

    def _allocate(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The mask's buffers, the rows' words and their indices, in host memory: pinned on a GPU, where the
        kernel reads them directly (`bitmask.py`: no copies to launch, each of which cost the host as much as
        the kernel's launch behind a queued forward). One pair serves every step: a step's mask is filled only
        after the step before it is read back, so every read of them has completed by then."""
        pin, n = self.device.type == "cuda", self.max_rows
        self._buffers = (
            torch.full((n, self.words), -1, dtype=torch.int32, pin_memory=pin),
            torch.zeros(n, dtype=torch.int64, pin_memory=pin),
        )
        return self._buffers


def _first_line(error: str | None) -> str:
    return (error or "the grammar failed").strip().splitlines()[0]
