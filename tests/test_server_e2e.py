"""The server on the real default model, driven by the official openai client (sync and async) and by
raw SSE parsing: wire format, greedy equality with the library, n=2, stop strings, usage, logprobs,
and 32 concurrent streams."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
from sluice.app.server.app import build_app
from sluice.core import AsyncEngine, EngineArgs, SamplingParams

from tests.server_helpers import ServerThread, check_chat_stream, metric_value, parse_sse

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
MESSAGES = [
    {"role": "system", "content": "You are a concise assistant."},
    {"role": "user", "content": "Name three colors of the rainbow."},
]


@pytest.fixture(scope="session")
def real_server():
    engine = AsyncEngine(EngineArgs(model=MODEL, device="cpu", num_kv_blocks=512, max_model_len=1024))
    srv = ServerThread(build_app(engine)).start()
    srv.engine = engine
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def sync_client(real_server):
    return openai.OpenAI(base_url=real_server.url + "/v1", api_key="unused", max_retries=0)


def library(srv: ServerThread, prompt, **params):
    """The same request through the library (`AsyncEngine.generate`) on the server's engine."""

    async def run():
        finals = {}
        async for out in srv.engine.generate(prompt, SamplingParams(**params)):
            if out.finished:
                finals[out.index] = out
        return finals

    return srv.call(run())


def test_greedy_stream_equals_non_stream_and_library(real_server, sync_client):
    # Distinct cache salts: each run computes its prompt afresh, so all three do the same arithmetic.
    common = dict(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=16)
    full = sync_client.chat.completions.create(**common, extra_body={"cache_salt": "a"})
    text, finish, role = "", None, None
    for chunk in sync_client.chat.completions.create(**common, stream=True, extra_body={"cache_salt": "b"}):
        delta = chunk.choices[0].delta
        role = role or delta.role
        text += delta.content or ""
        finish = chunk.choices[0].finish_reason or finish
    lib = library(real_server, MESSAGES, temperature=0, max_tokens=16, cache_salt="c")[0]
    assert role == "assistant"
    assert lib.text and full.choices[0].message.content == text == lib.text
    assert full.choices[0].finish_reason == finish == lib.finish_reason
    assert full.usage.completion_tokens == len(lib.token_ids)
    assert full.usage.prompt_tokens == len(lib.prompt_token_ids)
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens


async def test_async_client_stream_n2_include_usage_logprobs(real_server):
    c = openai.AsyncOpenAI(base_url=real_server.url + "/v1", api_key="unused", max_retries=0)
    args = dict(model=MODEL, messages=MESSAGES, n=2, temperature=0.8, seed=7, max_tokens=12)
    stream = await c.chat.completions.create(
        **args, stream=True, stream_options={"include_usage": True}, logprobs=True, top_logprobs=3
    )
    texts, finish, lp_count, usage = {0: "", 1: ""}, {}, 0, None
    async for chunk in stream:
        if not chunk.choices:
            usage = chunk.usage
            continue
        ch = chunk.choices[0]
        texts[ch.index] += ch.delta.content or ""
        if ch.finish_reason:
            finish[ch.index] = ch.finish_reason
        for tok in ch.logprobs.content:
            lp_count += 1
            assert len(tok.top_logprobs) == 3
            assert tok.logprob <= tok.top_logprobs[0].logprob + 1e-4  # top is best first
            assert bytes(tok.bytes).decode("utf-8", "replace") == tok.token
    assert set(finish) == {0, 1} and all(f in ("stop", "length") for f in finish.values())
    assert usage is not None and usage.completion_tokens == lp_count  # one logprob entry per token
    assert usage.prompt_tokens_details.cached_tokens >= 0
    # Seeded sampling is reproducible through the API, streamed or not.
    full = await c.chat.completions.create(**args)
    assert {ch.index: ch.message.content for ch in full.choices} == texts
    await c.close()


