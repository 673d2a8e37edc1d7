"""The range rule: one table of the values each numeric request field may take, checked at the edge.

A number a client sends crosses every layer of the engine: a Python int or float on the front end, msgpack on
the bridge to the core's process (integers within int64 / uint64, floats as float64), then the sampler's per-row
tensors (int64 for counts and token ids, float32 for temperatures, probabilities and penalties; a seed becomes a
`torch.Generator`'s 64-bit state). A value one layer cannot carry fails in that layer, after validation passed,
and there it fails more than its own request: ``max_tokens = 2**64`` passed validation and then failed the
bridge's encoding of the whole batch, which stopped the engine. So each field's range here is what every layer
carries, narrowed to what the field means. The HTTP request models (`sluice.app.server.schemas`) and
`SamplingParams.validate` both check against this table; a new numeric field gets its row here.
"""

from __future__ import annotations

from dataclasses import dataclass

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
UINT64_MAX = (1 << 64) - 1
FLOAT32_MAX = 3.4028234663852886e38
MAX_LOGPROBS = 20
# The seeds a torch.Generator takes (a 64-bit state; negative seeds are remapped into it). msgpack carries the
# whole span: int64 for the negative ones, uint64 for the rest.
SEED_MIN, SEED_MAX = INT64_MIN, UINT64_MAX
# top_k travels in an int32-safe span: the sampler compares it with vocabulary indices.
TOP_K_MAX = (1 << 31) - 1

# How a bound is written in an error message: the powers of two by name, not as 19 digits.
_NAMED = {
    INT64_MIN: "-2**63",
    INT64_MAX: "2**63 - 1",
    UINT64_MAX: "2**64 - 1",
    TOP_K_MAX: "2**31 - 1",
    FLOAT32_MAX: "3.4e38",
}


@dataclass(frozen=True, slots=True)
class ParamRange:
    """The values a numeric field may take: ``kind`` (an ``int`` field takes integers only, a ``float`` field
    integers and floats; never a bool) within ``[lo, hi]``, or ``(lo, hi]`` with ``lo_open``. NaN and the
    infinities are outside every range."""

    kind: type
    lo: int | float
    hi: int | float
    lo_open: bool = False

    def contains(self, x: object) -> bool:
        if isinstance(x, bool) or not isinstance(x, int if self.kind is int else (int, float)):
            return False
        above = x > self.lo if self.lo_open else x >= self.lo  # NaN compares False both ways
        return above and x <= self.hi

    def describe(self) -> str:
        what = "an integer" if self.kind is int else "a number"
        return f"{what} in {'(' if self.lo_open else '['}{_bound(self.lo)}, {_bound(self.hi)}]"

    def bounds(self, hi: int | float | None = None) -> dict[str, int | float]:
        """As pydantic `Field` constraints, optionally narrowed to ``hi`` (an API's own cap, e.g. OpenAI's
        temperature <= 2): a schema can be stricter than what the layers carry, never looser."""
        top = self.hi if hi is None else min(hi, self.hi)
        return {("gt" if self.lo_open else "ge"): self.lo, "le": top}


def _bound(x: int | float) -> str:
    return _NAMED.get(x, f"{x:g}" if isinstance(x, float) else str(x))


PARAM_RANGES: dict[str, ParamRange] = {
    "n": ParamRange(int, 1, INT64_MAX),
    "max_tokens": ParamRange(int, 1, INT64_MAX),
    "min_tokens": ParamRange(int, 0, INT64_MAX),
    "temperature": ParamRange(float, 0, FLOAT32_MAX),
    "top_p": ParamRange(float, 0, 1, lo_open=True),
    "top_k": ParamRange(int, -1, TOP_K_MAX),  # -1 is "off"; 0 is refused on its own (it would keep nothing)
    "min_p": ParamRange(float, 0, 1),
    "seed": ParamRange(int, SEED_MIN, SEED_MAX),
    "presence_penalty": ParamRange(float, -2, 2),
    "frequency_penalty": ParamRange(float, -2, 2),
    "repetition_penalty": ParamRange(float, 0, FLOAT32_MAX, lo_open=True),
    "logprobs": ParamRange(int, 0, MAX_LOGPROBS),
    # An item of stop_token_ids or of a prompt given as token ids; the served vocabulary bounds it further,
    # where the engine knows it (`check_row_params`, `make_requests`).
    "token_id": ParamRange(int, 0, INT64_MAX),
}
