"""What a new user meets first with `sluice serve` (issue 42): a chat request without max_tokens has a bounded
default (`--default-max-tokens`), and a bad or busy port is one line before anything loads."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import httpx
import pytest
from sluice.app.commands.cli import build_parser
from sluice.app.commands.serve import DEFAULT_MAX_TOKENS as SERVE_DEFAULT
from sluice.app.server.app import DEFAULT_MAX_TOKENS, build_app
from sluice.core import AsyncEngine, EngineArgs, InvalidRequestError

from tests.server_helpers import ServerThread

CAP = 7
MSG = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def client():
    engine = AsyncEngine(EngineArgs(model="dummy:tiny", device="cpu", num_kv_blocks=64, max_model_len=128))
    srv = ServerThread(build_app(engine, default_max_tokens=CAP)).start()
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        yield c
    srv.stop()


def _chat(client, **fields) -> dict:
    resp = client.post("/v1/chat/completions", json={"messages": MSG, "ignore_eos": True, **fields})
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_a_chat_request_without_max_tokens_gets_the_default_cap(client):
    body = _chat(client)
    assert body["usage"]["completion_tokens"] == CAP and body["choices"][0]["finish_reason"] == "length"
    # what the request says wins, both ways; min_tokens above the cap lifts it
    assert _chat(client, max_tokens=CAP + 5)["usage"]["completion_tokens"] == CAP + 5
    assert _chat(client, max_completion_tokens=2)["usage"]["completion_tokens"] == 2
    assert _chat(client, min_tokens=CAP + 2)["usage"]["completion_tokens"] == CAP + 2


def test_serve_flag_sets_the_cap_and_zero_means_the_rest_of_the_context():
    parse = build_parser().parse_args
    assert SERVE_DEFAULT == DEFAULT_MAX_TOKENS  # the flag's default is the server's
    assert parse(["serve"]).default_max_tokens == DEFAULT_MAX_TOKENS
    engine = AsyncEngine(EngineArgs(model="dummy:tiny", device="cpu"))
    from sluice.app.server.uvicorn_server import build_server

    for flag, cap in (("0", None), ("300", 300)):
        server = build_server(parse(["serve", "--default-max-tokens", flag]), engine)
        assert server.config.app.state.openai_server.config.default_max_tokens == cap
    with pytest.raises(InvalidRequestError):
        build_app(engine, default_max_tokens=0)


def _serve(*flags: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "sluice.app.commands.cli", "serve", *flags]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    "flags, words",
    [(["--port", "70000"], "must be 0..65535"), (["--default-max-tokens", "-1"], "must be >= 0")],
)
def test_an_out_of_range_flag_is_one_line_at_parse_time(flags, words):
    run = _serve(*flags)
    assert run.returncode == 2, run.stderr
    (line,) = run.stderr.strip().splitlines()  # one line, not argparse's usage of every flag first
    assert words in line and "sluice serve --help" in line


def test_a_port_in_use_is_one_line_before_the_model_loads():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        # A model that does not exist: were it looked at first, the line would be about the model.
        start = time.monotonic()
        run = _serve("--port", str(port), "--model", "/nonexistent/model.gguf")
        took = time.monotonic() - start
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 2 and len(lines) == 1, run.stderr
    assert f"127.0.0.1:{port}" in lines[0] and "in use" in lines[0], lines
    assert took < 60
    # the same free port passes the check and the model's line comes next
    run = _serve("--port", str(port), "--model", "/nonexistent/model.gguf")
    assert run.returncode == 2 and "nonexistent" in run.stderr and "in use" not in run.stderr, run.stderr


def test_the_port_is_held_from_the_check_until_uvicorn_listens_on_it():
    """The check keeps its socket (uvicorn then listens on it): binding once and letting go left the port free
    for the whole model load, and another program (another test's server, in CI) could take it meanwhile."""
    from sluice.app.commands.serve import bind_listening_socket

    held = bind_listening_socket("127.0.0.1", 0)
    try:
        port = held.getsockname()[1]
        with socket.socket() as other, pytest.raises(OSError):
            other.bind(("127.0.0.1", port))
    finally:
        held.close()


@pytest.mark.parametrize("bind", ["serve", "api_servers"])
def test_connections_on_the_held_socket_send_without_delay(bind):
    """uvicorn on asyncio's loop (no uvloop installed) leaves Nagle's algorithm on for the connections of a socket
    handed to it unless the socket says TCP: each request after the first on a kept-alive connection was answered
    ~40 ms late (the `--api-server-count` socket did). The held sockets' connections have TCP_NODELAY."""
    import asyncio

    from sluice.app.commands.serve import bind_listening_socket
    from sluice.app.server.api_servers import _bind

    held = bind_listening_socket if bind == "serve" else _bind

    async def accepted_no_delay() -> int:
        got: list[int] = []

        def on_connect(reader, writer) -> None:
            got.append(writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(on_connect, sock=held("127.0.0.1", 0))
        async with server:
            _, writer = await asyncio.open_connection(*server.sockets[0].getsockname()[:2])
            while not got:
                await asyncio.sleep(0.01)
            writer.close()
        return got[0]

    assert asyncio.run(accepted_no_delay()) != 0
