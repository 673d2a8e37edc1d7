"""`sluice bench serve`: online serving benchmark against a running server's OpenAI API.

Requests arrive as a Poisson process at ``--request-rate`` per second (``inf``: all at once), each a
streamed ``/v1/completions`` call (greedy, ``ignore_eos``, forced ``max_tokens``). Per request: TTFT
(time to the first streamed chunk), ITL (gaps between streamed chunks), TPOT ((latency - TTFT) /
(output tokens - 1)) and end-to-end latency. A chunk counts whether or not it carries text (tokens may
decode to nothing, as vLLM's client also counts them). Output tokens come from the stream's usage chunk when
the server sends one (``stream_options.include_usage``), else from the number of chunks with text; a request
completed when it produced output tokens and its stream ended without an error event.

With ``--requests-file`` the saved prompts are sent as token ids (``/v1/completions`` takes a list of ids), so
the run replays exactly the saved requests and needs no tokenizer, nor the model package that holds one.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from sluice.app.bench.common import add_dataset_args, load_bench_requests, percentiles, print_figures
from sluice.app.bench.datasets import BenchRequest
from sluice.app.bench.results import command_line, machine_info, versions, write_result


@dataclass(slots=True)
class RequestTiming:
    ok: bool = False
    error: str | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft_s: float = 0.0
    latency_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)


def register(sub) -> None:
    p = sub.add_parser("serve", help="online benchmark: Poisson arrivals against a running OpenAI-compatible server")
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server to measure")
    p.add_argument("--model", default=None, help="model name sent in requests (default: the server's first model)")
    p.add_argument(
        "--tokenizer",
        default=None,
        help="model source whose tokenizer samples the dataset (none is needed with --requests-file)",
    )
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests per second (inf: all at once)")
    p.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most (default: no limit)")
    p.add_argument("--seed", type=int, default=0, help="seed of the arrival times")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--out", default=None, help="write the JSON result here")
    add_dataset_args(p, default_num_prompts=200)
    p.set_defaults(func=main)


def arrival_times(n: int, rate: float, seed: int) -> list[float]:
    """Offsets (s) of ``n`` Poisson arrivals at ``rate`` per second; all zero for an infinite rate."""
    if rate == float("inf"):
        return [0.0] * n
    if rate <= 0:
        raise ValueError("request_rate must be > 0")
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


async def one_request(client, url: str, payload: dict, timeout: float) -> RequestTiming:
    import httpx

    res = RequestTiming()
    t0 = time.perf_counter()
    last = None
    text_chunks = 0
    usage_tokens = None
    try:
        async with client.stream("POST", url, json=payload, timeout=timeout) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")[:200]
                res.error = f"HTTP {resp.status_code}: {body}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                msg = json.loads(data)
                if msg.get("error"):  # a failure mid-stream (OpenAI's shape), before [DONE]
                    err = msg["error"]
                    res.error = f"error event: {err.get('message', err) if isinstance(err, dict) else err}"
                    return res
                if msg.get("usage"):
                    usage_tokens = msg["usage"].get("completion_tokens")
                    res.prompt_tokens = msg["usage"].get("prompt_tokens", 0) or 0
                choices = msg.get("choices") or []
                if not choices:
                    continue
                now = time.perf_counter()
                if last is None:
                    res.ttft_s = now - t0
                else:
                    res.itl_s.append(now - last)
                last = now
                text_chunks += bool(choices[0].get("text"))
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        res.error = f"{type(e).__name__}: {e}"
        return res
    res.latency_s = time.perf_counter() - t0
    res.output_tokens = usage_tokens if usage_tokens is not None else text_chunks
    res.ok = res.output_tokens > 0 and last is not None
    if not res.ok:
        res.error = "no chunk streamed" if last is None else "no output tokens reported"
    return res


async def run_benchmark(
    base_url: str,
    model: str,
    requests: Sequence[BenchRequest],
    prompts: Sequence[str | list[int]],
    request_rate: float,
    seed: int = 0,
    max_concurrency: int | None = None,
    timeout: float = 600.0,
) -> tuple[list[RequestTiming], float]:
    """Send every request at its arrival time; returns per-request timings and the benchmark's duration."""
    import anyio
    import httpx

    url = base_url.rstrip("/") + "/v1/completions"
    offsets = arrival_times(len(requests), request_rate, seed)
    timings: list[RequestTiming | None] = [None] * len(requests)
    limiter = anyio.CapacityLimiter(max_concurrency) if max_concurrency else None
    limits = httpx.Limits(max_connections=max_concurrency or max(1, len(requests)), max_keepalive_connections=64)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        t0 = time.perf_counter()

        async def send(i: int) -> None:
            delay = offsets[i] - (time.perf_counter() - t0)
            if delay > 0:
                await anyio.sleep(delay)
            payload = {
                "model": model,
                "prompt": prompts[i],
                "max_tokens": requests[i].output_len,
                "temperature": 0.0,
                "stream": True,
                "ignore_eos": True,
                "stream_options": {"include_usage": True},
            }
            if limiter is None:
                timings[i] = await one_request(client, url, payload, timeout)
            else:
                async with limiter:
                    timings[i] = await one_request(client, url, payload, timeout)

        async with anyio.create_task_group() as tg:
            for i in range(len(requests)):
                tg.start_soon(send, i)
        duration = time.perf_counter() - t0
    return [t for t in timings if t is not None], duration


