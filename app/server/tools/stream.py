"""A tool-calling turn as OpenAI sends it: the final message (`assistant_message`), or stream chunks
(`ToolCallStream`) whose ``delta.tool_calls`` fragments come from `ToolCallParser`'s events: a call's first
fragment carries ``index``, ``id``, ``type`` and the name with empty arguments, the next ones pieces of the
arguments. Each fragment is a chunk of its own, so a chunk never names one call twice."""

from __future__ import annotations

from collections.abc import Callable

from sluice.app.server import schemas as S
from sluice.app.server.tools.call_parser import ArgumentsPiece, CallOpened, ContentPiece, Event, ParsedTurn
from sluice.app.server.tools.plan import ToolPlan


def finish_reason(reason: str | None, has_calls: bool) -> str | None:
    """A turn that ended by itself after its calls finished them ("tool_calls"); a cut one stays "length"."""
    return "tool_calls" if reason == "stop" and has_calls else reason


def assistant_message(turn: ParsedTurn) -> S.AssistantMessage:
    if not turn.calls:
        return S.AssistantMessage(content=turn.content)
    calls = [S.ToolCall(id=c.id, function=S.FunctionCallOut(name=c.name, arguments=c.arguments)) for c in turn.calls]
    return S.AssistantMessage(content=turn.content or None, tool_calls=calls)


def _delta(ev: Event) -> S.DeltaMessage:
    if isinstance(ev, ContentPiece):
        return S.DeltaMessage(content=ev.text)
    if isinstance(ev, CallOpened):
        fn = S.DeltaFunctionCall(name=ev.name, arguments="")
        return S.DeltaMessage(tool_calls=[S.DeltaToolCall(index=ev.index, id=ev.id, type="function", function=fn)])
    assert isinstance(ev, ArgumentsPiece)
    return S.DeltaMessage(tool_calls=[S.DeltaToolCall(index=ev.index, function=S.DeltaFunctionCall(arguments=ev.text))])


class ToolCallStream:
    """The chunks of the choices of one streamed tool-calling request. ``write(choice)`` gives a chunk's JSON.
    A choice's first chunk carries ``delta.role``; its end is a chunk of its own with an empty delta and the
    finish reason. Logprobs of text not shown yet (held back as a possible opening tag) wait for the next chunk."""

    def __init__(self, plan: ToolPlan, write: Callable[[S.ChatChunkChoice], str]) -> None:
        self._plan = plan
        self._write = write
        self._parsers: dict = {}
        self._role_sent: set[int] = set()
        self._has_calls: set[int] = set()
        self._logprobs: dict[int, list] = {}

    def chunks(self, index: int, text: str, reason: str | None, logprobs: list | None = None) -> list[str]:
        """The chunks for a choice's new text and its logprob entries (and its end, with ``reason``)."""
        parser = self._parsers.get(index) or self._parsers.setdefault(index, self._plan.parser())
        events = parser.feed(text) if text else []
        if reason is not None:
            events += parser.finish()
        if logprobs:
            self._logprobs.setdefault(index, []).extend(logprobs)
        deltas = [_delta(ev) for ev in events]
        self._has_calls.update(index for ev in events if isinstance(ev, CallOpened))
        if reason is not None:
            deltas.append(S.DeltaMessage())
        if deltas and index not in self._role_sent:
            self._role_sent.add(index)
            deltas[0].role = "assistant"
        end = finish_reason(reason, index in self._has_calls)
        return [
            self._write(
                S.ChatChunkChoice(
                    index=index,
                    delta=d,
                    logprobs=self._take_logprobs(index) if i == 0 else None,
                    finish_reason=end if i == len(deltas) - 1 else None,
                )
            )
            for i, d in enumerate(deltas)
        ]

    def _take_logprobs(self, index: int) -> S.ChoiceLogprobs | None:
        lps = self._logprobs.pop(index, None)
        return None if lps is None else S.ChoiceLogprobs(content=lps)
