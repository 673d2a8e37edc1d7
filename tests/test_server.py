"""The HTTP server on the fast random-weight model: errors, limits, disconnects, overload, failures,
metrics, OpenAPI, and embedding in a user's app. A real uvicorn server on a loopback port."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time

import httpx
import openai
import pytest
from sluice.app.server.app import build_app
from sluice.core import AsyncEngine, EngineArgs
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Mount, Route

from tests.server_helpers import ServerThread, assert_openai_error, check_chat_stream, metric_value, parse_sse

KEY = "test-key-123"
AUTH = {"Authorization": f"Bearer {KEY}"}
MSG = [{"role": "user", "content": "Hi"}]
MAX_MODEL_LEN = 2048


def dummy_args(**kw) -> EngineArgs:
    base = dict(model="dummy:tiny", device="cpu", num_kv_blocks=512, max_model_len=MAX_MODEL_LEN)
    return EngineArgs(**{**base, **kw})


@pytest.fixture(scope="session")
def dummy_server():
    """Tight queue limits (2 running, 2 waiting) so overload is easy to reach; an API key is required. The
    engine core runs in its own process, as under `sluice serve`."""
    engine = AsyncEngine(dummy_args(max_num_seqs=2, max_waiting_requests=2, engine_core_process=True))
    srv = ServerThread(build_app(engine, api_key=KEY)).start()
    srv.engine = engine
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def one_process_server():
    """The engine in the server's process: a test can reach into its model runner."""
    engine = AsyncEngine(dummy_args(max_num_seqs=2, max_waiting_requests=2))
    srv = ServerThread(build_app(engine, api_key=KEY)).start()
    srv.engine = engine
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def client(dummy_server):
    with httpx.Client(base_url=dummy_server.url, headers=AUTH, timeout=60) as c:
        yield c


def chat(client: httpx.Client, **body) -> httpx.Response:
    return client.post("/v1/chat/completions", json={"messages": MSG, "max_tokens": 2, **body})


