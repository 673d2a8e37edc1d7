"""`sluice bench throughput`: offline throughput of the engine on ShareGPT or random requests, with the
transformers continuous-batching peer on the very same requests in the same run (`--peer hf`).

Every request is submitted at once through `AsyncEngine` (greedy, EOS ignored, so each produces exactly
its dataset output length), each asking for its final output only (vLLM's ``LLM.generate`` does the same;
``--stream`` streams every token through the request actors instead); the clock runs from the first
submission to the last finished request,
after a short warm-up (kernel compilation stays out of the figures). The peer runs after the engine is
closed and its memory released.

``--compare-tp 1,2`` runs the engine once per tensor-parallel size on the same requests instead (one
after another, each closed before the next starts) and reports the ratio of the last to the first.
"""

from __future__ import annotations

import argparse
import time
from typing import TYPE_CHECKING

from sluice.app.bench.common import (
    EngineRun,
    add_dataset_args,
    drive_engine,
    engine_args_for,
    graph_replays,
    graph_step_facts,
    load_bench_requests,
    print_figures,
    release_device_memory,
)
from sluice.app.bench.datasets import BenchRequest, sample_random
from sluice.app.bench.results import command_line, machine_line, write_result

if TYPE_CHECKING:
    from sluice.app.bench.hf_peer import PeerResult  # torch and transformers: not for `sluice --help`


def register(sub) -> None:
    from sluice.app.commands.cli import add_engine_args

    p = sub.add_parser("throughput", help="offline throughput (ShareGPT or random), optionally beside the HF peer")
    add_dataset_args(p)
    p.add_argument("--peer", choices=("hf",), default=None, help="also run the transformers peer on the same requests")
    p.add_argument(
        "--peer-timeout",
        type=float,
        default=600.0,
        help="seconds the peer may take (if it leaves requests unfinished: no ratio, and the JSON says why)",
    )
    p.add_argument(
        "--peer-num-prompts",
        type=int,
        default=None,
        help="the peer runs only the first N of the requests (a slow peer's sample: output tok/s rates compared)",
    )
    p.add_argument(
        "--peer-max-batch-tokens",
        type=int,
        default=None,
        help="the peer's tokens per forward step (default: transformers sizes it)",
    )
    p.add_argument("--out", default=None, help="write the JSON result here")
    p.add_argument("--only-save-requests", action="store_true", help="write --save-requests and stop (no run)")
    p.add_argument(
        "--compare-tp",
        default=None,
        help="comma-separated tensor-parallel sizes (e.g. 1,2): run each on the same requests, report the ratio",
    )
    p.add_argument(
        "--inspector",
        action="store_true",
        help="the inspector's overhead: the same requests with the inspector off and on, alternating, --repeats "
        "times each; prints both throughputs and their ratio",
    )
    p.add_argument("--repeats", type=int, default=3, help="--inspector: runs per setting")
    p.add_argument("--stream", action="store_true", help="stream every token to its caller (default: final outputs)")
    add_engine_args(p)
    p.set_defaults(func=main)


def engine_throughput(
    args, requests: list[BenchRequest], warmup: bool = True, stream: bool = False
) -> tuple[EngineRun, dict]:
    """Run ``requests`` through a fresh engine; returns the run and engine facts (KV pool, steps)."""
    import anyio
    from sluice.core import AsyncEngine

    async def go():
        async with AsyncEngine(args) as engine:
            if warmup:
                vocab = engine.source.config.vocab_size
                await drive_engine(engine, sample_random(4, 24, 8, vocab, seed=12345), tag="warmup")
            replays = graph_replays(engine)
            before = engine.stats()
            recorder = engine.inspector
            recorder_s = recorder.cost_s if recorder is not None else 0.0
            prof = engine.host_profile()
            cpu = time.process_time()
            run = await drive_engine(engine, requests, final_only=not stream)
            cpu = time.process_time() - cpu
            after = engine.stats()
            facts = {
                "kv_blocks": after.kv_blocks_total,
                "kv_tokens": after.kv_blocks_total * args.block_size,
                "num_steps": after.num_steps - before.num_steps,
                **graph_step_facts(replays, graph_replays(engine)),
                "num_preemptions": after.num_preemptions - before.num_preemptions,
            }
            # CPU seconds of the whole process (every thread): the work done, less blurred than the wall
            # clock by other processes competing for the cores
            facts["cpu_s"] = cpu
            # the model's dtype as loaded: on the CPU, --quantization auto over a GGUF runs bf16 activations
            dtype = args.resolve_dtype(args.resolve_device(), engine.source.gguf_file)
            facts["dtype"] = str(dtype).removeprefix("torch.")
            # where each step's host time went, and the device's time per step (on a GPU)
            facts["host_profile_ms_per_step"] = engine.host_profile().since(prof).per_step_ms()
            if recorder is not None:  # what recording cost, measured inside the recorder
                facts["recorder_s"] = recorder.cost_s - recorder_s
                facts["sse_encode_s"] = _sse_encode_s(recorder)
        return run, facts

    result = anyio.run(go)
    # The closed engine lingers in reference cycles (anyio's cancellation tracebacks hold its actors' frames): free
    # its model and KV pool now, before another engine or the peer loads.
    release_device_memory()
    return result


