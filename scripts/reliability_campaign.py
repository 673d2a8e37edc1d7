"""The reliability campaign of issue 36, repeatable: bad inputs with innocent victims, kill -9 of each process,
and a soak, against `sluice serve --model dummy:tiny --device cpu` servers it starts itself on loopback.

    python scripts/reliability_campaign.py --out docs/benchmarks/reliability  # --soak-requests 3000, --time-limit 1200

Three parts, each a table whose rows pass or fail by a stated rule (the campaign exits 1 if any row fails):

* **Bad inputs.** Each row sends one bad request (raw HTTP over a socket, so malformed bodies and headers go out
  as written) while three innocent "victim" streams run. A row passes when its status is the one expected (a 4xx,
  or 200 where the input is legal: unknown fields are ignored), no 5xx (a 503 only where documented), every
  victim streams its ``max_tokens`` tokens and ``[DONE]`` without an error, and /health is 200 afterwards.
* **kill -9.** Each row starts a server, opens streams, SIGKILLs one process (the core, a front end, the
  supervisor of ``--api-server-count 2``) and records what followed. A killed core passes when every open stream
  got an error event and ``[DONE]``, the server exited non-zero within `EXIT_WITHIN_S` and no process is left; a
  killed front end or supervisor passes when every other process is gone within `EXIT_WITHIN_S`. Run
  directories (``sluice-core-*``, ``sluice-serve-*`` in the servers' private TMPDIR) of dead owners must be gone
  after the next start.
* **Soak.** One server, ``--soak-requests`` requests from 16 clients: streamed to the end, not streamed,
  cancelled after the first chunk, bad. Passes when there is no 5xx, no innocent request fails, no request or
  KV block is left held afterwards (from /metrics), and the resident memory of the front end and of the core
  grows by less than `RSS_GROWTH_LIMIT_MIB` per 1,000 requests after the warm-up (the least-squares slope over
  samples every 250 requests).

It prints the tables in markdown and writes them with every measurement as JSON. Loopback only; bounded by
``--time-limit`` (each part stops when it runs out; what did not run is reported as not run).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
HOST = "127.0.0.1"
MODEL = "dummy:tiny"
SERVER_FLAGS = ("--num-kv-blocks", "512", "--max-model-len", "1024", "--max-num-seqs", "32", "--shutdown-timeout", "3")
MAX_NUM_SEQS = 32
EXIT_WITHIN_S = 10.0
RSS_GROWTH_LIMIT_MIB = 1.0
VICTIMS = 3
VICTIM_TOKENS = 24
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
OK_STATUSES = (200,)
REFUSED = tuple(range(400, 500))


# -- servers ---------------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class Server:
    """`sluice serve` on loopback in a process (and session) of its own, its output kept."""

    def __init__(self, tmpdir: str, *flags: str) -> None:
        self.port = free_port()
        self.url = f"http://{HOST}:{self.port}"
        cmd = [sys.executable, "-m", "sluice.app.commands.cli", "serve", "--model", MODEL, "--device", "cpu"]
        cmd += ["--host", HOST, "--port", str(self.port), *SERVER_FLAGS, *flags]
        self.log = open(os.path.join(tmpdir, f"server-{self.port}.log"), "w+")  # noqa: SIM115
        env = {**os.environ, "TMPDIR": tmpdir}
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT)

    def wait_healthy(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited {self.proc.returncode}:\n{self.output()}")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            if time.monotonic() > deadline:
                raise TimeoutError("the server did not come up")
            time.sleep(0.2)

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def descendants(self) -> list[int]:
        """Every live process under the server's (resource trackers left out)."""
        out, todo = [], [self.proc.pid]
        while todo:
            pid = todo.pop()
            for child in children(pid):
                if "resource_tracker" not in cmdline(child):
                    out.append(child)
                todo.append(child)
        return out

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as fh:
            return [int(p) for p in fh.read().split()]
    except OSError:
        return []


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def alive(pid: int) -> bool:
    """Running (a zombie runs nothing)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise ValueError(pid)


def wait_all_gone(pids: list[int], timeout: float) -> tuple[bool, float]:
    t0 = time.monotonic()
    while any(alive(p) for p in pids):
        if time.monotonic() - t0 > timeout:
            return False, time.monotonic() - t0
        time.sleep(0.02)
    return True, time.monotonic() - t0


# -- HTTP ------------------------------------------------------------------------------------------------------
async def raw_request(
    port: int, method: str, path: str, body: bytes, headers: dict[str, str] | None = None, timeout: float = 60.0
) -> tuple[int, dict | None]:
    """One request as written (no client fixes it up); its status and JSON body (None if not JSON)."""
    hdrs = {
        "Host": f"{HOST}:{port}",
        "Content-Type": "application/json",
        "Content-Length": str(len(body)),
        "Connection": "close",
    }
    for k, v in (headers or {}).items():
        if v is None:
            hdrs.pop(k, None)
        else:
            hdrs[k] = v
    head = f"{method} {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in hdrs.items()) + "\r\n"
    reader, writer = await asyncio.open_connection(HOST, port)
    try:
        writer.write(head.encode("latin-1") + body)
        with contextlib.suppress(ConnectionError):  # refused before the whole body went out (413): read the answer
            await writer.drain()
        data = await asyncio.wait_for(read_all(reader), timeout)
    finally:
        writer.close()
    status_line, _, rest = data.partition(b"\r\n")
    status = int(status_line.split()[1]) if status_line.startswith(b"HTTP/") else 0
    payload = rest.partition(b"\r\n\r\n")[2]
    if b"transfer-encoding: chunked" in rest.partition(b"\r\n\r\n")[0].lower():
        payload = dechunk(payload)
    try:
        return status, json.loads(payload)
    except ValueError:
        return status, None


async def read_all(reader: asyncio.StreamReader) -> bytes:
    """Until the server closes; what came before a reset (a server that answered before reading the whole body)."""
    parts = []
    with contextlib.suppress(ConnectionError):
        while chunk := await reader.read(65536):
            parts.append(chunk)
    return b"".join(parts)


def dechunk(data: bytes) -> bytes:
    out = b""
    while data:
        size_line, _, data = data.partition(b"\r\n")
        size = int(size_line.split(b";")[0] or b"0", 16)
        if size == 0:
            break
        out, data = out + data[:size], data[size + 2 :]
    return out


def error_code(body: dict | None) -> str | None:
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return str(body["error"].get("code") or body["error"].get("type"))
    return None


@dataclass(slots=True)
class StreamResult:
    status: int = 0
    tokens: int = 0
    done: bool = False
    error: str | None = None  # the error event's code, or how the stream broke

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.done and self.error is None


async def stream_chat(
    client: httpx.AsyncClient,
    max_tokens: int = VICTIM_TOKENS,
    cancel_after_first: bool = False,
    started: asyncio.Event | None = None,
    prompt: str = "Tell me a story",
) -> StreamResult:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    r = StreamResult()
    try:
        async with client.stream("POST", CHAT, json=body) as resp:
            r.status = resp.status_code
            if resp.status_code != 200:
                await resp.aread()
                with contextlib.suppress(ValueError):
                    r.error = error_code(json.loads(resp.content))
                return r
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if started is not None:
                    started.set()
                if data == "[DONE]":
                    r.done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    r.error = error_code(chunk)
                elif chunk.get("usage"):
                    r.tokens = chunk["usage"]["completion_tokens"]
                if cancel_after_first:
                    return r
    except (httpx.HTTPError, OSError) as e:
        r.error = f"transport: {type(e).__name__}"
    return r


def victim_ok(r: StreamResult) -> bool:
    return r.ok and r.tokens == VICTIM_TOKENS


async def healthy(client: httpx.AsyncClient) -> bool:
    try:
        return (await client.get("/health")).status_code == 200
    except httpx.HTTPError:
        return False


# -- part 1: bad inputs ----------------------------------------------------------------------------------------
@dataclass(slots=True)
class Case:
    name: str
    body: bytes | dict | list | str
    expect: tuple[int, ...] = (400,)  # statuses that pass
    path: str = CHAT
    method: str = "POST"
    headers: dict[str, str | None] = field(default_factory=dict)
    note: str = ""  # why this expectation (a documented 503, another branch's fix)


def chat(**kw: Any) -> dict:
    return {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **kw}


def cmpl(**kw: Any) -> dict:
    return {"prompt": "hi", "max_tokens": 4, **kw}


HARDEN_INPUT = "fixed on branch harden-input (issue 36: range checks at the edge)"


def bad_input_cases() -> list[Case]:
    big = 2**64
    cases = [
        # malformed bodies
        Case("malformed JSON (truncated)", b'{"messages": ['),
        Case("empty body", b""),
        Case("JSON null", b"null"),
        Case("JSON array", b"[]"),
        Case("JSON string", b'"hello"'),
        Case("invalid UTF-8", b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}'),
        Case("NaN literal", b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}'),
        Case("Infinity literal", b'{"messages": [{"role": "user", "content": "hi"}], "top_p": Infinity}'),
        Case("nested 100k deep", b"[" * 100_000 + b"]" * 100_000),
        Case(
            "duplicate keys",
            b'{"messages": 1, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}',
            expect=(200,),
            note="the last key wins, as in json.loads",
        ),
        Case("trailing garbage", b'{"messages": [{"role": "user", "content": "hi"}]} xyz'),
        # wrong types
        Case("messages a string", chat(messages="hi")),
        Case("messages a number", chat(messages=5)),
        Case("messages empty", chat(messages=[])),
        Case("message without role", chat(messages=[{"content": "hi"}])),
        Case("role unknown", chat(messages=[{"role": "robot", "content": "hi"}])),
        Case("role tool", chat(messages=[{"role": "tool", "content": "hi"}])),
        Case("content a number", chat(messages=[{"role": "user", "content": 5}])),
        Case(
            "content an image part",
            chat(
                messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]
            ),
        ),
        Case("content part without text", chat(messages=[{"role": "user", "content": [{"type": "text"}]}])),
        Case("content null only", chat(messages=[{"role": "user", "content": None}]), expect=(200, 400)),
        Case("message a list", chat(messages=[["user", "hi"]])),
        Case("max_tokens a string", chat(max_tokens="5"), expect=(200, 400), note="pydantic's lax mode may coerce"),
        Case("max_tokens a float", chat(max_tokens=5.5)),
        Case("max_tokens true", chat(max_tokens=True), expect=(200, 400), note="pydantic's lax mode may coerce"),
        Case("temperature a word", chat(temperature="hot")),
        Case("stream a word", chat(stream="maybe")),
        Case("stop a number", chat(stop=5)),
        Case("n a word", chat(n="two")),
        Case("logprobs a word", chat(logprobs="yes")),
        Case("seed a word", chat(seed="x")),
        Case("stream_options a number", chat(stream_options=5)),
        Case("model a number", chat(model=5)),
        Case("model unknown", chat(model="gpt-5"), expect=(404,)),
        # huge and negative numbers
        Case("max_tokens -1", chat(max_tokens=-1)),
        Case("max_tokens 0", chat(max_tokens=0)),
        Case("max_tokens 2^31", chat(max_tokens=2**31), expect=(200, 400), note="capped by the context"),
        Case("max_tokens 2^63", chat(max_tokens=2**63), expect=(200, 400), note=HARDEN_INPUT),
        Case("max_tokens 2^64", chat(max_tokens=big), expect=(200, 400), note=HARDEN_INPUT),
        Case("max_tokens 10^30", chat(max_tokens=10**30), expect=(200, 400), note=HARDEN_INPUT),
        Case("max_completion_tokens 2^64", chat(max_completion_tokens=big), expect=(200, 400), note=HARDEN_INPUT),
        Case("min_tokens 2^64", chat(min_tokens=big), note=HARDEN_INPUT),
        Case("min_tokens -1", chat(min_tokens=-1)),
        Case("min_tokens over max_tokens", chat(min_tokens=10, max_tokens=4)),
        Case("temperature -1", chat(temperature=-1)),
        Case("temperature 1e308", chat(temperature=1e308)),
        Case("top_p 2", chat(top_p=2)),
        Case("top_p 0", chat(top_p=0)),
        Case("top_k -5", chat(top_k=-5)),
        Case("top_k 2^63", chat(top_k=2**63)),
        Case("min_p 1.5", chat(min_p=1.5)),
        Case("seed 2^64", chat(seed=big)),
        Case("seed -2^63-1", chat(seed=-(2**63) - 1)),
        Case("seed 2^63-1", chat(seed=2**63 - 1), expect=(200,)),
        Case("presence_penalty 1e9", chat(presence_penalty=1e9)),
        Case("frequency_penalty -1e9", chat(frequency_penalty=-1e9)),
        Case("repetition_penalty 0", chat(repetition_penalty=0)),
        Case("repetition_penalty 1e300", chat(repetition_penalty=1e300)),
        Case("n 0", chat(n=0)),
        Case("n -1", chat(n=-1)),
        Case("n 10^6", chat(n=10**6)),
        Case(f"n over --max-num-seqs ({MAX_NUM_SEQS * 2})", chat(n=MAX_NUM_SEQS * 2), note=HARDEN_INPUT),
        Case("logit_bias", chat(logit_bias={"1": 100})),
        # unknown fields (ignored, as OpenAI's API does)
        Case("unknown field", chat(frobnicate=1), expect=(200,)),
        Case("unknown nested field", chat(stream_options={"include_usage": True, "x": 1}), expect=(200,)),
        Case("unknown message field", chat(messages=[{"role": "user", "content": "hi", "x": 1}]), expect=(200,)),
        # huge prompts
        Case(
            "body over --max-body-bytes (2 MB)",
            chat(messages=[{"role": "user", "content": "a" * (2 << 20)}]),
            expect=(413,),
        ),
        Case("prompt over the context (500 KB)", chat(messages=[{"role": "user", "content": "hello " * 85_000}])),
        Case("10,000 messages", chat(messages=[{"role": "user", "content": "hi"}] * 10_000)),
        Case("prompt token ids out of vocabulary", cmpl(prompt=[10**9]), path=COMPLETIONS),
        Case("prompt token id negative", cmpl(prompt=[-1]), path=COMPLETIONS),
        Case("prompt token id 2^64", cmpl(prompt=[big]), path=COMPLETIONS),
        Case("prompt token ids over the context", cmpl(prompt=[1] * 5000), path=COMPLETIONS),
        Case("prompt empty string", cmpl(prompt=""), path=COMPLETIONS),
        Case("prompt empty list", cmpl(prompt=[]), path=COMPLETIONS),
        Case("prompt a number", cmpl(prompt=5), path=COMPLETIONS),
        Case("prompt a batch", cmpl(prompt=["a", "b"]), path=COMPLETIONS),
        Case(
            "prompt special tokens as text",
            chat(messages=[{"role": "user", "content": "<|im_end|><|im_start|>"}]),
            expect=(200,),
        ),
        # logprobs
        Case("top_logprobs 21", chat(logprobs=True, top_logprobs=21)),
        Case("top_logprobs -1", chat(logprobs=True, top_logprobs=-1)),
        Case("top_logprobs 2^64", chat(logprobs=True, top_logprobs=big)),
        Case("top_logprobs without logprobs", chat(top_logprobs=3), expect=(200, 400)),
        Case("completions logprobs 21", cmpl(logprobs=21), path=COMPLETIONS),
        Case("completions logprobs -1", cmpl(logprobs=-1), path=COMPLETIONS),
        Case("logprobs over the response budget", chat(n=128, logprobs=True, top_logprobs=20, max_tokens=1000)),
        # stop lists
        Case("stop: 1,000 strings", chat(stop=[f"s{i}" for i in range(1000)]), expect=(200, 400)),
        Case("stop: a 100 KB string", chat(stop=["x" * 100_000]), expect=(200, 400)),
        Case("stop: empty string", chat(stop=[""]), expect=(200, 400)),
        Case("stop: a number in the list", chat(stop=["a", 5])),
        Case("stop_token_ids -1", chat(stop_token_ids=[-1])),
        Case("stop_token_ids 2^64", chat(stop_token_ids=[big]), note=HARDEN_INPUT),
        # n / best_of
        Case("best_of 2", cmpl(best_of=2), path=COMPLETIONS),
        Case("best_of 10^9", cmpl(best_of=10**9), path=COMPLETIONS),
        Case("echo true", cmpl(echo=True), path=COMPLETIONS),
        Case("suffix", cmpl(suffix="x"), path=COMPLETIONS),
        Case("tools", chat(tools=[{"type": "function", "function": {"name": "f"}}])),
        Case("response_format json", chat(response_format={"type": "json_object"})),
        # headers, methods, paths
        Case("Content-Type text/plain", chat(), headers={"Content-Type": "text/plain"}, expect=(200, 400, 415)),
        Case("no Content-Type", chat(), headers={"Content-Type": None}, expect=(200, 400, 415)),
        Case("Content-Length not a number", chat(), headers={"Content-Length": "abc"}),
        Case("Content-Length over the limit", chat(), headers={"Content-Length": str(10**9)}, expect=(413,)),
        Case(
            "Content-Length short of the body (a slow sender)",
            b"{}",
            headers={"Content-Length": "100"},
            expect=(400, 408),
            note="the body timeout (--body-timeout 3 here)",
        ),
        Case(
            "Authorization garbage (no key set)", chat(), headers={"Authorization": "Bearer \u00ff" * 3}, expect=(200,)
        ),
        Case("GET a POST route", b"", method="GET", expect=(405,)),
        Case("unknown path", chat(), path="/v1/nonexistent", expect=(404,)),
        Case("path traversal", b"", method="GET", path="/../../etc/passwd", expect=(400, 404)),
    ]
    return cases


def encode_body(body: bytes | dict | list | str) -> bytes:
    return body if isinstance(body, bytes) else json.dumps(body).encode()


async def run_case(server: Server, client: httpx.AsyncClient, case: Case) -> dict:
    started = [asyncio.Event() for _ in range(VICTIMS)]
    victims = [asyncio.create_task(stream_chat(client, started=started[i])) for i in range(VICTIMS)]
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 10)
    try:
        status, body = await raw_request(server.port, case.method, case.path, encode_body(case.body), case.headers)
    except (OSError, TimeoutError) as e:
        status, body = 0, {"transport": type(e).__name__}
    results = await asyncio.gather(*victims)
    innocent = sum(not victim_ok(r) for r in results)
    health = await healthy(client)
    passed = status in case.expect and not (500 <= status and status != 503) and innocent == 0 and health
    return {
        "case": case.name,
        "status": status,
        "code": error_code(body),
        "expect": list(case.expect),
        "victims_failed": innocent,
        "health_after": health,
        "passed": passed,
        "note": case.note,
    }


async def bad_inputs(tmpdir: str, deadline: float) -> list[dict]:
    """Every case against one server; a case that leaves it unhealthy (its engine died: the server exits) fails,
    and the next case gets a fresh server."""
    rows: list[dict] = []
    server: Server | None = None
    try:
        for case in bad_input_cases():
            if time.monotonic() > deadline:
                rows.append({"case": case.name, "passed": False, "note": "not run: out of time"})
                continue
            if server is None:
                server = Server(tmpdir, "--body-timeout", "3")
                server.wait_healthy()
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
                row = await run_case(server, client, case)
            rows.append(row)
            if not row["health_after"]:
                row["note"] = (
                    row["note"] + "; " if row["note"] else ""
                ) + "the server died (restarted for the next case)"
                server.stop()
                server = None
        return rows
    finally:
        if server is not None:
            server.stop()


# -- part 2: kill -9 -------------------------------------------------------------------------------------------
def run_dirs(tmpdir: str) -> list[str]:
    return sorted(n for n in os.listdir(tmpdir) if n.startswith(("sluice-core-", "sluice-serve-")))


async def open_streams(server: Server, n: int) -> tuple[httpx.AsyncClient, list[asyncio.Task]]:
    client = httpx.AsyncClient(base_url=server.url, timeout=60)
    started = [asyncio.Event() for _ in range(n)]
    tasks = [asyncio.create_task(stream_chat(client, 2000, started=started[i])) for i in range(n)]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
    return client, tasks


async def kill_row(tmpdir: str, name: str, flags: tuple[str, ...], target: str) -> dict:
    """Start a server with ``flags``, open two streams, SIGKILL ``target`` (core, front end, supervisor)."""
    server = Server(tmpdir, *flags)
    row: dict[str, Any] = {"case": name}
    try:
        server.wait_healthy()
        procs = server.descendants()
        client, tasks = await open_streams(server, 2)
        everything = [server.proc.pid, *procs]
        if target == "core":
            victim = core_pid(server)
        elif target == "front end":
            victim = front_end_pid(server)
        else:
            victim = server.proc.pid
        os.kill(victim, signal.SIGKILL)
        t0 = time.monotonic()
        results = await asyncio.gather(*tasks)
        await client.aclose()
        others = [p for p in everything if p != victim]
        gone, _ = await asyncio.to_thread(wait_all_gone, others, EXIT_WITHIN_S)
        try:
            code = server.proc.wait(EXIT_WITHIN_S)
        except subprocess.TimeoutExpired:
            code = None
        streams = ", ".join(
            "error+[DONE]" if r.done and r.error else "ok" if r.ok else (r.error or "cut") for r in results
        )
        row.update(
            killed=f"{target} (pid {victim})",
            streams=streams,
            exit_status=code,
            others_gone_s=round(time.monotonic() - t0, 2) if gone else None,
            left=[p for p in others if alive(p)],
            run_dirs_left=run_dirs(tmpdir),
        )
        if target == "core":
            row["passed"] = all(r.done and r.error == "engine_dead" for r in results) and code != 0 and gone
        else:
            row["passed"] = gone
        if not row["passed"]:
            row["log_tail"] = server.output().splitlines()[-40:]
        return row
    finally:
        server.stop()


def core_pid(server: Server) -> int:
    """The engine core: as the supervisor of `--api-server-count` logged it, else the server's one child."""
    text = server.output()
    marker = "started the engine core (pid "
    if marker in text:
        return int(text.split(marker, 1)[1].split(")", 1)[0])
    (pid,) = [p for p in children(server.proc.pid) if "resource_tracker" not in cmdline(p)]
    return pid


