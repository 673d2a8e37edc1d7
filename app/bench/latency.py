"""`sluice bench latency`: one fixed batch (``--batch-size`` requests of ``--input-len`` random tokens, each
forced to ``--output-len`` tokens), end to end, several iterations after warm-up.

Per iteration: the end-to-end latency (first submission to last finish), the prefill time (to the
batch's last first token), and the decode step time ``(e2e - prefill) / (output_len - 1)``, which is
also the ms per output token of every request in the batch. The prefill's model FLOPs (linear layers,
causal attention, LM head of the last rows) over its time give TFLOP/s and the share of ``--roof-tflops``.
Each iteration uses fresh random prompts, so the prefix cache never shortens a prefill.
"""

from __future__ import annotations

import argparse
import statistics
import time

from sluice.app.bench.common import (
    EngineRun,
    drive_engine,
    engine_args_for,
    graph_replays,
    graph_step_facts,
    percentiles,
    print_figures,
    release_device_memory,
)
from sluice.app.bench.datasets import BenchRequest, sample_random
from sluice.app.bench.results import command_line, machine_line, write_result


def register(sub) -> None:
    from sluice.app.commands.cli import add_engine_args

    p = sub.add_parser("latency", help="end-to-end latency of one fixed batch; per-step time and ms/token")
    p.add_argument("--batch-size", type=int, default=8, help="requests in the batch")
    p.add_argument("--input-len", type=int, default=32, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, default=128, help="output tokens per request")
    p.add_argument("--num-iters", type=int, default=5, help="measured runs of the batch")
    p.add_argument("--num-iters-warmup", type=int, default=2, help="unmeasured runs first")
    p.add_argument("--roof-tflops", type=float, default=770.0, help="matmul roof for the prefill share (H200 bf16)")
    p.add_argument("--peer", choices=("hf",), default=None, help="also time transformers `generate` (static batch)")
    p.add_argument("--out", default=None, help="write the JSON result here")
    add_engine_args(p)
    p.set_defaults(func=main)


def prefill_flops(config, num_seqs: int, input_len: int) -> float:
    """Model FLOPs of prefilling ``num_seqs`` prompts of ``input_len`` tokens: 2 x MACs of every linear
    layer per token, causal attention (QK^T and PV over ``L(L+1)/2`` pairs per head), LM head on one row
    per sequence."""
    h, m, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    hd = getattr(config, "head_dim", None) or h // config.num_attention_heads
    q, kv = config.num_attention_heads * hd, config.num_key_value_heads * hd
    linear = 2 * layers * (h * (q + 2 * kv) + q * h + 3 * h * m)
    attention = layers * 2 * q * input_len * (input_len + 1)
    head = 2 * h * config.vocab_size
    return float(num_seqs * (input_len * linear + attention + head))


def _batch(ns: argparse.Namespace, vocab: int, seed: int) -> list[BenchRequest]:
    return sample_random(ns.batch_size, ns.input_len, ns.output_len, vocab, seed=seed)


def engine_latency(args, ns: argparse.Namespace, vocab: int) -> tuple[list[EngineRun], dict]:
    import anyio
    from sluice.core import AsyncEngine

    async def go() -> tuple[list[EngineRun], dict]:
        runs = []
        async with AsyncEngine(args) as engine:
            for i in range(ns.num_iters_warmup):
                await drive_engine(engine, _batch(ns, vocab, 10_000 + i), tag=f"warmup{i}")
            replays = graph_replays(engine)
            steps = engine.stats().num_steps
            for i in range(ns.num_iters):
                runs.append(await drive_engine(engine, _batch(ns, vocab, i), tag=f"iter{i}"))
            facts = {
                "num_steps": engine.stats().num_steps - steps,
                **graph_step_facts(replays, graph_replays(engine)),
            }
        return runs, facts

    return anyio.run(go)