def wait_idle(engine: AsyncEngine, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while True:
        s = engine.stats()
        if s.num_running == 0 and s.num_waiting == 0 and s.kv_blocks_free == s.kv_blocks_total:
            return s
        assert time.monotonic() < deadline, f"engine not idle: {s}"
        time.sleep(0.02)


BIG = "x" * (2 * 1024 * 1024)


def _chunked(data: bytes):
    for i in range(0, len(data), 64 * 1024):
        yield data[i : i + 64 * 1024]


# (name, path, json body or raw bytes, headers override, status, param)
BAD_REQUESTS = [
    ("missing messages", "/v1/chat/completions", {"max_tokens": 2}, None, 400, "messages"),
    ("messages not a list", "/v1/chat/completions", {"messages": "Hi"}, None, 400, "messages"),
    ("max_tokens a string", "/v1/chat/completions", {"messages": MSG, "max_tokens": "5"}, None, 400, "max_tokens"),
    ("stream not a bool", "/v1/chat/completions", {"messages": MSG, "stream": "yes"}, None, 400, "stream"),
    (
        "bad role",
        "/v1/chat/completions",
        {"messages": [{"role": "robot", "content": "x"}]},
        None,
        400,
        "messages[0].role",
    ),
    (
        "image content part",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        None,
        400,
        "messages[0].content",
    ),
    ("n=0", "/v1/chat/completions", {"messages": MSG, "n": 0}, None, 400, "n"),
    ("negative max_tokens", "/v1/chat/completions", {"messages": MSG, "max_tokens": -1}, None, 400, "max_tokens"),
    ("temperature 3", "/v1/chat/completions", {"messages": MSG, "temperature": 3}, None, 400, "temperature"),
    ("top_p 0", "/v1/chat/completions", {"messages": MSG, "top_p": 0}, None, 400, "top_p"),
    ("n past max_waiting_requests", "/v1/chat/completions", {"messages": MSG, "n": 3}, None, 400, "n"),
    ("seed past 64 bits", "/v1/chat/completions", {"messages": MSG, "seed": 2**64}, None, 400, "seed"),
    (
        "stop token past the vocabulary",
        "/v1/chat/completions",
        {"messages": MSG, "stop_token_ids": [10**9]},
        None,
        400,
        "stop_token_ids",
    ),
    ("top_k 0 (engine check)", "/v1/chat/completions", {"messages": MSG, "top_k": 0}, None, 400, "top_k"),
    (
        "min_tokens over max_tokens",
        "/v1/chat/completions",
        {"messages": MSG, "max_tokens": 2, "min_tokens": 5},
        None,
        400,
        "min_tokens",
    ),
    (
        "top_logprobs without logprobs",
        "/v1/chat/completions",
        {"messages": MSG, "top_logprobs": 2},
        None,
        400,
        "top_logprobs",
    ),
    ("unknown model", "/v1/chat/completions", {"messages": MSG, "model": "gpt-4o"}, None, 404, "model"),
    (
        "prompt over max_model_len",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hello " * MAX_MODEL_LEN}]},
        None,
        400,
        "messages",
    ),
    ("malformed JSON", "/v1/chat/completions", b'{"messages": [', None, 400, None),
    ("JSON not an object", "/v1/chat/completions", b"[1, 2]", None, 400, None),
    ("empty body", "/v1/chat/completions", b"", None, 400, None),
    ("2 MB body", "/v1/chat/completions", {"messages": [{"role": "user", "content": BIG}]}, None, 413, None),
    ("2 MB body, chunked", "/v1/chat/completions", "chunked", None, 413, None),
    ("no API key", "/v1/chat/completions", {"messages": MSG}, {}, 401, None),
    ("wrong API key", "/v1/chat/completions", {"messages": MSG}, {"Authorization": "Bearer nope"}, 401, None),
    ("no API key on models", "/v1/models", None, {}, 401, None),
    ("prompt token id out of vocab", "/v1/completions", {"prompt": [1, 2, 10**9]}, None, 400, "prompt"),
    ("empty prompt ids", "/v1/completions", {"prompt": []}, None, 400, "prompt"),
    ("prompt wrong type", "/v1/completions", {"prompt": 5}, None, 400, "prompt"),
    ("echo unsupported", "/v1/completions", {"prompt": "Hi", "echo": True}, None, 400, "echo"),
    ("embeddings, said unsupported", "/v1/embeddings", {"input": "x"}, None, 404, None),
    ("unknown model by id", "/v1/models/no-such-model", None, None, 404, "model"),
    (
        "stream_options without stream",
        "/v1/completions",
        {"prompt": "Hi", "stream_options": {}},
        None,
        400,
        "stream_options",
    ),
    ("a list of prompts", "/v1/completions", {"prompt": ["Hi", "Ho"]}, None, 400, "prompt"),
]


@pytest.mark.parametrize("name,path,body,headers,status,param", BAD_REQUESTS, ids=[c[0] for c in BAD_REQUESTS])
def test_bad_request_gets_openai_error_and_server_keeps_serving(
    dummy_server, client, name, path, body, headers, status, param
):
    hdrs = AUTH if headers is None else headers
    with httpx.Client(base_url=dummy_server.url, headers=hdrs, timeout=60) as c:
        if body is None:
            resp = c.get(path)
        elif body == "chunked":
            raw = json.dumps({"messages": [{"role": "user", "content": BIG}]}).encode()
            resp = c.post(path, content=_chunked(raw), headers={"Content-Type": "application/json"})
            assert "content-length" not in resp.request.headers
        elif isinstance(body, bytes):
            resp = c.post(path, content=body, headers={"Content-Type": "application/json"})
        else:
            resp = c.post(path, json=body)
    err = assert_openai_error(resp, status, param)
    if status == 400 and param:
        assert param.split("[")[0].split(".")[0] in err["message"], "the message names the field"
    if status == 401:
        assert err["code"] == "invalid_api_key"
    ok = chat(client)
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"


def test_unknown_fields_are_ignored_and_model_may_be_named(client, dummy_server):
    resp = chat(client, model="dummy:tiny", parallel_tool_calls=False, whatever={"x": [1]})
    assert resp.status_code == 200
    body = resp.json()
    assert body["object"] == "chat.completion" and body["model"] == "dummy:tiny"
    assert body["usage"]["completion_tokens"] == 2


def test_api_corners_answer_as_openai_does(client):
    card = client.get("/v1/models/dummy:tiny").json()
    assert card == client.get("/v1/models").json()["data"][0]
    assert client.get("/v1/models/nope").json()["error"]["code"] == "model_not_found"
    assert (
        "embeddings are not supported" in client.post("/v1/embeddings", json={"input": "x"}).json()["error"]["message"]
    )
    chat_resp = chat(client, stream=False, stream_options={"include_usage": True})
    assert chat_resp.status_code == 400 and chat_resp.json()["error"]["param"] == "stream_options"
    listed = client.post("/v1/completions", json={"prompt": [[1, 2], [3]], "max_tokens": 1}).json()["error"]
    assert "a list of prompts is not supported" in listed["message"]
    ids = client.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 1})
    assert ids.status_code == 200  # one prompt given as token ids is still one prompt


