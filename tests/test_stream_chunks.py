"""The template-written SSE chunks are byte for byte what the pydantic models give, for any text (control
characters, quotes, backslashes, non-ASCII, emoji), index, finish reason and stream options."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from sluice.app.server import schemas as S
from sluice.app.server.stream_chunks import ChatChunks, CompletionChunks

# every code point but lone surrogates (not valid in a Python str written as UTF-8 anywhere)
TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=40)
FINISH = st.sampled_from([None, "stop", "length", "abort"])


@settings(max_examples=400, deadline=None)
@given(TEXT, st.integers(0, 127), st.booleans(), FINISH, st.booleans(), TEXT, st.integers(0, 2**40))
def test_chat_chunks_equal_pydantic(text, index, first, finish, include_usage, model, created):
    rid = "chatcmpl-" + "ab" * 16
    if first:
        delta = S.DeltaMessage(role="assistant", content=text)
    else:
        delta = S.DeltaMessage(content=text) if text else S.DeltaMessage()
    usage = {"usage": None} if include_usage else {}
    choice = S.ChatChunkChoice(index=index, delta=delta, logprobs=None, finish_reason=finish)
    want = S.ChatCompletionChunk(
        id=rid, object="chat.completion.chunk", created=created, model=model, choices=[choice], **usage
    ).model_dump_json(exclude_unset=True)
    assert ChatChunks(rid, created, model, include_usage).chunk(index, text, first, finish) == want


@settings(max_examples=400, deadline=None)
@given(TEXT, st.integers(0, 127), FINISH, st.booleans(), TEXT)
def test_completion_chunks_equal_pydantic(text, index, finish, include_usage, model):
    rid, created = "cmpl-" + "cd" * 16, 1_700_000_000
    usage = {"usage": None} if include_usage else {}
    choice = S.CompletionChoice(index=index, text=text, logprobs=None, finish_reason=finish)
    want = S.CompletionResponse(
        id=rid, object="text_completion", created=created, model=model, choices=[choice], **usage
    ).model_dump_json(exclude_unset=True)
    assert CompletionChunks(rid, created, model, include_usage).chunk(index, text, finish) == want
