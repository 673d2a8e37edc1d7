"""What every `sluice bench ...` command shares: dataset flags, request sampling, result printing."""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sluice.app.bench.datasets import (
    BenchRequest,
    load_requests,
    sample_random,
    sample_sharegpt,
    save_requests,
    summarize,
)
from sluice.core import envs


def add_dataset_args(p: argparse.ArgumentParser, default_num_prompts: int = 1000) -> None:
    p.add_argument("--dataset", choices=("sharegpt", "random"), default="sharegpt", help="where the prompts come from")
    p.add_argument("--num-prompts", type=int, default=default_num_prompts, help="requests to send")
    p.add_argument("--input-len", type=int, default=None, help="random: prompt tokens per request")
    p.add_argument("--output-len", type=int, default=None, help="random: forced output tokens (sharegpt: override)")
    p.add_argument("--dataset-seed", type=int, default=0, help="seed of the prompts' sampling from the dataset")
    p.add_argument(
        "--requests-file", default=None, help="replay requests saved with --save-requests (no dataset needed)"
    )
    p.add_argument("--save-requests", default=None, help="also write the sampled requests to this JSON file")


def load_bench_requests(ns: argparse.Namespace, tokenizer, vocab_size: int) -> tuple[list[BenchRequest], dict]:
    """The requests of a run and a description of them for the result file."""
    if ns.requests_file:
        reqs, meta = load_requests(ns.requests_file)
        if ns.num_prompts and ns.num_prompts < len(reqs):
            reqs = reqs[: ns.num_prompts]
        if ns.num_prompts and ns.num_prompts > len(reqs):
            raise ValueError(f"num_prompts: {ns.requests_file} holds only {len(reqs)} requests")
        desc = {**meta, "requests_file": ns.requests_file}
    elif ns.dataset == "sharegpt":
        reqs = sample_sharegpt(tokenizer, ns.num_prompts, seed=ns.dataset_seed, fixed_output_len=ns.output_len)
        desc = {"name": "sharegpt", "seed": ns.dataset_seed, "fixed_output_len": ns.output_len}
    else:
        if ns.input_len is None or ns.output_len is None:
            raise ValueError("--dataset random needs --input-len and --output-len")
        reqs = sample_random(ns.num_prompts, ns.input_len, ns.output_len, vocab_size, seed=ns.dataset_seed)
        desc = {"name": "random", "seed": ns.dataset_seed, "input_len": ns.input_len, "output_len": ns.output_len}
    if ns.save_requests:
        save_requests(ns.save_requests, reqs, desc)
    return reqs, {**desc, **summarize(reqs)}


def percentiles(values: Sequence[float], prefix: str, scale: float = 1000.0) -> dict[str, float]:
    """mean / median / p99 of ``values`` (seconds), in milliseconds by default, keyed ``{prefix}_mean_ms`` ..."""
    if not values:
        return {
            f"{prefix}_mean_ms": float("nan"),
            f"{prefix}_median_ms": float("nan"),
            f"{prefix}_p99_ms": float("nan"),
        }
    xs = sorted(values)
    p99 = xs[min(len(xs) - 1, max(0, int(round(0.99 * (len(xs) - 1)))))]
    return {
        f"{prefix}_mean_ms": statistics.fmean(xs) * scale,
        f"{prefix}_median_ms": statistics.median(xs) * scale,
        f"{prefix}_p99_ms": p99 * scale,
    }


def print_figures(title: str, figures: dict[str, Any]) -> None:
    """One figure per line, aligned, floats with 2 decimals."""
    print(f"== {title}")
    width = max(len(k) for k in figures) if figures else 0
    for k, v in figures.items():
        if isinstance(v, float):
            v = f"{v:,.2f}"
        elif isinstance(v, dict):
            if k.endswith("_ms_per_step"):  # the host profile: one line
                v = "  ".join(f"{name} {x:.2f}" for name, x in v.items())
            else:
                continue
        print(f"  {k.ljust(width)}  {v}")


# ------------------------------------------------------------------------------------------------ engine


