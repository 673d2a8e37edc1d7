"""Tool calling through a real loopback server on random weights (`dummy:tiny`) with the real `openai` client:
forced calls (``required``, a named function) always come, name a tool and carry arguments valid for its schema;
streamed fragments reassemble into the non-streamed calls; parallel calls carry distinct indices and ids; tool
results go back through the template; bad tools are 400s."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from sluice.app.server.app import build_app
from sluice.core import AsyncEngine, EngineArgs

from tests.server_helpers import ServerThread, assert_openai_error, parse_sse

KEY = "tools-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MSG = [{"role": "user", "content": "What is the weather in Oslo?"}]
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 5},
        "unit": {"enum": ["c", "f"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
FLAGS = {
    "type": "object",
    "properties": {"on": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}},
    "required": ["on"],
    "additionalProperties": False,
}
SCHEMAS = {"get_weather": WEATHER, "set_flags": FLAGS}
TOOLS = [{"type": "function", "function": {"name": n, "description": n, "parameters": p}} for n, p in SCHEMAS.items()]
MAX_TOKENS = 64


@pytest.fixture(scope="module")
def server():
    args = EngineArgs(model="dummy:tiny", device="cpu", num_kv_blocks=512, max_model_len=2048, max_num_seqs=8)
    srv = ServerThread(build_app(AsyncEngine(args), api_key=KEY)).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def create(client, **kw):
    body = {"model": "dummy:tiny", "messages": MSG, "tools": TOOLS, "max_tokens": MAX_TOKENS, **kw}
    return client.chat.completions.create(**body)


def check_calls(choice, names=tuple(SCHEMAS), whole: bool = True) -> list[tuple[str, str]]:
    """The choice's calls as (name, arguments), each checked: a known name, arguments valid for its tool. A turn
    cut by max_tokens (``whole`` False allows it) has its last call's arguments as far as they got."""
    calls = choice.message.tool_calls
    assert calls and choice.finish_reason in (("tool_calls",) if whole else ("tool_calls", "length")), choice
    assert choice.message.content is None
    cut = choice.finish_reason == "length"
    for k, c in enumerate(calls):
        assert c.type == "function" and c.id.startswith("call_")
        assert c.function.name in names
        if not (cut and k == len(calls) - 1):
            jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])
    assert len({c.id for c in calls}) == len(calls)
    return [(c.function.name, c.function.arguments) for c in calls]


def test_required_calls_validate_for_many_seeds(client):
    r = create(client, tool_choice="required", parallel_tool_calls=False, seed=0, n=6)
    seen = {name for choice in r.choices for name, _ in check_calls(choice)}
    assert seen == set(SCHEMAS)
    assert all(len(c.message.tool_calls) == 1 for c in r.choices)  # parallel calls off: one call


def test_a_named_tool_is_the_one_called(client):
    named = {"type": "function", "function": {"name": "set_flags"}}
    for choice in create(client, tool_choice=named, parallel_tool_calls=False, seed=1, n=2).choices:
        check_calls(choice, names=("set_flags",))


def reassemble(stream) -> tuple[dict[int, dict], dict, dict]:
    """Per choice, its calls by index from streamed ``delta.tool_calls`` fragments (checked as OpenAI sends
    them), its finish reason and its content."""
    calls: dict[int, dict] = {}
    finish: dict[int, str] = {}
    content: dict[int, str] = {}
    for chunk in stream:
        for ch in chunk.choices:
            content[ch.index] = content.get(ch.index, "") + (ch.delta.content or "")
            finish[ch.index] = ch.finish_reason or finish.get(ch.index)
            mine = calls.setdefault(ch.index, {})
            for frag in ch.delta.tool_calls or []:
                if frag.index not in mine:
                    assert frag.id and frag.type == "function" and frag.function.name
                    assert frag.function.arguments == ""
                    mine[frag.index] = {"id": frag.id, "name": frag.function.name, "arguments": ""}
                else:
                    assert frag.id is None and frag.function.name is None
                    mine[frag.index]["arguments"] += frag.function.arguments
    return calls, finish, content