def test_models_health_version(client):
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == "dummy:tiny"
    assert models["data"][0]["max_model_len"] == MAX_MODEL_LEN
    # Open without the key: load balancers and scrapers probe these.
    assert httpx.get(client.base_url.join("/health")).status_code == 200
    assert httpx.get(client.base_url.join("/version")).json()["version"]


def test_chat_stream_wire_format_on_dummy(client, dummy_server):
    body = {
        "messages": MSG,
        "max_tokens": 5,
        "n": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
        "logprobs": True,
        "top_logprobs": 2,
        "ignore_eos": True,
    }
    resp = client.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
    choices, usage = check_chat_stream(parse_sse(resp.content), 2, True, "dummy:tiny", logprobs=True)
    assert all(c["finish_reason"] == "length" and c["logprobs"] == 5 for c in choices.values())
    assert usage["completion_tokens"] == 10


def test_completions_stream_and_logprobs_on_dummy(client):
    body = {"prompt": [1, 2, 3, 4], "max_tokens": 4, "stream": True, "logprobs": 3, "ignore_eos": True}
    resp = client.post("/v1/completions", json=body)
    datas = parse_sse(resp.content)
    assert datas[-1] == "[DONE]"
    chunks = [json.loads(d) for d in datas[:-1]]
    assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"].startswith("cmpl-")
    assert all(c["object"] == "text_completion" and "usage" not in c for c in chunks)
    lps = [t for c in chunks for t in c["choices"][0]["logprobs"]["tokens"]]
    tops = [t for c in chunks for t in c["choices"][0]["logprobs"]["top_logprobs"]]
    assert len(lps) == 4 and all(1 <= len(t) <= 3 for t in tops)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    text = "".join(c["choices"][0]["text"] for c in chunks)
    full = client.post("/v1/completions", json={**body, "stream": False, "temperature": 0}).json()
    assert full["object"] == "text_completion" and full["usage"]["prompt_tokens"] == 4
    assert isinstance(text, str) and full["choices"][0]["logprobs"]["text_offset"][0] == 0