def api_server_pids(server: Server) -> list[int]:
    text = server.output()
    marker = "API servers (pids "
    if marker not in text:
        return []
    return [int(p) for p in text.split(marker, 1)[1].split(")", 1)[0].split(", ")]


def front_end_pid(server: Server) -> int:
    fronts = api_server_pids(server)
    return fronts[-1] if fronts else server.proc.pid


async def kills(tmpdir: str, deadline: float) -> list[dict]:
    plans = [
        ("sluice serve: kill -9 the core", (), "core"),
        ("sluice serve: kill -9 the front end", (), "front end"),
        ("--api-server-count 2: kill -9 the core", ("--api-server-count", "2"), "core"),
        ("--api-server-count 2: kill -9 a front end", ("--api-server-count", "2"), "front end"),
        ("--api-server-count 2: kill -9 the supervisor", ("--api-server-count", "2"), "supervisor"),
    ]
    rows = []
    for name, flags, target in plans:
        if time.monotonic() > deadline:
            rows.append({"case": name, "passed": False, "note": "not run: out of time"})
            continue
        try:
            rows.append(await kill_row(tmpdir, name, flags, target))
        except Exception as e:  # noqa: BLE001 - a row that could not run fails, the others still run
            rows.append({"case": name, "passed": False, "note": f"{type(e).__name__}: {e}"[:300]})
    return rows


