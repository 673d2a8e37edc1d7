"""The event loop never blocks on tokenization: while four clients send large prompts (all refused, 400),
/health answers at once and another client's stream keeps its pace. Large prompts are tokenized in a worker
thread; prompts that cannot fit whatever they tokenize to are refused without tokenizing."""

from __future__ import annotations

import statistics
import threading
import time

import httpx
import pytest
from sluice.app.server.app import build_app
from sluice.core import AsyncEngine, EngineArgs

from tests.server_helpers import ServerThread

# Before the fix, on a busy 2-core machine: 1 MB prompts held /health at a 0.43-0.57 s median (p90 1.3 s) and a
# stream's chunk gap at 0.8 s; 320 kB ones at 0.14-0.34 s (p90 0.43-0.67 s) and 0.54 s. After: 0.05 s and below.
HEALTH_MEDIAN_S, HEALTH_P90_S, GAP_MEDIAN_S = 0.1, 0.25, 0.2


@pytest.fixture(scope="module")
def server():
    engine = AsyncEngine(EngineArgs(model="dummy:tiny", device="cpu", num_kv_blocks=256, max_model_len=4096))
    srv = ServerThread(build_app(engine, max_body_bytes=4 << 20)).start()
    yield srv
    srv.stop()


def p90(xs: list[float]) -> float:
    return sorted(xs)[int(0.9 * (len(xs) - 1))]


# 1 MB cannot fit 4096 tokens whatever it tokenizes to (refused untokenized); 320 kB might, so it is
# tokenized (off the loop) and then refused.
@pytest.mark.parametrize("chars", [1_000_000, 320_000], ids=["1MB", "320kB"])
def test_health_and_a_stream_stay_responsive_while_large_prompts_arrive(server, chars):
    text = ("hello world, this is a test of the tokenizer. " * (chars // 40 + 1))[:chars]
    health: list[float] = []
    gaps: list[float] = []
    statuses: list[int] = []
    loading = threading.Event()
    done = threading.Event()

    def probe() -> None:
        with httpx.Client(base_url=server.url, timeout=30) as c:
            while not done.is_set():
                t = time.perf_counter()
                assert c.get("/health").status_code == 200
                if loading.is_set():
                    health.append(time.perf_counter() - t)
                time.sleep(0.02)

    def stream() -> None:
        body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as resp:
            last = None
            for line in resp.iter_lines():
                now = time.perf_counter()
                if line.startswith("data: "):
                    if last is not None and loading.is_set():
                        gaps.append(now - last)
                    last = now
                if done.is_set():
                    break

    def client() -> None:
        with httpx.Client(base_url=server.url, timeout=60) as c:
            for _ in range(3):
                body = {"messages": [{"role": "user", "content": text}]}
                statuses.append(c.post("/v1/chat/completions", json=body).status_code)

    background = [threading.Thread(target=probe), threading.Thread(target=stream)]
    for t in background:
        t.start()
    time.sleep(0.5)
    clients = [threading.Thread(target=client) for _ in range(4)]
    loading.set()
    for t in clients:
        t.start()
    for t in clients:
        t.join(timeout=120)
    loading.clear()
    done.set()
    for t in background:
        t.join(timeout=60)
    assert statuses == [400] * 12
    assert len(health) >= 3, health
    report = f"/health median {statistics.median(health):.3f} s, p90 {p90(health):.3f} s; gaps {gaps and max(gaps)}"
    assert statistics.median(health) < HEALTH_MEDIAN_S and p90(health) < HEALTH_P90_S, report
    assert gaps and statistics.median(gaps) < GAP_MEDIAN_S, report