def _sse_encode_s(recorder) -> float:
    """Seconds to encode the buffered records as /inspect/steps does: the cost of one page following."""
    import json

    from sluice.app.inspector.trace import step_dict

    t = time.perf_counter()
    for rec in recorder.steps:
        json.dumps(step_dict(rec), separators=(",", ":"))
    return (time.perf_counter() - t) / max(len(recorder.steps), 1)


def inspector_overhead(ns: argparse.Namespace, args, requests: list[BenchRequest], dataset: dict) -> int:
    """Off and on alternate (off-on, on-off, ...) so that drifting machine load hits both alike; each run is
    a fresh engine with its own warm-up. The ratios are of the medians: output tokens per wall second, and
    per CPU second of the process (on a shared machine the wall clock also measures the neighbours)."""
    import statistics
    from dataclasses import replace

    runs: dict[str, list[dict]] = {"off": [], "on": []}
    for i in range(ns.repeats):
        for mode in ("off", "on") if i % 2 == 0 else ("on", "off"):
            f = engine_figures(replace(args, enable_inspector=mode == "on"), requests)
            f["output_tokens_per_cpu_s"] = f["output_tokens"] / max(f["cpu_s"], 1e-9)
            runs[mode].append(f)
            extra = f", recorder {1e3 * f['recorder_s']:.1f} ms" if mode == "on" else ""
            tps, el = f["output_tokens_per_s"], f["elapsed_s"]
            cps = f["output_tokens_per_cpu_s"]
            print(f"  run {i + 1} inspector {mode}: {tps:,.1f} output tok/s in {el:.1f}s, {cps:,.1f} tok/cpu-s{extra}")
    med = {m: statistics.median(f["output_tokens_per_s"] for f in fs) for m, fs in runs.items()}
    cpu_med = {m: statistics.median(f["output_tokens_per_cpu_s"] for f in fs) for m, fs in runs.items()}
    on = runs["on"]
    steps = sum(f["num_steps"] for f in on)
    figures = {
        "output_tokens_per_s_off": med["off"],
        "output_tokens_per_s_on": med["on"],
        "ratio_on_off": med["on"] / med["off"],
        "runs_off": [f["output_tokens_per_s"] for f in runs["off"]],
        "runs_on": [f["output_tokens_per_s"] for f in on],
        "output_tokens_per_cpu_s_off": cpu_med["off"],
        "output_tokens_per_cpu_s_on": cpu_med["on"],
        "cpu_ratio_on_off": cpu_med["on"] / cpu_med["off"],
        "cpu_runs_off": [f["output_tokens_per_cpu_s"] for f in runs["off"]],
        "cpu_runs_on": [f["output_tokens_per_cpu_s"] for f in on],
        "recorder_us_per_step": 1e6 * sum(f["recorder_s"] for f in on) / max(steps, 1),
        "recorder_share_of_elapsed": sum(f["recorder_s"] for f in on) / sum(f["elapsed_s"] for f in on),
        "sse_encode_us_per_step": 1e6 * statistics.median(f["sse_encode_s"] for f in on),
        "num_steps_per_run": on[0]["num_steps"],
        "num_finished": min(f["num_finished"] for fs in runs.values() for f in fs),
    }
    print_figures("inspector overhead (medians)", figures)
    ratio = figures["ratio_on_off"]
    print(
        f"output tok/s: inspector off {med['off']:,.1f}, on {med['on']:,.1f}: ratio on/off {ratio:.4f} "
        f"({100 * (ratio - 1):+.2f}%); per CPU second off {cpu_med['off']:,.1f}, on {cpu_med['on']:,.1f}: "
        f"ratio {figures['cpu_ratio_on_off']:.4f}; recording costs {figures['recorder_us_per_step']:.1f} us "
        f"per step ({100 * figures['recorder_share_of_elapsed']:.3f}% of the run)"
    )
    print(machine_line())
    if ns.out:
        write_result(ns.out, command_line(), ns.model, dataset, figures)
        print(f"wrote {ns.out}")
    return 0


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


