"""Speculative decoding against our own engine without it, on the same requests, in one run.

    python -m sluice.app.bench.spec --head default --concurrency 1 --num-prompts 8 --max-new-tokens 256

Prompts are held-out ShareGPT chat prompts (never used to train the shipped head), decoded greedily
with their natural stop (EOS or ``--max-new-tokens``): greedy speculation emits exactly the plain
engine's tokens, so both sides produce the same text and the same token counts. Both engines run in
one process; each first serves two warm-up requests (kernel compilation, allocator), then the measured
requests, at most ``--concurrency`` at a time, in ``--rounds`` rounds of new prompts with the sides
taking turns to go first. Output tokens per second are total output tokens / total wall time.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import time

import anyio
from sluice.app.bench.results import command_line, machine_info, print_table, versions, write_result


async def _serve(engine, prompts: list[list[int]], params, concurrency: int) -> tuple[float, list[list[int]]]:
    outs: list[list[int]] = [[] for _ in prompts]
    limiter = anyio.CapacityLimiter(concurrency)

    async def one(i: int) -> None:
        async with limiter:
            async for o in engine.generate(prompts[i], params, request_id=f"b{i}-{time.monotonic_ns()}"):
                if o.finished:
                    outs[i] = o.token_ids

    t = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for i in range(len(prompts)):
            tg.start_soon(one, i)
    return time.perf_counter() - t, outs


def _graph_replays(engine) -> tuple[int, int]:
    """CUDA-graph replays so far of the plain decode graphs and of the speculative ones (0 without)."""
    runner = engine.local_core.executor.runner
    spec = runner.drafter.graphs if runner.drafter is not None else None
    return tuple(g.num_replays if g is not None else 0 for g in (runner.graphs, spec))


def _zero_totals() -> dict:
    return dict(seconds=0.0, outputs=[], steps=0, drafts=0, accepted=0, profile=None, graph_steps=[0, 0])


def run_sides(engine_args: dict, prompt_rounds: list[list[list[int]]], warmup, params, concurrency: int) -> dict:
    """Serve each round of prompts on every engine (both alive at once), alternating which goes first,
    so that drift in the machine (clocks, other load) falls on both sides alike. Per side: the totals.

    The engines are also started in both orders: the first half of the rounds runs on engines started in
    the given order, the second half on a new pair started in reverse. And the garbage collector runs before
    every round: both engines live in one process, and a full collection (~0.1 s with two engines' objects
    at 64 concurrent requests on the CPU) falls where the allocation count says, which with the same
    sequence of rounds every run is the same rounds of the same side. Without it the second engine named
    was 3-7% slower in every run, two identical engines included; with it the pair reads within ~3%."""
    from sluice.core import AsyncEngine

    order = list(engine_args)
    half = (len(prompt_rounds) + 1) // 2  # one round: all of it in the first half
    res = {name: _zero_totals() for name in order}

    async def main():
        for names, rounds in ((order, prompt_rounds[:half]), (order[::-1], prompt_rounds[half:])):
            if rounds:
                await serve_rounds(names, rounds)
        out = {}
        for name, r in res.items():
            tokens = sum(len(o) for o in r["outputs"])
            out[name] = {
                "seconds": round(r["seconds"], 3),
                "output_tokens": tokens,
                "tokens_per_s": round(tokens / r["seconds"], 2),
                "steps": r["steps"],
                "mean_acceptance_length": round(1 + r["accepted"] / r["drafts"], 3) if r["drafts"] else None,
                "graph_steps": {"plain": r["graph_steps"][0], "speculative": r["graph_steps"][1]},
                # the step's host time by phase, and the device's (`AsyncEngine.host_profile`)
                "host_profile_ms_per_step": {k: round(v, 3) for k, v in r["profile"].per_step_ms().items()},
                "outputs": r["outputs"],
            }
        return out

    async def serve_rounds(names: list[str], rounds: list) -> None:
        async with contextlib.AsyncExitStack() as stack:
            engines = {name: await stack.enter_async_context(AsyncEngine(engine_args[name])) for name in names}
            for engine in engines.values():
                await _serve(engine, warmup, params, concurrency)
            for i, prompts in enumerate(rounds):
                for name in names if i % 2 == 0 else names[::-1]:
                    engine, r = engines[name], res[name]
                    before, replays, prof = engine.stats(), _graph_replays(engine), engine.host_profile()
                    gc.collect()  # each side starts a round with nothing for the collector to catch up on
                    seconds, outs = await _serve(engine, prompts, params, concurrency)
                    delta = engine.host_profile().since(prof)
                    r["profile"] = delta if r["profile"] is None else r["profile"].plus(delta)
                    st = engine.stats()
                    r["seconds"] += seconds
                    r["outputs"] += outs
                    r["steps"] += st.num_steps - before.num_steps
                    r["drafts"] += st.spec_num_drafts - before.spec_num_drafts
                    r["accepted"] += st.spec_num_accepted_tokens - before.spec_num_accepted_tokens
                    r["graph_steps"] = [a + b - c for a, b, c in zip(r["graph_steps"], _graph_replays(engine), replays)]

    return anyio.run(main)


def main(argv: list[str] | None = None) -> dict:
    from sluice.app.commands.train_draft import chat_pairs, load_conversations
    from sluice.core import EngineArgs, SamplingParams, envs
    from sluice.core.args import DEFAULT_MODEL
    from sluice.core.frontend.tokenizer import load_tokenizer
    from sluice.core.models.loader import resolve_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--head", default="default", help="draft head directory, or 'default'")
    ap.add_argument("--num-speculative-tokens", type=int, default=None, help="default: the engine's")
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--num-prompts", type=int, default=8, help="prompts per round")
    ap.add_argument("--rounds", type=int, default=1, help="rounds of new prompts, the sides alternating first")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--max-prompt-len", type=int, default=512)
    ap.add_argument("--data", default="sharegpt", help="'sharegpt' or a JSON file of conversations")
    ap.add_argument("--split", default="heldout")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--speculative-disable-batch-size", type=int, default=None, help="default: the engine's")
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument(
        "--also-sync",
        action="store_true",
        help="a third side: speculation with asynchronous scheduling off (every step waits for the last one's tokens)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quantization", default=None, help="both sides' --quantization (default: none)")
    ap.add_argument(
        "--engine-args",
        default="{}",
        help="other EngineArgs fields for both sides, as a JSON object (cpu_compile serves the plain side alone: "
        "the runner leaves it off with a drafter)",
    )
    ap.add_argument("--out", default=None, help="also write the result as JSON here")
    args = ap.parse_args(argv)

    source = resolve_model(args.model, envs.SLUICE_CACHE_DIR)
    tokenizer = load_tokenizer(source.tokenizer_dir)
    convs = load_conversations(args.data, args.split)
    n = args.num_prompts * args.rounds
    pairs = chat_pairs(tokenizer, convs, n + 2, args.max_prompt_len, args.seed)
    prompts = [p for p, _ in pairs]
    if len(prompts) < n + 2:
        raise SystemExit(f"--data has {len(prompts)} usable prompts; {n + 2} needed (2 for warm-up)")
    warmup, prompts = prompts[:2], prompts[2:]
    rounds = [prompts[i : i + args.num_prompts] for i in range(0, n, args.num_prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_new_tokens)
    common = dict(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        max_model_len=args.max_prompt_len + args.max_new_tokens + 8,
        max_num_seqs=max(args.concurrency, 8),
        enforce_eager=args.enforce_eager,
        seed=args.seed,
        quantization=args.quantization,
    )
    extra = json.loads(args.engine_args)
    # Both engines live at once: small fixed pools.
    common["num_kv_blocks"] = -(-common["max_model_len"] // 16) * max(args.concurrency, 8) + 64
    spec_kw = dict(speculative_model=args.head, num_speculative_tokens=args.num_speculative_tokens)
    if args.speculative_disable_batch_size is not None:
        spec_kw["speculative_disable_batch_size"] = args.speculative_disable_batch_size
    sides = {"plain": EngineArgs(**common, **extra), "spec": EngineArgs(**common, **extra, **spec_kw)}
    spec_args = sides["spec"]
    device = spec_args.resolve_device()
    k = spec_args.resolve_num_speculative_tokens(device, spec_args.resolve_quantization(device, source.gguf_file))
    if args.also_sync:
        sides["spec_sync"] = EngineArgs(**common, **extra, **spec_kw, async_scheduling=False)
    res = run_sides(sides, rounds, warmup, params, args.concurrency)
    plain, spec = res["plain"], res["spec"]
    plain_outputs = plain.pop("outputs")
    same = sum(a == b for a, b in zip(plain_outputs, spec.pop("outputs")))
    speedup = spec["tokens_per_s"] / plain["tokens_per_s"]
    rows = [{"engine": "sluice", **plain}, {"engine": f"sluice + spec (k={k})", **spec}]
    sync = res.get("spec_sync")
    if sync is not None:
        sync["identical_outputs"] = sum(a == b for a, b in zip(plain_outputs, sync.pop("outputs")))
        sync["speedup"] = round(sync["tokens_per_s"] / plain["tokens_per_s"], 3)
        rows.append({"engine": "sluice + spec, async scheduling off", **sync})
    m, v = machine_info(), versions()
    print(
        f"spec bench: {args.model}, head {args.head}, {len(prompts)} held-out prompts, concurrency "
        f"{args.concurrency}, greedy, max {args.max_new_tokens} new tokens; {m['gpu'] or m['cpu']} "
        f"({m['cores']} cores), torch {v['torch']}, {time.strftime('%Y-%m-%d')}"
    )
    print_table(rows)
    print(f"speedup {speedup:.2f}x; identical outputs {same}/{len(prompts)}")
    figures = {"plain": plain, "spec": spec, "speedup": round(speedup, 3), "identical_outputs": same}
    figures["num_speculative_tokens"] = k
    if sync is not None:
        print(f"async scheduling off: speedup {sync['speedup']:.2f}x; identical outputs {sync['identical_outputs']}")
        figures["spec_sync"] = sync
    if args.out:
        dataset = dict(name=args.data, split=args.split, num_prompts=len(prompts), rounds=args.rounds, seed=args.seed)
        write_result(args.out, command_line(), args.model, dataset, {**figures, "concurrency": args.concurrency})
    return figures


if __name__ == "__main__":
    main()
