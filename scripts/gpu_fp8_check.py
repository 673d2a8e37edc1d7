"""FP8 W8A8 linear layers on the GPU (issue 39): correctness of every GPU path against the torch emulation at real
shapes, kernel timings against bf16, and greedy agreement of ``--quantization fp8`` with the unquantized model.

    python scripts/gpu_fp8_check.py kernels --out fp8_kernels.json
    python scripts/gpu_fp8_check.py agree --model $HOME/stage/smollm2-135m-instruct.gguf \
        --data $HOME/stage/heldout.json --out fp8_agree.json
    python scripts/gpu_fp8_check.py agree --device cpu --variant fp8-kv --num-prompts 12 --tokens 16 --out a.json

``kernels``: Llama-3-8B's projections (qkv 6144x4096, o 4096x4096, gate/up 28672x4096, down 4096x14336) at 1 to 512
rows: `fp8_kernels.fp8_linear` (the engine's dispatch), the GEMV with fp16 and with fp8 operands (sums promoted to
fp32 every 128 products, and not), and
``_scaled_mm`` after the row-quant kernel, each against `fp8_linear.fp8_linear_reference` (relative error of the
bf16 output; the row-quant kernel's codes bit for bit); the split-K GEMV replayed in a CUDA graph; extreme inputs
(zero, huge and infinite activations) give no NaN. Then CUDA-graph timings (``do_bench_cudagraph``) of bf16 cuBLAS,
the bf16 GEMV (`core/models/gemv.py`, to 64 rows) and the fp8 paths at rows 1, 8, 16, 32, 256 (``--sweep``: GEMV configs
at 1 row too), and the per-token sum of the four projections over 32 layers at batch 1. Exit status 1 when a
check fails, so a calling script stops early.

``agree``: held-out ShareGPT first turns (``--data``: a JSON list of conversations, or ``sharegpt``), chat template,
greedy with EOS ignored, the unquantized engine (recording top-2 logprobs) then the ``--variant`` engine; per prompt
the tokens equal up to the first difference, and whether the reference's top-2 gap there is a near-tie.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
# ``--small``: the default model's projections (SmolLM2-135M), whose K of 576 is no multiple of the GEMV's K step
SMALL_SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
# timed beside them: the LM head, which stays bf16 in the engine (`core/models/fp8_linear.py`): what fp8 would save
HEAD = {"lm_head": (128256, 4096)}
CHECK_ROWS = (1, 3, 8, 16, 32, 33, 64, 256, 512)
TIME_ROWS = (1, 8, 16, 32, 256)
LAYERS = 32
VARIANTS = {"fp8": {"quantization": "fp8"}, "fp8-kv": {"kv_cache_dtype": "fp8"}}
# bf16 output against the fp32-accumulated emulation: a few bf16 roundings and a different summation order
MAX_REL_ERR = 1e-2


def _rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def _inputs(m: int, n: int, k: int, seed: int):
    import torch
    from sluice.core.models.fp8_linear import quantize_weight

    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
    x[0] *= 30.0  # an outlier token: per-token scales keep the others' precision
    w = torch.randn(n, k, device="cuda", generator=g) * 0.02
    q, s = quantize_weight(w)
    counters = torch.zeros(-(-n // 32), dtype=torch.int32, device="cuda")
    return x, w.to(torch.bfloat16), q, s, counters


def check_paths(rows=CHECK_ROWS, shapes=SHAPES) -> list[dict]:
    """Every GPU path against the emulation at each shape and row count."""
    import torch
    from sluice.core.models import fp8_kernels as fk
    from sluice.core.models.fp8_linear import fp8_linear_reference, quantize_rows

    out = []
    for name, (n, k) in shapes.items():
        for m in rows:
            x, _, q, s, counters = _inputs(m, n, k, m)
            ref = fp8_linear_reference(x, q, s, None)
            row = {
                "shape": name,
                "n": n,
                "k": k,
                "rows": m,
                "dispatch": _rel(fk.fp8_linear(x, q, s, None, counters), ref),
            }
            c = fk.gemv_config(n, k, fk.num_sms(x.device), fk.block_m(m))
            if m <= 64:  # the GEMV with each dot flavour (the engine runs `gemv_config`'s)
                for flavour, cfg in _flavours(c).items():
                    try:
                        row[f"gemv_{flavour}"] = _rel(fk.fp8_gemv(x, q, s, None, counters, cfg), ref)
                    except Exception as e:  # noqa: BLE001 - recorded; only the default flavour must work
                        row[f"gemv_{flavour}_error"] = f"{type(e).__name__}: {str(e)[:200]}"
            if m >= 8:
                row["scaled_mm"] = _rel(fk.fp8_scaled_mm(x, q, s, None), ref)
            xq, sx = fk.quantize_rows(x)
            rq, rs = quantize_rows(x)
            row["quant_code_mismatches"] = int((xq.view(torch.uint8) != rq.view(torch.uint8)).sum())
            row["quant_scale_rel"] = _rel(sx, rs)
            default = f"gemv_dot{c.dot}"
            errs = [row["dispatch"], row.get("scaled_mm", 0.0), row.get(default, 0.0)]
            row["pass"] = (
                all(e <= MAX_REL_ERR for e in errs)
                and f"{default}_error" not in row
                and row["quant_code_mismatches"] <= m * k // 10000
            )
            out.append(row)
            print(json.dumps(row), flush=True)
    return out


def _flavours(c) -> dict:
    """The GEMV config ``c`` with fp16 operands (dot1), fp8 ones with sums promoted to fp32 every 128 products
    (dot2, the engine's) and without (dot2raw)."""
    return {"dot1": replace(c, dot=1), "dot2": replace(c, dot=2), "dot2raw": replace(c, dot=2, promote_k=0)}


def check_graph_and_guards() -> dict:
    """The split-K GEMV captured in a CUDA graph and replayed (its counters reset themselves), a bias, and extreme
    activations (zero, 1e30-ish in bf16's range, inf) that must not produce NaN."""
    import torch
    from sluice.core.models import fp8_kernels as fk
    from sluice.core.models.fp8_linear import fp8_linear_reference

    n, k = SHAPES["down"]
    res = {}
    for m in (1, 8, 64):
        x, _, q, s, counters = _inputs(m, n, k, 100 + m)
        bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        eager = fk.fp8_linear(x, q, s, bias, counters)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fk.fp8_linear(x, q, s, bias, counters)  # warm-up (compiles) outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static = fk.fp8_linear(x, q, s, bias, counters)
        errs = []
        for _ in range(3):
            graph.replay()
            errs.append(_rel(static, eager))
        res[f"graph_rows{m}"] = {
            "replay_vs_eager": max(errs),
            "vs_reference": _rel(eager, fp8_linear_reference(x, q, s, bias)),
        }
    x, _, q, s, counters = _inputs(40, *SHAPES["o"], 7)
    x[1] = 0.0
    x[2] = 1e30
    x[3, 5] = float("inf")
    for m in (4, 40):
        y = fk.fp8_linear(x[:m].contiguous(), q, s, None, counters)
        res[f"extreme_rows{m}_nan"] = int(torch.isnan(y).sum())
        res[f"extreme_rows{m}_zero_row_is_zero"] = bool((y[1] == 0).all())
    res["pass"] = all(
        v["replay_vs_eager"] == 0.0 and v["vs_reference"] <= MAX_REL_ERR
        for key, v in res.items()
        if key.startswith("graph")
    ) and all(res[f"extreme_rows{m}_nan"] == 0 and res[f"extreme_rows{m}_zero_row_is_zero"] for m in (4, 40))
    print(json.dumps(res), flush=True)
    return res


def _bench(fn) -> float:
    """Microseconds per call, replayed in a CUDA graph (launch overhead excluded, as in the engine's decode)."""
    from triton.testing import do_bench_cudagraph

    return 1000.0 * do_bench_cudagraph(fn, rep=50)


def time_paths(rows=TIME_ROWS) -> list[dict]:
    """bf16 cuBLAS, the bf16 GEMV and the fp8 paths at 8B shapes; the weights are larger than L2, as in a step."""
    out = []
    for name, (n, k) in (SHAPES | HEAD).items():
        for m in rows:
            row = _time_row(name, n, k, m)
            out.append(row)
            print(json.dumps({key: round(v, 3) if isinstance(v, float) else v for key, v in row.items()}), flush=True)
    return out


def _time_row(name: str, n: int, k: int, m: int) -> dict:
    import torch
    import torch.nn.functional as F
    from sluice.core.models import fp8_kernels as fk
    from sluice.core.models import gemv

    x, w, q, s, counters = _inputs(m, n, k, 1)
    bf_counters = torch.zeros(-(-n // gemv.MIN_BLOCK_N), dtype=torch.int32, device="cuda")
    row = {"shape": name, "rows": m, "bf16_cublas_us": _bench(lambda: F.linear(x, w))}
    if m <= gemv.MAX_ROWS:
        row["bf16_gemv_us"] = _bench(lambda: gemv.gemv(x, w, None, bf_counters))
    row["fp8_dispatch_us"] = _bench(lambda: fk.fp8_linear(x, q, s, None, counters))
    if m <= 64:
        c = fk.gemv_config(n, k, fk.num_sms(x.device), fk.block_m(m))
        for flavour, cfg in _flavours(c).items():
            row[f"fp8_gemv_{flavour}_us"] = _bench(lambda cfg=cfg: fk.fp8_gemv(x, q, s, None, counters, cfg))
    if m >= 8:
        row["fp8_scaled_mm_us"] = _bench(lambda: fk.fp8_scaled_mm(x, q, s, None))
        row["fp8_quant_rows_us"] = _bench(lambda: fk.quantize_rows(x))
    row["fp8_weight_tb_s"] = n * k / row["fp8_dispatch_us"] / 1e6
    row["bf16_best_us"] = min(row["bf16_cublas_us"], row.get("bf16_gemv_us", float("inf")))
    row["fp8_speedup"] = row["bf16_best_us"] / row["fp8_dispatch_us"]
    return row


def sweep_gemv(rows=(1,)) -> list[dict]:
    """GEMV configs at 8B shapes: the fastest against the default (`fp8_kernels.gemv_config`)."""
    out = []
    for name, (n, k) in SHAPES.items():
        for m in rows:
            row = _sweep_row(name, n, k, m)
            out.append(row)
            print(json.dumps(row), flush=True)
    return out


def _sweep_row(name: str, n: int, k: int, m: int) -> dict:
    from sluice.core.models import fp8_kernels as fk

    x, _, q, s, counters = _inputs(m, n, k, 2)
    default = fk.gemv_config(n, k, fk.num_sms(x.device), fk.block_m(m))
    times = {}
    # a small grid (each distinct config compiles once): tile rows (32, 64), K step, split-K none, the default's and
    # two and four times it (more programs in flight per SM: at one row a program's read is latency-bound), with the
    # default's operands; then the default with the other operands, 8 warps and 3 stages
    splits = {1, default.split_k, 2 * default.split_k, 4 * default.split_k}
    grid = [
        fk.Fp8GemvConfig(bn, bk, split, dot=default.dot) for bn in (32, 64) for bk in (256, 512) for split in splits
    ]
    other = 1 if default.dot == 2 else 2  # the other operands
    grid += [replace(default, dot=other), replace(default, num_warps=8), replace(default, num_stages=3)]
    for c in grid:
        try:
            times[c] = _bench(lambda c=c: fk.fp8_gemv(x, q, s, None, counters, c))
        except Exception:  # noqa: BLE001 - a config that does not compile (shared memory) is no candidate
            continue
    best = min(times, key=times.get)
    return {"shape": name, "rows": m, "default": str(default), "default_us": times.get(default),
            "best": str(best), "best_us": times[best], "candidates": len(times)}  # fmt: skip


def batch1_estimate(timings: list[dict]) -> dict:
    """The four projections of 32 layers and the LM head at one row: the GEMM part of a batch-1 step, bf16 vs fp8
    (the head bf16 in both, as the engine runs it; and fp8, what quantizing it would save)."""
    one = {r["shape"]: r for r in timings if r["rows"] == 1}
    bf16 = LAYERS * sum(one[s]["bf16_best_us"] for s in SHAPES) / 1000
    fp8 = LAYERS * sum(one[s]["fp8_dispatch_us"] for s in SHAPES) / 1000
    head_bf16, head_fp8 = one["lm_head"]["bf16_best_us"] / 1000, one["lm_head"]["fp8_dispatch_us"] / 1000
    est = {"bf16_ms": bf16 + head_bf16, "fp8_ms": fp8 + head_bf16, "fp8_with_fp8_head_ms": fp8 + head_fp8}
    est["ratio"] = est["fp8_ms"] / est["bf16_ms"]
    print(f"batch 1, 4 projections x {LAYERS} layers + LM head: bf16 {est['bf16_ms']:.3f} ms, fp8 {est['fp8_ms']:.3f}"
          f" ms ({est['ratio']:.2f}x); with an fp8 head {est['fp8_with_fp8_head_ms']:.3f} ms")  # fmt: skip
    return est


def kernels(ns: argparse.Namespace) -> int:
    import torch
    import triton

    t0 = time.perf_counter()
    env = {"torch": torch.__version__, "triton": triton.__version__, "device": torch.cuda.get_device_name()}
    print(json.dumps(env), flush=True)
    result: dict = {"env": env}
    try:
        result["paths"] = check_paths() + (check_paths(shapes=SMALL_SHAPES) if ns.small else [])
        result["graph_and_guards"] = check_graph_and_guards()
        ok = all(r["pass"] for r in result["paths"]) and result["graph_and_guards"]["pass"]
        result["correct"] = ok
        print(f"correctness: {'PASS' if ok else 'FAIL'}", flush=True)
        if not ns.no_bench:
            result["timings"] = time_paths()
            result["batch1"] = batch1_estimate(result["timings"])
            if ns.sweep:
                result["sweep"] = sweep_gemv()
    except Exception as e:  # noqa: BLE001 - written down, then a failing exit status
        import traceback

        traceback.print_exc()
        result["error"] = f"{type(e).__name__}: {e}"
        ok = False
    result["pass"] = ok
    result["seconds"] = time.perf_counter() - t0
    Path(ns.out).write_text(json.dumps(result, indent=1))
    print(f"kernels: pass={ok} in {result['seconds']:.0f}s; wrote {ns.out}")
    return 0 if ok else 1


# --------------------------------------------------------------------------------------------- agreement


def _prompts(ns: argparse.Namespace, tokenizer) -> list[list[int]]:
    from sluice.app.commands.train_draft import chat_pairs, load_conversations

    convs = load_conversations(ns.data, "heldout")
    prompts = [p for p, _ in chat_pairs(tokenizer, convs, ns.num_prompts, ns.max_prompt_len, seed=0)]
    if len(prompts) < ns.num_prompts:
        raise SystemExit(f"--data has {len(prompts)} usable prompts; {ns.num_prompts} asked")
    return prompts


def _generate(ns: argparse.Namespace, prompts, logprobs: bool, **options):
    from sluice.app.bench.common import release_device_memory
    from sluice.core import LLM, SamplingParams

    llm = LLM(
        model=ns.model, device=ns.device, dtype=ns.dtype, max_model_len=ns.max_prompt_len + ns.tokens + 8, **options
    )
    try:
        params = SamplingParams(max_tokens=ns.tokens, temperature=0, ignore_eos=True, logprobs=2 if logprobs else None)
        outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        return outs, llm.tokenizer
    finally:
        llm.close()
        del llm
        release_device_memory()


def agree(ns: argparse.Namespace) -> int:
    from sluice.core.frontend.tokenizer import load_tokenizer
    from sluice.core.models.loader import resolve_model

    t0 = time.perf_counter()
    prompts = _prompts(ns, load_tokenizer(resolve_model(ns.model).tokenizer_dir))
    ref, _ = _generate(ns, prompts, True)
    test, _ = _generate(ns, prompts, False, **VARIANTS[ns.variant])
    rows = []
    for i, (r, t) in enumerate(zip(ref, test)):
        div = next((j for j, (a, b) in enumerate(zip(r.token_ids, t.token_ids)) if a != b), None)
        row = {"prompt": i, "prompt_len": len(prompts[i]), "same_tokens": ns.tokens if div is None else div}
        if div is not None:
            top = sorted((lp.logprob for lp in r.logprobs[div].values()), reverse=True)  # the public `Logprob`s
            row["ref_top2_gap"] = top[0] - top[1]
            row["verdict"] = "near-tie" if row["ref_top2_gap"] <= ns.near_tie else "diverged"
        else:
            row["verdict"] = "equal"
        rows.append(row)
        print(json.dumps(row), flush=True)
    count = {v: sum(r["verdict"] == v for r in rows) for v in ("equal", "near-tie", "diverged")}
    summary = {"model": ns.model, "variant": ns.variant, "device": ns.device, "tokens": ns.tokens,
               "prompts": len(prompts), **count, "near_tie_threshold": ns.near_tie,
               "mean_same_tokens": sum(r["same_tokens"] for r in rows) / len(rows),
               "seconds": time.perf_counter() - t0, "rows": rows}  # fmt: skip
    print(f"agreement {ns.variant} vs unquantized: {count['equal']} of {len(rows)} prompts equal over {ns.tokens} "
          f"tokens; {count['near-tie']} part at a near-tie (<= {ns.near_tie}), {count['diverged']} at a wider gap; "
          f"mean {summary['mean_same_tokens']:.1f} equal tokens")  # fmt: skip
    Path(ns.out).write_text(json.dumps(summary, indent=1))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    k = sub.add_parser("kernels")
    k.add_argument("--no-bench", action="store_true", help="correctness only")
    k.add_argument("--sweep", action="store_true", help="also sweep GEMV configs at one row")
    k.add_argument("--small", action="store_true", help="also check the default model's shapes (K = 576)")
    k.add_argument("--out", required=True)
    a = sub.add_parser("agree")
    a.add_argument("--model", default="smollm2-135m-instruct")
    a.add_argument("--dtype", default="auto", help="both engines' model dtype (auto: fp32 on the CPU, bf16 on a GPU)")
    a.add_argument("--device", default="auto")
    a.add_argument("--variant", choices=sorted(VARIANTS), default="fp8")
    a.add_argument("--data", default="sharegpt", help="'sharegpt' or a JSON list of conversations")
    a.add_argument("--num-prompts", type=int, default=32)
    a.add_argument("--tokens", type=int, default=64)
    a.add_argument("--max-prompt-len", type=int, default=512)
    a.add_argument("--near-tie", type=float, default=0.25, help="largest reference top-2 logit gap called a tie")
    a.add_argument("--out", required=True)
    ns = ap.parse_args()
    return kernels(ns) if ns.cmd == "kernels" else agree(ns)


if __name__ == "__main__":
    sys.exit(main())
