"""`GrammarStarts`: matchers at the start of the grammars compiled so far, which new requests fork.

Forking a start takes microseconds where compiling takes milliseconds, so a request whose grammar came before
starts from a fork. A backend's forks may share state with their start under a lock (llguidance's forks share
the start's lexer, built lazily, and a mask computation holds its lock throughout), so rows forked from one start
fill their masks one at a time however many threads the backend runs. Hence several independent starts per
grammar (the backend's ``independent_starts``: as many as rows it fills at once), forked in turn: the first
requests of a grammar each compile one more start (in the background, as any compile), the later ones fork.
Each start is a *family* (a number): a step's rows go to the backend ordered by family, so that a thread of its
pool, which takes a contiguous run of the rows, mostly takes one family's lock (forked in turn, neighbouring rows
would each take another start's).
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from sluice.core.structured.backend import GrammarMatcher

_GRAMMARS = 64  # grammars kept (most recently used); their starts go with them


class GrammarStarts:
    def __init__(self, per_grammar: int) -> None:
        self.per_grammar = max(1, per_grammar)
        # grammar source -> its starts, each with its family
        self._starts: OrderedDict[str, list[tuple[int, GrammarMatcher]]] = OrderedDict()
        self._families = 0  # families given out so far (a start's, or a lone matcher's)
        self._turn = 0  # which start the next fork takes
        self._lock = threading.Lock()  # the compile thread adds starts, the executor's thread forks

    def fork(self, source: str) -> tuple[GrammarMatcher, int] | None:
        """A fork of one of ``source``'s starts, taken in turn, and its family; None while the grammar has fewer
        than ``per_grammar`` starts: the caller then compiles another."""
        with self._lock:
            starts = self._starts.get(source)
            if starts is None or len(starts) < self.per_grammar:
                return None
            self._starts.move_to_end(source)
            self._turn += 1
            family, start = starts[self._turn % len(starts)]
            return start.fork(), family

    def add(self, source: str, start: GrammarMatcher) -> int:
        """A newly compiled start of ``source`` (beyond ``per_grammar`` it is not kept); returns its family."""
        with self._lock:
            self._families += 1
            starts = self._starts.setdefault(source, [])
            if len(starts) < self.per_grammar:
                starts.append((self._families, start))
            self._starts.move_to_end(source)
            while len(self._starts) > _GRAMMARS:
                self._starts.popitem(last=False)
            return self._families

    def count(self, source: str) -> int:
        with self._lock:
            return len(self._starts.get(source, ()))