def test_stream_disconnect_aborts_and_frees_blocks(client, dummy_server):
    engine = dummy_server.engine
    before = wait_idle(engine)
    max_tokens = 1500
    body = {"messages": MSG, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        assert resp.status_code == 200
        seen = 0
        # Held in a name: a dropped line iterator is finalized, and that closes the connection early.
        lines = resp.iter_lines()
        for line in lines:
            seen += line.startswith("data: ")
            if seen == 3:
                break
        # The stats snapshot is published after the step whose tokens we read, so it may lag a moment.
        deadline = time.monotonic() + 10
        while engine.stats().num_running != 1:
            assert time.monotonic() < deadline, f"the request is not running: {engine.stats()}"
            time.sleep(0.01)
    # The connection is closed here, mid-stream.
    after = wait_idle(engine)
    generated = after.generation_tokens - before.generation_tokens
    assert 3 <= generated < max_tokens, "the request was aborted, not run to the end"
    metrics = client.get("/metrics").text
    assert metric_value(metrics, "sluice:kv_blocks_free") == metric_value(metrics, "sluice:kv_blocks_total")
    assert metric_value(metrics, "sluice:kv_cache_usage_perc") == 0.0
    assert metric_value(metrics, "sluice:num_requests_running") == 0.0


def test_non_stream_disconnect_aborts_and_frees_blocks(dummy_server):
    engine = dummy_server.engine
    before = wait_idle(engine)
    max_tokens = 1500
    body = {"messages": MSG, "max_tokens": max_tokens, "ignore_eos": True}
    with httpx.Client(base_url=dummy_server.url, headers=AUTH, timeout=0.3) as c:
        with pytest.raises(httpx.ReadTimeout):
            c.post("/v1/chat/completions", json=body)
    after = wait_idle(engine)
    assert after.generation_tokens - before.generation_tokens < max_tokens


async def test_overload_gets_503_with_retry_after(dummy_server):
    # 2 may run and 2 may wait; the rest of 8 simultaneous requests must be turned away.
    body = {"messages": MSG, "max_tokens": 20, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=dummy_server.url, headers=AUTH, timeout=60) as c:
        resps = await asyncio.gather(*(c.post("/v1/chat/completions", json=body) for _ in range(8)))
    ok = [r for r in resps if r.status_code == 200]
    busy = [r for r in resps if r.status_code == 503]
    assert len(ok) + len(busy) == 8, [r.status_code for r in resps]
    assert 1 <= len(ok) <= 4 and len(busy) >= 4
    for r in busy:
        assert r.headers["retry-after"] == "1"
        assert assert_openai_error(r, 503)["code"] == "engine_overloaded"
    for r in ok:
        assert r.json()["usage"]["completion_tokens"] == 20
    wait_idle(dummy_server.engine)
    async with httpx.AsyncClient(base_url=dummy_server.url, headers=AUTH, timeout=60) as c:
        assert (await c.post("/v1/chat/completions", json={**body, "max_tokens": 2})).status_code == 200


def test_openai_client_against_dummy(dummy_server):
    c = openai.OpenAI(base_url=dummy_server.url + "/v1", api_key=KEY, max_retries=0)
    r = c.chat.completions.create(model="dummy:tiny", messages=MSG, max_tokens=3, n=2)
    assert len(r.choices) == 2 and r.usage.prompt_tokens > 0
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=dummy_server.url + "/v1", api_key="bad", max_retries=0).models.list()
    with pytest.raises(openai.NotFoundError):
        c.chat.completions.create(model="nope", messages=MSG, max_tokens=3)
    with pytest.raises(openai.BadRequestError) as ei:
        c.chat.completions.create(model="dummy:tiny", messages=MSG, temperature=3)
    assert ei.value.body["param"] == "temperature"


