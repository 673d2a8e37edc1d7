"""The default grammar backend: llguidance (a Rust grammar engine; compiles in milliseconds, computes a mask
without the GIL, and its fast-forward tokens respect the tokenizer's canonical tokenization).

Every `StructuredOutputsParams` kind becomes one llguidance grammar text: a JSON schema (compact separators
unless ``whitespace_flexible``; keywords llguidance does not implement are refused, never ignored), a regex, a
choice (a Lark alternation of the literal strings), or a Lark grammar as given.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict

import numpy as np
from sluice.core import cpu_threads, envs
from sluice.core.errors import InvalidStructuredOutput
from sluice.core.sampling_params import StructuredOutputsParams
from sluice.core.structured.backend import CompiledGrammar
from sluice.core.structured.writable import check_writable, unwritable_bytes

_CACHE_SIZE = 256  # checked grammars kept (the same schema tends to come again and again)
# llguidance's threads for a step's masks: the usable cores less these (the step's own thread and the event loops
# need cores too), up to `_MASK_THREADS_MAX`: on a 16-core GPU host a 256-row fill kept getting faster up to 14
# threads, each row's start its own (`scripts/grammar_fill_cost.py`; docs/benchmarks/structured/).
_MASK_THREADS_KEEP = 2
_MASK_THREADS_MAX = 16
# From this many rows a step's tokens advance their matchers in one parallel call (below it, a call per row)
_PARALLEL_ACCEPT_ROWS = 8


def grammar_text(spec: StructuredOutputsParams) -> str:
    """llguidance's grammar for ``spec`` (not yet checked against a tokenizer)."""
    from llguidance import LLMatcher

    kind = spec.kind
    try:
        if kind in ("json", "json_object"):
            schema = spec.json if kind == "json" else {"type": "object"}
            if isinstance(schema, str):
                schema = json.loads(schema)
            if not isinstance(schema, dict):
                raise InvalidStructuredOutput("structured_outputs.json: a JSON schema is an object")
            options = {"whitespace_flexible": spec.whitespace_flexible}
            return LLMatcher.grammar_from_json_schema(schema, defaults=options)
        if kind == "regex":
            return LLMatcher.grammar_from_regex(spec.regex)
        if kind == "choice":
            return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.choice))
        return LLMatcher.grammar_from_lark(spec.grammar)
    except InvalidStructuredOutput:
        raise
    except Exception as e:  # a bad schema's text, a value llguidance refuses: the request's fault, never a 500
        raise InvalidStructuredOutput(f"structured_outputs.{kind}: {e}") from None


def mask_threads(cores: int) -> int:
    """llguidance's threads on a host of ``cores`` usable cores."""
    return max(1, min(_MASK_THREADS_MAX, cores - _MASK_THREADS_KEEP))


class LLGuidanceMatcher:
    """A `GrammarMatcher` over `llguidance.LLMatcher` (which never raises for grammar errors: it enters an error
    state, read here as ``error``)."""

    __slots__ = ("_m",)

    def __init__(self, matcher) -> None:
        self._m = matcher

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        words = bitmask[row]
        self._m.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)  # drops the GIL

    def accept_tokens(self, tokens: list[int]) -> bool:
        return self._m.consume_tokens(tokens)

    def validate_tokens(self, tokens: list[int]) -> int:
        return self._m.validate_tokens(tokens)

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self._m.rollback(num_tokens)

    def forced_tokens(self) -> list[int]:
        return self._m.compute_ff_tokens()

    def fork(self) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(self._m.deep_copy())

    @property
    def raw(self):
        """The `llguidance.LLMatcher` (for the backend's batched fill)."""
        return self._m

    @property
    def is_terminated(self) -> bool:
        return self._m.is_stopped()

    @property
    def error(self) -> str | None:
        return self._m.get_error() or None if self._m.is_error() else None