def summarize_runs(runs: list[EngineRun], ns: argparse.Namespace, flops: float) -> dict:
    e2e = [r.elapsed_s for r in runs]
    prefill = [max(r.first_token_s) for r in runs]
    fig: dict = {"batch_size": ns.batch_size, "input_len": ns.input_len, "output_len": ns.output_len}
    fig["num_iters"] = len(runs)
    fig["exact_output_lens"] = all(n == ns.output_len for r in runs for n in r.output_lens)
    fig.update(percentiles(e2e, "latency"))
    fig.update(percentiles(prefill, "prefill"))
    if ns.output_len > 1:
        steps = [(a - b) / (ns.output_len - 1) for a, b in zip(e2e, prefill)]
        fig.update(percentiles(steps, "decode_step"))
        fig["ms_per_output_token"] = statistics.median(steps) * 1000
    fig["e2e_ms_per_output_token"] = statistics.median(e2e) * 1000 / ns.output_len
    fig["output_tokens_per_s"] = ns.batch_size * ns.output_len / statistics.median(e2e)
    fig["prefill_tflops"] = flops / statistics.median(prefill) / 1e12
    fig["prefill_pct_of_roof"] = 100 * fig["prefill_tflops"] / ns.roof_tflops
    return fig


def peer_latency(ns: argparse.Namespace, model: str, device, dtype, vocab: int) -> dict:
    from sluice.app.bench.hf_peer import load_hf_model, run_hf_generate

    hf = load_hf_model(model, device=device, dtype=dtype)
    try:
        run_hf_generate(hf, _batch(ns, vocab, 10_000), ns.batch_size)  # warm-up
        e2e = [run_hf_generate(hf, _batch(ns, vocab, i), ns.batch_size).elapsed_s for i in range(ns.num_iters)]
    finally:
        del hf
        release_device_memory()
    fig = percentiles(e2e, "latency")
    fig["e2e_ms_per_output_token"] = statistics.median(e2e) * 1000 / ns.output_len
    return fig


def main(ns: argparse.Namespace) -> int:
    from sluice.core import envs
    from sluice.core.models.loader import resolve_model

    if min(ns.batch_size, ns.input_len, ns.output_len, ns.num_iters) < 1:
        raise ValueError("batch_size, input_len, output_len and num_iters must be >= 1")
    source = resolve_model(ns.model, envs.SLUICE_CACHE_DIR)
    cfg = source.config
    args = engine_args_for(ns, ns.batch_size, ns.input_len + ns.output_len)
    device = args.resolve_device()
    dtype = args.resolve_dtype(device, source.gguf_file)
    print(
        f"latency: batch {ns.batch_size}, {ns.input_len} in / {ns.output_len} out, {ns.num_iters} iterations "
        f"(+{ns.num_iters_warmup} warm-up); model {ns.model} on {device} ({str(dtype).removeprefix('torch.')})"
    )
    t = time.perf_counter()
    runs, facts = engine_latency(args, ns, cfg.vocab_size)
    figures = summarize_runs(runs, ns, prefill_flops(cfg, ns.batch_size, ns.input_len))
    figures.update(facts)
    figures["engine"] = {
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "enforce_eager": args.enforce_eager,
        "fused_kernels": args.fused_kernels,
        "kv_cache_dtype": args.kv_cache_dtype,
        "quantization": args.resolve_quantization(device, source.gguf_file),  # auto made concrete
        "dtype": str(dtype).removeprefix("torch."),
    }
    print_figures(f"sluice ({time.perf_counter() - t:.1f}s with start-up)", figures)
    release_device_memory()
    if ns.peer == "hf":
        try:
            pf = peer_latency(ns, ns.model, device, dtype, cfg.vocab_size)
            figures["peer"] = pf
            figures["peer_latency_median_ms"] = pf["latency_median_ms"]
            figures["ratio_vs_peer"] = pf["latency_median_ms"] / figures["latency_median_ms"]
            print_figures("peer hf-generate (static batch)", pf)
            print(f"speed-up over the peer (median end-to-end): {figures['ratio_vs_peer']:.2f}x")
        except Exception as e:
            figures["peer_error"] = f"{type(e).__name__}: {e}"
            print(f"peer failed: {figures['peer_error']}")
    print(machine_line())
    if ns.out:
        dataset = {
            "name": "random",
            "batch_size": ns.batch_size,
            "input_len": ns.input_len,
            "output_len": ns.output_len,
        }
        write_result(ns.out, command_line(), ns.model, dataset, figures)
        print(f"wrote {ns.out}")
    return 0