def test_failure_mid_stream_sends_error_event(one_process_server, monkeypatch):
    dummy_server = one_process_server
    client = httpx.Client(base_url=dummy_server.url, headers=AUTH, timeout=60)
    runner = dummy_server.engine.local_core.executor.runner
    real_launch = runner.launch
    fail = threading.Event()

    def flaky(so):
        if fail.is_set():
            fail.clear()
            raise RuntimeError("secret internal detail")
        return real_launch(so)

    monkeypatch.setattr(runner, "launch", flaky)
    body = {"messages": MSG, "max_tokens": 500, "ignore_eos": True, "stream": True}
    datas = []
    with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: "):
                datas.append(line[6:])
                if len(datas) == 2:
                    fail.set()
    assert datas[-1] == "[DONE]"
    err = json.loads(datas[-2])
    assert set(err) == {"error"} and err["error"]["code"] == "request_failed"
    assert "secret" not in "".join(datas) and "Traceback" not in "".join(datas)
    assert all("choices" in json.loads(d) for d in datas[:-2])
    wait_idle(dummy_server.engine)
    assert chat(client).status_code == 200
    # The official client turns the error event into an exception.
    fail.clear()
    c = openai.OpenAI(base_url=dummy_server.url + "/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.APIError, match="failed inside the engine"):
        for i, _ in enumerate(c.chat.completions.create(model="dummy:tiny", messages=MSG, max_tokens=500, stream=True)):
            if i == 1:
                fail.set()


def test_metrics_hit_rate_gauge_covers_the_recent_requests_only():
    """The gauge is the hit rate of the last requests (here all of them: it equals the cumulative counters'),
    and forgets what left its window."""
    from sluice.app.server.metrics import RecentHitRate

    srv = ServerThread(build_app(AsyncEngine(dummy_args(num_kv_blocks=64)))).start()
    try:
        prompt = list(range(100, 180))  # 80 tokens: 4 full blocks of 16 are cached after the first request
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            for _ in range(2):
                body = {"prompt": prompt, "max_tokens": 1}
                assert c.post("/v1/completions", json=body).status_code == 200
            text = c.get("/metrics").text
    finally:
        srv.stop()
    hits, queries = (
        metric_value(text, "sluice:prefix_cache_hits_total"),
        metric_value(text, "sluice:prefix_cache_queries_total"),
    )
    assert (hits, queries) == (64, 160)
    assert metric_value(text, "sluice:prefix_cache_hit_rate") == pytest.approx(hits / queries)

    recent = RecentHitRate(window=2)
    for prompt_tokens, cached in [(100, 0), (100, 50), (100, 100)]:
        recent.add(prompt_tokens, cached)
    assert recent.value == pytest.approx(150 / 200)  # the first request left the window


def test_metrics_names_and_histograms(client):
    assert chat(client, stream=True).status_code == 200
    text = client.get("/metrics").text
    for name in (
        "sluice:num_requests_running",
        "sluice:num_requests_waiting",
        "sluice:kv_cache_usage_perc",
        "sluice:prefix_cache_queries_total",
        "sluice:prefix_cache_hits_total",
        "sluice:num_preemptions_total",
        "sluice:prompt_tokens_total",
        "sluice:generation_tokens_total",
        "sluice:time_to_first_token_seconds_count",
        "sluice:inter_token_latency_seconds_count",
        "sluice:e2e_request_latency_seconds_count",
    ):
        assert metric_value(text, name) >= 0, name
    assert metric_value(text, "sluice:time_to_first_token_seconds_count") >= 1
    assert metric_value(text, "sluice:generation_tokens_total") >= 2
    assert metric_value(text, "sluice:request_success_total", 'finished_reason="length"') >= 1


def test_openapi_is_json_with_the_paths(client):
    resp = httpx.get(client.base_url.join("/openapi.json"))
    spec = resp.json()
    assert spec["openapi"].startswith("3.")
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics"):
        assert path in spec["paths"]
    req = spec["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    name = req["$ref"].rsplit("/", 1)[1]
    props = spec["components"]["schemas"][name]["properties"]
    for field in ("messages", "stream_options", "max_completion_tokens", "top_logprobs", "cache_salt", "min_p"):
        assert field in props


async def test_unstarted_engine_is_unhealthy_and_answers_503():
    app = build_app(AsyncEngine(dummy_args()))
    # ASGITransport runs no lifespan: the engine is never started.
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        assert (await c.get("/health")).status_code == 503
        resp = await c.post("/v1/chat/completions", json={"messages": MSG})
        assert assert_openai_error(resp, 503)["code"] == "engine_unavailable"
        assert (await c.get("/metrics")).status_code == 200


async def test_dead_engine_fails_requests_and_health():
    async with AsyncEngine(dummy_args(max_model_len=256, num_kv_blocks=32)) as engine:

        def broken(so):
            raise RuntimeError("CUDA error: secret device detail")

        engine.local_core.executor.runner.launch = broken
        app = build_app(engine)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            resp = await c.post("/v1/chat/completions", json={"messages": MSG, "max_tokens": 3})
            # The request in the failed step fails with it; the engine is dead from then on.
            assert assert_openai_error(resp, 500)["code"] == "request_failed"
            assert "secret" not in resp.text
            assert (await c.get("/health")).status_code == 503
            resp = await c.post("/v1/completions", json={"prompt": "Hi"})
            assert assert_openai_error(resp, 503)["code"] == "engine_dead"


def test_embedded_in_a_user_app():
    engine = AsyncEngine(dummy_args(max_model_len=256, num_kv_blocks=64))

    @contextlib.asynccontextmanager
    async def lifespan(app):
        async with engine:
            yield

    async def home(request):
        return PlainTextResponse(f"mine; engine running: {engine.is_running}")

    user_app = Starlette(routes=[Route("/", home), Mount("/llm", app=build_app(engine))], lifespan=lifespan)
    srv = ServerThread(user_app).start()
    try:
        assert httpx.get(srv.url + "/").text == "mine; engine running: True"
        assert httpx.get(srv.url + "/llm/health").status_code == 200
        c = openai.OpenAI(base_url=srv.url + "/llm/v1", api_key="none", max_retries=0)
        chunks = list(c.chat.completions.create(model="dummy:tiny", messages=MSG, max_tokens=3, stream=True))
        assert chunks[0].choices[0].delta.role == "assistant"
        assert chunks[-1].choices[0].finish_reason == "length"
    finally:
        srv.stop()
    assert not engine.is_running
