"""How many steps of an offline run decode how many requests: a simulation of the scheduler's admission on a
saved requests file (`sluice bench throughput ... --save-requests F`), for reading a run's time as step count x
step time (docs/benchmarks.md).

    python scripts/step_mix.py .stage/sharegpt1000.json --num-prompts 200 --max-num-seqs 256

First come, first served: each step decodes every running request whose prompt is done (one token each), then
spends the rest of ``--max-num-batched-tokens`` on prompt chunks (running requests first, then new ones while
fewer than ``--max-num-seqs`` run); a request leaves after its ``output_len`` tokens. No preemption (the KV pool
of the runs it models never filled). Prints the step count and the steps by decoding requests (power-of-two
buckets), those with prompt tokens apart: how many fit the mixed-step graphs' tokens, how many have 513-2,048.
"""

from __future__ import annotations

import argparse
import collections
import json


def simulate(requests: list[dict], max_num_seqs: int, max_tokens: int) -> list[tuple[int, int]]:
    """``(decoding requests, prompt tokens)`` per step."""
    waiting = [[len(r["prompt_token_ids"]), 0, r["output_len"]] for r in requests]  # prompt, computed, left
    running: list[list[int]] = []
    steps = []
    while waiting or running:
        decodes = sum(1 for q in running if q[1] >= q[0])
        budget, prefill = max_tokens - decodes, 0
        for q in running:
            if q[1] < q[0] and budget > 0:
                c = min(budget, q[0] - q[1])
                q[1] += c
                budget -= c
                prefill += c
        while waiting and len(running) < max_num_seqs and budget > 0:
            q = waiting.pop(0)
            c = min(budget, q[0])
            q[1] += c
            budget -= c
            prefill += c
            running.append(q)
        steps.append((decodes, prefill))
        for q in running:
            if q[1] >= q[0]:
                q[2] -= 1  # its prompt is done: this step sampled a token
        running = [q for q in running if q[2] > 0]
    return steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("requests_file")
    ap.add_argument("--num-prompts", type=int, default=None)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--max-graph-tokens", type=int, default=512)
    ns = ap.parse_args()
    requests = json.load(open(ns.requests_file))["requests"][: ns.num_prompts]
    steps = simulate(requests, ns.max_num_seqs, ns.max_num_batched_tokens)
    decodes = collections.Counter(1 << max(0, (d - 1).bit_length()) for d, prefill in steps if not prefill)
    prompt_steps = [d + prefill for d, prefill in steps if prefill]
    print(f"{len(requests)} requests, {len(steps)} steps")
    for bucket in sorted(decodes):
        print(f"  decode <= {bucket:<21d} {decodes[bucket]:6d}")
    print(f"  with prompt tokens               {len(prompt_steps):6d}")
    print(f"    of which <= max-graph-tokens   {sum(t <= ns.max_graph_tokens for t in prompt_steps):6d}")
    print(f"    of which 513-2048 tokens       {sum(512 < t <= 2048 for t in prompt_steps):6d}")


if __name__ == "__main__":
    main()
