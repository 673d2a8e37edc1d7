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
        "sluice.app.cli",
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
