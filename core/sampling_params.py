"""Sampling parameters of one request, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sluice.core.errors import InvalidRequestError, InvalidStructuredOutput
from sluice.core.param_ranges import (  # noqa: F401 - re-exported: the names callers import from here
    FLOAT32_MAX,
    MAX_LOGPROBS,
    PARAM_RANGES,
    SEED_MAX,
    SEED_MIN,
    TOP_K_MAX,
)

# The numeric fields, checked against their row of `PARAM_RANGES` (None: the default, where one is allowed).
_RANGED = (
    "n",
    "max_tokens",
    "min_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "seed",
    "logprobs",
)
_NONE_ALLOWED = frozenset({"max_tokens", "seed", "logprobs"})


_STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(slots=True)
class StructuredOutputsParams:
    """What a request's output must match, enforced token by token (`core/structured/`): exactly one of

    - ``json``: a JSON schema (a dict, or its text);
    - ``json_object``: any JSON object;
    - ``regex``: a regular expression the whole output matches;
    - ``choice``: one of these strings, verbatim;
    - ``grammar``: a grammar in llguidance's Lark syntax (which may embed JSON schemas: ``%json {...}``).

    JSON comes out compact (``{"a":1}``) unless ``whitespace_flexible``: the grammar then allows the whitespace
    JSON allows, which a weak model may spend its whole token budget on."""

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    whitespace_flexible: bool = False

    def __post_init__(self) -> None:
        given = [k for k in _STRUCTURED_KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise InvalidStructuredOutput(
                "structured_outputs: give exactly one of json, json_object, regex, choice, grammar"
                + (f" (got {', '.join(given)})" if given else "")
            )
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise InvalidStructuredOutput("structured_outputs.json: must be a JSON schema (an object or its text)")
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            raise InvalidStructuredOutput("structured_outputs.regex: must be a non-empty string")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):
            raise InvalidStructuredOutput("structured_outputs.grammar: must be a non-empty string")
        if self.choice is not None:
            if isinstance(self.choice, tuple):
                self.choice = list(self.choice)
            if not isinstance(self.choice, list) or not self.choice or not all(isinstance(c, str) for c in self.choice):
                raise InvalidStructuredOutput("structured_outputs.choice: must be a non-empty list of strings")

    @property
    def kind(self) -> str:
        """The one field that is set: "json", "json_object", "regex", "choice" or "grammar"."""
        return next(k for k in _STRUCTURED_KINDS if getattr(self, k) not in (None, False))


@dataclass(slots=True)
class SamplingParams:
    n: int = 1
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs per token (0 = only the sampled token's)
    cache_salt: str | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # the output must match this (a JSON schema, a regex, a choice, a grammar); None: free text
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if isinstance(self.structured_outputs, dict):  # a library caller's or the wire's plain mapping
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        self.validate()

    def validate(self) -> None:
        """Every numeric field within its row of `PARAM_RANGES` (what every layer of the engine can carry), and
        what relates fields to each other."""

        def bad(param: str, msg: str) -> InvalidRequestError:
            return InvalidRequestError(f"{param}: {msg}", param=param)

        for name in _RANGED:
            value = getattr(self, name)
            if value is None and name in _NONE_ALLOWED:
                continue
            rng = PARAM_RANGES[name]
            if name == "top_k" and (value == 0 or not rng.contains(value)):
                raise bad("top_k", f"must be -1 (off) or an integer in [1, 2**31 - 1], got {value!r}")
            if not rng.contains(value):
                raise bad(name, f"must be {rng.describe()}, got {value!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "must be non-empty strings")
        if self.structured_outputs is not None and self.min_tokens:
            # the end-of-sequence ban could leave a grammar that must end no token to continue with
            raise bad("min_tokens", "not supported with structured_outputs (the grammar decides where the output ends)")
        token_id = PARAM_RANGES["token_id"]
        if not all(map(token_id.contains, self.stop_token_ids)):
            first = next(t for t in self.stop_token_ids if not token_id.contains(t))
            raise bad("stop_token_ids", f"each must be {token_id.describe()}, got {first!r}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        """Whether sampling depends on the tokens so far (presence, frequency or repetition penalty)."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1
