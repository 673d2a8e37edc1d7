"""`sluice bench throughput`: offline throughput of the engine on ShareGPT or random requests, with the
transformers continuous-batching peer on the very same requests in the same run (`--peer hf`).

Every request is submitted at once through `AsyncEngine` (greedy, EOS ignored, so each produces exactly
its dataset output length); the clock runs from the first submission to the last finished request,
after a short warm-up (kernel compilation stays out of the figures). The peer runs after the engine is
closed and its memory released.

``--compare-tp 1,2`` runs the engine once per tensor-parallel size on the same requests instead (one
after another, each closed before the next starts) and reports the ratio of the last to the first.
"""

from __future__ import annotations

import argparse
import time

from app.bench.common import (
    EngineRun,
    add_dataset_args,
    drive_engine,
    engine_args_for,
    load_bench_requests,
    print_figures,
    release_device_memory,
)
from app.bench.datasets import BenchRequest, sample_random
from app.bench.results import command_line, machine_info, versions, write_result


def register(sub) -> None:
    from app.cli import add_engine_args

    p = sub.add_parser("throughput", help="offline throughput (ShareGPT or random), optionally beside the HF peer")
    add_dataset_args(p)
    p.add_argument("--peer", choices=("hf",), default=None, help="also run the transformers peer on the same requests")
    p.add_argument("--peer-timeout", type=float, default=600.0, help="seconds the peer may take (unfinished: counted)")
    p.add_argument("--peer-max-batch-tokens", type=int, default=None)
    p.add_argument("--out", default=None, help="write the JSON result here")
    p.add_argument("--only-save-requests", action="store_true", help="write --save-requests and stop (no run)")
    p.add_argument(
        "--compare-tp",
        default=None,
        help="comma-separated tensor-parallel sizes (e.g. 1,2): run each on the same requests, report the ratio",
    )
    add_engine_args(p)
    p.set_defaults(func=main)


def engine_throughput(args, requests: list[BenchRequest], warmup: bool = True) -> tuple[EngineRun, dict]:
    """Run ``requests`` through a fresh engine; returns the run and engine facts (KV pool, steps)."""
    import anyio

    from core import AsyncEngine

    async def go():
        async with AsyncEngine(args) as engine:
            if warmup:
                vocab = engine.source.config.vocab_size
                await drive_engine(engine, sample_random(4, 24, 8, vocab, seed=12345), tag="warmup")
            graphs = engine._executor.runner.graphs
            replays = graphs.num_replays if graphs is not None else 0
            before = engine.stats()
            run = await drive_engine(engine, requests)
            after = engine.stats()
            facts = {
                "kv_blocks": after.kv_blocks_total,
                "kv_tokens": after.kv_blocks_total * args.block_size,
                "num_steps": after.num_steps - before.num_steps,
                "graph_steps": (graphs.num_replays - replays) if graphs is not None else 0,
                "num_preemptions": after.num_preemptions - before.num_preemptions,
            }
        return run, facts

    return anyio.run(go)


def figures_of(run: EngineRun, requests: list[BenchRequest]) -> dict:
    out_tokens = sum(run.output_lens)
    done = [n > 0 for n in run.output_lens]
    prompt_tokens = sum(len(r.prompt_token_ids) for r, d in zip(requests, done) if d)
    el = max(run.elapsed_s, 1e-9)
    return {
        "num_requests": len(requests),
        "num_finished": sum(done),
        "exact_output_lens": sum(n == r.output_len for n, r in zip(run.output_lens, requests)),
        "elapsed_s": run.elapsed_s,
        "prompt_tokens": prompt_tokens,
        "output_tokens": out_tokens,
        "requests_per_s": sum(done) / el,
        "output_tokens_per_s": out_tokens / el,
        "total_tokens_per_s": (prompt_tokens + out_tokens) / el,
    }


def engine_figures(args, requests: list[BenchRequest]) -> dict:
    run, facts = engine_throughput(args, requests)
    figures = figures_of(run, requests)
    figures.update(facts)
    figures["engine"] = {
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "enforce_eager": args.enforce_eager,
        "attention_backend": args.attention_backend,
        "fused_kernels": args.fused_kernels,
        "dtype": str(args.resolve_dtype(args.resolve_device())).removeprefix("torch."),
        "tensor_parallel_size": args.tensor_parallel_size,
    }
    return figures


