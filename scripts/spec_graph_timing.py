"""GPU time of one CUDA-graph replay: the plain decode step and the uniform speculative step, batch 1.

    python scripts/spec_graph_timing.py --model smollm2-135m-instruct [--out FILE]

Set beside `python -m sluice.app.bench.spec` (wall time per engine step), this splits a step into GPU work and
everything else (scheduler, actors, host-side input preparation). One request is served first so the
graphs' buffers hold a real context; the replays then recompute that step over and over. Three figures
per step: back-to-back replays (GPU time), one replay waited for (GPU time plus the exposed launch), and
the model runner's whole `execute` of a one-request step (input preparation, replay, read-back).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def replay_ms(graphs, bs: int, iters: int) -> float:
    for _ in range(10):
        graphs.replay(bs)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        graphs.replay(bs)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def replay_latency_ms(graphs, bs: int, iters: int) -> float:
    total = 0.0
    for _ in range(iters):
        t = time.perf_counter()
        graphs.replay(bs)
        torch.cuda.synchronize()
        total += time.perf_counter() - t
    return 1e3 * total / iters


def execute_ms(runner, so_for, iters: int) -> float:
    for i in range(10):
        runner.execute(so_for(i))
    t = time.perf_counter()
    for i in range(iters):
        runner.execute(so_for(i))
    return 1e3 * (time.perf_counter() - t) / iters


def main() -> None:
    from sluice.app.bench.results import machine_info, versions
    from sluice.core import LLM, SamplingParams
    from sluice.core.step import NewRequest, SchedulerOutput

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--head", default="default")
    ap.add_argument("--num-speculative-tokens", type=int, default=4)
    ap.add_argument("--context", type=int, default=512, help="prompt tokens before the timed steps")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    llm = LLM(args.model, speculative_model=args.head, num_speculative_tokens=args.num_speculative_tokens,
              max_model_len=2048)  # fmt: skip
    try:
        prompt = [(7 * i) % 1000 + 10 for i in range(args.context)]
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)
        runner = llm.engine.local_core.executor.runner
        k = args.num_speculative_tokens
        res = {
            "context": args.context,
            "plain_decode_ms": round(replay_ms(runner.graphs, 1, args.iters), 4),
            "speculative_step_ms": round(replay_ms(runner.drafter.graphs, 1, args.iters), 4),
            "plain_decode_latency_ms": round(replay_latency_ms(runner.graphs, 1, args.iters), 4),
            "speculative_step_latency_ms": round(replay_latency_ms(runner.drafter.graphs, 1, args.iters), 4),
            "k": k,
        }
        # One request's step, run straight on the (idle) engine's runner: its KV goes to blocks nobody holds.
        table = list(range(-(-(args.context + 2 * k + 2) // runner.block_size)))
        greedy = SamplingParams(temperature=0)

        # "t" arrives with the context (its last token then decodes from the host), held by the runner from then on
        admit = NewRequest("t", prompt[: args.context], args.context, table, greedy)
        runner.execute(SchedulerOutput(10**6, ["t"], [1], [args.context - 1], [True], new_requests=[admit]))

        def step(i: int, spec: bool) -> SchedulerOutput:
            so = SchedulerOutput(10**6 + 1 + i, ["t"], [k + 1 if spec else 1], [args.context], [True])
            if spec:
                so.num_draft_tokens, so.drafting, so.uniform = {"t": k}, {"t"}, True
            return so

        res["plain_execute_ms"] = round(execute_ms(runner, lambda i: step(i, False), args.iters), 4)
        res["speculative_execute_ms"] = round(execute_ms(runner, lambda i: step(i, True), args.iters), 4)
        res["speculative_graph_replays"] = runner.drafter.graphs.num_replays
    finally:
        llm.close()
    res.update(model=args.model, machine=machine_info(), versions=versions())
    print(json.dumps(res, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