def summarize(timings: Sequence[RequestTiming], requests: Sequence[BenchRequest], duration: float) -> dict:
    ok = [t for t in timings if t.ok]
    out_tokens = sum(t.output_tokens for t in ok)
    prompt_tokens = sum(t.prompt_tokens or len(r.prompt_token_ids) for t, r in zip(timings, requests) if t.ok)
    fig: dict = {
        "num_requests": len(requests),
        "completed": len(ok),
        "failed": len(timings) - len(ok),
        "duration_s": duration,
        "output_tokens": out_tokens,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "output_tokens_per_s": out_tokens / duration if duration else 0.0,
        "total_tokens_per_s": (prompt_tokens + out_tokens) / duration if duration else 0.0,
    }
    fig.update(percentiles([t.ttft_s for t in ok], "ttft"))
    tpot = [(t.latency_s - t.ttft_s) / (t.output_tokens - 1) for t in ok if t.output_tokens > 1]
    fig.update(percentiles(tpot, "tpot"))
    fig.update(percentiles([x for t in ok for x in t.itl_s], "itl"))
    fig.update(percentiles([t.latency_s for t in ok], "e2e"))
    errors = [t.error for t in timings if not t.ok and t.error]
    if errors:
        fig["first_error"] = errors[0]
    return fig


def _server_model(base_url: str) -> str:
    import httpx

    r = httpx.get(base_url.rstrip("/") + "/v1/models", timeout=10.0)
    r.raise_for_status()
    return r.json()["data"][0]["id"]


def main(ns: argparse.Namespace) -> int:
    import anyio
    from sluice.core import envs
    from sluice.core.frontend.tokenizer import load_tokenizer
    from sluice.core.models.loader import resolve_model
    from sluice.core.models.registry import DEFAULT_MODEL

    model = ns.model or _server_model(ns.base_url)
    if ns.requests_file:
        requests, dataset = load_bench_requests(ns, tokenizer=None, vocab_size=0)
        prompts: list[str | list[int]] = [r.prompt_text or r.prompt_token_ids for r in requests]
    else:
        tokenizer = load_tokenizer(resolve_model(ns.tokenizer or DEFAULT_MODEL, envs.SLUICE_CACHE_DIR).tokenizer_dir)
        requests, dataset = load_bench_requests(ns, tokenizer, len(tokenizer))
        prompts = [r.prompt_text or tokenizer.decode(r.prompt_token_ids) for r in requests]
    print(
        f"serve: {len(requests)} requests at {ns.request_rate} req/s to {ns.base_url} (model {model}); "
        f"mean prompt {dataset['mean_prompt_len']:.1f}, mean output {dataset['mean_output_len']:.1f} tokens"
    )
    timings, duration = anyio.run(
        run_benchmark, ns.base_url, model, requests, prompts, ns.request_rate, ns.seed, ns.max_concurrency, ns.timeout
    )
    figures = summarize(timings, requests, duration)
    figures["request_rate"] = ns.request_rate
    figures["base_url"] = ns.base_url
    print_figures("serve", figures)
    m, v = machine_info(), versions()
    print(f"client machine: {m['cpu']}; torch {v['torch']}")
    if ns.out:
        write_result(ns.out, command_line(), model, dataset, figures)
        print(f"wrote {ns.out}")
    return 0 if figures["completed"] else 1
