"""The SSE chunks of a stream without logprobs, written from a template: the bytes pydantic's
``ChatCompletionChunk`` / ``CompletionResponse`` ``.model_dump_json(exclude_unset=True)`` gives, at a fraction
of the cost (a chunk is written per token per stream: a pydantic model each time was the front end's largest
cost per token).

Everything but the text and the finish reason is fixed for a stream, so it is encoded once; the text is
escaped by msgspec's JSON encoder, which escapes as pydantic's does (``tests/test_stream_chunks.py`` holds the
two byte-equal). Chunks with logprobs, and the usage chunk, still go through the pydantic models.
"""

from __future__ import annotations

import msgspec

_json = msgspec.json.Encoder()


def _str(s: str) -> str:
    return _json.encode(s).decode()


class ChatChunks:
    """``chat.completion.chunk`` lines of one stream."""

    __slots__ = ("_head", "_tail")

    def __init__(self, stream_id: str, created: int, model: str, include_usage: bool) -> None:
        self._head = (
            f'{{"id":{_str(stream_id)},"object":"chat.completion.chunk","created":{created},'
            f'"model":{_str(model)},"choices":[{{"index":'
        )
        self._tail = ',"usage":null}' if include_usage else "}"

    def chunk(self, index: int, content: str, role: bool, finish_reason: str | None) -> str:
        """A choice's chunk: with ``role``, its first (``delta.role`` beside the content); an empty content
        (a finish with no new text) sends an empty delta after the first."""
        if role:
            delta = f'{{"role":"assistant","content":{_str(content)}}}'
        elif content:
            delta = f'{{"content":{_str(content)}}}'
        else:
            delta = "{}"
        finish = "null" if finish_reason is None else _str(finish_reason)
        return f'{self._head}{index},"delta":{delta},"logprobs":null,"finish_reason":{finish}}}]{self._tail}'


class CompletionChunks:
    """``text_completion`` stream lines of one stream."""

    __slots__ = ("_head", "_tail")

    def __init__(self, stream_id: str, created: int, model: str, include_usage: bool) -> None:
        self._head = (
            f'{{"id":{_str(stream_id)},"object":"text_completion","created":{created},'
            f'"model":{_str(model)},"choices":[{{"index":'
        )
        self._tail = ',"usage":null}' if include_usage else "}"

    def chunk(self, index: int, text: str, finish_reason: str | None) -> str:
        finish = "null" if finish_reason is None else _str(finish_reason)
        return f'{self._head}{index},"text":{_str(text)},"logprobs":null,"finish_reason":{finish}}}]{self._tail}'
