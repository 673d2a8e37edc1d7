"""The range rule over HTTP, against a real server (the core in its own process, as `sluice serve` runs it): every
integer and float field of the chat and completions request models, found from the models themselves, driven with
extreme values. Each answer is a 4xx in OpenAI's error shape or a 200; an innocent stream running all along is
unaffected; /health is 200 afterwards."""

from __future__ import annotations

import json
import math
import threading

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sluice.app.server import schemas as S
from sluice.app.server.app import build_app
from sluice.core import AsyncEngine, EngineArgs

from tests.server_helpers import ServerThread, assert_openai_error, check_chat_stream, parse_sse
from tests.test_numeric_ranges import EXTREMES, numeric_fields

MSG = [{"role": "user", "content": "Hi"}]
MAX_NUM_SEQS = 4
ROUTES = {
    "/v1/chat/completions": (S.ChatCompletionRequest, {"messages": MSG, "max_tokens": 2}),
    "/v1/completions": (S.CompletionRequest, {"prompt": "Hi", "max_tokens": 2}),
}
# (route, field, whether it holds a list of numbers), for every numeric field of each route's request model
FIELDS = [
    (path, name, is_list) for path, (model, _) in ROUTES.items() for name, is_list in numeric_fields(model).items()
]


@pytest.fixture(scope="module")
def server():
    args = EngineArgs(
        model="dummy:tiny",
        device="cpu",
        num_kv_blocks=128,
        max_model_len=64,
        max_num_seqs=MAX_NUM_SEQS,
        engine_core_process=True,
    )
    srv = ServerThread(build_app(AsyncEngine(args))).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


class InnocentStreams:
    """Streams one ordinary chat completion after another in a thread until stopped; each must end as it does
    alone (every chunk well formed, finish_reason "length" after its 12 tokens, the usage, then [DONE])."""

    def __init__(self, url: str) -> None:
        self.url, self.done, self.failures = url, 0, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> InnocentStreams:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(60)

    def _run(self) -> None:
        body = {
            "messages": MSG,
            "max_tokens": 12,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        with httpx.Client(base_url=self.url, timeout=60) as c:
            while not self._stop.is_set():
                try:
                    resp = c.post("/v1/chat/completions", json=body)
                    assert resp.status_code == 200, resp.text
                    choices, usage = check_chat_stream(parse_sse(resp.content), 1, True, "dummy:tiny")
                    assert choices[0]["finish_reason"] == "length" and usage["completion_tokens"] == 12, usage
                    self.done += 1
                except Exception as e:  # noqa: BLE001 - reported by the test
                    self.failures.append(repr(e))


def post(client: httpx.Client, path: str, fields: dict, stream: bool = False) -> httpx.Response:
    body = {**ROUTES[path][1], **fields, "stream": stream}
    # json.dumps writes NaN and Infinity as JavaScript does; the server must refuse them, not choke on them
    return client.post(path, content=json.dumps(body), headers={"Content-Type": "application/json"})


def check_answer(resp: httpx.Response, stream: bool) -> None:
    assert resp.status_code == 200 or 400 <= resp.status_code < 500, (resp.status_code, resp.text)
    if resp.status_code != 200:
        err = assert_openai_error(resp, resp.status_code, resp.json()["error"]["param"])
        assert err["type"] == "invalid_request_error", err
    elif stream:
        datas = parse_sse(resp.content)
        assert datas[-1] == "[DONE]" and all("error" not in json.loads(d) for d in datas[:-1]), datas
    else:
        assert resp.json()["choices"], resp.text


def value_of(value, is_list: bool):
    return [value] if is_list else value


def test_the_fields_found_are_the_numeric_ones():
    chat = {name for path, name, _ in FIELDS if path == "/v1/chat/completions"}
    completions = {name for path, name, _ in FIELDS if path == "/v1/completions"}
    common = {"n", "max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop_token_ids"}
    common |= {"presence_penalty", "frequency_penalty", "repetition_penalty"}
    assert common | {"max_completion_tokens", "top_logprobs"} <= chat
    assert common | {"logprobs", "prompt"} <= completions


def test_every_numeric_field_at_every_extreme(server, client):
    """Each field alone at each extreme value, while an innocent stream runs beside."""
    with InnocentStreams(server.url) as innocent:
        for path, name, is_list in FIELDS:
            for value in EXTREMES:
                check_answer(post(client, path, {name: value_of(value, is_list)}), stream=False)
    assert not innocent.failures, innocent.failures[:3]
    assert innocent.done >= 1
    assert client.get("/health").status_code == 200


@settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    path=st.sampled_from(sorted(ROUTES)),
    picks=st.lists(st.tuples(st.integers(0, 10**6), st.sampled_from(EXTREMES)), min_size=1, max_size=4),
    stream=st.booleans(),
)
def test_extremes_in_any_combination(server, client, path, picks, stream):
    """Several fields at once, streamed or not: still a 4xx or a 200, never a failed engine."""
    fields = [(name, is_list) for p, name, is_list in FIELDS if p == path]
    body = {}
    for k, value in picks:
        name, is_list = fields[k % len(fields)]
        body[name] = value_of(value, is_list)
    check_answer(post(client, path, body, stream), stream)
    assert client.get("/health").status_code == 200


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens", "min_tokens"])
def test_token_counts_past_64_bits_are_400_and_the_engine_serves_on(client, field):
    """The issue's reproduction: max_tokens = 2**64 stopped the engine for every client."""
    for value in (2**64, 2**63):
        resp = post(client, "/v1/chat/completions", {field: value})
        assert_openai_error(resp, 400, field)
    assert client.get("/health").status_code == 200
    ok = post(client, "/v1/chat/completions", {})
    assert ok.status_code == 200, ok.text


def test_n_over_max_num_seqs_is_400_naming_the_limit(client):
    for path in ROUTES:
        err = assert_openai_error(post(client, path, {"n": MAX_NUM_SEQS + 1}), 400, "n")
        assert "max_num_seqs" in err["message"] and str(MAX_NUM_SEQS) in err["message"]
    assert post(client, "/v1/chat/completions", {"n": MAX_NUM_SEQS}).status_code == 200


def test_floats_the_json_parser_allows_are_refused():
    """NaN and the infinities parse (as JavaScript writes them) and are then out of every range."""
    for value in (math.nan, math.inf, -math.inf):
        with pytest.raises(Exception) as e:
            S.ChatCompletionRequest.model_validate_json(json.dumps({"messages": MSG, "temperature": value}))
        assert "temperature" in str(e.value)
