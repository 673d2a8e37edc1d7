"""`sluice bench prefix`: a prefix-cache workload through the real engine (`AsyncEngine`), with the cache
on and off in one run: hit rate, TTFT (mean, p50, p99) and throughput of each, side by side.

Every request is greedy with ``ignore_eos`` and its forced output length, so both sides compute exactly
the same tokens. On and off alternate (on, off, off, on, ...) over ``--repeats`` rounds, each round on
a fresh engine, so that drift on a shared machine falls on both sides alike; each engine first runs one
short warm-up request that shares nothing with the workload, and its counters are subtracted.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import anyio
from sluice.app.bench.common import release_device_memory
from sluice.app.bench.workloads import FIRST_TOKEN_ID, Workload, WorkloadRequest

WARMUP_PROMPT = [FIRST_TOKEN_ID - 1] * 48  # no workload prompt starts with this id


@dataclass(slots=True)
class RunFigures:
    prefix_caching: bool
    round: int
    num_requests: int
    num_failed: int
    duration_s: float
    prompt_tokens: int
    output_tokens: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    hit_rate: float
    ttft_mean_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    requests_per_s: float
    output_tokens_per_s: float
    total_tokens_per_s: float  # (prompt + output) / duration
    num_preemptions: int
    num_steps: int


def percentile(xs: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation between closest ranks."""
    if not xs:
        return math.nan
    s = sorted(xs)
    k = (len(s) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


async def run_workload(
    engine, workload: Workload, max_concurrency: int | None = None, on_done: Callable[[], object] = lambda: None
) -> dict:
    """Replay ``workload`` on a running engine: each request starts at its arrival time, after the request
    it depends on (a previous turn) has finished, and when fewer than ``max_concurrency`` are in flight
    (first come, first served); ``on_done`` is called as each one ends (a progress bar). Returns per-request
    TTFTs and the totals."""
    from sluice.core.sampling_params import SamplingParams

    reqs = workload.requests
    done = [anyio.Event() for _ in reqs]
    ttft: list[float | None] = [None] * len(reqs)
    out_tokens = [0] * len(reqs)
    failed: list[str] = []
    limiter = anyio.Semaphore(max_concurrency) if max_concurrency else None
    t0 = time.perf_counter()

    async def one(i: int, r: WorkloadRequest) -> None:
        try:
            if r.after is not None:
                await done[r.after].wait()
            delay = r.arrival_time - (time.perf_counter() - t0)
            if delay > 0:
                await anyio.sleep(delay)
            params = SamplingParams(max_tokens=r.output_len, temperature=0.0, ignore_eos=True, cache_salt=r.cache_salt)
            if limiter is not None:
                await limiter.acquire()
            try:
                start = time.perf_counter()
                async for o in engine.generate(r.prompt_token_ids, params, request_id=f"bench-{i}"):
                    if ttft[i] is None and o.token_ids:
                        ttft[i] = time.perf_counter() - start
                    out_tokens[i] = len(o.token_ids)
            finally:
                if limiter is not None:
                    limiter.release()
        except Exception as e:  # one failed request is a figure, not the end of the run
            failed.append(f"{i}: {type(e).__name__}: {e}")
        finally:
            done[i].set()
            on_done()

    async with anyio.create_task_group() as tg:
        for i, r in enumerate(reqs):
            tg.start_soon(one, i, r)
    return {
        "duration_s": time.perf_counter() - t0,
        "ttft": [t for t in ttft if t is not None],
        "output_tokens": sum(out_tokens),
        "failed": failed,
    }


async def run_engine(
    args,
    workload: Workload,
    round_: int,
    max_concurrency: int | None = None,
    warmup: bool = True,
    on_done: Callable[[], object] = lambda: None,
) -> RunFigures:
    """One fresh engine with ``args``: warm up, replay the workload, and measure."""
    from sluice.core import AsyncEngine
    from sluice.core.sampling_params import SamplingParams

    async with AsyncEngine(args) as engine:
        if warmup:
            async for _ in engine.generate(WARMUP_PROMPT, SamplingParams(max_tokens=4, temperature=0.0)):
                pass
        before = engine.stats()
        res = await run_workload(engine, workload, max_concurrency, on_done)
        after = engine.stats()
    q = after.prefix_cache_queries - before.prefix_cache_queries
    h = after.prefix_cache_hits - before.prefix_cache_hits
    ttft, dur = res["ttft"], res["duration_s"]
    prompt_tokens = sum(len(r.prompt_token_ids) for r in workload.requests)
    return RunFigures(
        prefix_caching=args.enable_prefix_caching,
        round=round_,
        num_requests=len(workload.requests),
        num_failed=len(res["failed"]),
        duration_s=dur,
        prompt_tokens=prompt_tokens,
        output_tokens=res["output_tokens"],
        prefix_cache_queries=q,
        prefix_cache_hits=h,
        hit_rate=h / q if q else 0.0,
        ttft_mean_s=statistics.fmean(ttft) if ttft else math.nan,
        ttft_p50_s=percentile(ttft, 50),
        ttft_p99_s=percentile(ttft, 99),
        requests_per_s=len(workload.requests) / dur,
        output_tokens_per_s=res["output_tokens"] / dur,
        total_tokens_per_s=(prompt_tokens + res["output_tokens"]) / dur,
        num_preemptions=after.num_preemptions - before.num_preemptions,
        num_steps=after.num_steps - before.num_steps,
    )


def summarize_runs(runs: Sequence[RunFigures]) -> dict:
    """Medians per side, the on/off throughput ratio of the medians, and of each round (the noise)."""
    out: dict = {}
    for side, flag in (("cache_on", True), ("cache_off", False)):
        rs = [r for r in runs if r.prefix_caching is flag]
        if not rs:
            continue
        fields = ("hit_rate", "ttft_mean_s", "ttft_p50_s", "ttft_p99_s", "total_tokens_per_s")
        fields += ("output_tokens_per_s", "requests_per_s", "duration_s")
        out[side] = {f: statistics.median(getattr(r, f) for r in rs) for f in fields}
        out[side]["rounds"] = len(rs)
    if "cache_on" in out and "cache_off" in out:
        on = {r.round: r for r in runs if r.prefix_caching}
        off = {r.round: r for r in runs if not r.prefix_caching}
        ratios = [on[k].total_tokens_per_s / off[k].total_tokens_per_s for k in sorted(on) if k in off]
        out["throughput_ratio_on_off"] = out["cache_on"]["total_tokens_per_s"] / out["cache_off"]["total_tokens_per_s"]
        out["throughput_ratio_per_round"] = ratios
        out["throughput_ratio_spread"] = [min(ratios), max(ratios)] if ratios else []
    return out


def _log(line: str) -> None:
    print(line, flush=True)  # each phase's figures as it ends, also when stdout is a pipe or a file


async def bench_prefix(
    engine_args,
    workload: Workload,
    repeats: int = 1,
    max_concurrency: int | None = None,
    log=_log,
    progress: bool = False,
) -> tuple[list[RunFigures], dict]:
    """Alternate cache on and off for ``repeats`` rounds (on-off, then off-on, ...); ``progress`` draws a bar of
    the requests finished in each phase (on stderr)."""
    from tqdm import tqdm

    runs: list[RunFigures] = []
    for k in range(repeats):
        order = (True, False) if k % 2 == 0 else (False, True)
        for flag in order:
            args = dataclasses.replace(
                engine_args,
                enable_prefix_caching=flag,
                max_waiting_requests=max(engine_args.max_waiting_requests, len(workload.requests)),
            )
            desc = f"round {k} cache {'on' if flag else 'off'}"
            with tqdm(
                total=len(workload.requests), desc=desc, unit="req", file=sys.stderr, disable=not progress
            ) as bar:
                fig = await run_engine(args, workload, k, max_concurrency, on_done=bar.update)
            release_device_memory()  # the closed engine lingers in reference cycles: free it before the next loads
            log(
                f"round {k} cache {'on ' if flag else 'off'}: {fig.duration_s:.1f}s, hit rate "
                f"{100 * fig.hit_rate:.1f}%, {fig.total_tokens_per_s:.0f} tok/s, TTFT p50 {fig.ttft_p50_s:.2f}s"
                + (f", {fig.num_failed} FAILED" if fig.num_failed else "")
            )
            runs.append(fig)
    return runs, summarize_runs(runs)


# ------------------------------------------------------------------------------------------ command line


def cmd_bench_prefix(ns: argparse.Namespace) -> int:
    from sluice.app.bench.results import command_line, machine_info, print_table, versions, write_result
    from sluice.app.bench.workloads import build_workload, shared_prefix_optimum
    from sluice.app.commands.cli import engine_args_from
    from sluice.core import envs
    from sluice.core.frontend.tokenizer import load_tokenizer
    from sluice.core.models.loader import resolve_model

    args = engine_args_from(ns)
    source = resolve_model(args.model, envs.SLUICE_CACHE_DIR)
    workload = build_workload(ns, lambda: load_tokenizer(source.tokenizer_dir), source.config.vocab_size)
    if ns.ignore_arrival_times:
        workload.requests = [dataclasses.replace(r, arrival_time=0.0) for r in workload.requests]
        workload.shape["ignore_arrival_times"] = True
    summary = workload.summary()
    m, v = machine_info(), versions()
    print(f"machine: {m['cpu']} ({m['cores']} cores), {m['gpu'] or 'no GPU'}; torch {v['torch']}; {args.model}")
    print(f"workload: {summary}")
    runs, figures = anyio.run(bench_prefix, args, workload, ns.repeats, ns.max_concurrency, _log, True)
    cols = ["cache", "hit_rate", "ttft_mean_s", "ttft_p50_s", "ttft_p99_s", "total_tokens_per_s", "requests_per_s"]
    rows = []
    for side in ("cache_on", "cache_off"):
        if side in figures:
            f = figures[side]
            rows.append(
                {
                    "cache": side.replace("cache_", ""),
                    **{c: round(f[c], 3) for c in cols[2:]},
                    "hit_rate": f"{100 * f['hit_rate']:.2f}%",
                }
            )
    print_table(rows, cols)
    if "throughput_ratio_on_off" in figures:
        lo, hi = figures["throughput_ratio_spread"]
        print(
            f"throughput cache on / off: {figures['throughput_ratio_on_off']:.2f}x "
            f"(per round {lo:.2f}x .. {hi:.2f}x over {len(figures['throughput_ratio_per_round'])} rounds)"
        )
    if workload.name == "shared-prefix":
        s = workload.shape
        h, q = shared_prefix_optimum(
            s["groups"], s["prompts_per_group"], s["system_len"], s["question_len"], args.block_size
        )
        figures["optimal_hit_rate"] = h / q
        print(f"analytic optimum hit rate: {100 * h / q:.2f}%")
    out = ns.out or f"sluice-bench-prefix-{workload.name}.json"
    engine = {k: v for k, v in dataclasses.asdict(args).items() if k != "enable_prefix_caching"}
    write_result(
        out,
        command_line(),
        args.model,
        summary,
        {
            "engine_args": engine,
            "max_concurrency": ns.max_concurrency,
            "summary": figures,
            "runs": [dataclasses.asdict(r) for r in runs],
        },
    )
    print(f"wrote {out}")
    return 0


def register(subparsers) -> None:
    from sluice.app.bench.workloads import add_workload_args
    from sluice.app.commands.cli import add_engine_args

    p = subparsers.add_parser(
        "prefix",
        help="a prefix-cache workload through the engine, cache on vs off",
        description=__doc__.split("\n\n")[0],
    )
    add_workload_args(p)
    p.add_argument("--repeats", type=int, default=1, help="rounds of (cache on, cache off), alternating order")
    p.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at once (default: all)")
    p.add_argument(
        "--ignore-arrival-times",
        action="store_true",
        help="replay as fast as possible: every request arrives at once (a trace's recorded arrival times, or "
        "a workload's, are dropped; a later turn still waits for the one it follows, and --max-concurrency holds)",
    )
    p.add_argument("--out", default=None, help="result JSON (default sluice-bench-prefix-WORKLOAD.json)")
    add_engine_args(p)
    p.set_defaults(func=cmd_bench_prefix)
