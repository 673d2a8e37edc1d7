"""`sluice bench disagg`: a prefill/decode pair against two independent engines, on the same devices, the same
requests and the same Poisson arrivals.

* **pair**: `DisaggEngine`, prefill on ``--prefill-device``, decode on ``--decode-device``;
* **split**: one `AsyncEngine` per device, requests alternating between them (split evenly).

The workload is ShareGPT (vLLM's sampling rule) with a share of long prompts mixed in (``--long-fraction`` of
the requests get ``--long-len`` random tokens): on one engine such a prefill fills whole steps and stalls the
decodes batched with it, which is what disaggregation removes. Per configuration: TTFT, ITL (gaps between a
request's streamed outputs), TPOT and end-to-end percentiles, output throughput; the ratios pair / split.
Both configurations run in this process one after the other, each engine freed before the next loads.

The GPU run the issue asks for (two H200s, ``dummy:llama3-8b``, 10% of 8k-token prompts)::

    sluice bench disagg --model dummy:llama3-8b --prefill-device cuda:0 --decode-device cuda:1 \\
        --num-prompts 600 --request-rate 6 --long-fraction 0.1 --long-len 7936 --long-output-len 128 \\
        --max-model-len 8192 --out docs/benchmarks/disagg_h200x2.json

(``scripts/disagg_gpu_bench.sh`` runs it at a few rates.)
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from sluice.app.bench.common import add_dataset_args, engine_args_for, percentiles, print_figures
from sluice.app.bench.datasets import BenchRequest, sample_random, sample_sharegpt, summarize
from sluice.app.bench.results import command_line, write_result
from sluice.app.bench.serve import arrival_times


@dataclass(slots=True)
class Timing:
    ok: bool = False
    error: str | None = None
    output_tokens: int = 0
    ttft_s: float = 0.0
    latency_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)


def register(sub) -> None:
    from sluice.app.commands.cli import add_engine_args

    p = sub.add_parser("disagg", help="prefill/decode pair vs two independent engines, same devices and arrivals")
    add_dataset_args(p, default_num_prompts=600)
    p.add_argument("--prefill-device", default="cuda:0", help="the pair's prefill device; the split's first engine")
    p.add_argument("--decode-device", default="cuda:1", help="the pair's decode device; the split's second engine")
    p.add_argument("--request-rate", type=float, default=6.0, help="Poisson arrivals per second (inf: all at once)")
    p.add_argument("--long-fraction", type=float, default=0.1, help="share of requests given a long random prompt")
    p.add_argument("--long-len", type=int, default=7936, help="tokens of a long prompt")
    p.add_argument("--long-output-len", type=int, default=128, help="output tokens of a long-prompt request")
    p.add_argument("--arrival-seed", type=int, default=0, help="seed of the arrival times and the long prompts")
    p.add_argument("--only", choices=("pair", "split"), default=None, help="run one configuration")
    p.add_argument("--out", default=None, help="write the result (JSON) here")
    add_engine_args(p)
    p.set_defaults(func=main)


def workload(ns: argparse.Namespace, tokenizer, vocab_size: int) -> list[BenchRequest]:
    """ShareGPT (or random) requests, a ``long_fraction`` of them replaced by long random prompts."""
    if ns.dataset == "sharegpt" and not ns.requests_file:
        reqs = sample_sharegpt(tokenizer, ns.num_prompts, seed=ns.dataset_seed, fixed_output_len=ns.output_len)
    else:
        from sluice.app.bench.common import load_bench_requests

        reqs, _ = load_bench_requests(ns, tokenizer, vocab_size)
    rng = random.Random(ns.arrival_seed)
    num_long = round(ns.long_fraction * len(reqs))
    long_at = set(rng.sample(range(len(reqs)), num_long))
    longs = iter(sample_random(num_long, ns.long_len, ns.long_output_len, vocab_size, seed=ns.arrival_seed + 1))
    return [next(longs) if i in long_at else r for i, r in enumerate(reqs)]


async def run(engines: Sequence, requests: Sequence[BenchRequest], offsets: Sequence[float]) -> tuple[list, float]:
    """Send request ``i`` at ``offsets[i]`` to ``engines[i % len(engines)]``; time its streamed outputs."""
    import anyio
    from sluice.core import SamplingParams

    timings = [Timing() for _ in requests]
    t0 = time.perf_counter()

    async def one(i: int) -> None:
        await anyio.sleep(max(0.0, offsets[i] - (time.perf_counter() - t0)))
        r, t = requests[i], timings[i]
        params = SamplingParams(max_tokens=r.output_len, temperature=0.0, ignore_eos=True)
        start = last = time.perf_counter()
        try:
            async for out in engines[i % len(engines)].generate(r.prompt_token_ids, params, request_id=f"b{i}"):
                now = time.perf_counter()
                if out.delta_token_ids:
                    if t.output_tokens == 0:
                        t.ttft_s = now - start
                    else:
                        t.itl_s.append(now - last)
                    t.output_tokens += len(out.delta_token_ids)
                    last = now
            t.latency_s = time.perf_counter() - start
            t.ok = t.output_tokens == r.output_len
        except Exception as e:  # noqa: BLE001 - counted as failed, reported in the figures
            t.error = f"{type(e).__name__}: {e}"

    async with anyio.create_task_group() as tg:
        for i in range(len(requests)):
            tg.start_soon(one, i)
    return timings, time.perf_counter() - t0


def figures_of(timings: Sequence[Timing], duration: float) -> dict:
    ok = [t for t in timings if t.ok]
    out_tokens = sum(t.output_tokens for t in ok)
    fig: dict = {
        "completed": len(ok),
        "failed": len(timings) - len(ok),
        "duration_s": duration,
        "output_tokens_per_s": out_tokens / duration if duration else 0.0,
    }
    fig.update(percentiles([t.ttft_s for t in ok], "ttft"))
    fig.update(percentiles([x for t in ok for x in t.itl_s], "itl"))
    tpot = [(t.latency_s - t.ttft_s) / (t.output_tokens - 1) for t in ok if t.output_tokens > 1]
    fig.update(percentiles(tpot, "tpot"))
    fig.update(percentiles([t.latency_s for t in ok], "e2e"))
    errors = [t.error for t in timings if t.error]
    if errors:
        fig["first_error"] = errors[0]
    return fig


async def bench_pair(args, ns, requests, offsets) -> dict:
    from sluice.core.disagg.engine import DisaggEngine

    async with DisaggEngine(args, ns.prefill_device, ns.decode_device) as pair:
        timings, duration = await run([pair], requests, offsets)
        fig = figures_of(timings, duration)
        ts, ps = pair.transfer_stats, pair.pair_stats
        fig["kv_transfer"] = {
            "transfers": ts.num_transfers,
            "failed": ts.num_failed,
            "blocks": ts.num_blocks,
            "gib": ts.num_bytes / 2**30,
            "recomputed": ps.num_recomputed,
            "direct": ps.num_direct,
        }
    return fig


async def bench_split(args, ns, requests, offsets) -> dict:
    import contextlib

    from sluice.core import AsyncEngine

    async with contextlib.AsyncExitStack() as stack:
        engines = []
        for device in (ns.prefill_device, ns.decode_device):
            engines.append(await stack.enter_async_context(AsyncEngine(replace(args, device=device))))
        timings, duration = await run(engines, requests, offsets)
    return figures_of(timings, duration)


def main(ns: argparse.Namespace) -> int:
    import anyio
    from sluice.app.bench.common import release_device_memory
    from sluice.core import envs
    from sluice.core.frontend.tokenizer import load_tokenizer
    from sluice.core.models.loader import resolve_model

    source = resolve_model(ns.model, envs.SLUICE_CACHE_DIR)
    tokenizer = load_tokenizer(source.tokenizer_dir)
    requests = workload(ns, tokenizer, source.config.vocab_size)
    longest = max(len(r.prompt_token_ids) + r.output_len for r in requests)
    args = engine_args_for(ns, len(requests), longest)
    offsets = arrival_times(len(requests), ns.request_rate, ns.arrival_seed)
    dataset = {
        "name": ns.dataset,
        "long_fraction": ns.long_fraction,
        "long_len": ns.long_len,
        "request_rate": ns.request_rate,
        **summarize(requests),
    }
    figures: dict = {"prefill_device": ns.prefill_device, "decode_device": ns.decode_device}
    for name, fn in (("pair", bench_pair), ("split", bench_split)):
        if ns.only not in (None, name):
            continue
        fig = anyio.run(fn, args, ns, requests, offsets)
        release_device_memory()
        print_figures(f"disagg: {name}", fig)
        figures[name] = fig
    if "pair" in figures and "split" in figures:
        p, s = figures["pair"], figures["split"]

        def ratio(key: str) -> float | None:
            return s[key] / p[key] if p.get(key) else None

        figures["itl_p99_gain"] = ratio("itl_p99_ms")  # split / pair: > 1 = the pair is better
        figures["ttft_median_ratio"] = p["ttft_median_ms"] / s["ttft_median_ms"] if s.get("ttft_median_ms") else None
        figures["output_throughput_ratio"] = (
            p["output_tokens_per_s"] / s["output_tokens_per_s"] if s.get("output_tokens_per_s") else None
        )
        print_figures(
            "disagg: pair vs split",
            {k: figures[k] for k in ("itl_p99_gain", "ttft_median_ratio", "output_throughput_ratio")},
        )
    if ns.out:
        write_result(ns.out, command_line(), ns.model, dataset, figures)
        print(f"wrote {ns.out}")
    return 0