@dataclass(slots=True)
class EngineRun:
    """One batch of requests through the engine: per request, in input order (seconds from the start)."""

    elapsed_s: float
    output_lens: list[int]
    first_token_s: list[float]
    finish_s: list[float]


# A burst's callers are spawned this many at a time, the event loop's turn between (``SLUICE_SUBMIT_CHUNK``; 0:
# all before any runs). Spawning a task costs the harness ~10 us of the loop's thread, so spawning a thousand
# before any runs made the engine's first step wait for the harness (docs/benchmarks.md).
SUBMIT_CHUNK = envs.SLUICE_SUBMIT_CHUNK


async def drive_engine(
    engine,
    requests: Sequence[BenchRequest],
    tag: str = "bench",
    final_only: bool = False,
    submit_chunk: int = SUBMIT_CHUNK,
    structured_outputs=None,
) -> EngineRun:
    """Submit every request at once (greedy, EOS ignored, forced output lengths) and wait for all. With
    ``final_only`` each request yields only its final output, so its first-token time is its finish time.

    "At once": one task per request, spawned ``submit_chunk`` at a time (0: all) with a turn of the event loop between
    chunks, so the callers spawned first reach the engine while the harness spawns the rest, as requests
    arriving over a network would; the clock starts before the first spawn. ``structured_outputs``: every request
    under that grammar (`StructuredOutputsParams`)."""
    import anyio
    import anyio.lowlevel
    from sluice.core import SamplingParams

    n = len(requests)
    lens = [0] * n
    first = [float("nan")] * n
    finish = [float("nan")] * n
    t0 = time.perf_counter()

    async def one(i: int) -> None:
        r = requests[i]
        params = SamplingParams(
            max_tokens=r.output_len, temperature=0.0, ignore_eos=True, structured_outputs=structured_outputs
        )
        async for out in engine.generate(r.prompt_token_ids, params, request_id=f"{tag}-{i}", final_only=final_only):
            now = time.perf_counter() - t0
            if out.delta_token_ids and first[i] != first[i]:
                first[i] = now
            if out.finished:
                lens[i] = len(out.token_ids)
                finish[i] = now

    async with anyio.create_task_group() as tg:
        for i in range(n):
            tg.start_soon(one, i)
            if submit_chunk and (i + 1) % submit_chunk == 0:
                await anyio.lowlevel.checkpoint()
    return EngineRun(time.perf_counter() - t0, lens, first, finish)


def engine_args_for(ns: argparse.Namespace, num_requests: int, longest: int):
    """EngineArgs from the command's engine flags, with room to queue every request at once and a
    context long enough for the longest one."""
    from dataclasses import replace

    from sluice.app.commands.cli import engine_args_from

    args = engine_args_from(ns)
    args = replace(args, max_waiting_requests=max(args.max_waiting_requests, num_requests))
    if args.max_model_len is not None and args.max_model_len < longest + 1:
        raise ValueError(f"max_model_len: {args.max_model_len} is shorter than the longest request ({longest})")
    return args


def release_device_memory() -> None:
    """Free a closed engine (or a peer's model) and give its cached GPU memory back, before the next one loads. A
    closed engine lingers in reference cycles until a full collection, so its model and KV pool stay allocated."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def graph_replays(engine) -> tuple[int, int] | None:
    """CUDA-graph replays so far of the engine's (one-process) model runner: decode steps, mixed steps. None
    when the engine core runs in a process of its own (``engine_core_process``): its counters live there."""
    core = engine.local_core
    if core is None:
        return None
    runner = core.executor.runner  # a tensor-parallel runner captures none
    graphs = (getattr(runner, "graphs", None), getattr(runner, "mixed_graphs", None))
    return tuple(g.num_replays if g is not None else 0 for g in graphs)


def graph_step_facts(before: tuple[int, int] | None, after: tuple[int, int] | None) -> dict:
    """``graph_steps`` and ``mixed_graph_steps`` between two `graph_replays`; none where the core is elsewhere."""
    if before is None or after is None:
        return {}
    return {"graph_steps": after[0] - before[0], "mixed_graph_steps": after[1] - before[1]}