def compare_tp(ns: argparse.Namespace, args, requests: list[BenchRequest], dataset: dict) -> int:
    """The engine at each of ``--compare-tp``'s sizes on the same requests; the ratio of last to first."""
    from dataclasses import replace

    try:
        sizes = [int(x) for x in ns.compare_tp.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"compare_tp: expected sizes like 1,2, got {ns.compare_tp!r}") from None
    if len(sizes) < 2 or min(sizes) < 1 or len(set(sizes)) != len(sizes):
        raise ValueError(f"compare_tp: expected two or more distinct sizes >= 1, got {ns.compare_tp!r}")
    if ns.peer:
        raise ValueError("compare_tp: runs the engine only; drop --peer")
    runs: dict[str, dict] = {}
    for tp in sizes:
        t = time.perf_counter()
        runs[str(tp)] = engine_figures(replace(args, tensor_parallel_size=tp), requests)
        print_figures(f"sluice TP={tp} ({time.perf_counter() - t:.1f}s with start-up)", runs[str(tp)])
        release_device_memory()
    first, last = runs[str(sizes[0])], runs[str(sizes[-1])]
    ratio = last["output_tokens_per_s"] / max(first["output_tokens_per_s"], 1e-9)
    figures = {"tensor_parallel": runs, "ratio_tp": ratio}
    print(f"ratio (output tok/s, TP={sizes[-1]} / TP={sizes[0]}): {figures['ratio_tp']:.2f}x")
    m, v = machine_info(), versions()
    print(
        f"machine: {m['gpu_count']} x {m['gpu']}" if m["gpu"] else f"machine: {m['cpu']}",
        f"({m['cores']} cores); torch {v['torch']}, triton {v['triton']}, transformers {v['transformers']}",
    )
    if ns.out:
        write_result(ns.out, command_line(), ns.model, dataset, figures)
        print(f"wrote {ns.out}")
    return 0


def run_peer(model: str, device, dtype, requests: list[BenchRequest], timeout_s: float, max_batch_tokens):
    from app.bench.hf_peer import load_hf_model, run_hf_continuous_batching

    hf = load_hf_model(model, device=device, dtype=dtype)
    try:
        return run_hf_continuous_batching(hf, requests, max_batch_tokens=max_batch_tokens, timeout_s=timeout_s)
    finally:
        del hf
        release_device_memory()


def main(ns: argparse.Namespace) -> int:
    from core.models.loader import resolve_model
    from core.tokenizer import load_tokenizer

    source = resolve_model(ns.model)
    tokenizer = load_tokenizer(source.tokenizer_dir)
    requests, dataset = load_bench_requests(ns, tokenizer, source.config.vocab_size)
    if ns.only_save_requests:
        print(f"wrote {len(requests)} requests to {ns.save_requests}")
        return 0
    longest = max(len(r.prompt_token_ids) + r.output_len for r in requests)
    args = engine_args_for(ns, len(requests), longest)
    device = args.resolve_device()
    dtype = args.resolve_dtype(device)
    print(
        f"throughput: {dataset['num_requests']} requests ({dataset.get('name', 'file')}), mean prompt "
        f"{dataset['mean_prompt_len']:.1f}, mean output {dataset['mean_output_len']:.1f} tokens; model {ns.model} "
        f"on {device} ({str(dtype).removeprefix('torch.')})"
    )
    if ns.compare_tp:
        return compare_tp(ns, args, requests, dataset)
    t = time.perf_counter()
    figures = engine_figures(args, requests)
    print_figures(f"sluice ({time.perf_counter() - t:.1f}s with start-up)", figures)
    release_device_memory()
    if ns.out and ns.peer:  # the engine's figures survive a peer that is killed at a time limit
        write_result(ns.out, command_line(), ns.model, dataset, figures)
    if ns.peer == "hf":
        try:
            peer = run_peer(ns.model, device, dtype, requests, ns.peer_timeout, ns.peer_max_batch_tokens)
            pf = peer.figures()
            figures["peer"] = pf
            figures["peer_output_tokens_per_s"] = pf["output_tokens_per_s"]
            figures["peer_requests_per_s"] = pf["requests_per_s"]
            figures["peer_num_finished"] = pf["num_finished"]
            figures["ratio_vs_peer"] = figures["output_tokens_per_s"] / max(pf["output_tokens_per_s"], 1e-9)
            print_figures(f"peer {pf['name']} (limit {ns.peer_timeout:.0f}s)", pf)
            print(
                f"ratio (output tok/s, sluice / peer): {figures['ratio_vs_peer']:.2f}x "
                f"(peer finished {pf['num_finished']}/{pf['num_requests']})"
            )
        except Exception as e:  # the engine's figures still count; say why the peer has none
            figures["peer_error"] = f"{type(e).__name__}: {e}"
            print(f"peer failed: {figures['peer_error']}")
    m, v = machine_info(), versions()
    print(
        f"machine: {m['gpu'] or m['cpu']}; torch {v['torch']}, triton {v['triton']}, transformers {v['transformers']}"
    )
    if ns.out:
        write_result(ns.out, command_line(), ns.model, dataset, figures)
        print(f"wrote {ns.out}")
    return 0
