"""`sluice serve` as a process: it comes up, serves, and on SIGTERM stops taking connections, lets the
in-flight stream finish, and exits 0."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai

ROOT = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_streams_then_shuts_down_gracefully_on_sigterm():
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [
        sys.executable,
        "-m",
        "sluice.app.commands.cli",
        "serve",
        "--model",
        "dummy:tiny",
        "--device",
        "cpu",
        "--port",
        str(port),
    ]
    cmd += ["--num-kv-blocks", "64", "--max-model-len", "512", "--api-key", "k", "--shutdown-timeout", "60"]
    env = dict(os.environ)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "server did not come up"
            time.sleep(0.2)
        assert httpx.get(url + "/v1/models").status_code == 401  # --api-key is enforced

        lines: list[str] = []
        started = threading.Event()

        def read_stream() -> None:
            body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 80, "ignore_eos": True}
            headers = {"Authorization": "Bearer k"}
            with httpx.stream(
                "POST", url + "/v1/chat/completions", json={**body, "stream": True}, headers=headers, timeout=120
            ) as resp:
                for line in resp.iter_lines():
                    if line.startswith("data: "):
                        lines.append(line[6:])
                        started.set()

        reader = threading.Thread(target=read_stream)
        reader.start()
        assert started.wait(60)
        proc.send_signal(signal.SIGTERM)
        # New connections are refused while the stream drains. One that reached the listening socket's backlog
        # just before it closed is reset instead of refused: not served either.
        deadline = time.monotonic() + 10
        while True:
            try:
                httpx.get(url + "/health", timeout=1)
            except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError):
                break
            assert time.monotonic() < deadline, "still accepting connections after SIGTERM"
            time.sleep(0.05)
        assert "[DONE]" not in lines, "the stream was still in flight when the server stopped accepting"
        reader.join(timeout=120)
        assert lines[-1] == "[DONE]", lines[-3:]
        last = json.loads(lines[-2])
        assert last["choices"][0]["finish_reason"] == "length", "the in-flight stream ran to its end"
        assert proc.wait(timeout=60) == 0
        out = proc.stdout.read()
        assert "Application shutdown complete" in out and "Traceback" not in out
    except BaseException:
        # what the server said, for a failure that does not reproduce (CI once saw the server's connections
        # reset right after SIGTERM, with the stream cut short)
        if proc.poll() is None:
            proc.kill()
        print("server output:\n" + (proc.stdout.read() or ""))
        raise
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _start(*flags: str) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    cmd = [sys.executable, "-m", "sluice.app.commands.cli", "serve", "--model", "dummy:tiny", "--device", "cpu"]
    cmd += ["--port", str(port), *flags]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, proc.stdout.read()
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "server did not come up"
        time.sleep(0.2)


def test_sigterm_past_the_grace_ends_each_request_with_an_openai_error():
    """Requests still running at --shutdown-timeout: a stream gets an error event then [DONE] (the openai client
    raises instead of returning a text cut short as if complete), a non-streamed request and one still queued
    get 503 JSON; nothing is cut silently, and the process exits 0."""
    proc, url = _start("--num-kv-blocks", "700", "--max-model-len", "4096", "--max-num-seqs", "2",
                       "--shutdown-timeout", "1")  # fmt: skip
    long = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4000, "ignore_eos": True}
    results: dict[str, object] = {}
    streaming = threading.Event()

    def raw_stream(name: str) -> None:
        with httpx.stream("POST", url + "/v1/chat/completions", json={**long, "stream": True}, timeout=60) as resp:
            datas = [ln[6:] for ln in resp.iter_lines() if ln.startswith("data: ") and streaming.set() is None]
            results[name] = (resp.status_code, datas)

    def whole(name: str) -> None:
        resp = httpx.post(url + "/v1/chat/completions", json=long, timeout=60)
        results[name] = (resp.status_code, resp.headers.get("content-type"), resp.text)

    def openai_stream() -> None:
        c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        try:
            body = {"messages": long["messages"], "max_tokens": 4000, "extra_body": {"ignore_eos": True}}
            for _ in c.chat.completions.create(model="dummy:tiny", stream=True, **body):
                pass
            results["openai"] = "returned as if complete"
        except openai.APIError as e:
            results["openai"] = e

    try:
        threads = [threading.Thread(target=raw_stream, args=("stream",))]
        threads.append(threading.Thread(target=whole, args=("whole",)))
        threads[0].start()
        assert streaming.wait(60)
        threads[1].start()
        time.sleep(0.5)  # both seats taken: the next ones queue
        threads += [threading.Thread(target=openai_stream), threading.Thread(target=whole, args=("queued",))]
        for t in threads[2:]:
            t.start()
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(timeout=60)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        out = proc.stdout.read()
    status, datas = results["stream"]
    assert status == 200 and datas[-1] == "[DONE]", (datas[-3:], out[-2000:])
    err = json.loads(datas[-2])["error"]
    assert err["code"] == "server_shutting_down" and set(err) == {"message", "type", "param", "code"}
    assert all("choices" in json.loads(d) for d in datas[:-2])
    for name in ("whole", "queued"):
        status, ctype, text = results[name]
        assert status == 503 and ctype == "application/json", (name, status, text)
        assert json.loads(text)["error"]["code"] == "server_shutting_down"
    assert isinstance(results["openai"], openai.APIError), results["openai"]
    assert "Traceback" not in out


def test_slow_headers_and_bodies_are_cut_at_the_body_timeout():
    """uvicorn times out only idle connections: one sending its headers a byte at a time was held forever.
    `sluice serve` closes it after --body-timeout; a slow body gets 408; a prompt client is served."""
    proc, url = _start("--num-kv-blocks", "64", "--max-model-len", "256", "--body-timeout", "1")
    port = int(url.rsplit(":", 1)[1])
    try:
        partial_headers = [socket.create_connection(("127.0.0.1", port)) for _ in range(10)]
        slow_body = socket.create_connection(("127.0.0.1", port))
        for s in partial_headers:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\n")
        slow_body.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Length: 100\r\n\r\n{")
        t0 = time.monotonic()
        for s in [*partial_headers, slow_body]:
            s.settimeout(10)
            data = b""
            while chunk := s.recv(65536):
                data += chunk
            assert s is not slow_body or data.startswith(b"HTTP/1.1 408"), data[:100]
            s.close()
        assert time.monotonic() - t0 < 6
        body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
        assert httpx.post(url + "/v1/chat/completions", json=body, timeout=30).status_code == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