class LLGuidanceBackend:
    """A `GrammarBackend`. Building llguidance's view of the tokenizer takes a fraction of a second: once, on the
    first compile (off the event loop, like every compile)."""

    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_ids: list[int]) -> None:
        self.vocab_size = vocab_size
        self._hf_tokenizer = hf_tokenizer
        self._eos = list(eos_token_ids) or None
        self._tokenizer = None
        self._unwritable: frozenset[int] = frozenset()  # bytes no token holds (`writable.py`), with the tokenizer
        self._lock = threading.Lock()  # compiles run in several threads; the tokenizer is built once
        self._checked: OrderedDict[str, None] = OrderedDict()
        self._executor = None  # llguidance's thread pool for a step's masks, at the first step with several

    @property
    def tokenizer(self):
        with self._lock:
            if self._tokenizer is None:
                import llguidance.hf

                tok = llguidance.hf.from_tokenizer(self._hf_tokenizer, self.vocab_size, self._eos)
                plain = [t for t in range(tok.vocab_size) if not tok.is_special_token(t)]
                self._unwritable = unwritable_bytes(tok.decode_bytes([t]) for t in plain)
                self._tokenizer = tok
            return self._tokenizer

    def compile(self, spec: StructuredOutputsParams) -> CompiledGrammar:
        from llguidance import LLMatcher

        text = grammar_text(spec)
        with self._lock:
            known = text in self._checked
            if known:
                self._checked.move_to_end(text)
        if not known:
            tokenizer = self.tokenizer
            check_writable(spec, self._unwritable)  # what llguidance's check lets through (`writable.py`)
            try:
                failed, messages = LLMatcher.validate_grammar_with_warnings(text, tokenizer)
            except Exception as e:  # llguidance reports errors as values; anything raised is the grammar's too
                failed, messages = True, [str(e)]
            if failed:
                raise InvalidStructuredOutput(f"structured_outputs.{spec.kind}: {messages[0].strip()}")
            with self._lock:
                self._checked[text] = None
                while len(self._checked) > _CACHE_SIZE:
                    self._checked.popitem(last=False)
        return CompiledGrammar(text, spec.kind)

    def fill_bitmasks(self, rows: list[tuple[LLGuidanceMatcher, int]], bitmask: np.ndarray) -> None:
        """One row alone in the caller's thread; several on llguidance's threads, without the GIL."""
        if len(rows) == 1:
            m, row = rows[0]
            m.fill_bitmask(bitmask, row)
            return
        one_row = bitmask.shape[1] * bitmask.itemsize
        pairs = [(m.raw, row) for m, row in rows]
        self.executor.unsafe_compute_mask_ptr(pairs, bitmask.ctypes.data, one_row, len(bitmask))

    def accept_each(self, steps: list[tuple[LLGuidanceMatcher, int]]) -> list[bool]:
        """Few rows one by one here; more on llguidance's threads (one call instead of a Python call per row)."""
        if len(steps) < _PARALLEL_ACCEPT_ROWS:
            return [m.accept_tokens([t]) for m, t in steps]
        return self.executor.consume_token_par([(m.raw, t) for m, t in steps])

    @property
    def executor(self):
        """llguidance's thread pool for a step's rows, made at the first step with several."""
        if self._executor is None:
            from llguidance import LLExecutor

            self._executor = LLExecutor(num_threads=self.threads)
        return self._executor

    @property
    def threads(self) -> int:
        """The executor's threads: ``SLUICE_GRAMMAR_THREADS``, else `mask_threads` of this process's cores."""
        return envs.SLUICE_GRAMMAR_THREADS or mask_threads(cpu_threads.usable_cores())

    @property
    def independent_starts(self) -> int:
        """A fork of an `LLMatcher` shares its lexer with the matcher it came from, under a lock held through a
        whole mask computation: one independent start per thread, so that a step's rows fill in parallel."""
        return self.threads

    def grammar_of(self, spec: StructuredOutputsParams) -> CompiledGrammar:
        return CompiledGrammar(grammar_text(spec), spec.kind)

    def matcher(self, grammar: CompiledGrammar) -> LLGuidanceMatcher:
        from llguidance import LLMatcher

        try:
            m = LLMatcher(self.tokenizer, grammar.source, log_level=0)
        except Exception as e:
            raise InvalidStructuredOutput(f"structured_outputs.{grammar.kind}: {e}") from None
        if m.is_error():
            raise InvalidStructuredOutput(f"structured_outputs.{grammar.kind}: {m.get_error()}")
        return LLGuidanceMatcher(m)
