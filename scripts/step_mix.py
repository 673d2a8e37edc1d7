"""How many steps of an offline run decode how many requests: a simulation of the scheduler's admission on a
saved requests file (`sluice bench throughput ... --save-requests F`), for reading a run's time as step count x
step time (docs/benchmarks.md).

    python scripts/step_mix.py .stage/sharegpt1000.json --num-prompts 200 --max-num-seqs 256

First come, first served: each step decodes every running request whose prompt is done (one token each), then
spends the rest of ``--max-num-batched-tokens`` on prompt chunks (running requests first, then new ones while
fewer than ``--max-num-seqs`` run); a request leaves after its ``output_len`` tokens. No preemption (the KV pool
of the runs it models never filled). Prints the step count and the steps by decoding requests (power-of-two
buckets), those with prompt tokens apart: how many fit the mixed-step graphs' tokens, how many have up to 2,048.

    SLUICE_STEP_TRACE=/tmp/trace.json sluice bench throughput ...; python scripts/step_mix.py --trace /tmp/trace.json

reads what a run did instead (its executor's trace): the same groups with their device time, and the device's
idle time before their steps; ``--list N`` prints its first N steps, each with its host times.
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


def report(
    steps: list[tuple[int, int]], seconds: list[float] | None, idle: list[float] | None, max_graph_tokens: int
) -> None:
    """Steps by decoding requests (power-of-two buckets), those with prompt tokens apart; with ``seconds`` and
    ``idle`` (a trace), each group's device time and the device's idle time before its steps."""
    secs, idles = seconds or [0.0] * len(steps), idle or [0.0] * len(steps)
    groups: dict[str, list[tuple[float, float]]] = collections.defaultdict(list)
    for (d, prefill), s, i in zip(steps, secs, idles):
        if not prefill:
            groups[f"decode <= {1 << max(0, (d - 1).bit_length())}"].append((s, i))
        elif d + prefill <= max_graph_tokens:
            groups["prompt, <= max-graph-tokens"].append((s, i))
        elif d + prefill <= 2048:
            groups[f"prompt, {max_graph_tokens + 1}-2048 tokens"].append((s, i))
        else:
            groups["prompt, > 2048 tokens"].append((s, i))
    decodes = sorted((g for g in groups if g.startswith("decode")), key=lambda g: int(g.split()[-1]))
    head = f"{len(steps)} steps"
    if seconds:
        head += f", {sum(secs):.3f} s of device time, {sum(idles):.3f} s idle between steps"
    print(head)
    for g in [*decodes, *(g for g in groups if g.startswith("prompt"))]:
        times = [s for s, _ in groups[g]]
        line = f"  {g:<30s} {len(times):6d}"
        if seconds:
            line += f"  {sum(times):8.3f} s  {1e3 * sum(times) / len(times):7.2f} ms/step"
            line += f"  idle {1e3 * sum(i for _, i in groups[g]):7.1f} ms"
        print(line)


def list_steps(trace: list[list]) -> None:
    """A trace's steps one per line; traces with host times (from the first launch, the launch's own time, and
    within it until the inputs were uploaded and until the forward and sampling were enqueued) and the caching
    allocator's bytes also show those: a device idle before a step whose launch began in time, with a long
    launch, was waiting on that launch."""
    print(
        "  step  decodes  other tokens  eager  device ms  idle ms  launch at s  launch ms  allocator GiB"
        "  uploaded ms  enqueued ms"
    )
    for i, t in enumerate(trace):
        line = f"  {i:4d}  {t[0]:7d}  {t[1]:12d}  {'yes' if t[2] else 'no':>5s}  {1e3 * t[3]:9.2f}  {1e3 * t[4]:7.2f}"
        if len(t) > 7:
            line += f"  {t[5]:11.4f}  {1e3 * t[6]:9.2f}  {t[7] / 2**30:13.2f}"
        if len(t) > 9:
            line += f"  {1e3 * t[8]:11.2f}  {1e3 * t[9]:11.2f}"
        print(line)


def long_launches(trace: list[list]) -> None:
    """For traces with host times: the launches that lasted about as long as their step's device work or longer
    (the host enqueued the step only as fast as the device ran it: it waited for the device, e.g. to load a kernel
    on its first use), and the device's idle time before the step after each."""
    if not trace or len(trace[0]) <= 6:
        return
    long = [i for i, t in enumerate(trace) if t[6] >= 0.9 * t[3] and t[6] > 0.02]
    idle = sum(trace[i + 1][4] for i in long if i + 1 < len(trace))
    shown = ", ".join(f"{i} ({1e3 * trace[i][6]:.0f} ms)" for i in long[:12]) + (" ..." if len(long) > 12 else "")
    print(
        f"  launches as long as their step's device time: {len(long)}{': steps ' + shown if long else ''}; "
        f"idle before the steps after them {1e3 * idle:.1f} ms"
    )


def step_floor(trace: list[list]) -> None:
    """The run's steps at the device time of a one-row decode step (the median of its own): what the step count
    alone costs, the weights read once per step and every kernel's launch, whatever the step's rows. The rest of
    the device time is what its rows add (prompt tokens, more decodes, their attention). A run whose step count is
    set by its longest request (offline ShareGPT: one request decodes to the end alone) gains from a faster
    one-row step in proportion to this share."""
    ones = sorted(t[3] for t in trace if t[0] == 1 and not t[1])
    if not ones:
        return
    floor = ones[len(ones) // 2]
    total = sum(t[3] for t in trace)
    at_floor = len(trace) * floor
    print(
        f"  at the one-row step's {1e3 * floor:.2f} ms (median of {len(ones)}), its {len(trace)} steps take "
        f"{at_floor:.3f} s ({100 * at_floor / total:.0f}% of the device time); their rows add {total - at_floor:.3f} s"
    )


def burst_start(trace: list[list]) -> None:
    """The device's idle time before the run's first step: the first step with prompt tokens after a decode-only
    step (a benchmark's warm-up requests run first), with the idle of the next few steps: the burst's admission."""
    first = next((i for i in range(1, len(trace)) if trace[i][1] and not trace[i - 1][1]), None)
    if first is None:
        return
    after = sum(t[4] for t in trace[first + 1 : first + 8])
    idle = 1e3 * trace[first][4]
    print(f"  the run's first step: {first}, idle before it {idle:.1f} ms, before its next 7 {1e3 * after:.1f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("requests_file", nargs="?")
    ap.add_argument("--trace", help="a run's step trace (SLUICE_STEP_TRACE) instead of a simulation")
    ap.add_argument("--num-prompts", type=int, default=None)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--max-graph-tokens", type=int, default=2048, help="the engine's (for grouping the steps)")
    ap.add_argument("--list", type=int, default=0, metavar="N", help="with --trace: also print its first N steps")
    ns = ap.parse_args()
    if ns.trace:
        trace = json.load(open(ns.trace))["steps"]
        report([(t[0], t[1]) for t in trace], [t[3] for t in trace], [t[4] for t in trace], ns.max_graph_tokens)
        long_launches(trace)
        step_floor(trace)
        burst_start(trace)
        if ns.list:
            list_steps(trace[: ns.list])
        return
    if not ns.requests_file:
        ap.error("a requests file or --trace")
    requests = json.load(open(ns.requests_file))["requests"][: ns.num_prompts]
    print(f"{len(requests)} requests")
    report(simulate(requests, ns.max_num_seqs, ns.max_num_batched_tokens), None, None, ns.max_graph_tokens)


if __name__ == "__main__":
    main()
