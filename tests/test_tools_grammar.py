"""Tool calling without a server: the grammar a plan builds holds random sampling to calls whose names are the
tools' and whose arguments validate; the parser reads a turn the same fed whole or in pieces; the Hermes format
renders tools, calls and results through the model's own template."""

from __future__ import annotations

import json
import random

import jsonschema
import numpy as np
import pytest
from sluice.app.server import schemas as S
from sluice.app.server.tools import ToolCallParser, plan_tools
from sluice.core.errors import InvalidRequestError
from sluice.core.frontend.tokenizer import apply_chat_template, load_tokenizer
from sluice.core.models.loader import resolve_model

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 6},
        "unit": {"enum": ["c", "f"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
PICK = {
    "type": "object",
    "properties": {"ids": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}},
    "required": ["ids"],
    "additionalProperties": False,
}
SCHEMAS = {
    "get_weather": WEATHER,
    "pick": PICK,
    "ping": {"type": "object", "properties": {}, "additionalProperties": False},
}


def tools(**schemas: dict) -> list[S.ChatTool]:
    return [
        S.ChatTool.model_validate({"type": "function", "function": {"name": n, "parameters": p}})
        for n, p in schemas.items()
    ]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_model("dummy:tiny", None).tokenizer_dir)


@pytest.fixture(scope="module")
def lltok(tokenizer):
    import llguidance.hf

    return llguidance.hf.from_tokenizer(tokenizer)


def sample(lltok, grammar: str, seed: int, prefix: str = "", limit: int = 300) -> str:
    """A turn sampled uniformly from what the grammar allows (a random-weight model's worst case)."""
    import llguidance

    m = llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_lark(grammar))
    assert not m.is_error(), m.get_error()
    toks = lltok.tokenize_str(prefix) if prefix else []
    assert m.consume_tokens(toks), m.get_error()
    rng = random.Random(seed)
    for _ in range(limit):
        bits = np.unpackbits(np.frombuffer(m.compute_bitmask(), dtype=np.uint8), bitorder="little")
        allowed = np.flatnonzero(bits)
        if m.is_stopped() or allowed.size == 0:
            break
        t = int(allowed[rng.randrange(allowed.size)])
        if t == lltok.eos_token:
            break
        assert m.consume_token(t), m.get_error()
        toks.append(t)
    assert m.is_accepting(), "the sampled turn is unfinished"
    return lltok.decode_str(toks)


def check_calls(turn, allowed: set[str]) -> None:
    assert turn.calls
    for call in turn.calls:
        assert call.name in allowed
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    assert len({c.id for c in turn.calls}) == len(turn.calls)


@pytest.mark.parametrize("parallel", [True, False])
def test_required_calls_validate(lltok, parallel):
    plan = plan_tools(tools(**SCHEMAS), "required", parallel)
    counts = set()
    for seed in range(12):
        turn = ToolCallParser.parse(sample(lltok, plan.grammar, seed), auto=False)
        assert turn.content == ""
        check_calls(turn, set(SCHEMAS))
        counts.add(len(turn.calls))
    assert counts == {1} if not parallel else max(counts) > 1


def test_named_choice_calls_that_tool_only(lltok):
    choice = S.NamedToolChoice.model_validate({"type": "function", "function": {"name": "pick"}})
    plan = plan_tools(tools(**SCHEMAS), choice, None)
    for seed in range(8):
        check_calls(ToolCallParser.parse(sample(lltok, plan.grammar, seed), auto=False), {"pick"})


def test_auto_is_text_until_a_call_opens_then_the_call_is_enforced(lltok):
    plan = plan_tools(tools(**SCHEMAS), None, True)
    assert plan.auto
    text = sample(lltok, plan.grammar, 0, limit=40)  # free text: it need not end, so a short sample
    for seed in range(6):
        turn = ToolCallParser.parse(sample(lltok, plan.grammar, seed, prefix="Let me look. <tool_call>"), auto=True)
        assert turn.content == "Let me look. "
        check_calls(turn, set(SCHEMAS))
    assert "<tool_call>" not in text or ToolCallParser.parse(text, auto=True).calls


def test_streamed_pieces_parse_as_the_whole(lltok):
    plan = plan_tools(tools(**SCHEMAS), "required", True)
    for seed in range(6):
        text = "Hi <tool_ca" + sample(lltok, plan.grammar, seed)[len("") :]
        for auto in (True, False):
            whole = ToolCallParser.parse(text, auto)
            rng = random.Random(seed)
            p, pieces = ToolCallParser(auto), []
            i = 0
            while i < len(text):
                j = i + rng.randint(1, 7)
                pieces += p.feed(text[i:j])
                i = j
            pieces += p.finish()
            from sluice.app.server.tools import ParsedTurn

            turn = ParsedTurn()
            turn.add(pieces)
            assert turn.content == whole.content
            assert [(c.name, c.arguments) for c in turn.calls] == [(c.name, c.arguments) for c in whole.calls]


