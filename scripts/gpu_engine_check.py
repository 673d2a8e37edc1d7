"""Engine-level checks on the GPU: greedy equality of the fast path against the torch reference, and a
profile of where a step's time goes.

    python scripts/gpu_engine_check.py equality --model smollm2-135m-instruct --out eq.json
    python scripts/gpu_engine_check.py profile --model dummy:llama3-8b --out profile.json

``equality``: 16 chat prompts, greedy, EOS ignored. The reference engine runs the torch attention backend,
eagerly, with the unfused torch layers, and records the top-2 logprobs of every step; the engine under test
runs its defaults (Triton kernels, CUDA graphs for decode, fused kernels). Each prompt must give the same
first ``--tokens`` tokens, or diverge only where the reference's top-2 logit gap is at most ``--near-tie``.
The logits are bf16 (the LM head runs in bf16): SmolLM2's top logits lie between ~8 and ~40, where bf16
values are 0.0625 to 0.25 apart, so a gap of one such step (the default, 0.25) is a tie at bf16 resolution.

``profile``: a `ModelRunner` driven with synthetic steps (no scheduler, no actors): decode steps at several
batch sizes with and without CUDA graphs, and a prefill step of ``8 x 2048`` tokens; a torch.profiler
summary (GPU time per kernel class, and the top kernels) of eager decode and prefill steps; with ``--mixed DxP``,
steps of D decode rows beside a P-token prompt chunk (as the engine runs them, and eagerly by kernel class).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TOPICS = [
    "rivers", "prime numbers", "the moon", "bread", "volcanoes", "chess", "the ocean", "trains",
    "music theory", "photosynthesis", "the printing press", "glaciers", "bees", "compilers", "bridges", "tea",
]  # fmt: skip


def _prompts(tokenizer) -> list[list[int]]:
    from sluice.core.frontend.tokenizer import apply_chat_template

    out = []
    for i, topic in enumerate(TOPICS):
        text = f"Explain {topic} to a curious student." + " Give two examples and one surprising fact." * (i % 4)
        msgs = [{"role": "user", "content": text}]
        if i % 3 == 0:
            msgs.insert(0, {"role": "system", "content": "You are a concise, helpful assistant."})
        out.append(apply_chat_template(tokenizer, msgs))
    return out


def equality(ns: argparse.Namespace) -> dict:
    from sluice.app.bench.common import release_device_memory
    from sluice.core import LLM, SamplingParams

    n = ns.tokens
    ref = LLM(
        model=ns.model, attention_backend="torch", enforce_eager=True, fused_kernels="off", max_model_len=1024,
        gpu_memory_utilization=0.5,
    )  # fmt: skip
    prompts = _prompts(ref.tokenizer)
    t = time.perf_counter()
    ref_out = ref.generate(prompts, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=2), False)
    ref_s = time.perf_counter() - t
    ref.close()
    del ref
    release_device_memory()

    fast = LLM(model=ns.model, max_model_len=1024, gpu_memory_utilization=0.5)
    runner = fast.engine.local_core.executor.runner
    t = time.perf_counter()
    fast_out = fast.generate(prompts, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True), False)
    fast_s = time.perf_counter() - t
    replays = runner.graphs.num_replays if runner.graphs is not None else 0
    fast.close()
    del fast, runner
    release_device_memory()

    rows, ok = [], True
    for i, (p, r, f) in enumerate(zip(prompts, [o.outputs[0] for o in ref_out], [o.outputs[0] for o in fast_out])):
        div = next((j for j, (a, b) in enumerate(zip(r.token_ids, f.token_ids)) if a != b), None)
        row = {"prompt": i, "prompt_len": len(p), "same_tokens": n if div is None else div}
        if div is not None:
            top = sorted((lp.logprob for lp in r.logprobs[div].values()), reverse=True)
            gap = top[0] - top[1]
            row.update(ref_token=r.token_ids[div], fast_token=f.token_ids[div], ref_top2_gap=gap)
            row["verdict"] = "near-tie" if gap <= ns.near_tie else "MISMATCH"
            ok &= gap <= ns.near_tie
        else:
            row["verdict"] = "equal"
        rows.append(row)
        print(json.dumps(row))
    summary = {
        "model": ns.model,
        "tokens": n,
        "prompts": len(prompts),
        "equal": sum(r["verdict"] == "equal" for r in rows),
        "near_ties": sum(r["verdict"] == "near-tie" for r in rows),
        "mismatches": sum(r["verdict"] == "MISMATCH" for r in rows),
        "near_tie_threshold": ns.near_tie,
        "graph_replays": replays,
        "reference_s": ref_s,
        "fast_s": fast_s,
        "pass": ok,
        "rows": rows,
    }
    print(f"equality: {summary['equal']} equal, {summary['near_ties']} near-ties, {summary['mismatches']} mismatches "
          f"of {len(prompts)} prompts x {n} tokens; graph replays {replays}; PASS={ok}")  # fmt: skip
    return summary


# ------------------------------------------------------------------------------------------------ profile


def _kernel_class(name: str) -> str:
    n = name.lower()
    if "decode" in n and "kernel" in n:
        return "attention decode (triton)"
    if "prefill_kernel" in n:
        return "attention prefill (triton)"
    if "kv_write" in n:
        return "kv write (triton)"
    if "rmsnorm" in n or "silu_and_mul" in n or "rope_kernel" in n:
        return "fused norm/act/rope (triton)"
    if "int4_gem" in n or "int8_gem" in n:  # GEMV and GEMM kernels of core/models/quant_kernels.py
        return "matmul (quantized, triton)"
    if any(k in n for k in ("gemm", "gemv", "cutlass", "nvjet", "sm90_xmma", "cublas", "splitk")):
        return "matmul (cuBLAS)"
    if "argmax" in n or "reduce" in n:
        return "argmax/reduce"
    if "memcpy" in n or "memset" in n:
        return "memcpy/memset"
    return "other elementwise/index"


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _profile_steps(step, steps: int) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    _sync()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        t = time.perf_counter()
        for _ in range(steps):
            step()
        _sync()
        wall = (time.perf_counter() - t) / steps
    classes: dict[str, float] = {}
    kernels = []
    for evt in prof.key_averages():
        dev_us = getattr(evt, "self_device_time_total", None)
        if dev_us is None:
            dev_us = getattr(evt, "self_cuda_time_total", 0)
        if dev_us <= 0 or evt.key.startswith(("ProfilerStep", "aten::", "cuda")):
            continue
        classes[_kernel_class(evt.key)] = classes.get(_kernel_class(evt.key), 0.0) + dev_us / steps / 1000
        kernels.append((dev_us / steps / 1000, evt.count // steps, evt.key[:90]))
    kernels.sort(reverse=True)
    gpu = sum(classes.values())
    return {
        "wall_ms_per_step": wall * 1000,
        "gpu_kernel_ms_per_step": gpu,
        "gaps_and_host_ms_per_step": wall * 1000 - gpu,
        "by_class_ms": dict(sorted(classes.items(), key=lambda kv: -kv[1])),
        "top_kernels": [{"ms": round(ms, 4), "calls": c, "name": k} for ms, c, k in kernels[:24]],
    }


def profile(ns: argparse.Namespace) -> dict:
    import torch
    from sluice.app.bench.latency import prefill_flops
    from sluice.core import envs
    from sluice.core.args import EngineArgs
    from sluice.core.models.loader import resolve_model
    from sluice.core.sampling_params import SamplingParams
    from sluice.core.step import NewRequest, SchedulerOutput
    from sluice.core.worker.model_runner import ModelRunner

    source = resolve_model(ns.model, envs.SLUICE_CACHE_DIR)
    args = EngineArgs(
        model=ns.model,
        max_num_seqs=max(ns.batch_sizes),
        max_num_batched_tokens=8 * 2048,
        num_kv_blocks=ns.num_kv_blocks,
        quantization=ns.quantization,
        kv_cache_dtype=ns.kv_cache_dtype,
        max_graph_tokens=ns.max_graph_tokens,
    )
    t = time.perf_counter()
    runner = ModelRunner(args, source, max_model_len=4096)
    start_s = time.perf_counter() - t
    greedy = SamplingParams(temperature=0, max_tokens=1 << 20, ignore_eos=True)
    bs_tok = runner.block_size
    vocab = source.config.vocab_size
    g = torch.Generator().manual_seed(0)
    step_ids = iter(range(1, 1 << 30))

    def synthetic(rows: list[tuple[list[int], int, int]], tag: str) -> tuple[SchedulerOutput, SchedulerOutput]:
        """The step that admits ``rows`` (arrived tokens, start, tokens computed) into the persistent batch,
        and the same step again for the requests already held (repeatable)."""
        first, again = SchedulerOutput(0), SchedulerOutput(0)
        next_block = 0
        for i, (tokens, start, q) in enumerate(rows):
            nb = -(-(start + q) // bs_tok)
            rid = f"{tag}{i}"
            first.new_requests.append(
                NewRequest(rid, tokens, len(tokens), list(range(next_block, next_block + nb)), greedy)
            )
            next_block += nb
            for so in (first, again):
                so.req_ids.append(rid)
                so.num_computed_tokens.append(start)
                so.num_scheduled_tokens.append(q)
                so.samples.append(True)
        return first, again

    def decode_step(bs: int, ctx: int) -> tuple[SchedulerOutput, SchedulerOutput]:
        # requests that arrived with ctx - 1 tokens decode at position ctx - 1 (their last sampled token)
        return synthetic([(torch.randint(vocab, (ctx - 1,), generator=g).tolist(), ctx - 1, 1) for _ in range(bs)], "d")

    def run(so: SchedulerOutput):
        so.step_id = next(step_ids)
        return runner.execute(so)

    def drop(pair) -> None:
        run(SchedulerOutput(0, finished_request_ids=list(pair[1].req_ids)))

    def timed(pair, reps: int) -> float:
        first, again = pair
        run(first)
        _sync()
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            run(again)
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts) * 1000

    out: dict = {"model": ns.model, "start_s": start_s, "kv_blocks": runner.num_kv_blocks, "decode": []}
    graphs = runner.graphs
    for bs in ns.batch_sizes:
        for ctx in ns.contexts:
            pair = decode_step(bs, ctx)
            row = {"batch": bs, "context": ctx, "graph_ms": timed(pair, 20) if graphs is not None else None}
            runner.graphs = None
            row["eager_ms"] = timed((pair[1], pair[1]) if graphs is not None else pair, 10)  # admitted once
            runner.graphs = graphs
            drop(pair)
            print(json.dumps(row))
            out["decode"].append(row)
    # prefills: the engine's eager step (host launches and device work), e.g. 1x128 and 8x2048
    pres = {}
    for shape in ns.prefills:
        b, n = map(int, shape.split("x"))
        pre = synthetic([(torch.randint(vocab, (n,), generator=g).tolist(), 0, n) for _ in range(b)], f"p{shape}-")
        ms = timed(pre, 5)
        tflops = prefill_flops(source.config, b, n) / (ms / 1000) / 1e12
        pres[shape] = pre
        row = {"ms": ms, "tflops": tflops, "pct_of_770": 100 * tflops / 770}
        if ns.sync_debug:  # every host-device synchronization inside one step, with where it happens
            import warnings

            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                run(pre[1])
                torch.cuda.set_sync_debug_mode(0)
            row["syncs"] = sorted({f"{w.filename}:{w.lineno}: {str(w.message)[:200]}" for w in caught})
        out[f"prefill_{shape}"] = row
        print(json.dumps({shape: row}))
        if shape != ns.prefills[-1]:
            drop(pre)
    # mixed steps: D decode rows (at the first context) beside one prompt chunk of P tokens, timed as the engine
    # runs them (a mixed-step graph where one fits) and eagerly, with the eager step's kernels by class
    out["mixed"] = []
    for shape in ns.mixed:
        d, n = map(int, shape.split("x"))
        ctx = ns.contexts[0]
        rows = [(torch.randint(vocab, (ctx - 1,), generator=g).tolist(), ctx - 1, 1) for _ in range(d)]
        pair = synthetic([*rows, (torch.randint(vocab, (n,), generator=g).tolist(), 0, n)], f"m{shape}-")
        row = {"decode_rows": d, "prompt_tokens": n, "context": ctx, "ms": timed(pair, 10)}
        mixed_graphs = runner.mixed_graphs
        runner.graphs = runner.mixed_graphs = None
        row["eager_ms"] = timed((pair[1], pair[1]), 5)
        p = _profile_steps(lambda so=pair[1]: run(so), 3)
        runner.graphs, runner.mixed_graphs = graphs, mixed_graphs
        row["eager_by_class_ms"], row["eager_top_kernels"] = p["by_class_ms"], p["top_kernels"]
        drop(pair)
        out["mixed"].append(row)
        print(json.dumps(row))
    pre = pres[ns.prefills[-1]]
    # where the time goes: a batch-1 decode step as served (its CUDA graph's kernels, as the profiler lists them),
    # then eagerly (no decode nor mixed-step graph: a mixed graph would pad the step's tokens), kernels one by one
    mixed_graphs = runner.mixed_graphs
    out["profile"] = {}
    for name, pair, steps, graphed in (
        ("decode b1 ctx512 graph", decode_step(1, 512), 20, True),
        ("decode b1 ctx512 eager", decode_step(1, 512), 5, False),
        (f"decode b{max(ns.batch_sizes)} ctx512 eager", decode_step(max(ns.batch_sizes), 512), 3, False),
        (f"prefill {ns.prefills[-1]}", pre, 2, False),
    ):
        if pair is not pre:
            run(pair[0])
        runner.graphs, runner.mixed_graphs = (graphs, mixed_graphs) if graphed else (None, None)
        p = _profile_steps(lambda so=pair[1]: run(so), steps)
        if pair is not pre:
            drop(pair)
        out["profile"][name] = p
        print(f"-- {name}: wall {p['wall_ms_per_step']:.2f} ms/step, GPU kernels {p['gpu_kernel_ms_per_step']:.2f} ms")
        for k, v in p["by_class_ms"].items():
            print(f"   {k:32s} {v:8.3f} ms")
        for row in p["top_kernels"][:16]:
            print(f"   {row['ms']:8.3f} ms x{row['calls']:<4d} {row['name']}")
    runner.graphs, runner.mixed_graphs = graphs, mixed_graphs
    return out


def main() -> int:
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("equality")
    e.add_argument("--model", default="smollm2-135m-instruct")
    e.add_argument("--tokens", type=int, default=32)
    e.add_argument("--near-tie", type=float, default=0.25, help="largest top-2 logit gap that counts as a tie")
    e.add_argument("--out", required=True)
    p = sub.add_parser("profile")
    p.add_argument("--model", default="dummy:llama3-8b")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 64, 256])
    p.add_argument("--contexts", type=int, nargs="+", default=[512])
    p.add_argument("--num-kv-blocks", type=int, default=None, help="default: sized by the memory profile")
    p.add_argument("--quantization", choices=("int8", "int4", "fp8"), default=None)
    p.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto")
    p.add_argument("--prefills", nargs="+", default=["8x2048"], help="prefill steps BxN to time (the last is profiled)")
    p.add_argument("--mixed", nargs="*", default=[], help="mixed steps DxP: D decode rows beside a P-token prompt")
    p.add_argument("--max-graph-tokens", type=int, default=512, help="mixed-step graphs up to this many tokens")
    p.add_argument("--sync-debug", action="store_true", help="list host-device synchronizations in each prefill step")
    p.add_argument("--out", required=True)
    ns = ap.parse_args()
    from sluice.app.bench.results import machine_info, utc_now_iso, versions

    result = equality(ns) if ns.cmd == "equality" else profile(ns)
    result.update(command=" ".join(["python scripts/gpu_engine_check.py", *sys.argv[1:]]), machine=machine_info(),
                  versions=versions(), date=utc_now_iso())  # fmt: skip
    Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
    Path(ns.out).write_text(json.dumps(result, indent=2, default=str) + "\n")
    return 0 if result.get("pass", True) else 1


if __name__ == "__main__":
    sys.exit(main())
