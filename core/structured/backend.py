"""The grammar backend's interface: what the engine asks of a grammar engine.

A backend compiles a request's `StructuredOutputsParams` into a `CompiledGrammar` (raising
`InvalidStructuredOutput` for an invalid or unsupported one), and makes one `GrammarMatcher` per request from it.
The matcher follows the request's output token by token: it fills the request's row of a packed next-token bitmask
(int32 words, bit ``t % 32`` of word ``t // 32`` set where token ``t`` is allowed), accepts the sampled tokens,
checks drafts (how many the grammar allows) and rolls tokens back.

`llguidance_backend.py` is the default; another engine (xgrammar) is one more implementation of these two
protocols and an entry in `registry.make_backend`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
from sluice.core.sampling_params import StructuredOutputsParams


def bitmask_words(vocab_size: int) -> int:
    """int32 words per row of a packed bitmask over ``vocab_size`` tokens."""
    return (vocab_size + 31) // 32


@dataclass(slots=True, frozen=True)
class CompiledGrammar:
    """A grammar, checked against the tokenizer: what a backend makes matchers from. ``source`` is the backend's
    own text of it (llguidance: its grammar JSON), the same for equal requests (a cache key)."""

    source: str
    kind: str  # the `StructuredOutputsParams` field it came from


class GrammarMatcher(Protocol):
    """One request's position in its grammar."""

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        """Write the tokens the grammar allows next into ``bitmask[row]`` (int32 words)."""
        ...

    def accept_tokens(self, tokens: list[int]) -> bool:
        """Advance over ``tokens`` (sampled, or accepted drafts); False if the grammar rejects one (an error)."""
        ...

    def validate_tokens(self, tokens: list[int]) -> int:
        """How many of ``tokens`` (drafts) the grammar allows in a row from here, without advancing."""
        ...

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens."""
        ...

    def forced_tokens(self) -> list[int]:
        """The tokens the grammar forces from here (fast-forward), possibly none."""
        ...

    def fork(self) -> GrammarMatcher:
        """A matcher at the same position, independent from here on (cheap: how a request starts from a
        grammar compiled for an earlier one)."""
        ...

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete: nothing but the end of the sequence may follow."""
        ...

    @property
    def error(self) -> str | None:
        """Why the matcher failed (a rejected token, a resource limit), or None."""
        ...


class GrammarBackend(Protocol):
    vocab_size: int  # the bitmask's width: the model's vocabulary (logits' last dimension)
    # Independent starts to keep per grammar (`starts.py`): 1 where forks share no locked state, else the rows
    # the backend fills at once
    independent_starts: int

    def compile(self, spec: StructuredOutputsParams) -> CompiledGrammar:
        """Check ``spec`` against the tokenizer; `InvalidStructuredOutput` if it is invalid or unsupported.
        May take milliseconds: call it off the event loop."""
        ...

    def grammar_of(self, spec: StructuredOutputsParams) -> CompiledGrammar:
        """``spec``'s grammar without the check (`matcher` fails on what the check would refuse): for the engine
        core, whose requests the front end checked."""
        ...

    def matcher(self, grammar: CompiledGrammar) -> GrammarMatcher:
        """A matcher at the grammar's start; `InvalidStructuredOutput` if the grammar does not compile."""
        ...

    def fill_bitmasks(self, rows: list[tuple[GrammarMatcher, int]], bitmask: np.ndarray) -> None:
        """``matcher.fill_bitmask(bitmask, row)`` for each of ``rows`` (this backend's matchers), in parallel
        where the backend can."""
        ...

    def accept_each(self, steps: list[tuple[GrammarMatcher, int]]) -> list[bool]:
        """``matcher.accept_tokens([token])`` for each ``(matcher, token)`` of a step's rows (this backend's
        matchers), in parallel where the backend can; each one's result in order."""
        ...
