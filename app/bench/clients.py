"""`sluice bench clients`: many concurrent streaming clients through the official openai client, and what the
serving front end spends per streamed token.

It starts `sluice serve` itself (the front end's and the engine core's process ids are then known), waits for
it, sends one warm-up request, then opens ``--num-clients`` streaming chat completions at once
(``ignore_eos``, forced ``max_tokens``), each through ``openai.AsyncOpenAI``. A client completed when its
stream ended without an error and its usage chunk counts ``max_tokens`` tokens. The processes' CPU seconds
(user + system, from ``/proc``: Linux) over the run give the front end's CPU per streamed token, the figure
the front end/core split is about; the core's is reported beside it. The clients run in this process, on
the same machine: the server's wall-clock figures share its cores with them, its CPU seconds do not.
"""

from __future__ import annotations

import argparse
import os
import resource
import shlex
import socket
import subprocess
import sys
import time

from sluice.app.bench.common import print_figures
from sluice.app.bench.results import command_line, write_result


def register(sub) -> None:
    p = sub.add_parser("clients", help="N concurrent streaming openai clients against `sluice serve`: front-end CPU")
    p.add_argument("--model", default="dummy:tiny", help="the served model (default: %(default)s)")
    p.add_argument("--num-clients", type=int, default=1000, help="concurrent streams (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens per stream (default: %(default)s)")
    p.add_argument(
        "--serve-args",
        default="--device cpu --max-num-seqs 256 --max-model-len 512",
        help="more flags for `sluice serve` (default: %(default)r)",
    )
    p.add_argument("--timeout", type=float, default=600.0, help="seconds for the whole run (default: %(default)s)")
    p.add_argument("--out", default=None, help="write the JSON result here")
    p.set_defaults(func=main)


def main(ns: argparse.Namespace) -> int:
    import logging

    import anyio

    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request, a thousand times

    _raise_open_files_limit(2 * ns.num_clients + 256)  # a socket per client, here and in the server
    port = _free_port()
    cmd = [sys.executable, "-m", "sluice.app.commands.cli", "serve", "--model", ns.model, "--port", str(port)]
    cmd += ["--max-waiting-requests", str(max(1024, ns.num_clients)), *shlex.split(ns.serve_args)]
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_healthy(server, url)
        figures = anyio.run(_measure, ns, url, server.pid)
    finally:
        server.terminate()
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    print_figures(f"{ns.num_clients} concurrent streaming clients (openai), {ns.max_tokens} tokens each", figures)
    if ns.out:
        write_result(ns.out, command_line(), ns.model, {"name": "fixed", "max_tokens": ns.max_tokens}, figures)
    return 0 if figures["failed"] == 0 else 1


async def _measure(ns: argparse.Namespace, url: str, front_pid: int) -> dict:
    import anyio
    import httpx
    import openai

    limits = httpx.Limits(max_connections=ns.num_clients + 8, max_keepalive_connections=ns.num_clients + 8)
    http = httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(ns.timeout))
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, http_client=http)
    errors: list[str] = []
    tokens = [0] * ns.num_clients

    async def one(i: int) -> None:
        try:
            stream = await client.chat.completions.create(
                model=ns.model,
                messages=[{"role": "user", "content": f"Client {i} says hello."}],
                max_tokens=ns.max_tokens,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
            async for chunk in stream:
                if chunk.usage is not None:
                    tokens[i] = chunk.usage.completion_tokens
            if tokens[i] != ns.max_tokens:
                errors.append(f"client {i}: {tokens[i]} of {ns.max_tokens} tokens")
        except Exception as e:  # counted, not raised: every client's outcome is the result
            errors.append(f"client {i}: {type(e).__name__}: {e}")

    async with http:
        await one(0)  # warm-up: the first request compiles and allocates what later ones reuse
        errors.clear()
        core_pid = _child_pid(front_pid)
        front0, core0 = _cpu_s(front_pid), _cpu_s(core_pid)
        t0 = time.perf_counter()
        with anyio.fail_after(ns.timeout):
            async with anyio.create_task_group() as tg:
                for i in range(ns.num_clients):
                    tg.start_soon(one, i)
        elapsed = time.perf_counter() - t0
        front_s, core_s = _cpu_s(front_pid) - front0, _cpu_s(core_pid) - core0
    streamed = sum(tokens)
    return {
        "num_clients": ns.num_clients,
        "completed": ns.num_clients - len(errors),
        "failed": len(errors),
        "errors": errors[:10],
        "streamed_tokens": streamed,
        "duration_s": elapsed,
        "tokens_per_s": streamed / elapsed,
        "front_end_cpu_s": front_s,
        "front_end_cpu_us_per_token": 1e6 * front_s / max(streamed, 1),
        "engine_core_cpu_s": core_s,
        "engine_core_cpu_us_per_token": 1e6 * core_s / max(streamed, 1) if core_pid is not None else None,
        "engine_core_process": core_pid is not None,
        "serve_args": ns.serve_args,
    }


def _cpu_s(pid: int | None) -> float:
    """User + system CPU seconds of a process so far (0 without one)."""
    if pid is None:
        return 0.0
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _child_pid(pid: int) -> int | None:
    """The engine core's process: the server's child that runs sluice (not multiprocessing's resource tracker)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                cmdline = fh.read()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if ppid == pid and b"resource_tracker" not in cmdline:
            return int(entry)
    return None


def _raise_open_files_limit(want: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want if hard == resource.RLIM_INFINITY else min(want, hard), hard))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(server: subprocess.Popen, url: str, timeout: float = 300.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        if server.poll() is not None:
            raise RuntimeError(f"sluice serve exited: {server.stderr.read()[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError("sluice serve did not come up")
        time.sleep(0.2)
