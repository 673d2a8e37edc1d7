"""Limits a public server needs: a response-size budget, a request-body read timeout, /metrics behind the key,
and fields the server does not implement refused by name instead of silently ignored."""

from __future__ import annotations

import socket
import time

import httpx
import openai
import pytest
from sluice.app.server.app import build_app
from sluice.core import AsyncEngine, EngineArgs, InvalidRequestError

from tests.server_helpers import ServerThread, assert_openai_error

KEY = "limits-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MSG = [{"role": "user", "content": "Hi"}]
BODY_TIMEOUT_S = 1.0
BUDGET = 2_000_000


@pytest.fixture(scope="module")
def server():
    engine = AsyncEngine(EngineArgs(model="dummy:tiny", device="cpu", num_kv_blocks=256, max_model_len=1024))
    app = build_app(
        engine, api_key=KEY, body_timeout=BODY_TIMEOUT_S, max_response_bytes=BUDGET, metrics_require_key=True
    )
    srv = ServerThread(app).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as c:
        yield c


def test_a_response_over_the_budget_is_refused_before_it_runs(client):
    """n=16 with 20 top logprobs over 200 tokens would be ~6.8 MB of JSON: 400 naming the cure, before any
    token is generated; the same request with fewer tokens fits and runs."""
    body = {"messages": MSG, "n": 16, "logprobs": True, "top_logprobs": 20, "max_tokens": 200}
    for stream in (False, True):
        resp = client.post("/v1/chat/completions", json={**body, "stream": stream})
        err = assert_openai_error(resp, 400, "max_tokens")
        assert err["code"] == "response_too_large" and "max_tokens" in err["message"]
    # unset max_tokens means up to the end of the context: counted as such
    unset = {k: v for k, v in body.items() if k != "max_tokens"} | {"n": 1}
    assert_openai_error(client.post("/v1/chat/completions", json=unset), 400, "max_tokens")
    small = client.post("/v1/chat/completions", json={**body, "max_tokens": 3})
    assert small.status_code == 200 and len(small.content) < BUDGET
    # the estimate is an upper bound: the actual JSON per token and choice stays under it
    per_token = len(small.content) / (16 * 3)
    assert per_token < 16 + 21 * 100, per_token
    completion = {"prompt": "Hi", "n": 16, "logprobs": 20, "max_tokens": 200}
    assert_openai_error(client.post("/v1/completions", json=completion), 400, "max_tokens")


def test_slow_request_bodies_are_cut_at_the_body_timeout(server):
    """Connections that declare 100 bytes of body and send 2 get 408 and are closed after the timeout, instead
    of staying open for as long as the client likes."""
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
        f"Content-Length: 100\r\nAuthorization: Bearer {KEY}\r\n\r\n"
    )
    socks = []
    for _ in range(20):
        s = socket.create_connection(("127.0.0.1", server.port))
        s.sendall(head.encode() + b'{"')
        s.settimeout(BODY_TIMEOUT_S + 10)
        socks.append(s)
    t0 = time.monotonic()
    try:
        for s in socks:
            data = b""
            while chunk := s.recv(65536):  # until the server closes the connection
                data += chunk
            assert data.startswith(b"HTTP/1.1 408"), data[:200]
            assert b'"request_timeout"' in data
    finally:
        for s in socks:
            s.close()
    assert time.monotonic() - t0 < BODY_TIMEOUT_S + 5


def test_metrics_need_the_key_when_asked(server):
    assert_openai_error(httpx.get(server.url + "/metrics"), 401)
    assert_openai_error(httpx.get(server.url + "/metrics", headers={"Authorization": "Bearer no"}), 401)
    ok = httpx.get(server.url + "/metrics", headers=AUTH)
    assert ok.status_code == 200 and "sluice:num_requests_running" in ok.text
    assert httpx.get(server.url + "/health").status_code == 200  # probes stay open


def test_metrics_key_needs_an_api_key():
    with pytest.raises(InvalidRequestError, match="metrics_require_key"):
        build_app(AsyncEngine(EngineArgs(model="dummy:tiny")), metrics_require_key=True)


UNSUPPORTED = [
    ("/v1/chat/completions", "functions", [{"name": "f"}]),
    ("/v1/chat/completions", "function_call", "auto"),
    ("/v1/chat/completions", "logit_bias", {"50256": -100}),
    ("/v1/completions", "logit_bias", {"50256": -100}),
    ("/v1/completions", "suffix", "tail"),
    ("/v1/completions", "best_of", 3),
]


@pytest.mark.parametrize("path, field, value", UNSUPPORTED, ids=[f"{p[4:]}-{f}-{i}" for i, (p, f, _) in
                                                                 enumerate(UNSUPPORTED)])  # fmt: skip
def test_fields_the_server_does_not_implement_are_refused_by_name(client, path, field, value):
    base = {"messages": MSG} if "chat" in path else {"prompt": "Hi"}
    err = assert_openai_error(client.post(path, json={**base, "max_tokens": 2, field: value}), 400, field)
    assert "not supported" in err["message"]


def test_their_harmless_values_are_accepted(client, server):
    harmless = {"response_format": {"type": "text"}, "tool_choice": "none", "tools": [], "logit_bias": {}}
    assert client.post("/v1/chat/completions", json={"messages": MSG, "max_tokens": 2, **harmless}).status_code == 200
    c = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="dummy:tiny", messages=MSG, max_tokens=2, logit_bias={"50256": -100})
    assert e.value.body["param"] == "logit_bias"