def test_auto_text_with_a_partial_tag_is_content():
    turn = ToolCallParser.parse("a <tool_ca", auto=True)
    assert turn.content == "a <tool_ca" and not turn.calls
    p = ToolCallParser(auto=True)
    assert [e.text for e in p.feed("x <tool")] == ["x "]  # the possible tag is held back
    assert [e.text for e in p.feed("s>")] == ["<tools>"]


@pytest.mark.parametrize(
    ("tool_list", "choice", "param"),
    [
        ([{"name": "bad name"}], None, "tools[0].function.name"),
        ([{"name": "a"}, {"name": "a"}], None, "tools[1].function.name"),
        ([{"name": "a", "parameters": {"type": "objekt"}}], None, "tools[0].function.parameters"),
        ([{"name": "a", "parameters": {"type": "string"}}], None, "tools[0].function.parameters"),
        (
            [{"name": "a", "parameters": {"type": "object", "properties": {"x": {"$ref": "#/nope"}}}}],
            None,
            "tools[0].function.parameters",
        ),
        ([{"name": "a"}], {"type": "function", "function": {"name": "b"}}, "tool_choice"),
        ([], "required", "tool_choice"),
    ],
)
def test_bad_tools_are_refused(tool_list, choice, param):
    ts = [S.ChatTool.model_validate({"type": "function", "function": f}) for f in tool_list]
    if isinstance(choice, dict):
        choice = S.NamedToolChoice.model_validate(choice)
    with pytest.raises(InvalidRequestError) as e:
        plan_tools(ts, choice, None)
    assert e.value.param == param


def test_none_and_no_tools_are_plain_text():
    assert plan_tools(tools(**SCHEMAS), "none", None) is None
    assert plan_tools(None, "auto", None) is None


def test_hermes_template_renders_tools_calls_and_results(tokenizer):
    shown = plan_tools(tools(get_weather=WEATHER), "auto", None).tools
    messages = [
        {"role": "user", "content": "Weather in Oslo?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "c"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "-3 C"},
    ]
    text = tokenizer.decode(apply_chat_template(tokenizer, messages, tools=shown))
    at = [text.index(s) for s in ("<tools>\n{", '"get_weather"', "}\n</tools>", "Weather in Oslo?")]
    assert at == sorted(at)
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}</tool_call>' in text
    assert "<tool_response>\n-3 C\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n")
    plain = tokenizer.decode(apply_chat_template(tokenizer, messages[:1]))
    assert "<tools>" not in plain


def test_a_template_with_tools_renders_them_itself(tokenizer):
    import copy

    tok = copy.copy(tokenizer)
    tok.chat_template = (
        "{% for t in tools %}TOOL {{ t.function.name }}\n{% endfor %}"
        "{% for m in messages %}{{ m.role }}: {{ m.content }}"
        "{% for c in m.tool_calls or [] %}CALL {{ c.function.name }} {{ c.function.arguments.city }}{% endfor %}"
        "\n{% endfor %}"
    )
    shown = plan_tools(tools(get_weather=WEATHER), "auto", None).tools
    calls = [{"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]
    msgs = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "", "tool_calls": calls},
        {"role": "tool", "content": "ok"},
    ]
    text = tok.decode(apply_chat_template(tok, msgs, tools=shown))
    assert text.startswith("TOOL get_weather\nuser: hiassistant: CALL get_weather Oslotool: ok")  # trim_blocks


def test_an_auto_stream_sends_the_text_then_the_call_fragments():
    from sluice.app.server.tools.stream import ToolCallStream

    plan = plan_tools(tools(**SCHEMAS), "auto", True)
    sent: list[S.ChatChunkChoice] = []
    stream = ToolCallStream(plan, lambda choice: sent.append(choice) or "")
    text = 'Let me look. <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}</tool_call>'
    pieces = [text[i : i + 3] for i in range(0, len(text), 3)]
    for k, piece in enumerate(pieces):
        stream.chunks(0, piece, "stop" if k == len(pieces) - 1 else None)
    deltas = [c.delta for c in sent]
    assert deltas[0].role == "assistant" and all(d.role is None for d in deltas[1:])
    assert "".join(d.content or "" for d in deltas) == "Let me look. "
    frags = [f for d in deltas for f in d.tool_calls or []]
    assert frags[0].id.startswith("call_") and frags[0].function.name == "get_weather"
    assert frags[0].function.arguments == "" and all(f.id is None and f.index == 0 for f in frags[1:])
    assert "".join(f.function.arguments for f in frags) == '{"city": "Oslo", "unit": "c"}'
    assert [c.finish_reason for c in sent][-1] == "tool_calls" and sent[-1].delta.model_dump(exclude_unset=True) == {}
    assert all(c.finish_reason is None for c in sent[:-1])
