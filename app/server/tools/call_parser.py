"""Reads a tool-calling turn back, incrementally, by the layout its grammar enforces (`hermes_tools`).

The grammar fixes every byte but the text before the calls (``auto``), the names (one of the tools') and the
arguments (JSON valid for the tool). So the reader is a small state machine over that layout, not a search for
things that look like calls: it matches the fixed parts literally, reads a name up to its closing quote (names hold
no escapes), and follows the arguments' JSON (depth, strings, escapes) to the brace that closes them. Fed a turn in
pieces it gives the same calls as fed it whole. Text that leaves the layout (a turn generated without the grammar)
ends the reading: the rest is content.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from sluice.core.frontend.hermes_tools import ARGS_HEAD, CALL_CLOSE, CALL_OPEN, CALL_SEP, NAME_HEAD


@dataclass(slots=True)
class CallOpened:
    index: int
    id: str
    name: str


@dataclass(slots=True)
class ArgumentsPiece:
    index: int
    text: str


@dataclass(slots=True)
class ContentPiece:
    text: str


Event = CallOpened | ArgumentsPiece | ContentPiece


@dataclass(slots=True)
class ParsedCall:
    id: str
    name: str
    arguments: str = ""


@dataclass(slots=True)
class ParsedTurn:
    content: str = ""
    calls: list[ParsedCall] = field(default_factory=list)

    def add(self, events: list[Event]) -> None:
        for ev in events:
            if isinstance(ev, ContentPiece):
                self.content += ev.text
            elif isinstance(ev, CallOpened):
                self.calls.append(ParsedCall(ev.id, ev.name))
            else:
                self.calls[ev.index].arguments += ev.text


# States: text before the calls; a fixed literal (the rest of it in `_want`); a name; arguments; free content.
_TEXT, _LITERAL, _NAME, _ARGS, _CONTENT = range(5)


class ToolCallParser:
    """``feed(text)`` -> events (`ContentPiece`, `CallOpened`, `ArgumentsPiece`); ``finish()`` at the end."""

    __slots__ = ("_state", "_want", "_then", "_held", "_calls", "_depth", "_in_string", "_escaped")

    def __init__(self, auto: bool) -> None:
        self._held = ""  # text not yet decided on (a possible start of the opening tag; a name so far)
        self._calls = 0
        self._depth, self._in_string, self._escaped = 0, False, False
        if auto:
            self._state, self._want, self._then = _TEXT, "", _NAME
        else:
            self._state, self._want, self._then = _LITERAL, CALL_OPEN + NAME_HEAD, _NAME

    @staticmethod
    def parse(text: str, auto: bool) -> ParsedTurn:
        """A whole turn at once."""
        p, turn = ToolCallParser(auto), ParsedTurn()
        turn.add(p.feed(text))
        turn.add(p.finish())
        return turn

    def feed(self, text: str) -> list[Event]:
        events: list[Event] = []
        while text:
            text = self._step(text, events)
        return events

    def finish(self) -> list[Event]:
        """The end of the turn: text held back as a possible opening tag was content after all."""
        held, self._held = self._held, ""
        if held and self._state in (_TEXT, _CONTENT):
            return [ContentPiece(held)]
        return []

    def _step(self, text: str, events: list[Event]) -> str:
        """Consume a prefix of ``text`` in the current state; return the rest."""
        if self._state == _TEXT:
            return self._text(text, events)
        if self._state == _LITERAL:
            return self._literal(text, events)
        if self._state == _NAME:
            return self._name(text, events)
        if self._state == _ARGS:
            return self._args(text, events)
        events.append(ContentPiece(text))
        return ""

    def _text(self, text: str, events: list[Event]) -> str:
        buf = self._held + text
        at = buf.find(CALL_OPEN)
        if at >= 0:
            self._held = ""
            if at:
                events.append(ContentPiece(buf[:at]))
            self._state, self._want = _LITERAL, NAME_HEAD
            return buf[at + len(CALL_OPEN) :]
        keep = _partial_suffix(buf, CALL_OPEN)
        self._held = buf[len(buf) - keep :] if keep else ""
        if len(buf) > keep:
            events.append(ContentPiece(buf[: len(buf) - keep]))
        return ""

    def _literal(self, text: str, events: list[Event]) -> str:
        n = min(len(text), len(self._want))
        if text[:n] != self._want[:n]:  # off the layout: no grammar held this turn
            self._state = _CONTENT
            events.append(ContentPiece(text))
            return ""
        self._want = self._want[n:]
        if not self._want:
            self._state = self._then
        return text[n:]

    def _name(self, text: str, events: list[Event]) -> str:
        end = text.find('"')
        if end < 0:
            self._held += text
            return ""
        name, self._held = self._held + text[:end], ""
        events.append(CallOpened(self._calls, f"call_{uuid.uuid4().hex[:24]}", name))
        self._state, self._want, self._then = _LITERAL, ARGS_HEAD[1:], _ARGS
        self._depth, self._in_string, self._escaped = 0, False, False
        return text[end + 1 :]

    def _args(self, text: str, events: list[Event]) -> str:
        end = self._json_end(text)
        piece = text if end is None else text[:end]
        if piece:
            events.append(ArgumentsPiece(self._calls, piece))
        if end is None:
            return ""
        self._calls += 1
        self._state, self._want, self._then = _LITERAL, CALL_CLOSE + CALL_SEP + CALL_OPEN + NAME_HEAD, _NAME
        return text[end:]

    def _json_end(self, text: str) -> int | None:
        """Where the arguments' JSON ends within ``text`` (just past its closing brace), or None if not in it."""
        depth, in_string, escaped = self._depth, self._in_string, self._escaped
        for i, ch in enumerate(text):
            if in_string:
                if escaped:
                    escaped = False
                elif ch == "\\":
                    escaped = True
                elif ch == '"':
                    in_string = False
            elif ch == '"':
                in_string = True
            elif ch in "{[":
                depth += 1
            elif ch in "}]":
                depth -= 1
                if depth == 0:
                    return i + 1
        self._depth, self._in_string, self._escaped = depth, in_string, escaped
        return None


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that begins ``tag`` (held back: the tag may be arriving)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
