"""What a tokenizer cannot write: the bytes none of its tokens holds, and the refusal of a grammar whose literal
text needs one.

A byte-level BPE vocabulary need not hold all 256 bytes (SmolLM2's lacks 0xF1, 0xF2 and a few control bytes,
so it cannot write U+40000..U+BFFFF or U+0004). A grammar that requires such a character cannot be followed;
worse, where the grammar forces it, llguidance computes the forced tokens by tokenizing the forced bytes, the
tokenizer silently drops the bytes it has no token for, and the mask allows a token the matcher then rejects:
the request would fail mid-generation. So the front end refuses it up front (400), reading the spec's literal
strings (the choices; a JSON schema's property names and values, not its annotations; a regex's or a Lark
grammar's text, and the characters their escapes name outside character classes: ``\\x04``, ``\\u{53000}``).
An escape inside a class is not read (a range such as ``[\\x00-\\x1f]`` offers other characters), nor a JSON
schema pattern's escapes.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator

from sluice.core.errors import InvalidStructuredOutput
from sluice.core.sampling_params import StructuredOutputsParams

# JSON schema keywords whose values are never output (annotations, references): their text may hold anything
_NOT_OUTPUT = frozenset(
    {"description", "title", "$comment", "examples", "default", "$ref", "$id", "$schema", "$anchor"}
)
# keywords whose value maps keys to schemas: property names (or their patterns: output), or names to refer to
_KEYS_UNDER = {"properties": "names", "patternProperties": "names", "$defs": "refs", "definitions": "refs"}
# a regex's (or Lark's) escapes of a character by its code, any other escape, a character class's brackets
_ESCAPE = re.compile(
    r"\\(?:x([0-9a-fA-F]{2})|u\{([0-9a-fA-F]{1,6})\}|u([0-9a-fA-F]{4})|U([0-9a-fA-F]{8})|.)|(\[)|(\])", re.S
)


def unwritable_bytes(token_bytes: Iterable[bytes]) -> frozenset[int]:
    """The bytes that none of ``token_bytes`` (a vocabulary's tokens, special ones left out) contains."""
    seen: set[int] = set()
    for b in token_bytes:
        seen.update(b)
    return frozenset(range(256)) - seen


def check_writable(spec: StructuredOutputsParams, unwritable: frozenset[int]) -> None:
    """`InvalidStructuredOutput` naming the first literal character of ``spec`` that needs a byte in
    ``unwritable``."""
    if not unwritable:
        return
    for where, text in _literals(spec):
        if unwritable.isdisjoint(text.encode("utf-8", "surrogatepass")):
            continue
        ch = next(c for c in text if not unwritable.isdisjoint(c.encode("utf-8", "surrogatepass")))
        raise InvalidStructuredOutput(
            f"structured_outputs.{where}: the model's tokenizer cannot write the character U+{ord(ch):04X}, so "
            "the output could never match"
        )


def _literals(spec: StructuredOutputsParams) -> Iterator[tuple[str, str]]:
    kind = spec.kind
    if kind == "choice":
        for i, c in enumerate(spec.choice):
            yield f"choice[{i}]", c
    elif kind == "json":
        schema = json.loads(spec.json) if isinstance(spec.json, str) else spec.json
        yield from (("json", s) for s in _schema_strings(schema))
    elif kind in ("regex", "grammar"):
        text = getattr(spec, kind)
        yield kind, text
        yield kind, _escaped(text)


def _escaped(text: str) -> str:
    """The characters that ``text``'s escapes name by their code, outside character classes."""
    out, in_class = [], False
    for m in _ESCAPE.finditer(text):
        code = next((g for g in m.groups()[:4] if g), None)
        if code is not None and not in_class and int(code, 16) <= 0x10FFFF:
            out.append(chr(int(code, 16)))
        elif m.group(5):
            in_class = True
        elif m.group(6):
            in_class = False
    return "".join(out)


def _schema_strings(node, keys: str = "schema") -> Iterator[str]:
    """Every string of a JSON schema that may reach the output: property names, ``const``/``enum`` values,
    patterns; annotations and references skipped. ``keys``: what ``node``'s keys are, if it is an object: keywords of a
    "schema", property "names" (output), or "refs" (a ``$defs`` map's)."""
    if isinstance(node, str):
        yield node
    elif isinstance(node, list):
        for v in node:
            yield from _schema_strings(v)
    elif isinstance(node, dict):
        for k, v in node.items():
            if keys == "names":
                yield k
            elif keys == "schema" and k in _NOT_OUTPUT:
                continue
            inner = _KEYS_UNDER.get(k, "schema") if keys == "schema" else "schema"
            yield from _schema_strings(v, inner)