def orphan_sweep_row(tmpdir: str) -> dict:
    """After the kills (each server's owner is dead), one more start: every run directory of a dead owner goes."""
    before = run_dirs(tmpdir)
    server = Server(tmpdir)
    try:
        server.wait_healthy()
        after = run_dirs(tmpdir)
        own = [d for d in after if d.split("-")[2] in {str(server.proc.pid)}]
        left = [d for d in after if d not in own]
        return {
            "case": "run directories of dead owners after the next start",
            "before": before,
            "after": after,
            "left": left,
            "passed": not left,
        }
    finally:
        server.stop()


# -- part 3: soak ----------------------------------------------------------------------------------------------
async def soak(tmpdir: str, total: int, deadline: float, concurrency: int = 16) -> dict:
    server = Server(tmpdir)
    try:
        server.wait_healthy()
        front = server.proc.pid
        core = core_pid(server)
        warmup = min(500, total // 5)
        samples: list[tuple[int, float, float]] = []
        counts = {"stream": 0, "whole": 0, "cancelled": 0, "bad": 0}
        innocent_failed = five_xx = 0
        done = 0
        sent = 0
        lock = asyncio.Lock()
        async with httpx.AsyncClient(
            base_url=server.url, timeout=60, limits=httpx.Limits(max_connections=concurrency * 2)
        ) as client:

            async def one(i: int) -> None:
                nonlocal innocent_failed, five_xx, done
                kind = ("stream", "stream", "whole", "cancelled", "bad", "stream", "whole", "cancelled")[i % 8]
                counts[kind] += 1
                if kind == "stream":
                    r = await stream_chat(client, 16 + i % 17, prompt=f"soak {i} " + "x" * (i % 200))
                    bad = not (r.ok and r.tokens == 16 + i % 17)
                    five_xx += r.status >= 500
                elif kind == "cancelled":
                    r = await stream_chat(client, 64, cancel_after_first=True, prompt=f"cancel {i}")
                    bad = r.status != 200
                    five_xx += r.status >= 500
                elif kind == "whole":
                    resp = await client.post(COMPLETIONS, json=cmpl(prompt=f"whole {i}", max_tokens=8, ignore_eos=True))
                    bad = resp.status_code != 200 or resp.json()["usage"]["completion_tokens"] != 8
                    five_xx += resp.status_code >= 500
                else:
                    resp = await client.post(CHAT, json=chat(max_tokens=-i - 1))
                    bad = resp.status_code != 400
                    five_xx += resp.status_code >= 500
                async with lock:
                    innocent_failed += bad
                    done += 1
                    if done >= warmup and (done - warmup) % 250 == 0:
                        samples.append((done, rss_mib(front), rss_mib(core)))

            async def worker() -> None:
                nonlocal sent
                while sent < total and time.monotonic() < deadline:
                    i = sent
                    sent += 1
                    await one(i)

            t0 = time.monotonic()
            await asyncio.gather(*(worker() for _ in range(concurrency)))
            took = time.monotonic() - t0
            leaks = await held_after(client)
        front_slope = slope([(n, f) for n, f, _ in samples]) * 1000
        core_slope = slope([(n, c) for n, _, c in samples]) * 1000
        passed = (
            five_xx == 0
            and innocent_failed == 0
            and not leaks
            and done == total
            and front_slope < RSS_GROWTH_LIMIT_MIB
            and core_slope < RSS_GROWTH_LIMIT_MIB
        )
        return {
            "requests": done,
            "of": total,
            "mix": counts,
            "seconds": round(took, 1),
            "five_xx": five_xx,
            "innocent_failed": innocent_failed,
            "leaks": leaks,
            "warmup": warmup,
            "rss_front_mib": [round(f, 2) for _, f, _ in samples],
            "rss_core_mib": [round(c, 2) for _, _, c in samples],
            "front_growth_mib_per_1k": round(front_slope, 3),
            "core_growth_mib_per_1k": round(core_slope, 3),
            "passed": passed,
        }
    finally:
        server.stop()


async def held_after(client: httpx.AsyncClient, timeout: float = 10.0) -> dict:
    """What is still held once every request has ended (a leak, if anything after ``timeout``)."""
    deadline = time.monotonic() + timeout
    while True:
        text = (await client.get("/metrics")).text
        values = {
            k: metric(text, "sluice:" + k)
            for k in ("num_requests_running", "num_requests_waiting", "kv_blocks_free", "kv_blocks_total")
        }
        held = {
            "running": values["num_requests_running"],
            "waiting": values["num_requests_waiting"],
            "kv_blocks_held": values["kv_blocks_total"] - values["kv_blocks_free"],
        }
        if not any(held.values()):
            return {}
        if time.monotonic() > deadline:
            return held
        await asyncio.sleep(0.2)


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise KeyError(name)


def slope(points: list[tuple[int, float]]) -> float:
    """Least-squares slope (MiB per request); 0 with fewer than two points."""
    if len(points) < 2:
        return 0.0
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    den = sum((x - mx) ** 2 for x, _ in points)
    return sum((x - mx) * (y - my) for x, y in points) / den if den else 0.0


# -- report ----------------------------------------------------------------------------------------------------
def markdown(report: dict) -> str:
    out = [f"Reliability campaign, {report['date']} on {report['machine']} (`{report['command']}`)", ""]
    out += [
        "### Bad inputs (3 victim streams each)",
        "",
        "| case | status | error code | expected | victims failed | /health after | pass |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in report["bad_inputs"]:
        exp = "/".join(map(str, r.get("expect", [])))
        note = f" ({r['note']})" if r.get("note") and not r["passed"] else ""
        out.append(
            f"| {r['case']} | {r.get('status', '-')} | {r.get('code') or '-'} | {exp} | "
            f"{r.get('victims_failed', '-')} | {r.get('health_after', '-')} | "
            f"{'yes' if r['passed'] else 'NO' + note} |"
        )
    out += [
        "",
        "### kill -9",
        "",
        "| case | killed | open streams ended | exit status | others gone after (s) | pass |",
        "|---|---|---|---|---|---|",
    ]
    for r in report["kills"]:
        out.append(
            f"| {r['case']} | {r.get('killed', '-')} | {r.get('streams', '-')} | {r.get('exit_status', '-')} | "
            f"{r.get('others_gone_s', '-')} | {'yes' if r['passed'] else 'NO ' + r.get('note', '')} |"
        )
    s = report.get("sweep")
    if s:
        out.append(
            f"| {s['case']} | - | {len(s['before'])} before the start | - | left: {s['left'] or 'none'} | "
            f"{'yes' if s['passed'] else 'NO'} |"
        )
    k = report.get("soak")
    if k:
        out += [
            "",
            "### Soak",
            "",
            "| requests | mix | s | 5xx | innocent failed | leaks | front end RSS MiB/1k | core RSS MiB/1k | pass |",
            "|---|---|---|---|---|---|---|---|---|",
            f"| {k['requests']} | {k['mix']} | {k['seconds']} | {k['five_xx']} | {k['innocent_failed']} | "
            f"{k['leaks'] or 0} | {k['front_growth_mib_per_1k']} | {k['core_growth_mib_per_1k']} | "
            f"{'yes' if k['passed'] else 'NO'} |",
        ]
    failed = [r["case"] for r in report["bad_inputs"] + report["kills"] if not r["passed"]]
    out += ["", f"**{report['summary']}**" + (": " + "; ".join(failed) if failed else ""), ""]
    return "\n".join(out)


async def campaign(ns: argparse.Namespace) -> dict:
    deadline = time.monotonic() + ns.time_limit
    tmpdir = tempfile.mkdtemp(prefix="reliability-")
    try:
        report: dict[str, Any] = {
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "machine": f"{platform.node()}: {platform.processor() or platform.machine()}, "
            f"{len(os.sched_getaffinity(0))} cores usable, Python {platform.python_version()}",
            "command": "python scripts/reliability_campaign.py " + " ".join(sys.argv[1:]),
        }
        part = ns.parts
        report["bad_inputs"] = await bad_inputs(tmpdir, deadline) if "bad" in part else []
        report["kills"] = await kills(tmpdir, deadline) if "kill" in part else []
        report["sweep"] = orphan_sweep_row(tmpdir) if "kill" in part and time.monotonic() < deadline else None
        report["soak"] = await soak(tmpdir, ns.soak_requests, deadline) if "soak" in part else None
        rows = report["bad_inputs"] + report["kills"] + [r for r in (report["sweep"], report["soak"]) if r]
        failed = sum(not r["passed"] for r in rows)
        report["summary"] = f"{len(rows) - failed} of {len(rows)} rows pass"
        report["passed"] = failed == 0
        return report
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--soak-requests", type=int, default=3000)
    p.add_argument("--time-limit", type=float, default=1200.0, help="seconds for the whole campaign")
    p.add_argument("--parts", default="bad,kill,soak", help="comma-separated: bad, kill, soak")
    p.add_argument("--out", default=None, help="directory for reliability.json and reliability.md")
    ns = p.parse_args()
    report = asyncio.run(campaign(ns))
    text = markdown(report)
    print(text)
    if ns.out:
        os.makedirs(ns.out, exist_ok=True)
        Path(ns.out, "reliability.json").write_text(json.dumps(report, indent=1) + "\n")
        Path(ns.out, "reliability.md").write_text(text)
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
