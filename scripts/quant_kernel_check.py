"""Check the quantization kernels at real shapes on the GPU, and time them against bf16.

    python scripts/quant_kernel_check.py --out quant_kernel_check.json      # on the GPU (H200)
    python scripts/quant_kernel_check.py --tiny --out /tmp/q.json           # CPU smoke, Triton interpreter

Cases (Llama-3-8B shapes unless ``--tiny``):

* ``gemv``: int4 (group 128) and int8 weight-only matmul of one row (batch-1 decode) for the q/k/v, o,
  gate/up, down and LM-head projections: every GEMV config's error against the exact product (fp32, the
  dequantized weight) and its time; the tuner's pick; the bf16 ``F.linear`` time of the same shape; the
  effective bandwidth (bytes of the packed weight, scales and mins over the time); the fastest config of
  each int4 layout ("3d", "2d", "tc" tensor cores, "tcx" the same with the inline-PTX unpack). The
  tensor-core layouts are also checked with fp16 activations (their fp16 unpack differs from bf16's).
* ``gemm``: the tensor-core kernel at 16 and 256 rows (decode batches, prefill), error and time vs bf16.
* ``graph``: a split-K GEMV captured in a CUDA graph and replayed on new inputs (the arrival counters
  must reset themselves inside the graph).
* ``fp8``: the KV write kernel against torch's cast (bit for bit), and decode / prefill over an fp8 cache
  against the torch reference on the same bytes; decode time against the same kernel on a bf16 cache.

Results are rewritten to ``--out`` after every case; exit status 1 if any case fails or errors.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LINEAR_SHAPES = {  # name: (N, K)
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
    "lm_head": (128256, 4096),
}
TINY_SHAPES = {"qkv": (96, 256), "down": (40, 384)}


def _bench(fn, on_gpu: bool) -> float | None:
    if not on_gpu:
        return None
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=5, rep=25))


def _cfg(c) -> list:
    return [c.block_n, c.row_bytes, c.split_k, c.num_warps, c.layout, c.num_stages]


def _rel(y, ref) -> float:
    return float((y.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-12))


def linear_cases(shapes: dict, dev: str, on_gpu: bool):
    import torch
    from sluice.core.models import quant_kernels as qk
    from sluice.core.models.quant import (
        MIN_GEMV_BLOCK_N,
        dequantize_int4,
        dequantize_int8,
        quantize_int4,
        quantize_int8,
    )

    g = torch.Generator(device=dev).manual_seed(0)
    for name, (n, k) in shapes.items():
        w = torch.randn(n, k, generator=g, device=dev) * 0.02
        dense = w.bfloat16()
        for bits in (4, 8):
            t0 = time.perf_counter()
            key = ("int4", n, k, 128) if bits == 4 else ("int8", n, k)
            if bits == 4:
                packed, scales, mins = quantize_int4(w, 128)
                wd = dequantize_int4(packed, scales, mins, torch.float32)
                nbytes = sum(t.numel() * t.element_size() for t in (packed, scales, mins))

                def mm(x, cnt=None, tuner=None, p=packed, s=scales, z=mins):
                    return qk.int4_matmul(x, p, s, z, 128, None, cnt, tuner)
            else:
                q, s8 = quantize_int8(w)
                wd = dequantize_int8(q, s8, torch.float32)
                nbytes = q.numel() + s8.numel() * 4

                def mm(x, cnt=None, tuner=None, q=q, s=s8):
                    return qk.int8_matmul(x, q, s, None, cnt, tuner)

            cnt = torch.zeros(-(-n // MIN_GEMV_BLOCK_N), dtype=torch.int32, device=dev)
            x = torch.randn(1, k, generator=g, device=dev).bfloat16()
            ref = x.float() @ wd.t()
            bf16_ms = _bench(lambda x=x, dense=dense: torch.nn.functional.linear(x, dense), on_gpu)
            configs = []
            for cfg in qk.GEMV_CONFIGS if bits == 4 else [c for c in qk.GEMV_CONFIGS if c.layout == "3d"]:
                row = {"config": _cfg(cfg)}
                try:
                    tuner = qk.GemvTuner(configs=(cfg,))
                    tuner.choice[key] = cfg
                    y = mm(x, cnt, tuner)
                    row["rel_err"] = _rel(y, ref)
                    if cfg.layout in ("tc", "tcx"):
                        x16 = x.half()
                        row["rel_err"] = max(row["rel_err"], _rel(mm(x16, cnt, tuner), x16.float() @ wd.t()))
                    row["counters_reset"] = not bool(cnt.any())
                    ms = _bench(lambda x=x, tuner=tuner, cnt=cnt: mm(x, cnt, tuner), on_gpu)
                    row["ms"] = ms
                    row["gb_s"] = nbytes / ms / 1e6 if ms else None
                except Exception as e:  # noqa: BLE001 - one config failing must not hide the others
                    row["error"] = f"{type(e).__name__}: {e}"
                configs.append(row)
            tuner = qk.GemvTuner()
            y = mm(x, cnt, tuner)
            pick = next(iter(tuner.choice.values()), None)
            ok_rows = [r for r in configs if "rel_err" in r]
            best = min((r for r in ok_rows if r.get("ms")), key=lambda r: r["ms"], default=None)
            passed = bool(ok_rows) and all(r["rel_err"] < 1e-2 and r["counters_reset"] for r in ok_rows)
            passed &= _rel(y, ref) < 1e-2
            by_layout = {}
            for r in ok_rows:
                if r.get("ms") and (r["config"][4] not in by_layout or r["ms"] < by_layout[r["config"][4]]["ms"]):
                    by_layout[r["config"][4]] = {"ms": r["ms"], "gb_s": r["gb_s"], "config": r["config"]}
            yield {
                "case": f"gemv int{bits} {name} {n}x{k}",
                "pass": passed,
                "weight_mib": nbytes / 2**20,
                "bf16_ms": bf16_ms,
                "bf16_gb_s": n * k * 2 / bf16_ms / 1e6 if bf16_ms else None,
                "tuned_config": _cfg(pick) if pick else None,
                # the tuner's own timings (its pick has disagreed with the sweep's best: kept to find out why)
                "tuner_ms": {" ".join(map(str, _cfg(c))): t for c, t in next(iter(tuner.timings.values()), {}).items()},
                "best_ms": best["ms"] if best else None,
                "best_gb_s": best["gb_s"] if best else None,
                "speedup_vs_bf16": bf16_ms / best["ms"] if best and bf16_ms else None,
                "best_by_layout": by_layout,
                "configs": configs,
                "quantize_s": time.perf_counter() - t0,
            }
            for m in (16, 256):
                xm = torch.randn(m, k, generator=g, device=dev).bfloat16()
                refm = xm.float() @ wd.t()
                row = {"case": f"gemm int{bits} {name} {n}x{k} M={m}"}
                try:
                    row["rel_err"] = _rel(mm(xm), refm)
                    row["pass"] = row["rel_err"] < 2e-2
                    row["ms"] = _bench(lambda xm=xm: mm(xm), on_gpu)
                    row["bf16_ms"] = _bench(lambda xm=xm, dense=dense: torch.nn.functional.linear(xm, dense), on_gpu)
                except Exception as e:  # noqa: BLE001
                    row["pass"], row["error"] = False, f"{type(e).__name__}: {e}"
                yield row
        del w, dense


def graph_case(dev: str, on_gpu: bool):
    import torch
    from sluice.core.models import quant_kernels as qk
    from sluice.core.models.quant import MIN_GEMV_BLOCK_N, dequantize_int4, quantize_int4

    if not on_gpu:
        return
    n, k = 4096, 4096
    g = torch.Generator(device="cpu").manual_seed(1)
    packed, scales, mins = quantize_int4((torch.randn(n, k, generator=g) * 0.02).to(dev), 128)
    wd = dequantize_int4(packed, scales, mins, torch.float32)
    cnt = torch.zeros(n // MIN_GEMV_BLOCK_N, dtype=torch.int32, device=dev)
    split = next(c for c in qk.GEMV_CONFIGS if c.split_k == 4)
    tuner = qk.GemvTuner(configs=(split,))
    tuner.choice[("int4", n, k, 128)] = split
    x = torch.randn(1, k, generator=g).to(dev).bfloat16()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        qk.int4_matmul(x, packed, scales, mins, 128, None, cnt, tuner)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = qk.int4_matmul(x, packed, scales, mins, 128, None, cnt, tuner)
    errs = []
    for _ in range(5):
        x.copy_(torch.randn(1, k, generator=g).to(dev).bfloat16())
        graph.replay()
        torch.cuda.synchronize()
        errs.append(_rel(y, x.float() @ wd.t()))
    yield {
        "case": "graph int4 split-K=4 GEMV 4096x4096, 5 replays",
        "pass": max(errs) < 1e-2 and not bool(cnt.any()),
        "rel_errs": errs,
    }


def fp8_cases(dev: str, on_gpu: bool, tiny: bool):
    import torch
    from sluice.kv.attention import fp8
    from sluice.kv.attention.torch_ref import TorchAttentionBackend
    from sluice.kv.attention.triton_backend import TritonAttentionBackend

    from tests.helpers import random_paged_batch

    heads, kv_heads, d = (4, 2, 32) if tiny else (32, 8, 128)
    ref_be, tr = TorchAttentionBackend(), TritonAttentionBackend()
    g = torch.Generator(device="cpu").manual_seed(2)
    scale = (torch.rand(2, kv_heads, generator=g) * 0.05 + 0.01).to(dev)
    n_tok = 64 if tiny else 4096
    k = (torch.randn(n_tok, kv_heads, d, generator=g) * 3).to(dev).bfloat16()
    v = (torch.randn(n_tok, kv_heads, d, generator=g) * 3).to(dev).bfloat16()
    nb = -(-n_tok // 16) + 4
    slots = torch.randperm(nb * 16, generator=g)[:n_tok].to(dev)
    a = torch.zeros(2, nb, 16, kv_heads, d, dtype=fp8.FP8_DTYPE, device=dev)
    b = torch.zeros_like(a)
    ref_be.write_kv(k, v, a, slots, scale)
    tr.write_kv(k, v, b, slots, scale)
    # bytes that differ as values; -0 against +0 (the GPU build has written +0 where torch keeps -0) decode
    # to the same 0 and are counted apart
    bits_differ = a.view(torch.uint8) != b.view(torch.uint8)
    differ = bits_differ & (a.float() != b.float())
    fa, fb = a.float()[differ], b.float()[differ]
    yield {
        "case": f"fp8 write {n_tok} tokens",
        "pass": not bool(differ.any()),
        "mismatched_values": int(differ.sum()),
        "signed_zero_differences": int((bits_differ & ~differ).sum()),
        "of_values": differ.numel(),
        # e4m3 has 3 mantissa bits: one step is 1/8 of the value's power of two (2^-9 in the subnormal range)
        "max_diff_in_e4m3_steps": float(((fa - fb).abs() / (fa.abs().clamp_min(2**-6) / 8)).max()) if fa.numel() else 0,
        "examples_torch_vs_triton": [[x, y] for x, y in zip(fa[:5].tolist(), fb[:5].tolist())],
        "ms": _bench(lambda: tr.write_kv(k, v, b, slots, scale), on_gpu),
    }
    specs = (
        [("decode b4", [40, 17, 70, 9], [1] * 4), ("prefill", [40, 33], [40, 20])]
        if tiny
        else [
            ("decode b1 ctx8192", [8192], [1]),
            ("decode b64 ctx<=2048", [2048] + [int(x) for x in torch.randint(1, 2048, (63,), generator=g)], [1] * 64),
            ("prefill 4x1024", [1024] * 4, [1024] * 4),
            ("chunked 2x(2048 cached+512)", [2560] * 2, [512] * 2),
        ]
    )
    for label, seq_lens, q_lens in specs:
        q, cache, meta_dev = random_paged_batch(
            seq_lens, q_lens, kv_heads, heads // kv_heads, d, dtype=torch.bfloat16, device=dev
        )
        cache = cache.float() * 3
        c8 = torch.stack(
            [fp8.quantize(cache[i].reshape(-1, kv_heads, d), scale[i]).reshape(cache[i].shape) for i in range(2)]
        )
        c16 = torch.stack([fp8.dequantize(c8[i], scale[i], torch.bfloat16) for i in range(2)])
        row = {"case": f"fp8 {label}"}
        try:
            # exact answer: fp32 attention over the dequantized fp8 values
            exact = ref_be.forward(q.float(), c16.float(), meta_dev, d**-0.5)
            out = tr.forward(q, c8, meta_dev, d**-0.5, scale)
            row["rel_err"] = _rel(out, exact)
            row["bf16_cache_rel_err"] = _rel(tr.forward(q, c16, meta_dev, d**-0.5), exact)
            row["pass"] = row["rel_err"] < 2e-2
            row["ms_fp8"] = _bench(lambda q=q, c=c8, m=meta_dev: tr.forward(q, c, m, d**-0.5, scale), on_gpu)
            row["ms_bf16"] = _bench(lambda q=q, c=c16, m=meta_dev: tr.forward(q, c, m, d**-0.5), on_gpu)
        except Exception as e:  # noqa: BLE001
            row["pass"], row["error"] = False, f"{type(e).__name__}: {e}"
        yield row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="small shapes (CPU interpreter smoke)")
    p.add_argument("--out", default="quant_kernel_check.json")
    p.add_argument("--only", choices=("fp8", "graph", "linear"), action="append", help="run these groups only")
    ns = p.parse_args()
    import torch

    on_gpu = torch.cuda.is_available()
    if not on_gpu:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from sluice.app.bench.results import machine_info, utc_now_iso, versions

    dev = "cuda" if on_gpu else "cpu"
    record = {"command": " ".join(sys.argv), "machine": machine_info(), "versions": versions(), "date": utc_now_iso()}
    rows: list[dict] = []
    gens = {
        "fp8": lambda: fp8_cases(dev, on_gpu, ns.tiny),
        "graph": lambda: graph_case(dev, on_gpu),
        "linear": lambda: linear_cases(TINY_SHAPES if ns.tiny else LINEAR_SHAPES, dev, on_gpu),
    }
    for make in (gens[g] for g in gens if not ns.only or g in ns.only):
        try:
            for row in make():
                rows.append(row)
                short = {k: v for k, v in row.items() if k != "configs"}
                print(json.dumps(short, default=str), flush=True)
                Path(ns.out).write_text(json.dumps({**record, "cases": rows}, indent=1, default=str))
        except Exception as e:  # noqa: BLE001 - report and go on to the next group
            rows.append({"case": "error", "pass": False, "error": traceback.format_exc()[-3000:]})
            print(f"ERROR {type(e).__name__}: {e}", flush=True)
    Path(ns.out).write_text(json.dumps({**record, "cases": rows}, indent=1, default=str))
    failed = [r["case"] for r in rows if not r.get("pass")]
    print(f"{len(rows) - len(failed)} of {len(rows)} cases pass" + (f"; FAILED: {failed}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
