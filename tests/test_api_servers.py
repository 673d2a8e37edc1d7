"""`sluice serve --api-server-count 2`: two front-end processes on one port in front of one engine core.

One server (a module fixture, started once) answers many concurrent openai clients through both front ends
with one front end's greedy outputs; /metrics on either front end counts every request of both; SIGTERM then
leaves no process (a killed core takes the whole server down: tests/test_dead_core_exit.py). A
second server loses a front end and goes down whole, its live core with it. In this process, two front ends on
one core keep their requests apart (the same request id on both at once; one front end's shutdown grace
ending), and the core stops by itself once both are done."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import anyio
import httpx
import openai
import pytest
from sluice.core import AsyncEngine, EngineArgs, SamplingParams
from sluice.core.engine_core.process import BridgeAddress, CoreProcessSpec, run_core_process
from sluice.core.errors import EngineStoppedError
from sluice.core.frontend.engine_core_client import SharedCore

from tests.server_helpers import free_port, metric_value, wait_gone

ROOT = Path(__file__).resolve().parent.parent
MAX_TOKENS = 12
PROMPTS = [f"Tell me about {w}" for w in ("rivers", "mountains", "the sea", "bread", "clocks", "owls")]
STARTED = re.compile(r"started the engine core \(pid (\d+)\) and \d+ API servers \(pids ([\d, ]+)\)")


class Serve:
    """`sluice serve` in a process of its own, its output read as it comes (several front ends say a lot)."""

    def __init__(self, *flags: str) -> None:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "sluice.app.commands.cli", "serve", "--model", "dummy:tiny", "--device", "cpu"]
        self.proc = subprocess.Popen(
            [*cmd, "--port", str(port), *flags], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.requests = self.prompt_tokens = self.cached_tokens = 0  # what the tests sent, to check /metrics by

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def wait(self, timeout: float = 30) -> int:
        """The exit status, once every line the server's processes wrote has been read."""
        code = self.proc.wait(timeout=timeout)
        self._reader.join(timeout)
        return code

    def wait_for(self, needle: str, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while not any(needle in line for line in self.lines):
            assert self.proc.poll() is None, self.output
            assert time.monotonic() < deadline, f"no {needle!r} in:\n{self.output}"
            time.sleep(0.05)

    def pids(self) -> tuple[int, list[int]]:
        """The core's and the front ends' process ids, as the supervisor logged them."""
        (m,) = [m for m in map(STARTED.search, self.lines) if m]
        return int(m[1]), [int(p) for p in m[2].split(", ")]

    def answered(self, request_line: str) -> Counter:
        """Access-log lines containing ``request_line`` by the front end (0, 1) that wrote them."""
        tag = re.compile(r"^\(APIServer(\d) pid=\d+\) ")
        return Counter(int(m[1]) for line in list(self.lines) if request_line in line and (m := tag.match(line)))

    def wait_answered(self, request_line: str, total: int | None = None, both: bool = False) -> Counter:
        deadline = time.monotonic() + 10
        while True:
            seen = self.answered(request_line)
            if (total is None or sum(seen.values()) >= total) and (not both or len(seen) == 2):
                return seen
            assert time.monotonic() < deadline, (request_line, seen)
            time.sleep(0.05)

    def stop(self) -> None:
        """After a test that failed first: SIGTERM (the supervisor cleans up), a kill if that is not enough."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="module")
def server():
    s = Serve("--api-server-count", "2", "--num-kv-blocks", "256", "--max-model-len", "512", "--access-log",
              "--shutdown-timeout", "5")  # fmt: skip
    try:
        s.wait_for("Uvicorn running on")  # logged once every front end serves
        yield s
    finally:
        s.stop()  # the last test stops it; this is for one that failed first (or a -k that left it out)


def chat(client: openai.OpenAI, prompt: str, stream: bool) -> tuple[str, int, int]:
    """Greedy; the text, prompt tokens and cached tokens."""
    kwargs = dict(model="dummy:tiny", messages=[{"role": "user", "content": prompt}], max_tokens=MAX_TOKENS,
                  temperature=0, extra_body={"ignore_eos": True})  # fmt: skip
    if not stream:
        r = client.chat.completions.create(**kwargs)
        return r.choices[0].message.content, r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens
    text, usage = "", None
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        else:
            usage = chunk.usage
    return text, usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens


def test_many_concurrent_openai_clients_get_one_front_ends_outputs_from_both(server):
    # One front end's answers: one connection (a connection is one front end's), one request after another.
    with openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60) as one:
        alone = [chat(one, p, stream=False) for p in PROMPTS]
    expected = {p: text for p, (text, _, _) in zip(PROMPTS, alone)}
    jobs = [(PROMPTS[i % len(PROMPTS)], i % 2 == 0) for i in range(48)]
    with openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60) as client:
        with ThreadPoolExecutor(24) as pool:  # 24 connections at once, streamed and not
            got = list(pool.map(lambda job: chat(client, *job), jobs))
    assert [text for text, _, _ in got] == [expected[p] for p, _ in jobs]
    for _, prompt_tokens, cached in alone + got:
        server.prompt_tokens += prompt_tokens
        server.cached_tokens += cached
    server.requests += len(alone) + len(jobs)
    # both front ends served requests (each logs the requests it answered)
    served = server.wait_answered('"POST /v1/chat/completions HTTP/1.1" 200', total=server.requests)
    assert set(served) == {0, 1} and sum(served.values()) == server.requests, served


def test_metrics_on_either_front_end_count_every_request(server):
    assert server.requests, "needs the test above"
    names = [
        ("sluice:request_success_total", 'finished_reason="length"'),  # per request, summed over the front ends
        ("sluice:e2e_request_latency_seconds_count", ""),
        ("sluice:generation_tokens_total", ""),  # the core's counters, the same on each
        ("sluice:prompt_tokens_total", ""),
        ("sluice:prefix_cache_hit_rate", ""),  # the front ends' windows, merged
    ]
    scrapes = []
    for _ in range(50):  # a new connection each: either front end answers
        text = httpx.get(server.url + "/metrics").text
        scrapes.append([metric_value(text, *n) for n in names])
        if len(scrapes) >= 4 and len(server.answered('"GET /metrics')) == 2:
            break
    server.wait_answered('"GET /metrics', both=True)
    assert all(s == scrapes[0] for s in scrapes), scrapes
    success, e2e, generated, prompt_tokens, hit_rate = scrapes[0]
    assert success == e2e == server.requests
    assert generated == server.requests * MAX_TOKENS and prompt_tokens == server.prompt_tokens
    assert server.cached_tokens > 0 and hit_rate == pytest.approx(server.cached_tokens / server.prompt_tokens)
    assert metric_value(text, "sluice:num_requests_running") == 0
    assert metric_value(text, "sluice:kv_blocks_free") == metric_value(text, "sluice:kv_blocks_total")


def test_sigterm_stops_every_process(server):
    core, fronts = server.pids()
    server.proc.send_signal(signal.SIGTERM)
    assert server.wait() == 0, server.output
    for pid in [core, *fronts]:
        wait_gone(pid, timeout=5)
    assert server.output.count("Application shutdown complete") == 2
    assert "Traceback" not in server.output and "killing" not in server.output


def test_a_front_end_that_dies_takes_the_server_down_with_its_core():
    s = Serve("--api-server-count", "2", "--num-kv-blocks", "64", "--max-model-len", "256", "--shutdown-timeout", "2")
    try:
        s.wait_for("Uvicorn running on")
        core, fronts = s.pids()
        os.kill(fronts[1], signal.SIGKILL)
        assert s.wait() == 1
        for pid in [core, fronts[0]]:
            wait_gone(pid, timeout=5)
        assert f"API server 1 (pid {fronts[1]}) was killed by SIGKILL: stopping the server" in s.output
    finally:
        s.stop()


async def test_front_ends_on_one_core_keep_their_requests_apart():
    args = EngineArgs(model="dummy:tiny", device="cpu", num_kv_blocks=256, max_model_len=512, engine_core_process=True)
    run_dir = tempfile.mkdtemp(prefix="sluice-test-")
    bridges = [BridgeAddress(f"ipc://{run_dir}/to-core-{i}", f"ipc://{run_dir}/to-front-{i}") for i in range(2)]
    spec = CoreProcessSpec(args, 512, bridges, os.getpid(), logging.WARNING, core_binds=True)
    core = mp.get_context("spawn").Process(target=run_core_process, args=(spec,))
    core.start()
    try:
        a, b = (AsyncEngine(args, shared_core=SharedCore(i, bridges[i], core.pid)) for i in range(2))
        greedy = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)

        async def run(engine, prompt: list[int], params: SamplingParams, request_id: str) -> list[int]:
            async for out in engine.generate(prompt, params, request_id=request_id):
                if out.finished:
                    return out.token_ids
            raise AssertionError("no final output")

        async with a, b:
            alone = [await run(a, [5, 6, 7], greedy, "x"), await run(b, [9, 10, 11, 12], greedy, "y")]
            together: list = [None, None]

            async def one(i: int, engine, prompt: list[int]) -> None:
                together[i] = await run(engine, prompt, greedy, "same")  # one id, two front ends, at once

            async with anyio.create_task_group() as tg:
                tg.start_soon(one, 0, a, [5, 6, 7])
                tg.start_soon(one, 1, b, [9, 10, 11, 12])
            assert together == alone

            # One front end's shutdown grace ends its own requests, not the other front end's.
            long = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
            kept: list[int] = []

            async def keep() -> None:
                kept.extend(await run(b, [3, 4], long, "long"))

            async with anyio.create_task_group() as tg:
                tg.start_soon(keep)
                ended = a.generate([3, 4], long, request_id="long")
                await anext(ended)
                await a.end_all_requests(EngineStoppedError("the server is shutting down"))
                with pytest.raises(EngineStoppedError):
                    async for _ in ended:
                        pass
            assert len(kept) == 200
            with pytest.raises(EngineStoppedError):
                await run(a, [1, 2], greedy, "later")
            assert len(await run(b, [1, 2], greedy, "later")) == 16
        core.join(10)  # both front ends said they were done: the core stopped on its own
        assert core.exitcode == 0
    finally:
        if core.is_alive():
            core.kill()
            core.join()
        shutil.rmtree(run_dir, ignore_errors=True)
