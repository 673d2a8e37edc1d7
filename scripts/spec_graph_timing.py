"""GPU time of one CUDA-graph replay: the plain decode step and the uniform speculative step, batch 1.

    python scripts/spec_graph_timing.py --model smollm2-135m-instruct [--out FILE]

Set beside `python -m app.bench.spec` (wall time per engine step), this splits a step into GPU work and
everything else (scheduler, actors, host-side input preparation). One request is served first so the
graphs' buffers hold a real context; the replays then recompute that step over and over.
"""

from __future__ import annotations

import argparse
import json
import sys
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


def main() -> None:
    from app.bench.results import machine_info, versions
    from core import LLM, SamplingParams

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
        runner = llm.engine._executor.runner
        res = {
            "context": args.context,
            "plain_decode_ms": round(replay_ms(runner.graphs, 1, args.iters), 4),
            "speculative_step_ms": round(replay_ms(runner.spec.graphs, 1, args.iters), 4),
            "k": args.num_speculative_tokens,
        }
    finally:
        llm.close()
    res.update(model=args.model, machine=machine_info(), versions=versions())
    print(json.dumps(res, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
