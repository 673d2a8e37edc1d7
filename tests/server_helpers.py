"""Test helpers for the HTTP server: a real uvicorn server on a loopback port in a background thread, a
strict parser of OpenAI-style server-sent event streams, and a few helpers for server processes."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Coroutine
from typing import Any

import httpx
import uvicorn
from sluice.app.server.uvicorn_server import no_delay


class ServerThread:
    """Serves ``app`` with uvicorn (its lifespan included) on 127.0.0.1 and a free port, on an event loop
    in a daemon thread. ``call(coro)`` runs a coroutine on that loop (e.g. direct engine calls)."""

    def __init__(self, app: Any) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        no_delay(self.sock)  # as `sluice serve`'s socket: uvicorn runs on asyncio's loop here
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, lifespan="on", log_level="warning"))
        self.loop: asyncio.AbstractEventLoop | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        async def serve() -> None:
            self.loop = asyncio.get_running_loop()
            await self.server.serve(sockets=[self.sock])

        try:
            asyncio.run(serve())
        except BaseException as e:  # noqa: BLE001 - reported by start()
            self.error = e

    def start(self, timeout: float = 180.0) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError(f"server failed to start: {self.error!r}")
            if time.monotonic() > deadline:
                raise TimeoutError("server did not start")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=60)
        self.sock.close()

    def call(self, coro: Coroutine, timeout: float = 120.0) -> Any:
        assert self.loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)


def parse_sse(raw: bytes) -> list[str]:
    """The ``data`` payloads of an event stream sent with "\\n" separators, checked strictly: every event
    is one ``data:`` line followed by a blank line; comment lines (keep-alive pings) are skipped."""
    text = raw.decode("utf-8")
    assert "\r" not in text, "events must be separated by \\n only"
    assert text.endswith("\n\n"), "the stream must end with a complete event"
    out = []
    for block in text.split("\n\n")[:-1]:
        lines = [ln for ln in block.split("\n") if not ln.startswith(":")]
        if not lines:
            continue
        assert len(lines) == 1 and lines[0].startswith("data: "), f"unexpected event {block!r}"
        out.append(lines[0][len("data: ") :])
    return out


def check_chat_stream(
    datas: list[str], n: int, include_usage: bool, model: str, logprobs: bool = False
) -> tuple[dict[int, dict[str, Any]], dict | None]:
    """Validates every chunk of a chat completion stream against OpenAI's wire format. Returns, per
    choice index, its text, finish_reason, number of chunks and of logprob entries; and the usage."""
    assert datas and datas[-1] == "[DONE]", "the stream must end with [DONE]"
    chunks = [json.loads(d) for d in datas[:-1]]
    assert all("error" not in c for c in chunks), chunks
    ids = {c["id"] for c in chunks}
    created = {c["created"] for c in chunks}
    assert len(ids) == 1 and len(created) == 1, "one id and one created per stream"
    assert next(iter(ids)).startswith("chatcmpl-")
    choices: dict[int, dict[str, Any]] = {}
    usage_chunk = None
    for k, c in enumerate(chunks):
        assert c["object"] == "chat.completion.chunk"
        assert c["model"] == model
        assert isinstance(c["created"], int)
        if include_usage:
            assert "usage" in c
        else:
            assert "usage" not in c
        if not c["choices"]:
            assert include_usage and k == len(chunks) - 1, "only the final usage chunk has no choices"
            usage_chunk = c
            continue
        assert c.get("usage") is None
        assert len(c["choices"]) == 1
        ch = c["choices"][0]
        assert set(ch) == {"index", "delta", "logprobs", "finish_reason"}, ch
        i = ch["index"]
        assert 0 <= i < n
        st = choices.setdefault(i, {"text": "", "finish_reason": None, "chunks": 0, "logprobs": 0})
        assert st["finish_reason"] is None, f"choice {i} got a chunk after its finish_reason"
        delta = ch["delta"]
        if st["chunks"] == 0:
            # The first chunk carries the role together with the first content.
            assert delta.get("role") == "assistant", delta
            assert isinstance(delta.get("content"), str)
            assert delta["content"] or ch["finish_reason"] is not None, "the role chunk waits for content"
        else:
            assert "role" not in delta
            assert set(delta) <= {"content"}
            assert delta.get("content") or ch["finish_reason"] is not None, "no empty chunks mid-stream"
        st["text"] += delta.get("content") or ""
        st["chunks"] += 1
        st["finish_reason"] = ch["finish_reason"]
        if logprobs:
            assert ch["logprobs"] is not None and isinstance(ch["logprobs"]["content"], list)
            st["logprobs"] += len(ch["logprobs"]["content"])
        else:
            assert ch["logprobs"] is None
    assert set(choices) == set(range(n)), f"choices seen: {sorted(choices)}"
    for i, st in choices.items():
        assert st["finish_reason"] in ("stop", "length"), f"choice {i} has no finish_reason"
    if include_usage:
        assert usage_chunk is not None, "include_usage needs a final usage chunk"
        u = usage_chunk["usage"]
        assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
        assert u["completion_tokens"] >= n and u["prompt_tokens"] > 0
        assert 0 <= u["prompt_tokens_details"]["cached_tokens"] < u["prompt_tokens"]
        return choices, u
    assert usage_chunk is None
    return choices, None


def metric_value(text: str, name: str, labels: str = "") -> float:
    """One sample's value from Prometheus text, e.g. ``metric_value(t, "sluice:kv_blocks_free")``."""
    key = name + (f"{{{labels}}}" if labels else "")
    for line in text.splitlines():
        if line.startswith(key + " "):
            return float(line.split()[-1])
    raise KeyError(key)


def assert_openai_error(resp: httpx.Response, status: int, param: str | None = None) -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    assert err["param"] == param, err
    assert "Traceback" not in resp.text
    return err


def read_sse_events(resp: httpx.Response, n: int) -> list[dict[str, str]]:
    """The first ``n`` events of a streamed response (``with client.stream(...) as resp``), each as its fields
    (``event``, ``id``, ``data``); keep-alive comments are skipped. A stream that stalls raises the client's
    read timeout."""
    events: list[dict[str, str]] = []
    buf = ""
    for chunk in resp.iter_text():
        buf += chunk
        while "\n\n" in buf and len(events) < n:
            block, buf = buf.split("\n\n", 1)
            fields: dict[str, str] = {}
            for line in block.split("\n"):
                if line.startswith(":"):
                    continue
                name, _, value = line.partition(": ")
                fields[name] = fields[name] + "\n" + value if name in fields else value
            if fields:
                events.append(fields)
        if len(events) == n:
            return events
    raise AssertionError(f"the stream ended after {len(events)} of {n} events")


def gone(pid: int) -> bool:
    """No such process any more (a zombie waiting for a reaper counts as gone: it runs nothing)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def wait_gone(pid: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not gone(pid):
        assert time.monotonic() < deadline, f"process {pid} is still running"
        time.sleep(0.05)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