def test_streamed_fragments_reassemble_into_the_non_streamed_calls(client):
    """Parallel calls on (the default): several calls in a turn, each with its own index and id."""
    named = {"type": "function", "function": {"name": "set_flags"}}  # short calls: room for several
    kw = {"tool_choice": named, "seed": 5, "n": 3, "temperature": 1.0, "max_tokens": 64}
    whole = create(client, **kw)
    calls, finish, content = reassemble(create(client, stream=True, **kw))
    several = 0
    for choice in whole.choices:
        mine = calls[choice.index]
        assert finish[choice.index] == choice.finish_reason and content[choice.index] == ""
        assert sorted(mine) == list(range(len(mine)))
        streamed = [(c["name"], c["arguments"]) for c in mine.values()]
        assert streamed == check_calls(choice, names=("set_flags",), whole=False)
        assert len({c["id"] for c in mine.values()}) == len(mine)
        several += len(mine) > 1
    assert several, "no choice made parallel calls"


def test_the_stream_on_the_wire(server):
    """Every chunk a chat.completion.chunk; the role with the first fragment; the end a chunk of its own with an
    empty delta; each token's logprob sent once; the usage last."""
    named = {"type": "function", "function": {"name": "set_flags"}}  # a short call
    body = {"messages": MSG, "tools": TOOLS, "tool_choice": named, "parallel_tool_calls": False, "seed": 1}
    body |= {"max_tokens": MAX_TOKENS, "stream": True, "logprobs": True, "stream_options": {"include_usage": True}}
    resp = httpx.post(server.url + "/v1/chat/completions", json=body, headers=AUTH, timeout=120)
    datas = parse_sse(resp.content)
    assert datas[-1] == "[DONE]"
    chunks = [json.loads(d) for d in datas[:-1]]
    assert all(c["object"] == "chat.completion.chunk" and "usage" in c for c in chunks)
    *calls, end, usage = chunks
    assert calls[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all("role" not in c["choices"][0]["delta"] and c["choices"][0]["finish_reason"] is None for c in calls[1:])
    assert end["choices"][0]["delta"] == {} and end["choices"][0]["finish_reason"] == "tool_calls"
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] > 0
    logprobs = [lp for c in calls + [end] for lp in (c["choices"][0]["logprobs"] or {}).get("content", [])]
    assert len(logprobs) == usage["usage"]["completion_tokens"]


def test_auto_answers_text_or_a_valid_call(client):
    for choice in create(client, tool_choice="auto", seed=2, max_tokens=8, n=3).choices:
        if choice.message.tool_calls:
            check_calls(choice)
        else:
            assert "<tool_call>" not in (choice.message.content or "")
            assert choice.finish_reason in ("stop", "length")


def test_none_shows_no_tools_and_answers_text(client):
    plain = create(client, tool_choice="none", seed=1, max_tokens=4)
    assert plain.choices[0].message.tool_calls is None
    without = client.chat.completions.create(model="dummy:tiny", messages=MSG, max_tokens=4)
    assert plain.usage.prompt_tokens == without.usage.prompt_tokens
    shown = create(client, tool_choice="required", max_tokens=1)
    assert shown.usage.prompt_tokens > without.usage.prompt_tokens + 50  # the tools are in the prompt


def test_tool_results_go_back_through_the_template(client):
    args = '{"city": "Oslo", "unit": "c"}'
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": args}}
    history = [
        *MSG,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "-3 C and snow"},
    ]
    first = create(client, tool_choice="auto", max_tokens=1)
    again = create(client, messages=history, tool_choice="auto", max_tokens=1)
    assert again.usage.prompt_tokens >= first.usage.prompt_tokens + 20  # the call and its result
    no_tools = client.chat.completions.create(model="dummy:tiny", messages=history, max_tokens=1)
    assert no_tools.choices[0].message.tool_calls is None
    assert no_tools.usage.prompt_tokens < again.usage.prompt_tokens - 50  # no tools shown, the turns still there


BAD = [
    (
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}]},
        "tools[0].function.parameters",
    ),
    ({"tools": [{"type": "function", "function": {"name": "no spaces"}}]}, "tools[0].function.name"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tools"),
]


@pytest.mark.parametrize(("body", "param"), BAD)
def test_bad_tools_are_400s(server, body, param):
    resp = httpx.post(
        server.url + "/v1/chat/completions",
        json={"messages": MSG, "max_tokens": 4, **body},
        headers=AUTH,
        timeout=60,
    )
    assert_openai_error(resp, 400, param)
