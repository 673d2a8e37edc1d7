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

from tests.server_helpers import ServerThread, assert_openai_error

KEY = "tools-key"
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
MAX_TOKENS = 160


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


def check_calls(choice, names=tuple(SCHEMAS)) -> list[tuple[str, str]]:
    """The choice's calls as (name, arguments), each checked: a known name, arguments valid for its tool."""
    calls = choice.message.tool_calls
    assert calls and choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None
    for c in calls:
        assert c.type == "function" and c.id.startswith("call_")
        assert c.function.name in names
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])
    assert len({c.id for c in calls}) == len(calls)
    return [(c.function.name, c.function.arguments) for c in calls]


def test_required_calls_validate_for_many_seeds(client):
    seen = set()
    for seed in range(6):
        r = create(client, tool_choice="required", seed=seed, n=2)
        for choice in r.choices:
            seen.update(name for name, _ in check_calls(choice))
    assert seen == set(SCHEMAS)


def test_a_named_tool_is_the_one_called(client):
    for seed in range(3):
        r = create(client, tool_choice={"type": "function", "function": {"name": "set_flags"}}, seed=seed)
        check_calls(r.choices[0], names=("set_flags",))


def reassemble(stream) -> tuple[dict[int, dict], str | None, str]:
    """Calls by index from streamed ``delta.tool_calls`` fragments, checked as OpenAI sends them."""
    calls: dict[int, dict] = {}
    finish, content = None, ""
    for chunk in stream:
        for ch in chunk.choices:
            content += ch.delta.content or ""
            finish = ch.finish_reason or finish
            for frag in ch.delta.tool_calls or []:
                if frag.index not in calls:
                    assert frag.id and frag.type == "function" and frag.function.name
                    assert frag.function.arguments == ""
                    calls[frag.index] = {"id": frag.id, "name": frag.function.name, "arguments": ""}
                else:
                    assert frag.id is None and frag.function.name is None
                    calls[frag.index]["arguments"] += frag.function.arguments
    return calls, finish, content


def test_streamed_fragments_reassemble_into_the_non_streamed_calls(client):
    several = 0
    for seed in range(6):
        whole = create(client, tool_choice="required", seed=seed, temperature=1.0)
        calls, finish, content = reassemble(create(client, tool_choice="required", seed=seed, stream=True))
        assert finish == "tool_calls" and content == ""
        assert sorted(calls) == list(range(len(calls)))
        assert [(c["name"], c["arguments"]) for c in calls.values()] == check_calls(whole.choices[0])
        assert len({c["id"] for c in calls.values()}) == len(calls)
        several += len(calls) > 1
    assert several, "no seed gave parallel calls"


def test_parallel_tool_calls_off_gives_one_call(client):
    for seed in range(4):
        r = create(client, tool_choice="required", parallel_tool_calls=False, seed=seed)
        assert len(check_calls(r.choices[0])) == 1


def test_auto_answers_text_or_a_valid_call(client):
    for seed in range(3):
        choice = create(client, tool_choice="auto", seed=seed, max_tokens=24).choices[0]
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
    shown = create(client, tool_choice="required", max_tokens=MAX_TOKENS)
    assert shown.usage.prompt_tokens > without.usage.prompt_tokens + 50  # the tools are in the prompt


def test_tool_results_go_back_through_the_template(client):
    first = create(client, tool_choice={"type": "function", "function": {"name": "get_weather"}}, seed=3)
    call = first.choices[0].message.tool_calls[0]
    history = [
        *MSG,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "-3 C and snow"},
    ]
    again = create(client, messages=history, tool_choice="auto", max_tokens=8)
    assert again.usage.prompt_tokens > first.usage.prompt_tokens + len(call.function.arguments) // 8
    no_tools = client.chat.completions.create(model="dummy:tiny", messages=history, max_tokens=4)
    assert no_tools.choices[0].message.tool_calls is None and no_tools.usage.prompt_tokens > 10


BAD = [
    (
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}]},
        "tools[0].function.parameters",
    ),
    ({"tools": [{"type": "function", "function": {"name": "no spaces"}}]}, "tools[0].function.name"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
]


@pytest.mark.parametrize(("body", "param"), BAD)
def test_bad_tools_are_400s(server, body, param):
    resp = httpx.post(
        server.url + "/v1/chat/completions",
        json={"messages": MSG, "max_tokens": 4, **body},
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=60,
    )
    assert_openai_error(resp, 400, param)