def test_stop_strings_cut_the_text(sync_client):
    base = dict(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=24)
    text = sync_client.chat.completions.create(**base).choices[0].message.content
    words = text.split()
    assert len(words) >= 4, text
    stop = words[len(words) // 2]
    expected = text[: text.find(stop)]
    stopped = sync_client.chat.completions.create(**base, stop=[stop, "never-appears-xyz"])
    assert stopped.choices[0].message.content == expected
    assert stopped.choices[0].finish_reason == "stop"
    streamed = "".join(
        chunk.choices[0].delta.content or ""
        for chunk in sync_client.chat.completions.create(**base, stop=stop, stream=True)
    )
    assert streamed == expected


def test_raw_sse_wire_format_and_cached_tokens(real_server):
    body = {
        "model": MODEL,
        "messages": MESSAGES,
        "n": 2,
        "max_tokens": 10,
        "temperature": 0.7,
        "stream": True,
        "stream_options": {"include_usage": True},
        "logprobs": True,
    }
    with httpx.Client(base_url=real_server.url, timeout=120) as c:
        first = c.post("/v1/chat/completions", json=body)
        second = c.post("/v1/chat/completions", json=body)
    for resp in (first, second):
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        choices, usage = check_chat_stream(parse_sse(resp.content), 2, True, MODEL, logprobs=True)
        assert sum(c["logprobs"] for c in choices.values()) == usage["completion_tokens"]
        assert all(c["text"] for c in choices.values())
    # The same prompt again: its full blocks come from the prefix cache.
    _, usage = check_chat_stream(parse_sse(second.content), 2, True, MODEL, logprobs=True)
    assert usage["prompt_tokens_details"]["cached_tokens"] >= 16


async def test_32_concurrent_streams(real_server):
    topics = ["rivers", "mountains", "the moon", "bread"]
    with httpx.Client(base_url=real_server.url) as c:
        before = metric_value(c.get("/metrics").text, "sluice:generation_tokens_total")

    async def one(i: int, c: httpx.AsyncClient):
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": f"Say something about {topics[i % 4]}."}],
            "max_tokens": 6,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        resp = await c.post("/v1/chat/completions", json=body)
        assert resp.status_code == 200, resp.text
        return check_chat_stream(parse_sse(resp.content), 1, True, MODEL)

    async with httpx.AsyncClient(base_url=real_server.url, timeout=300) as c:
        results = await asyncio.gather(*(one(i, c) for i in range(32)))
    assert len(results) == 32
    for choices, usage in results:
        assert choices[0]["text"] and 1 <= usage["completion_tokens"] <= 6
    with httpx.Client(base_url=real_server.url) as c:
        metrics = c.get("/metrics").text
    generated = metric_value(metrics, "sluice:generation_tokens_total") - before
    assert generated == sum(u["completion_tokens"] for _, u in results)
    assert metric_value(metrics, "sluice:kv_blocks_free") == metric_value(metrics, "sluice:kv_blocks_total")


def test_completions_text_and_token_ids_match_library(real_server, sync_client, default_tokenizer):
    prompt = "The capital of France is"
    ids = default_tokenizer.encode(prompt)
    lib = library(real_server, ids, temperature=0, max_tokens=8, logprobs=2)[0]
    by_text = sync_client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=8, logprobs=2)
    by_ids = sync_client.completions.create(model=MODEL, prompt=ids, temperature=0, max_tokens=8)
    assert by_text.choices[0].text == by_ids.choices[0].text == lib.text
    assert by_text.usage.prompt_tokens == len(ids)
    lp = by_text.choices[0].logprobs
    assert len(lp.tokens) == len(lib.token_ids) == by_text.usage.completion_tokens
    assert lp.token_logprobs == pytest.approx([t.logprob for t in lib.logprobs], abs=1e-4)
    assert all(len(top) <= 2 for top in lp.top_logprobs)
    streamed = "".join(
        ch.choices[0].text
        for ch in sync_client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=8, stream=True)
    )
    assert streamed == lib.text
    assert json.loads(by_text.model_dump_json())["object"] == "text_completion"