def engine_figures(args, requests: list[BenchRequest], stream: bool = False) -> dict:
    run, facts = engine_throughput(args, requests, stream=stream)
    figures = figures_of(run, requests)
    figures.update(facts)
    figures["engine"] = {
        "outputs": "stream" if stream else "final_only",
        "async_scheduling": args.async_scheduling,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "enforce_eager": args.enforce_eager,
        "attention_backend": args.attention_backend,
        "fused_kernels": args.fused_kernels,
        "kv_cache_dtype": args.kv_cache_dtype,
        "quantization": args.quantization,
        "dtype": figures.pop("dtype"),
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
    first, last = runs[str(sizes[0])], runs[str(sizes[-1])]
    ratio = last["output_tokens_per_s"] / max(first["output_tokens_per_s"], 1e-9)
    figures = {"tensor_parallel": runs, "ratio_tp": ratio}
    print(f"ratio (output tok/s, TP={sizes[-1]} / TP={sizes[0]}): {figures['ratio_tp']:.2f}x")
    print(machine_line())
    if ns.out:
        write_result(ns.out, command_line(), ns.model, dataset, figures)
        print(f"wrote {ns.out}")
    return 0


def peer_comparison(figures: dict, peer: PeerResult | None, peer_error: str | None = None) -> dict:
    """The peer's figures to add to the engine's ``figures``, and the ratio of output throughputs: only when the
    peer finished every request (a partial run is a different workload, and a failed one has no throughput);
    otherwise ``ratio_vs_peer`` is None and ``no_ratio_reason`` says why."""
    if peer is None:
        return {"peer_error": peer_error, "ratio_vs_peer": None, "no_ratio_reason": f"the peer failed: {peer_error}"}
    pf = peer.figures()
    out = {
        "peer": pf,
        "peer_output_tokens_per_s": pf["output_tokens_per_s"],
        "peer_requests_per_s": pf["requests_per_s"],
        "peer_num_finished": pf["num_finished"],
    }
    reason = peer.incomplete_reason
    if reason is None:
        out["ratio_vs_peer"] = figures["output_tokens_per_s"] / pf["output_tokens_per_s"]
    else:
        out.update(ratio_vs_peer=None, no_ratio_reason=f"the peer did not finish every request: {reason}")
    return out


def run_peer(model: str, device, dtype, requests: list[BenchRequest], timeout_s: float, max_batch_tokens):
    from sluice.app.bench.hf_peer import load_hf_model, run_hf_continuous_batching

    hf = load_hf_model(model, device=device, dtype=dtype)
    try:
        return run_hf_continuous_batching(hf, requests, max_batch_tokens=max_batch_tokens, timeout_s=timeout_s)
    finally:
        del hf
        release_device_memory()


def main(ns: argparse.Namespace) -> int:
    from sluice.core import envs
    from sluice.core.frontend.tokenizer import load_tokenizer
    from sluice.core.models.loader import resolve_model

    source = resolve_model(ns.model, envs.SLUICE_CACHE_DIR)
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
    if ns.inspector:
        return inspector_overhead(ns, args, requests, dataset)
    t = time.perf_counter()
    figures = engine_figures(args, requests, stream=ns.stream)
    print_figures(f"sluice ({time.perf_counter() - t:.1f}s with start-up)", figures)
    if ns.out and ns.peer:  # the engine's figures survive a peer that is killed at a time limit
        write_result(ns.out, command_line(), ns.model, dataset, figures)
    if ns.peer == "hf":
        try:
            sample = requests[: ns.peer_num_prompts] if ns.peer_num_prompts else requests
            figures["peer_num_prompts"] = len(sample)
            peer = run_peer(ns.model, device, dtype, sample, ns.peer_timeout, ns.peer_max_batch_tokens)
        except Exception as e:  # the engine's figures still count; say why the peer has none
            figures.update(peer_comparison(figures, None, f"{type(e).__name__}: {e}"))
        else:
            figures.update(peer_comparison(figures, peer))
            print_figures(f"peer {peer.name} (limit {ns.peer_timeout:g}s)", figures["peer"])
        if figures["ratio_vs_peer"] is not None:
            print(f"ratio (output tok/s, sluice / peer): {figures['ratio_vs_peer']:.2f}x")
        else:
            print(f"no ratio: {figures['no_ratio_reason']}")
    print(machine_line())
    if ns.out:
        write_result(ns.out, command_line(), ns.model, dataset, figures)
        print(f"wrote {ns.out}")
    return 0
