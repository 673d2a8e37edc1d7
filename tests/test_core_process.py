"""The engine core in its own process (``engine_core_process``): the same outputs as one process, the wire
format's round trip, and every way the two processes can part: the core killed mid-stream (each client gets a
clean error, /health says 503, nothing is left running), the front end killed (its core goes too), and many
clients that leave mid-stream (no KV block leaks, read from /metrics)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import anyio
import httpx
import pytest
from sluice.app.server.app import build_app
from sluice.core import AsyncEngine, EngineArgs, EngineOverloaded, InvalidRequestError, SamplingParams
from sluice.core.messages import TokenEvent
from sluice.core.outputs import TokenLogprob

from tests.server_helpers import ServerThread, assert_openai_error, gone, metric_value, wait_gone

ROOT = Path(__file__).resolve().parent.parent
MSG = [{"role": "user", "content": "Hi"}]


def tiny_args(**kw) -> EngineArgs:
    return EngineArgs(**{**dict(model="dummy:tiny", device="cpu", num_kv_blocks=256, max_model_len=512), **kw})


def test_events_and_errors_cross_the_wire_as_themselves():
    from sluice.core.ipc import wire

    ev = TokenEvent("r#1", [5, 6], [TokenLogprob(5, -0.25, [(5, -0.25), (9, -2.0)])], "stop", 6, 3, None, 12.5)
    step = wire.CoreStep([wire.event_to_wire(ev)], wire.EngineStats(num_running=2))
    back = wire.core_decoder.decode(wire.core_encoder.encode(step))
    assert wire.event_from_wire(back.events[0]) == ev and back.stats.num_running == 2
    overloaded = wire.error_from_wire(wire.error_to_wire(EngineOverloaded("full")))
    assert type(overloaded) is EngineOverloaded and str(overloaded) == "full"
    invalid = wire.error_from_wire(wire.error_to_wire(InvalidRequestError("n: bad", param="n")))
    assert type(invalid) is InvalidRequestError and invalid.param == "n"
    # anything else is not sluice's to name: the request actor wraps it as a failed request
    other = wire.error_from_wire(wire.error_to_wire(ValueError("boom")))
    assert type(other) is RuntimeError and "boom" in str(other)


CASES = [
    ([5, 6, 7, 8], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)),
    ("Count: 1, 2, 3,", SamplingParams(max_tokens=20, temperature=0.9, top_p=0.9, seed=11, logprobs=2)),
    (MSG, SamplingParams(n=3, max_tokens=16, temperature=1.0, seed=3, ignore_eos=True)),
    (list(range(40, 90)), SamplingParams(max_tokens=30, temperature=0.7, seed=5, stop=["ment", "an"])),
]


async def run_cases(engine: AsyncEngine) -> list[list[tuple]]:
    results: list[list[tuple]] = [[] for _ in CASES]

    async def one(i: int) -> None:
        prompt, params = CASES[i]
        deltas: dict[int, str] = {}
        async for out in engine.generate(prompt, params, request_id=f"case-{i}"):
            deltas[out.index] = deltas.get(out.index, "") + out.delta_text
            if out.finished:
                lps = [(lp.token_id, round(lp.logprob, 4), lp.top) for lp in out.logprobs or []]
                results[i].append((out.index, out.token_ids, out.text, out.finish_reason, out.stop_reason, lps))
                assert deltas[out.index] == out.text

    async with anyio.create_task_group() as tg:  # together, so they share steps
        for i in range(len(CASES)):
            tg.start_soon(one, i)
    return [sorted(r) for r in results]


async def test_outputs_are_identical_to_one_process():
    async with AsyncEngine(tiny_args()) as one:
        expected = await run_cases(one)
    async with AsyncEngine(tiny_args(engine_core_process=True)) as split:
        assert split.core_pid is not None and split.core_pid != os.getpid()
        got = await run_cases(split)
        s = split.stats()
        assert s.num_running == 0 and s.kv_blocks_free == s.kv_blocks_total and s.generation_tokens > 0
        pid = split.core_pid
    assert got == expected
    assert [len(r) for r in got] == [p.n for _, p in CASES]
    wait_gone(pid)  # `async with` ended: the core's process with it


@pytest.fixture(scope="module")
def split_server():
    engine = AsyncEngine(tiny_args(max_num_seqs=64, num_kv_blocks=512, engine_core_process=True))
    srv = ServerThread(build_app(engine)).start()
    srv.engine = engine
    yield srv
    srv.stop()


@pytest.mark.slow
async def test_cancelling_500_random_streams_leaks_no_block(split_server):
    """Clients leave at random points: before their first chunk, after some, or at the end; the engine must
    free every block of every aborted request (read from /metrics, as an operator would)."""
    rng = random.Random(0)
    body = {"messages": MSG, "stream": True, "ignore_eos": True}

    async def one(c: httpx.AsyncClient, i: int) -> None:
        cut, max_tokens = rng.randint(0, 30), rng.randint(1, 40)
        with anyio.move_on_after(rng.uniform(0.0, 3.0) if i % 4 == 0 else 60):
            async with c.stream("POST", "/v1/chat/completions", json={**body, "max_tokens": max_tokens}) as resp:
                assert resp.status_code == 200
                n = 0
                async for line in resp.aiter_lines():
                    n += line.startswith("data: ")
                    if n >= cut:
                        break

    limits = httpx.Limits(max_connections=600)
    async with httpx.AsyncClient(base_url=split_server.url, timeout=60, limits=limits) as c:
        async with anyio.create_task_group() as tg:
            for i in range(500):
                tg.start_soon(one, c, i)
    # the operator's scrapes on connections of their own: the streams' pool holds connections the server closed
    # when their clients left mid-response, and reusing one fails on the client's side (httpx.ReadError)
    async with httpx.AsyncClient(base_url=split_server.url, timeout=60) as c:
        with anyio.fail_after(30):
            while True:
                text = (await c.get("/metrics")).text
                if metric_value(text, "sluice:num_requests_running") + metric_value(
                    text, "sluice:num_requests_waiting"
                ) == 0 and metric_value(text, "sluice:kv_blocks_free") == metric_value(text, "sluice:kv_blocks_total"):
                    break
                await anyio.sleep(0.05)
        assert metric_value(text, "sluice:kv_cache_usage_perc") == 0.0
        assert metric_value(text, "sluice:prompt_tokens_total") > 0
        assert (await c.get("/health")).status_code == 200


def test_killing_the_core_mid_stream_ends_every_stream_with_an_error_and_health_503():
    engine = AsyncEngine(tiny_args(engine_core_process=True))
    srv = ServerThread(build_app(engine)).start()
    try:
        pid = engine.core_pid
        results: dict[int, list[str]] = {}
        streaming = [threading.Event() for _ in range(4)]

        def stream(i: int) -> None:
            body = {"messages": MSG, "max_tokens": 400, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", srv.url + "/v1/chat/completions", json=body, timeout=60) as resp:
                assert resp.status_code == 200
                datas = []
                for line in resp.iter_lines():
                    if line.startswith("data: "):
                        datas.append(line[6:])
                        streaming[i].set()
                results[i] = datas

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for ev in streaming:
            assert ev.wait(60)
        os.kill(pid, signal.SIGKILL)
        for t in threads:
            t.join(60)
        assert sorted(results) == [0, 1, 2, 3]
        for datas in results.values():
            assert datas[-1] == "[DONE]"
            err = json.loads(datas[-2])
            assert set(err) == {"error"} and err["error"]["code"] == "engine_dead", err
            assert "SIGKILL" not in datas[-2] and "Traceback" not in datas[-2]
            assert all("choices" in json.loads(d) for d in datas[:-2])
        health = httpx.get(srv.url + "/health")
        assert health.status_code == 503
        resp = httpx.post(srv.url + "/v1/chat/completions", json={"messages": MSG, "max_tokens": 2})
        assert assert_openai_error(resp, 503)["code"] == "engine_dead"
        metrics = httpx.get(srv.url + "/metrics").text
        assert metric_value(metrics, "sluice:engine_healthy") == 0
        assert gone(pid)
    finally:
        srv.stop()
    assert not engine.is_running


def test_killing_the_front_end_takes_its_core_down(tmp_path):
    """`sluice serve` (the core in its own process by default) killed with SIGKILL: it cannot tell its core,
    which notices on its own and exits."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "sluice.app.commands.cli", "serve", "--model", "dummy:tiny", "--device", "cpu"]
    cmd += ["--port", str(port), "--num-kv-blocks", "64", "--max-model-len", "256"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "server did not come up"
            time.sleep(0.2)
        children = child_pids(proc.pid)
        assert len(children) == 1, children  # the engine core
        body = {"messages": MSG, "max_tokens": 2}
        assert httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=30).status_code == 200
        proc.kill()
        proc.wait()
        wait_gone(children[0])
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def child_pids(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    if int(fh.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(entry))
            except (FileNotFoundError, ProcessLookupError):
                pass
    # multiprocessing's spawn also starts a resource tracker; the core is the one running our target
    return [p for p in out if "resource_tracker" not in _cmdline(p)]


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().replace(b"\0", b" ").decode()
    except FileNotFoundError:
        return ""


async def test_cancelling_the_caller_while_the_core_starts_leaves_no_process():
    """``async with AsyncEngine(...)`` cancelled while its core loads the model (or, on a fast machine, once it
    runs): the core's process is stopped either way."""
    engine = AsyncEngine(tiny_args(engine_core_process=True))
    before = set(child_pids(os.getpid()))
    seen: set[int] = set()

    async def watch() -> None:
        while True:
            seen.update(set(child_pids(os.getpid())) - before)
            await anyio.sleep(0.02)

    async with anyio.create_task_group() as tg:
        tg.start_soon(watch)
        with anyio.move_on_after(3.0) as scope:
            async with engine:
                await anyio.sleep_forever()
        tg.cancel_scope.cancel()
    assert scope.cancelled_caught and not engine.is_running
    assert seen, "the core's process was never seen"
    for pid in seen:
        wait_gone(pid, timeout=1.0)


def test_an_llm_with_its_core_in_a_process_exits_without_close(tmp_path):
    """`LLM(..., engine_core_process=True)` in a script that never closes it: the script prints its outputs and
    exits, and its core's process is gone with it."""
    script = tmp_path / "script.py"
    script.write_text(
        "import os\n"
        "from sluice.core import LLM, SamplingParams\n\n"
        'if __name__ == "__main__":\n'
        '    llm = LLM(model="dummy:tiny", device="cpu", num_kv_blocks=32, max_model_len=128,\n'
        "              engine_core_process=True)\n"
        '    out = llm.generate(["hi", "there"], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)\n'
        "    print(llm.engine.core_pid, [len(o.outputs[0].token_ids) for o in out], flush=True)\n"
    )
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr
    pid, lens = proc.stdout.split(" ", 1)
    assert lens.strip() == "[3, 3]" and "Traceback" not in proc.stderr
    wait_gone(int(pid))
