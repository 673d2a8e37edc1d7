"""`sluice serve --data-parallel-size 2 --data-parallel-backend ray` on the CPU: two `dummy:tiny` replicas on a
local Ray the server starts (one per module), one OpenAI endpoint. Greedy outputs equal one engine's, streamed
and not; a replica killed mid-stream fails only its own requests and the endpoint recovers; SIGTERM leaves no
Ray process behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.server_helpers import free_port, gone

pytest.importorskip("ray.serve")
openai = pytest.importorskip("openai")

ROOT = Path(__file__).resolve().parent.parent
ENGINE = ["--model", "dummy:tiny", "--device", "cpu", "--num-kv-blocks", "256", "--max-model-len", "2048"]
PROMPTS = ["the river runs to the sea and", "owls are awake at night because", "one two three four five"]


def descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = set(), [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.add(c)
            todo.append(c)
    return out


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except FileNotFoundError:
        return ""


@pytest.fixture(scope="module")
def server():
    port = free_port()
    cmd = [sys.executable, "-m", "sluice.app.commands.cli", "serve", *ENGINE, "--port", str(port)]
    cmd += ["--data-parallel-size", "2", "--data-parallel-backend", "ray", "--routing", "kv"]
    env = {**os.environ, "RAY_num_prestart_python_workers": "0"}
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300  # two replicas' start on a loaded 2-core machine (180 s fell short once)
    try:
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.5)
        # the Ray processes as started, for the shutdown test: a later test kills a replica (Serve replaces it)
        started_tree = descendants(proc.pid)
        assert any("raylet" in cmdline(p) for p in started_tree), [cmdline(p)[:80] for p in started_tree]
        yield proc, url, started_tree
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def one_engine_outputs(max_tokens: int) -> list[list[int]]:
    from sluice.core import LLM, SamplingParams

    llm = LLM(model="dummy:tiny", device="cpu", num_kv_blocks=256, max_model_len=2048)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].text for o in outs]


def test_openai_client_through_one_endpoint_equals_one_engine_streamed_and_not(server):
    _, url, _ = server
    client = openai.OpenAI(base_url=url + "/v1", api_key="none")
    expected = one_engine_outputs(12)
    extra = {"ignore_eos": True}
    plain = [
        client.completions.create(model="dummy:tiny", prompt=p, max_tokens=12, temperature=0, extra_body=extra)
        for p in PROMPTS
    ]
    assert [c.choices[0].text for c in plain] == expected
    streamed = []
    for i, p in enumerate(PROMPTS):
        chunks = client.completions.create(
            model="dummy:tiny", prompt=p, max_tokens=12, temperature=0, stream=True, extra_body=extra,
            extra_headers={"x-session-id": f"s{i % 2}"},
        )  # fmt: skip
        streamed.append("".join(c.choices[0].text for c in chunks if c.choices))
    assert streamed == expected
    too_long = httpx.post(url + "/v1/completions", json={"prompt": list(range(1, 3000)), "max_tokens": 2})
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "prompt", too_long.text
    metrics = httpx.get(url + "/metrics").text
    assert 'sluice:replica_kv_blocks_total{replica="' in metrics, "per-replica figures beside the sums"


def test_kv_routing_sends_a_shared_prefix_where_it_is_cached(server):
    """Round-robin or random routing would miss on about half of these; `kv` hits on every one after the first."""
    _, url, _ = server
    prefix = " ".join(f"word{i}" for i in range(120))
    cached = []
    for i in range(6):
        body = {"prompt": f"{prefix} question {i}", "max_tokens": 2, "temperature": 0}
        r = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        cached.append(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
    assert cached[0] == 0 and all(c >= 5 * 16 for c in cached[1:]), cached


def _replica_prompt_tokens(url: str) -> dict[str, float]:
    time.sleep(1.5)  # the replicas post their counters every half second; the front end reads them as often
    out = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith('sluice:replica_prompt_tokens{replica="'):
            out[line.split('"')[1]] = float(line.rsplit(" ", 1)[1])
    return out


def test_a_session_stays_on_one_replica_and_requests_without_one_spread(server):
    _, url, _ = server

    def burst(headers: dict) -> dict[str, float]:
        before = _replica_prompt_tokens(url)
        threads = [
            threading.Thread(
                target=httpx.post,
                args=(url + "/v1/completions",),
                kwargs={"json": {"prompt": f"burst {i} " * 20, "max_tokens": 40}, "headers": headers, "timeout": 60},
            )
            for i in range(6)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        after = _replica_prompt_tokens(url)
        return {r: after[r] - before.get(r, 0) for r in after}

    assert sorted(v > 0 for v in burst({}).values()) == [True, True], "unrelated requests use both replicas"
    assert sorted(v > 0 for v in burst({"x-session-id": "s-1"}).values()) == [False, True], "one session, one replica"


def _stream(url: str, prompt: str, results: dict, started: threading.Event, i: int) -> None:
    body = {"model": "dummy:tiny", "prompt": prompt, "max_tokens": 800, "temperature": 0, "stream": True}
    body["ignore_eos"] = True
    events = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
                started.set()
    results[i] = events


def test_a_replica_killed_mid_stream_fails_only_its_requests_and_the_endpoint_recovers(server):
    proc, url, _ = server
    replicas = sorted(p for p in descendants(proc.pid) if "ServeReplica" in cmdline(p))
    assert len(replicas) == 2, [cmdline(p) for p in descendants(proc.pid)]
    results: dict[int, list] = {}
    started = [threading.Event() for _ in range(4)]
    threads = [
        threading.Thread(target=_stream, args=(url, f"tenant {i} asks about {PROMPTS[i % 3]}", results, started[i], i))
        for i in range(4)
    ]
    for t in threads:
        t.start()
    for e in started:
        assert e.wait(60)
    os.kill(replicas[0], signal.SIGKILL)
    for t in threads:
        t.join(120)
    failed = [r for r in results.values() if r and "error" in r[-1]]
    finished = [r for r in results.values() if r and r[-1].get("choices") and r[-1]["choices"][0]["finish_reason"]]
    assert failed and finished and len(failed) + len(finished) == 4
    assert all(r[-1]["error"]["code"] == "engine_dead" for r in failed)
    deadline = time.monotonic() + 90
    while True:  # new requests go to the live replica, then Serve's replacement joins
        r = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
        if r.status_code == 200 and httpx.get(url + "/health").status_code == 200:
            break
        assert time.monotonic() < deadline, r.text
        time.sleep(1)


def test_sigterm_leaves_no_ray_process_behind(server):
    proc, url, started_tree = server
    tree = started_tree | descendants(proc.pid)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(120) == 0  # ~9 s on a quiet machine; CI's two busy workers once took over 60
    deadline = time.monotonic() + 30
    while not all(gone(p) for p in tree):
        left = [cmdline(p)[:80] for p in tree if not gone(p)]
        assert time.monotonic() < deadline, f"left behind: {left}"
        time.sleep(0.5)


def test_ray_is_imported_only_when_the_ray_backend_is_chosen():
    code = (
        "import sys; from sluice.app.commands.cli import build_parser; build_parser(); import sluice.app.server.app; "
        "import sluice.app.commands.serve; assert 'ray' not in sys.modules, 'ray imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
